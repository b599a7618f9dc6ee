"""`turborlhf kto`: Kahneman-Tversky optimisation (Ethayarajh et al. 2402.01306) on unpaired data.

With r(x,y) = logπθ(y|x) - logπref(y|x) (summed response log-probs) and the reference point z0
(maths in `turborlhf.algo.losses.kto_loss` / `kto_kl_estimate`):

    desirable y:    λ_D (1 - σ(β (r - z0)))
    undesirable y:  λ_U (1 - σ(β (z0 - r)))
    z0 = max(0, mean_j [logπθ(y'_j|x_j) - logπref(y'_j|x_j)])   over mismatched pairs, detached
    loss = mean over the step's examples

Implementation details (docs/algorithms/kto.md has the equations and the peer comparison):

1. Mismatched pairs come from the step batch: prompt j gets the completion of example j-1
   (TRL's rotation ``[completions[-1]] + completions[:-1]``). If that would hand a prompt a
   completion written for the same prompt (pair-derived data puts both answers of one prompt in
   the set), the shift grows to the smallest k with no such collision.
2. z0 is estimated once per optimizer step over all of the step's mismatched pairs, with the
   policy under ``no_grad`` (TRL and HALOs estimate it per micro-batch/device batch): every
   micro-batch uses the same z0, so micro-batching never changes the gradient.
3. The plan of steps is deterministic, so the mismatched pairs of every step are known before
   training: reference log-probs of all matched examples, all mismatched pairs, and the test
   set are computed ONCE and cached in ``<output_dir>/ref_logps.pt`` (as in DPO).
4. As TRL, warn when λ_D·N_D / (λ_U·N_U) is outside [1, 4/3] (paper §4.2 recommendation).

    turborlhf kto --config configs/hh_smollm2/kto.yaml
"""
from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import torch

from turborlhf.algo import kto_kl_estimate, kto_loss, reduce_seq_loss
from turborlhf.config import KTOConfig
from turborlhf.data.loaders import load_kto
from turborlhf.data.tokenize import batch_tokenized, encode_prompt_response, report_truncation
from turborlhf.engine.checkpoint import PlanDigest, restore, save_checkpoint, trainer_state
from turborlhf.engine.lifecycle import checkpointed_steps, eval_due, log_due, run_to_end, start_run
from turborlhf.engine.run import export_model, plan_steps, print_batch_table, resolve_hardware
from turborlhf.engine.train import (clip_and_step, count_parameters, make_optimizer, make_scheduler,
                                    seed_everything, set_threads)
from turborlhf.metrics import M, MetricsLogger, tracker_kwargs
from turborlhf.models.forward import sequence_logps, summed_logps
from turborlhf.models.load import load_tokenizer, load_trainable
from turborlhf.models.reference import reference_logps, reuses_policy

__all__ = ["phases", "train", "train_steps", "mismatch_sources", "check_weights"]

logger = logging.getLogger(__name__)


def phases(cfg: KTOConfig) -> tuple[str, ...]:
    """The memory phases of the run, in order (`turborlhf plan` sizes each one and refuses a config whose phases it does not model): the reference
    log-probs (once, up front); per optimizer step the no-grad KL reference point z0 over the
    step's mismatched pairs, the forward/backward, the step."""
    return ("reference log-probs (once)", "z0 (no grad)", "train", "optimizer step")


def mismatch_sources(prompts: Sequence[str]) -> list[int]:
    """For each position j, the index whose completion forms j's mismatched (KL) pair.

    TRL rotation: ``j - 1`` (mod B). If any prompt would get a completion of the same prompt,
    the smallest shift k in 1..B-1 without collision is used instead (k = 1 if none exists).
    Raises ``ValueError`` for fewer than 2 examples.
    """
    B = len(prompts)
    if B < 2:
        raise ValueError("KTO needs at least 2 examples per batch to build mismatched pairs")
    for k in range(1, B):
        if all(prompts[j] != prompts[(j - k) % B] for j in range(B)):
            return [(j - k) % B for j in range(B)]
    return [(j - 1) % B for j in range(B)]


def check_weights(n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float) -> float:
    """λ_D·N_D / (λ_U·N_U); warns (``UserWarning``, as TRL) when it is outside [1, 4/3]."""
    ratio = (desirable_weight * n_desirable) / (undesirable_weight * n_undesirable) if n_undesirable else float("inf")
    if not 1.0 <= ratio <= 4 / 3:
        warnings.warn(f"KTO: desirable_weight·N_D / (undesirable_weight·N_U) = {desirable_weight}·{n_desirable} / "
                      f"({undesirable_weight}·{n_undesirable}) = {ratio:.3f} is outside [1, 4/3] recommended by the "
                      "paper (§4.2); adjust algo.desirable_weight / algo.undesirable_weight", UserWarning, stacklevel=2)
    return ratio


def _encode(tok, rows: Sequence[dict], max_len: int) -> list[dict]:
    with batch_tokenized(tok, [t for r in rows for t in (r["prompt"], r["completion"])]):
        return [{**encode_prompt_response(tok, r["prompt"], r["completion"], max_len), "label": r["label"]}
                for r in rows]


def _kl_pairs(tok, rows: Sequence[dict], idx: Sequence[int], max_len: int) -> list[dict]:
    """Mismatched sequences for the examples `idx`: prompt of idx[j] + completion of its source."""
    src = mismatch_sources([rows[i]["prompt"] for i in idx])
    with batch_tokenized(tok, [t for i, s in zip(idx, src) for t in (rows[i]["prompt"], rows[idx[s]]["completion"])]):
        return [encode_prompt_response(tok, rows[i]["prompt"], rows[idx[s]]["completion"], max_len)
                for i, s in zip(idx, src)]


def kto_batch_loss(model, tok, enc: Sequence[dict], ref_B: torch.Tensor, z0: torch.Tensor, cfg: KTOConfig,
                   num_examples: int) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch (one forward over all its examples), divided by the step's count."""
    A = cfg.algo
    logp_B, _, _ = summed_logps(model, tok.pad_token_id, enc, cfg.model.dtype)
    des = torch.tensor([bool(e["label"]) for e in enc])
    loss_N, st = kto_loss(logp_B[des], ref_B[des], logp_B[~des], ref_B[~des], z0, A.beta,
                          A.desirable_weight, A.undesirable_weight)
    sums = {"loss": float(loss_N.detach().sum()), "chosen": float(st["chosen_rewards"].sum()),
            "rejected": float(st["rejected_rewards"].sum()), "n_chosen": int(des.sum()),
            "n_rejected": int((~des).sum()), "logp_c": float(logp_B[des].detach().sum()),
            "logp_r": float(logp_B[~des].detach().sum())}
    return reduce_seq_loss(loss_N, num_seqs=num_examples), sums


def _summary(sums: dict, n: int, prefix: str = "") -> dict:
    """Per-step (or per-eval) means; reward/logp means over the examples of each label (TRL)."""
    out = {f"{prefix}loss" if prefix else M.LOSS: sums["loss"] / n}
    if sums["n_chosen"]:
        out[prefix + M.R_CHOSEN] = sums["chosen"] / sums["n_chosen"]
        out[prefix + M.LOGP_CHOSEN] = sums["logp_c"] / sums["n_chosen"]
    if sums["n_rejected"]:
        out[prefix + M.R_REJECTED] = sums["rejected"] / sums["n_rejected"]
        out[prefix + M.LOGP_REJECTED] = sums["logp_r"] / sums["n_rejected"]
    if sums["n_chosen"] and sums["n_rejected"]:
        out[prefix + M.R_MARGIN] = out[prefix + M.R_CHOSEN] - out[prefix + M.R_REJECTED]
    return out


@torch.no_grad()
def evaluate(model, tok, test_enc: Sequence[dict], test_kl: Sequence[dict], ref: dict, cfg: KTOConfig) -> dict:
    """Test loss/rewards; z0 from the test set's own mismatched pairs (one rotation over the set)."""
    bs = 4 * cfg.train.micro_batch_size
    pi_kl = sequence_logps(model, tok.pad_token_id, test_kl, cfg.model.dtype, bs)
    z0 = kto_kl_estimate(pi_kl, ref["test_kl"])
    pi = sequence_logps(model, tok.pad_token_id, test_enc, cfg.model.dtype, bs)
    des = torch.tensor([bool(e["label"]) for e in test_enc])
    A = cfg.algo
    loss_N, st = kto_loss(pi[des], ref["test"][des], pi[~des], ref["test"][~des], z0, A.beta,
                          A.desirable_weight, A.undesirable_weight)
    sums = {"loss": float(loss_N.sum()), "chosen": float(st["chosen_rewards"].sum()),
            "rejected": float(st["rejected_rewards"].sum()), "n_chosen": int(des.sum()),
            "n_rejected": int((~des).sum()), "logp_c": float(pi[des].sum()), "logp_r": float(pi[~des].sum())}
    return {**_summary(sums, len(test_enc), "eval/"), "eval/kl": float(z0), "n": len(test_enc)}


def train(cfg: KTOConfig, resume: bool = False) -> Path:
    """`turborlhf kto`: the whole run (`train_steps` to its end); returns the output directory."""
    return run_to_end(train_steps(cfg, resume))


def train_steps(cfg: KTOConfig, resume: bool = False) -> Iterator[tuple[int, int, dict]]:
    """`train` as a generator: yields ``(done, total, metrics)`` after each optimizer step (``done``:
    steps finished, 1-based, of ``total``; ``metrics``: that step's, logged or not); the final evaluation,
    checkpoint and export run when it is resumed after the last step; returns the output directory."""
    # 1. run directory, threads, seed
    cfg = resolve_hardware(cfg, "kto")      # device and precision: auto → this host's choice
    out, ckpt = start_run(cfg, resume, "kto")
    set_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    loop, A = cfg.train, cfg.algo

    # 2. tokenizer; examples → token ids (read and checked before any model loads); deterministic
    #    plan; each step's mismatched (KL) pairs
    tok = load_tokenizer(cfg.model.name_or_path)
    rows = load_kto(cfg.data.train_file, tok, **cfg.data.loader_kwargs())
    if cfg.data.max_samples:
        rows = rows[:cfg.data.max_samples]
    n_des = sum(bool(r["label"]) for r in rows)
    check_weights(n_des, len(rows) - n_des, A.desirable_weight, A.undesirable_weight)
    train_enc = _encode(tok, rows, cfg.data.max_len)
    report_truncation("kto", train_enc, cfg.data.max_len)
    plan = plan_steps([len(e["input_ids"]) for e in train_enc], loop.examples_per_step,
                      loop.epochs, loop.max_steps, loop.seed)
    # the KL reference point z0 pairs each step's examples with each other (a step holds examples_per_step, or
    # all of them when there are fewer: plan_steps drops a remainder)
    if min(len(b) for b in plan) < 2:
        from turborlhf.config import ConfigError
        cap = " (data.max_samples)" if cfg.data.max_samples else ""
        raise ConfigError(f"data.train_file: KTO needs at least 2 training examples (its KL reference point pairs "
                          f"them), got {len(train_enc)}{cap}")
    step_kl = [_kl_pairs(tok, rows, idx, cfg.data.max_len) for idx in plan]
    test_enc, test_kl = [], []
    if cfg.data.test_file:
        test_rows = load_kto(cfg.data.test_file, tok, **cfg.data.loader_kwargs())
        test_rows = test_rows[:cfg.data.max_test_samples] if cfg.data.max_test_samples else test_rows
        if len(test_rows) < 2:     # the KL reference point z0 needs mismatched pairs of two examples
            from turborlhf.config import ConfigError
            cap = " (data.max_test_samples)" if cfg.data.max_test_samples else ""
            raise ConfigError(f"data.test_file: KTO's evaluation needs at least 2 examples (its KL reference point "
                              f"pairs them), got {len(test_rows)}{cap}")
        test_enc = _encode(tok, test_rows, cfg.data.max_len)
        test_kl = _kl_pairs(tok, test_rows, range(len(test_rows)), cfg.data.max_len)

    # 3. policy (fp32 master weights; bf16 autocast compute)
    model = load_trainable("causal", cfg.model, tok, ckpt_dir=ckpt / "policy" if ckpt else None)

    # 4. reference log-probs of everything, once, cached (flat list of KL pairs, sliced per step)
    offsets = [0]
    for kl in step_kl:
        offsets.append(offsets[-1] + len(kl))
    sets = {"train": train_enc, "train_kl": [s for kl in step_kl for s in kl], "test": test_enc, "test_kl": test_kl}
    reference = cfg.reference or cfg.model.name_or_path
    reuse = model if reuses_policy(model, cfg.model.name_or_path, reference, resumed=ckpt is not None) else None
    ref = reference_logps(out, reference, tok, sets, cfg.model.dtype, 4 * loop.micro_batch_size, reuse, "kto",
                          device=cfg.model.device)
    print_batch_table("kto", [("examples", len(train_enc)), ("desirable", n_des), ("undesirable", len(rows) - n_des),
                              ("test_examples", len(test_enc)), ("examples_per_step", loop.examples_per_step),
                              ("micro_batch_size", loop.micro_batch_size), ("optimizer_steps", len(plan)),
                              ("beta", A.beta), ("trainable_params", count_parameters(model, trainable_only=True))])

    # 5. optimizer, schedule, resume state
    optim = make_optimizer(model, cfg.optim)
    sched = make_scheduler(optim, cfg.optim, len(plan))
    steps_digest = PlanDigest(plan, train_enc)      # resuming with other data or batches is refused
    start = restore(ckpt, optim, sched, "kto", steps_digest)
    log = MetricsLogger(out, "kto", len(plan), show=(M.LOSS, M.KL, M.R_MARGIN, M.LR), **tracker_kwargs(cfg),
                        progress=cfg.log.progress, resume=bool(ckpt), start_step=start)
    try:
        def checkpoint(step: int) -> Path:
            return save_checkpoint(out, step, {"policy": model}, tok, trainer_state(optim, sched, step, steps_digest),
                                   keep=loop.keep_checkpoints)

        # 6. training loop: z0 once per step (no grad), then per-example losses / examples in the step
        for step in checkpointed_steps(start, len(plan), checkpoint, loop.save_every, "kto"):
            t0 = time.perf_counter()
            idx = plan[step]
            n = len(idx)
            pi_kl = sequence_logps(model, tok.pad_token_id, step_kl[step], cfg.model.dtype, 2 * loop.micro_batch_size)
            z0 = kto_kl_estimate(pi_kl, ref["train_kl"][offsets[step]:offsets[step + 1]])
            sums: dict[str, float] = {}
            for s in range(0, n, loop.micro_batch_size):
                mb = idx[s:s + loop.micro_batch_size]
                loss, part = kto_batch_loss(model, tok, [train_enc[i] for i in mb], ref["train"][mb], z0, cfg, n)
                loss.backward()
                for k, v in part.items():
                    sums[k] = sums.get(k, 0) + v
            lr = sched.get_last_lr()[0]
            gnorm = clip_and_step(model, optim, sched, cfg.optim.max_grad_norm)
            dt = time.perf_counter() - t0
            n_tok = sum(len(train_enc[i]["input_ids"]) for i in idx) + sum(len(s["input_ids"]) for s in step_kl[step])
            metrics = {**_summary(sums, n), M.KL: float(z0), M.LR: lr, M.GRAD_NORM: gnorm,
                       M.TOKENS_PER_S: n_tok / dt, M.T_STEP: dt}
            done = step + 1
            evaluated = eval_due(done, len(plan), loop.eval_every, bool(test_enc))
            if evaluated:
                metrics.update({k: v for k, v in evaluate(model, tok, test_enc, test_kl, ref, cfg).items() if k != "n"})
            if log_due(done, len(plan), cfg.log.every, evaluated):
                log.log(done, metrics)
            yield done, len(plan), metrics

        # 7. (the loop wrote the last step's checkpoint: a signal during the evaluation finds it) final
        #    evaluation, exported HF policy
        if test_enc:
            ev = evaluate(model, tok, test_enc, test_kl, ref, cfg)
            log.log(len(plan), {k: v for k, v in ev.items() if k != "n"})
            (out / "eval.json").write_text(json.dumps(ev, indent=2))
            logger.info(f"[kto] test loss {ev['eval/loss']:.4f}, kl {ev['eval/kl']:.4f} on {ev['n']} examples")
        export_model(model, tok, out)
    finally:
        log.close()   # trackers and callbacks end whatever stops the run
    logger.info(f"[kto] saved policy to {out}")
    return out
