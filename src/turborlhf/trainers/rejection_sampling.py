"""`turborlhf rejection-sampling`: iterative best-of-n rejection sampling (Touvron et al. 2023,
Llama 2 §3.2.3; OpenRLHF's `train_rejection_sampling_*.sh`), then SFT on the winners.

Each round k = 1 … `rounds`:

1. sample: n = `n_samples_per_prompt` responses y_i1 … y_in for each of the round's prompts x_i
   from the *current* policy π_k with the rollout engine (seed depends on the round only);
2. score: s_ij = r(x_i, y_ij) with the reward model at the final EOS; a response cut at
   `max_new_tokens` is scored as cut, the convention of `turborlhf eval-policy` and `ppo`, so
   selection optimises what evaluation measures (`score_truncated_with_eos` appends an EOS first);
3. select: j*_i = argmax_j s̃_ij with s̃_ij = s_ij − c·[y_ij cut at max_new_tokens] (c =
   `missing_eos_penalty`, default 0); the prompt is kept if s̃_ij* > `min_score` (if set);
   the winners go to ``<output_dir>/round_<k>/best.jsonl`` with all candidate scores;
4. SFT: the token-mean NLL of the kept responses, L = −Σ_t log π(y_t | x, y_<t) / Σ_i |y_i|,
   exactly the loss of `turborlhf sft` (`trainers.common.sft_loss_on_batch`), `train.epochs` passes
   with a fresh AdamW and schedule per round (OpenRLHF runs `train_sft` anew per iteration);
   with `accumulate` the data are the winners of rounds 1 … k (Llama 2 keeps earlier winners);
5. sync the new weights into the rollout engine, log, checkpoint (``step-00000k`` = k rounds done).

Deliberate details: a winner cut at `max_new_tokens` is trained *without* an appended EOS (the
policy must not learn to stop where the text was merely truncated); responses are decoded to
text and re-encoded like SFT data. Metrics per round (``metrics.jsonl``, step = round):
``rollout/reward_mean`` (all candidates), ``rollout/best_score_mean`` (the per-prompt maxima,
before the threshold), ``rollout/best_of_n_gain`` (their difference), the kept fraction, loss.

    turborlhf rejection-sampling --config configs/tiny/rejection_sampling.yaml
"""
from __future__ import annotations

import json
import logging
import random
import signal
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from turborlhf.config import RejectionSamplingConfig
from turborlhf.data.chat import stop_ids
from turborlhf.data.jsonl import read_jsonl, write_jsonl
from turborlhf.data.loaders import load_prompts
from turborlhf.data.tokenize import encode_examples, encode_prompts, response_end_id
from turborlhf.engine.checkpoint import (atomic_write_text, check_plan, load_trainer_state, plan_digest,
                                         save_checkpoint)
from turborlhf.engine.lifecycle import RunInterrupted, checkpointed_steps, start_run, stop_requested
from turborlhf.engine.run import export_model, plan_steps, print_batch_table, resolve_hardware
from turborlhf.engine.train import (clip_and_step, load_optimizer_and_schedule, make_optimizer, make_scheduler,
                                    rng_state, seed_everything, set_rng_state, set_threads)
from turborlhf.metrics import M, MetricsLogger, tracker_kwargs
from turborlhf.models.load import load_tokenizer, load_trainable, merge_lora_for_save
from turborlhf.rewards.model import check_reward_model, load_reward_model, score_token_ids, warn_if_other_format
from turborlhf.rollout import make_engine
from turborlhf.rollout.backends import vllm_kwargs
from turborlhf.rollout.sync import push_weights, start_sync_check
from turborlhf.rollout.base import SamplingParams
from turborlhf.trainers.common import sft_step

__all__ = ["phases", "train", "select_best", "round_prompts", "sft_on_rows", "SFTStopped"]

logger = logging.getLogger(__name__)


def phases(cfg: RejectionSamplingConfig) -> tuple[str, ...]:
    """The memory phases of one round, in order (`turborlhf plan` sizes each one and refuses a config whose phases it does not model): round steps
    1-2 (sample with the engine, score with the reward model), then step 4's SFT forward/backward and
    optimizer steps."""
    return ("generate", "score", "train", "optimizer step")

BEST_SCORE = "rollout/best_score_mean"
GAIN = "rollout/best_of_n_gain"
KEPT = "rollout/kept_fraction"


# ----------------------------------------------------------------------------------------------
# Pure pieces
# ----------------------------------------------------------------------------------------------

def select_best(scores_BN: torch.Tensor, finished_BN: torch.Tensor, min_score: Optional[float] = None,
                missing_eos_penalty: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-of-n selection over B prompts × N candidates.

    Args:
        scores_BN: reward-model scores s_ij (float).
        finished_BN: bool, True where the candidate ended with a stop token.
        min_score: keep prompt i only if its selection score s̃_ij* > min_score (None keeps all).
        missing_eos_penalty: c subtracted from s_ij of unfinished candidates (None = 0).

    Returns ``(best_B, keep_B, sel_scores_BN)``: the argmax index j*_i of s̃_i· (the first one on
    ties; a NaN score is never selected, and a prompt whose scores are all NaN is not kept),
    whether prompt i is kept, and the selection scores s̃_ij (−inf for NaN). Raises ValueError if
    the shapes differ or N = 0.
    """
    if scores_BN.shape != finished_BN.shape or scores_BN.dim() != 2 or scores_BN.shape[1] == 0:
        raise ValueError(f"scores_BN {tuple(scores_BN.shape)} and finished_BN {tuple(finished_BN.shape)} "
                         "must be equal B×N shapes with N ≥ 1")
    nan_BN = torch.isnan(scores_BN)
    sel_BN = scores_BN.float().masked_fill(nan_BN, float("-inf"))     # argmax would pick a NaN
    if missing_eos_penalty is not None:
        sel_BN = torch.where(finished_BN.bool(), sel_BN, sel_BN - missing_eos_penalty)
    best_B = sel_BN.argmax(dim=1)                                       # first maximum on ties
    best_sel_B = sel_BN.gather(1, best_B[:, None]).squeeze(1)
    keep_B = best_sel_B > min_score if min_score is not None else torch.ones_like(best_B, dtype=torch.bool)
    return best_B, keep_B & ~nan_BN.all(dim=1), sel_BN


def round_prompts(n_prompts: int, per_round: int, round_idx: int, seed: int) -> list[int]:
    """Prompt indices of round `round_idx` (0-based): consecutive slices of one seeded permutation,
    wrapping around, `min(per_round, n_prompts)` distinct indices per round (as OpenRLHF's
    ``--iter`` × ``--rollout_batch_size``). Raises ValueError if n_prompts < 1."""
    if n_prompts < 1:
        raise ValueError("no prompts")
    order = list(range(n_prompts))
    random.Random(seed).shuffle(order)
    k = min(per_round, n_prompts)
    return [order[(round_idx * k + i) % n_prompts] for i in range(k)]


# ----------------------------------------------------------------------------------------------
# SFT on the winners (round step 4)
# ----------------------------------------------------------------------------------------------

class SFTStopped(Exception):
    """`sft_on_rows` stopped part-way on request; ``state`` continues it (`sft_on_rows(resume=...)`)."""

    def __init__(self, state: dict) -> None:
        super().__init__(f"SFT stopped after step {state['step']}")
        self.state = state


def sft_on_rows(model, tok, rows: list[dict], cfg: RejectionSamplingConfig, seed: int, tag: str = "rs",
                resume: Optional[dict] = None, should_stop: Callable[[], object] = lambda: None) -> dict:
    """Fine-tune `model` in place on ``{prompt, response, finished}`` rows with the SFT loss
    (`train.*` settings, a fresh optimizer and schedule). Returns mean loss, steps, last lr,
    mean grad norm and tokens/s. Raises ValueError on no rows.

    `should_stop()` is asked after every optimizer step but the last; a true answer raises
    `SFTStopped`, whose ``state`` (optimizer, schedule, step, running sums) given back as `resume`
    continues exactly where it stopped."""
    loop = cfg.train
    enc = encode_examples(tok, rows, cfg.data.max_len)
    plan = plan_steps([len(e["input_ids"]) for e in enc], loop.sequences_per_step, loop.epochs, loop.max_steps, seed)
    optim = make_optimizer(model, cfg.optim)
    sched = make_scheduler(optim, cfg.optim, len(plan))
    model.train()
    acc = {"losses": [], "gnorms": [], "n_tok": 0, "seconds": 0.0, "lr": sched.get_last_lr()[0], "step": 0}
    if resume is not None:
        load_optimizer_and_schedule(optim, sched, lambda: optim.load_state_dict(resume["optimizer"]),
                                    resume["scheduler"])
        acc = resume["acc"]
    t0 = time.perf_counter()
    for step in range(acc["step"], len(plan)):
        batch = [enc[i] for i in plan[step]]
        step_loss = sft_step(model, tok, batch, loop.micro_batch_size, cfg.model.dtype)
        acc["lr"] = sched.get_last_lr()[0]
        acc["gnorms"].append(clip_and_step(model, optim, sched, cfg.optim.max_grad_norm))
        acc["losses"].append(step_loss)
        acc["n_tok"] += sum(len(e["input_ids"]) for e in batch)
        acc["step"] = step + 1
        if cfg.log.progress and ((step + 1) % cfg.log.every == 0 or step + 1 == len(plan)):
            logger.info(f"[{tag}] sft {step + 1}/{len(plan)} loss {step_loss:.4f} lr {acc['lr']:.2e}")
        if step + 1 < len(plan) and should_stop():
            acc["seconds"] += time.perf_counter() - t0
            raise SFTStopped({"optimizer": optim.state_dict(), "scheduler": sched.state_dict(), "acc": acc,
                              "step": step + 1})
    dt = acc["seconds"] + time.perf_counter() - t0
    losses, gnorms = acc["losses"], acc["gnorms"]
    return {M.LOSS: sum(losses) / len(losses), "train/loss_last": losses[-1], "train/steps": len(plan),
            M.LR: acc["lr"], M.GRAD_NORM: sum(gnorms) / len(gnorms), M.TOKENS_PER_S: acc["n_tok"] / max(dt, 1e-9)}


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------

def _sampling(cfg: RejectionSamplingConfig, tok, seed: int) -> SamplingParams:
    roll = cfg.rollout
    return SamplingParams(max_new_tokens=roll.max_new_tokens, min_new_tokens=roll.min_new_tokens,
                          temperature=roll.temperature,
                          top_p=roll.top_p, top_k=roll.top_k, stop_token_ids=stop_ids(tok),
                          n=cfg.algo.n_samples_per_prompt, seed=seed)


def _score(rm, rm_tok, same_vocab: bool, prompts: list[str], p_ids: list[list[int]], r_ids: list[list[int]],
           texts: list[str], finished: list[bool], cfg: RejectionSamplingConfig) -> torch.Tensor:
    """Scores ``B·N`` of the candidates. With the policy's vocabulary, the sampled ids are scored
    (an EOS appended to truncated ones if `score_truncated_with_eos`); otherwise the decoded texts
    are re-encoded with the RM's tokenizer under the same EOS rule."""
    A = cfg.algo
    eos_for = [f or A.score_truncated_with_eos for f in finished]          # ends with EOS when scored
    if same_vocab:
        seqs = [p + r + ([response_end_id(rm_tok, text)] if e and not f else [])
                for p, r, f, e, text in zip(p_ids, r_ids, finished, eos_for, prompts)]
    else:
        rows = [{"prompt": p, "response": t, "finished": e} for p, t, e in zip(prompts, texts, eos_for)]
        seqs = [x["input_ids"] for x in encode_examples(rm_tok, rows, 4096)]
    return score_token_ids(rm, rm_tok.pad_token_id, seqs, cfg.model.dtype, A.score_batch_size)


def _best_rows(prompts: list[str], texts: list[str], scores_BN: torch.Tensor, fin_BN: torch.Tensor,
               best_B: torch.Tensor, keep_B: torch.Tensor, k: int) -> list[dict]:
    """One ``best.jsonl`` row per prompt: the winner and every candidate's score and EOS flag."""
    n = scores_BN.shape[1]
    rows = []
    for b, prompt in enumerate(prompts):
        j = int(best_B[b])
        rows.append({"prompt": prompt, "response": texts[b * n + j], "score": float(scores_BN[b, j]),
                     "finished": bool(fin_BN[b, j]), "kept": bool(keep_B[b]), "best_index": j,
                     "candidate_scores": scores_BN[b].tolist(), "candidate_finished": fin_BN[b].tolist(),
                     "round": k})
    return rows


def _round_metrics(scores_BN: torch.Tensor, fin_BN: torch.Tensor, best_B: torch.Tensor, keep_B: torch.Tensor,
                   response_ids: list[list[int]], t_gen: float) -> dict:
    """The round's rollout metrics. Scores the reward model gave as NaN (never selected) are left out of
    the means: one of them made every score metric of the round NaN. ``best_score_mean`` is the mean
    score of the selected candidates (the per-prompt maxima; with ``missing_eos_penalty``, the raw
    scores of the candidates its penalised scores select), over prompts with a non-NaN score."""
    scores = scores_BN.float()
    valid = scores[~torch.isnan(scores)]
    winners = scores.gather(1, best_B[:, None]).squeeze(1)
    winners = winners[~torch.isnan(winners)]
    nan = float("nan")
    all_mean = float(valid.mean()) if valid.numel() else nan
    best_mean = float(winners.mean()) if winners.numel() else nan
    lens = torch.tensor([len(r) for r in response_ids], dtype=torch.float32)
    return {M.REWARD_MEAN: all_mean, M.REWARD_STD: float(valid.std()) if valid.numel() > 1 else 0.0,
            BEST_SCORE: best_mean, GAIN: best_mean - all_mean, KEPT: float(keep_B.float().mean()),
            M.RESPONSE_LEN: float(lens.mean()), M.EOS_FRAC: float(fin_BN.float().mean()),
            "rollout/tokens_per_s": float(lens.sum()) / max(t_gen, 1e-9)}


def _sample_round(k: int, cfg: RejectionSamplingConfig, tok, engine, scorer: tuple, prompts: list[str],
                  prompt_ids: list[list[int]], per_round: int, rdir: Path) -> tuple[dict, float, float]:
    """Round steps 1-3 (module docstring): sample, score, select; write ``rdir/best.jsonl``.
    `scorer` is ``(rm, rm_tok, same_vocab)``. Returns the round's rollout metrics and the seconds
    spent generating and scoring."""
    A = cfg.algo
    idx = round_prompts(len(prompts), per_round, k - 1, cfg.train.seed)
    n = A.n_samples_per_prompt
    # 1. sample n responses per prompt from the current policy (samples of a prompt consecutive)
    t0 = time.perf_counter()
    outs = engine.generate([prompt_ids[i] for i in idx], _sampling(cfg, tok, cfg.train.seed * 1000003 + k))
    t_gen = time.perf_counter() - t0
    rows_p = [i for i in idx for _ in range(n)]
    texts = [tok.decode(r, skip_special_tokens=True) for r in outs.response_ids]
    # 2. score every candidate
    t0 = time.perf_counter()
    scores = _score(*scorer, [prompts[i] for i in rows_p], [prompt_ids[i] for i in rows_p],
                    outs.response_ids, texts, outs.finished, cfg)
    t_score = time.perf_counter() - t0
    # 3. keep the best candidate per prompt; write the round's data
    scores_BN = scores.view(len(idx), n)
    fin_BN = torch.tensor(outs.finished, dtype=torch.bool).view(len(idx), n)
    best_B, keep_B, _ = select_best(scores_BN, fin_BN, A.min_score, A.missing_eos_penalty)
    if n_nan := int(torch.isnan(scores_BN).sum()):
        logger.warning(f"[rs] round {k}: the reward model scored {n_nan} of {scores_BN.numel()} candidates NaN; "
                       "they are never selected")
    rdir.mkdir(parents=True, exist_ok=True)
    write_jsonl(rdir / "best.jsonl", _best_rows([prompts[i] for i in idx], texts, scores_BN, fin_BN, best_B,
                                                keep_B, k))
    return _round_metrics(scores_BN, fin_BN, best_B, keep_B, outs.response_ids, t_gen), t_gen, t_score


def _round_dir(out: Path, k: int) -> Path:
    return out / f"round_{k}"


def _training_rows(out: Path, k: int, accumulate: bool) -> list[dict]:
    rows = []
    for j in (range(1, k + 1) if accumulate else [k]):
        rows += [obj for _, obj in read_jsonl(_round_dir(out, j) / "best.jsonl") if obj.get("kept", True)]
    return rows


def train(cfg: RejectionSamplingConfig, resume: bool = False) -> Path:
    # 1. run directory, threads, seed
    cfg = resolve_hardware(cfg, "rejection-sampling")      # device and precision: auto → this host's choice
    out, ckpt = start_run(cfg, resume, "rs")
    set_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    A, roll = cfg.algo, cfg.rollout

    # 2. prompts (read and checked before any model loads); policy (from the last finished round
    #    when resuming), frozen reward model, rollout engine
    tok = load_tokenizer(cfg.model.name_or_path)
    prompts = load_prompts(cfg.data.prompts_file, tok, **cfg.data.loader_kwargs())
    check_reward_model(cfg.reward_model)
    model = load_trainable("causal", cfg.model, tok, ckpt_dir=ckpt / "policy" if ckpt else None)
    frozen_dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    rm_tok = load_tokenizer(cfg.reward_model)
    rm = load_reward_model(cfg.reward_model, rm_tok, dtype=frozen_dtype, device=cfg.model.device,
                           device_field="model.device").eval().requires_grad_(False)
    same_vocab = rm_tok.get_vocab() == tok.get_vocab()
    if not same_vocab:
        warn_if_other_format(rm_tok, tok, cfg.reward_model)
    engine = make_engine(roll.engine, merge_lora_for_save(model), dtype=roll.dtype, device=roll.device,
                         device_field="rollout.device", weight_dtype=roll.weight_dtype,
                         max_batch_size=roll.batch_size, **vllm_kwargs(roll, shares_gpu=True))

    # 3. prompts → token ids (cut from the left like every rollout)
    if cfg.data.max_samples:
        prompts = prompts[:cfg.data.max_samples]
    prompt_ids = encode_prompts(tok, prompts, roll.max_prompt_len)
    per_round = min(A.prompts_per_round, len(prompts))
    print_batch_table("rs", [("prompts", len(prompts)), ("rounds", A.rounds), ("prompts_per_round", per_round),
                             ("n_samples_per_prompt", A.n_samples_per_prompt),
                             ("samples_per_round", per_round * A.n_samples_per_prompt),
                             ("sequences_per_step", cfg.train.sequences_per_step),
                             ("micro_batch_size", cfg.train.micro_batch_size),
                             ("rollout_engine", type(engine).__name__),
                             ("rm_scores", "token ids" if same_vocab else "re-encoded text")])
    canary = start_sync_check(engine, model, prompt_ids, roll.verify_sync, roll.sync_tolerance)
    start, mid = 0, None
    plan_sha256 = plan_digest([list(range(len(prompts)))], prompts)   # rounds draw from these prompts
    if ckpt:
        st = load_trainer_state(ckpt)
        check_plan(st, plan_sha256, ckpt, "rs")       # an edited prompts file: other rounds' prompts
        set_rng_state(st["rng"])
        start, mid = st["round"], st.get("sft")      # mid: stopped inside round start+1's SFT
        logger.info(f"[rs] resumed from {ckpt} after round {start}"
                    + (f" and SFT step {mid['sft']['step']} of round {mid['round']}" if mid else ""))
    log = MetricsLogger(out, "rs", A.rounds, show=(M.REWARD_MEAN, BEST_SCORE, GAIN, KEPT, M.LOSS),
                        **tracker_kwargs(cfg), progress=cfg.log.progress, resume=bool(ckpt),
                        start_step=start)
    try:
        def checkpoint(k: int) -> Path:
            return save_checkpoint(out, k, {"policy": model}, tok,
                                   {"round": k, "rng": rng_state(), "plan_sha256": plan_sha256},
                                   keep=cfg.train.keep_checkpoints)

        # 4. rounds: sample → score → select → SFT → sync (module docstring, steps 1-5); a checkpoint
        #    after every round; SIGINT/SIGTERM stop after the current SFT step (or generation/scoring)
        for r in checkpointed_steps(start, A.rounds, checkpoint, 1, "rs"):
            k = r + 1                                                         # rounds count from 1
            t_round = time.perf_counter()
            rdir = _round_dir(out, k)
            if mid is None:     # 4.1-4.3 sample, score, select; the winners go to round_<k>/best.jsonl
                metrics, t_gen, t_score = _sample_round(k, cfg, tok, engine, (rm, rm_tok, same_vocab), prompts,
                                                        prompt_ids, per_round, rdir)
            else:               # resumed inside this round's SFT: its winners are on disk already
                metrics, t_gen, t_score = mid["metrics"], mid["t_gen"], mid["t_score"]
            # 4.4 SFT on the kept winners (of this round, or of all rounds so far); a signal stops it
            #     after its current optimizer step, with a checkpoint that continues it
            t0 = time.perf_counter()
            train_rows = _training_rows(out, k, A.accumulate)
            if train_rows:
                try:
                    metrics.update(sft_on_rows(model, tok, train_rows, cfg, seed=cfg.train.seed + k,
                                               resume=mid and mid["sft"], should_stop=stop_requested))
                except SFTStopped as e:
                    signum = stop_requested()
                    mid = {"round": k, "sft": e.state, "metrics": metrics, "t_gen": t_gen, "t_score": t_score}
                    path = save_checkpoint(out, k - 1, {"policy": model}, tok,
                                           {"round": k - 1, "rng": rng_state(), "plan_sha256": plan_sha256, "sft": mid},
                                           keep=cfg.train.keep_checkpoints)
                    raise RunInterrupted(f"{signal.Signals(signum).name} in round {k}/{A.rounds} after SFT step "
                                         f"{e.state['step']}: kept checkpoint {path}; continue with --resume",
                                         signum) from None
            else:
                logger.info(f"[rs] round {k}: no response beat min_score={A.min_score}; policy unchanged")
            mid = None
            metrics["train/examples"] = len(train_rows)
            t_train = time.perf_counter() - t0
            # 4.5 weight sync, metrics, checkpoint
            if train_rows:  # push + canary check (merges LoRA); WeightSyncError if the engine disagrees
                metrics.update(push_weights(engine, model, canary, roll.sync_tolerance).metrics())
            metrics.update({M.T_GENERATE: t_gen, "timing/score": t_score, M.T_TRAIN: t_train,
                            M.T_STEP: time.perf_counter() - t_round})
            atomic_write_text(rdir / "metrics.json", json.dumps(metrics, indent=2))
            log.log(k, metrics)

        # 5. (the loop wrote the last round's checkpoint) the final policy as an HF directory in output_dir
        export_model(model, tok, out)
    finally:
        log.close()   # trackers and callbacks end whatever stops the run
    logger.info(f"[rs] saved policy to {out}")
    return out
