"""`turborlhf dpo`: direct preference optimisation (Rafailov et al. 2305.18290) and its variants.

With summed response log-probs π_c, π_r (policy) and ρ_c, ρ_r (reference) of a chosen/rejected
pair, ``h = (π_c - π_r) - (ρ_c - ρ_r)`` and, per pair (maths in `turborlhf.algo.losses.dpo_loss`):

    dpo     -logσ(βh)                                   (Eq. 7; ε > 0 makes it cdpo, as OpenRLHF)
    cdpo    -(1-ε)logσ(βh) - ε logσ(-βh)                (Mitchell 2023)
    robust  [-(1-ε)logσ(βh) + ε logσ(-βh)] / (1-2ε)     (Chowdhury et al. 2403.00409)
    ipo     (h - 1/(2β))²                               (Azar et al. 2310.12036; summed log-probs
                                                         unless algo.ipo_normalize_by_length)
    reference_free: h = π_c - π_r
    loss = mean over the step's pairs  (+ nll_coef · mean_pairs[token-mean NLL of chosen])

Implementation details (docs/algorithms/dpo.md has the equations and the peer comparison):

1. Chosen and rejected share one prompt truncation (the shorter of the two left-cut prompts),
   so both implicit rewards condition on the same context.
2. Reference log-probs are computed **once**, before training, for every train and test pair,
   and cached in memory and in ``<output_dir>/ref_logps.pt`` under a fingerprint of the
   reference weights (path, file sizes and mtimes), the compute dtype and every token id; a
   resumed run with the same fingerprint loads them and never builds the reference model.
   The reference runs like the policy (fp32 weights under the configured autocast): on
   SmolLM2-135M/HH in bf16 a bf16-weight copy sat 0.29-0.40 nats (mean per sequence) from the
   policy's training forward; the same weights with the training forward's attention kernels
   (`sequence_logps`) give the same log-probs, so the step-1 loss is ln 2 also in bf16. When the reference
   is the initial policy, the freshly loaded policy itself computes them (no second copy).
3. Chosen and rejected sequences of a micro-batch go through ONE forward pass ([chosen;
   rejected] rows); log-probs are gathered only at response positions (no B×T×V logits).
4. Per-pair losses are summed over micro-batches and divided by the step's pair count
   (`reduce_seq_loss` with the global count), so micro-batching never changes the gradient.

    turborlhf dpo --config configs/hh_smollm2/dpo.yaml
    turborlhf eval-dpo --policy runs/hh_smollm2/dpo --reference smollm2-135m-instruct \\
        --data runs/hh_data/test_pairs.jsonl --json
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

from turborlhf.algo import dpo_loss, reduce_loss, reduce_seq_loss, sft_nll_loss
from turborlhf.config import DPOConfig
from turborlhf.data.loaders import load_pairs
from turborlhf.data.tokenize import encode_pair, encode_pair_list, report_truncation
from turborlhf.engine.checkpoint import PlanDigest, restore, save_checkpoint, trainer_state
from turborlhf.engine.lifecycle import checkpointed_steps, eval_due, log_due, run_to_end, start_run
from turborlhf.engine.run import export_model, plan_steps, print_batch_table, resolve_hardware
from turborlhf.engine.train import (clip_and_step, count_parameters, make_optimizer, make_scheduler,
                                    seed_everything, set_threads)
from turborlhf.metrics import M, MetricsLogger, tracker_kwargs
from turborlhf.models.forward import sequence_logps, summed_logps
from turborlhf.models.load import load_causal_lm, load_tokenizer, load_trainable
from turborlhf.models.reference import check_reference_vocabulary, reference_logps, reuses_policy

__all__ = ["phases", "train", "train_steps", "eval_dpo", "eval_dpo_main", "encode_pair", "dpo_batch_loss",
           "pair_metrics"]

logger = logging.getLogger(__name__)


def phases(cfg: DPOConfig) -> tuple[str, ...]:
    """The memory phases of the run, in order (`turborlhf plan` sizes each one and refuses a config whose phases it does not model): the reference
    log-probs, computed once up front (none with ``algo.reference_free``), then each optimizer
    step's forward/backward and step."""
    return (() if cfg.algo.reference_free else ("reference log-probs (once)",)) + ("train", "optimizer step")

# config name → turborlhf.algo.DPO_VARIANTS key (one explicit table, no if/elif ladder)
LOSS_VARIANTS = {"dpo": "sigmoid", "cdpo": "cdpo", "robust": "robust", "ipo": "ipo"}

NLL = "train/nll"


# ----------------------------------------------------------------------------------------------
# Per-batch loss and evaluation
# ----------------------------------------------------------------------------------------------

def dpo_batch_loss(model, tokenizer, pairs: Sequence[dict], ref_c_B: torch.Tensor, ref_r_B: torch.Tensor,
                   cfg: DPOConfig, num_pairs: int) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch of encoded pairs, already divided by the step's `num_pairs`.

    One forward over ``[chosen; rejected]`` (2B rows). Returns the scalar to back-propagate and
    detached per-micro-batch sums (``loss``, ``nll``, rewards, logps, correct count).
    """
    A = cfg.algo
    B = len(pairs)
    logp_2B, logp_2BT, mask_2BT = summed_logps(model, tokenizer.pad_token_id,
                                               [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
                                               cfg.model.dtype)
    len_2B = mask_2BT.sum(-1)
    loss_B, st = dpo_loss(logp_2B[:B], logp_2B[B:], ref_c_B, ref_r_B, A.beta, LOSS_VARIANTS[A.loss],
                          A.label_smoothing, A.reference_free, A.ipo_normalize_by_length, len_2B[:B], len_2B[B:])
    loss = reduce_seq_loss(loss_B, num_seqs=num_pairs)
    sums = {"loss": float(loss_B.detach().sum())}
    if A.nll_coef:
        # OpenRLHF nll_loss: token mean per chosen response, averaged over the step's pairs
        nll = reduce_loss(sft_nll_loss(logp_2BT[:B], mask_2BT[:B]), mask_2BT[:B], "seq_mean_token_mean",
                          num_seqs=num_pairs)
        loss = loss + A.nll_coef * nll
        sums["nll"] = float(nll.detach()) * num_pairs
        sums["loss"] += A.nll_coef * sums["nll"]
    sums.update({"chosen": float(st["chosen_rewards"].sum()), "rejected": float(st["rejected_rewards"].sum()),
                 "correct": float((st["chosen_rewards"] > st["rejected_rewards"]).sum()),
                 "logp_c": float(logp_2B[:B].detach().sum()), "logp_r": float(logp_2B[B:].detach().sum())})
    return loss, sums


def pair_metrics(pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor, beta: float,
                 variant: str = "sigmoid", **loss_kw) -> dict:
    """Implicit-reward statistics over N pairs: loss, accuracy (strict >), margin, reward means."""
    loss_N, st = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, variant, **loss_kw)
    correct = int((st["chosen_rewards"] > st["rejected_rewards"]).sum())  # == st["accuracy"]·N, exact
    return {"loss": float(loss_N.mean()), "accuracy": correct / len(pi_c), "margin": float(st["margin"]),
            "chosen_reward_mean": float(st["chosen_rewards"].mean()),
            "rejected_reward_mean": float(st["rejected_rewards"].mean()),
            "logps_chosen_mean": float(pi_c.mean()), "logps_rejected_mean": float(pi_r.mean()), "n": len(pi_c)}


def evaluate(model, tokenizer, pairs: Sequence[dict], ref: dict[str, torch.Tensor], cfg: DPOConfig) -> dict:
    """Policy log-probs on the test pairs (no grad) against their cached reference log-probs."""
    bs = 4 * cfg.train.micro_batch_size
    pi_c = sequence_logps(model, tokenizer.pad_token_id, [p["chosen"] for p in pairs], cfg.model.dtype, bs)
    pi_r = sequence_logps(model, tokenizer.pad_token_id, [p["rejected"] for p in pairs], cfg.model.dtype, bs)
    A = cfg.algo
    lens = {}
    if A.ipo_normalize_by_length:
        lens = {"len_c_B": torch.tensor([sum(p["chosen"]["loss_mask"]) for p in pairs]),
                "len_r_B": torch.tensor([sum(p["rejected"]["loss_mask"]) for p in pairs])}
    return pair_metrics(pi_c, pi_r, ref["test_chosen"], ref["test_rejected"], A.beta, LOSS_VARIANTS[A.loss],
                        label_smoothing=A.label_smoothing, reference_free=A.reference_free,
                        ipo_normalize_by_length=A.ipo_normalize_by_length, **lens)


def _eval_metrics(ev: dict) -> dict:
    return {M.EVAL_LOSS: ev["loss"], M.EVAL_ACC: ev["accuracy"], "eval/" + M.R_MARGIN: ev["margin"],
            "eval/" + M.R_CHOSEN: ev["chosen_reward_mean"], "eval/" + M.R_REJECTED: ev["rejected_reward_mean"]}


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

def train(cfg: DPOConfig, resume: bool = False) -> Path:
    """`turborlhf dpo`: the whole run (`train_steps` to its end); returns the output directory."""
    return run_to_end(train_steps(cfg, resume))


def train_steps(cfg: DPOConfig, resume: bool = False) -> Iterator[tuple[int, int, dict]]:
    """`train` as a generator: yields ``(done, total, metrics)`` after each optimizer step (``done``:
    steps finished, 1-based, of ``total``; ``metrics``: that step's, logged or not); the final evaluation,
    checkpoint and export run when it is resumed after the last step; returns the output directory."""
    # 1. run directory, threads, seed
    cfg = resolve_hardware(cfg, "dpo")      # device and precision: auto → this host's choice
    out, ckpt = start_run(cfg, resume, "dpo")
    set_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    loop, A = cfg.train, cfg.algo

    # 2. tokenizer; pairs → token ids (shared prompt truncation; read and checked before any model
    #    loads); deterministic plan of optimizer steps
    tok = load_tokenizer(cfg.model.name_or_path)
    pairs = load_pairs(cfg.data.train_file, tok, **cfg.data.loader_kwargs())
    if cfg.data.max_samples:
        pairs = pairs[:cfg.data.max_samples]
    train_enc = encode_pair_list(tok, pairs, cfg.data.max_len)
    report_truncation("dpo", [e[side] for e in train_enc for side in ("chosen", "rejected")], cfg.data.max_len)
    test_enc = []
    if cfg.data.test_file:
        test_pairs = load_pairs(cfg.data.test_file, tok, **cfg.data.loader_kwargs())
        test_pairs = test_pairs[:cfg.data.max_test_samples] if cfg.data.max_test_samples else test_pairs
        test_enc = encode_pair_list(tok, test_pairs, cfg.data.max_len)
    plan = plan_steps([max(len(e["chosen"]["input_ids"]), len(e["rejected"]["input_ids"])) for e in train_enc],
                      loop.pairs_per_step, loop.epochs, loop.max_steps, loop.seed)

    # 3. policy (fp32 master weights; bf16 autocast compute)
    model = load_trainable("causal", cfg.model, tok, ckpt_dir=ckpt / "policy" if ckpt else None)

    # 4. reference log-probs: once for all train and test pairs, cached (none if reference-free)
    sets = {"train_chosen": [e["chosen"] for e in train_enc], "train_rejected": [e["rejected"] for e in train_enc],
            "test_chosen": [e["chosen"] for e in test_enc], "test_rejected": [e["rejected"] for e in test_enc]}
    if A.reference_free:
        ref = {k: torch.zeros(len(v)) for k, v in sets.items()}
    else:
        reference = cfg.reference or cfg.model.name_or_path
        reuse = model if reuses_policy(model, cfg.model.name_or_path, reference, resumed=ckpt is not None) else None
        ref = reference_logps(out, reference, tok, sets, cfg.model.dtype, 4 * loop.micro_batch_size, reuse, "dpo",
                              device=cfg.model.device)
    print_batch_table("dpo", [("pairs", len(train_enc)), ("test_pairs", len(test_enc)),
                              ("pairs_per_step", loop.pairs_per_step),
                              ("micro_batch_size (pairs)", loop.micro_batch_size),
                              ("sequences_per_forward", 2 * loop.micro_batch_size), ("optimizer_steps", len(plan)),
                              ("loss", A.loss), ("beta", A.beta),
                              ("trainable_params", count_parameters(model, trainable_only=True))])

    # 5. optimizer, schedule, resume state
    optim = make_optimizer(model, cfg.optim)
    sched = make_scheduler(optim, cfg.optim, len(plan))
    steps_digest = PlanDigest(plan, train_enc)      # resuming with other data or batches is refused
    start = restore(ckpt, optim, sched, "dpo", steps_digest)
    log = MetricsLogger(out, "dpo", len(plan), show=(M.LOSS, M.R_ACC, M.R_MARGIN, M.EVAL_ACC, M.LR),
                        **tracker_kwargs(cfg), progress=cfg.log.progress, resume=bool(ckpt),
                        start_step=start)
    try:
        def checkpoint(step: int) -> Path:
            return save_checkpoint(out, step, {"policy": model}, tok, trainer_state(optim, sched, step, steps_digest),
                                   keep=loop.keep_checkpoints)

        # 6. training loop: per-pair losses summed over micro-batches, divided by the step's pair count
        for step in checkpointed_steps(start, len(plan), checkpoint, loop.save_every, "dpo"):
            t0 = time.perf_counter()
            idx = plan[step]
            n_pairs = len(idx)
            sums: dict[str, float] = {}
            for s in range(0, n_pairs, loop.micro_batch_size):
                mb = idx[s:s + loop.micro_batch_size]
                loss, part = dpo_batch_loss(model, tok, [train_enc[i] for i in mb], ref["train_chosen"][mb],
                                            ref["train_rejected"][mb], cfg, n_pairs)
                loss.backward()
                for k, v in part.items():
                    sums[k] = sums.get(k, 0.0) + v
            lr = sched.get_last_lr()[0]
            gnorm = clip_and_step(model, optim, sched, cfg.optim.max_grad_norm)
            dt = time.perf_counter() - t0
            n_tok = sum(len(train_enc[i]["chosen"]["input_ids"]) + len(train_enc[i]["rejected"]["input_ids"])
                        for i in idx)
            metrics = {M.LOSS: sums["loss"] / n_pairs, M.R_CHOSEN: sums["chosen"] / n_pairs,
                       M.R_REJECTED: sums["rejected"] / n_pairs, M.R_ACC: sums["correct"] / n_pairs,
                       M.R_MARGIN: (sums["chosen"] - sums["rejected"]) / n_pairs,
                       M.LOGP_CHOSEN: sums["logp_c"] / n_pairs,
                       M.LOGP_REJECTED: sums["logp_r"] / n_pairs, M.LR: lr, M.GRAD_NORM: gnorm,
                       M.TOKENS_PER_S: n_tok / dt, M.T_STEP: dt}
            if "nll" in sums:
                metrics[NLL] = sums["nll"] / n_pairs
            done = step + 1
            evaluated = eval_due(done, len(plan), loop.eval_every, bool(test_enc))
            if evaluated:
                metrics.update(_eval_metrics(evaluate(model, tok, test_enc, ref, cfg)))
            if log_due(done, len(plan), cfg.log.every, evaluated):
                log.log(done, metrics)
            yield done, len(plan), metrics

        # 7. (the loop wrote the last step's checkpoint: a signal during the evaluation finds it) final
        #    evaluation on the test pairs, exported HF policy
        if test_enc:
            ev = evaluate(model, tok, test_enc, ref, cfg)
            log.log(len(plan), _eval_metrics(ev))
            (out / "eval.json").write_text(json.dumps(ev, indent=2))
            logger.info(f"[dpo] test implicit-reward accuracy {ev['accuracy']:.3f}, margin {ev['margin']:.4f} "
                        f"on {ev['n']} pairs")
        export_model(model, tok, out)
    finally:
        log.close()   # trackers and callbacks end whatever stops the run
    logger.info(f"[dpo] saved policy to {out}")
    return out


# ----------------------------------------------------------------------------------------------
# `turborlhf eval-dpo`
# ----------------------------------------------------------------------------------------------

def eval_dpo(policy: str, reference: str, data: str, beta: float = 0.1, max_len: int = 1024, limit: int = 0,
             batch_size: int = 8, dtype: str = "fp32") -> dict:
    """Implicit-reward accuracy of `policy` against `reference` on preference pairs.

    rewards = β·(logπ - logπ_ref) of each response (summed log-probs); ``accuracy`` = share of
    pairs with chosen reward > rejected reward (strict: ties are wrong, so policy == reference
    gives 0); ``margin`` = mean(β·h); ``loss`` = mean sigmoid DPO loss. The two models are loaded
    one after the other (fp32 weights, `dtype` autocast), so peak memory is one model.

    Default dtype fp32: each implicit reward is a difference of two ~100-token log-prob sums, and
    bf16 rounding moves such a sum by ~0.2 nats (SmolLM2-135M, HH), as much as a lightly trained
    policy's margins; on 100 HH pairs one policy scored 0.57 in fp32 and 0.53 in bf16.
    """
    set_threads()
    t0 = time.perf_counter()
    tok = load_tokenizer(policy)
    pairs = load_pairs(data, tok)
    pairs = pairs[:limit] if limit else pairs
    enc = encode_pair_list(tok, pairs, max_len)
    seqs = [e["chosen"] for e in enc] + [e["rejected"] for e in enc]
    n = len(enc)
    logps = {}
    for name, src in (("policy", policy), ("reference", reference)):
        check_reference_vocabulary(src, tok, f"--{name}")
        model = load_causal_lm(src, tok, device="auto").eval().requires_grad_(False)
        logps[name] = sequence_logps(model, tok.pad_token_id, seqs, dtype, 2 * batch_size)
        del model
        gc.collect()
    res = pair_metrics(logps["policy"][:n], logps["policy"][n:], logps["reference"][:n], logps["reference"][n:], beta)
    res.update({"beta": beta, "policy": policy, "reference": reference, "data": data,
                "seconds": round(time.perf_counter() - t0, 2)})
    return res


def eval_dpo_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="turborlhf eval-dpo",
                                description="implicit-reward accuracy and margin of a DPO policy on preference pairs")
    p.add_argument("--policy", required=True, help="trained policy directory (causal LM)")
    p.add_argument("--reference", required=True, help="reference policy (HF dir or zoo name, e.g. the SFT model)")
    p.add_argument("--data", required=True, help="pairs: raw HH lines or {prompt,chosen,rejected} (.jsonl[.gz])")
    p.add_argument("--beta", type=float, default=0.1, help="β of the implicit reward β·(logπ - logπ_ref)")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per sequence (prompt cut from the left)")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N pairs")
    p.add_argument("--batch-size", type=int, default=8, help="pairs per forward pass")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32",
                   help="compute dtype; bf16 autocast is ~2.5x faster on CPU but its rounding noise is "
                        "comparable to small implicit-reward margins")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    a = p.parse_args(argv)
    for flag, ok in (("--beta", a.beta > 0), ("--max-len", a.max_len >= 2), ("--limit", a.limit >= 0),
                     ("--batch-size", a.batch_size >= 1)):
        if not ok:     # as eval-rm and eval-policy: --limit -1 dropped the last pair, --max-len 1 scored nothing
            p.error(f"{flag}: {getattr(a, flag[2:].replace('-', '_'))} is out of range")
    # everything but the final JSON goes to stderr so stdout stays machine-readable
    with contextlib.redirect_stdout(sys.stderr):
        res = eval_dpo(a.policy, a.reference, a.data, a.beta, a.max_len, a.limit, a.batch_size, a.dtype)
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>22}: {v}")
    return 0
