"""`turborlhf sft`: supervised fine-tuning with the next-token loss on response tokens only.

Loss: token mean over all response tokens of the optimizer step (a global denominator shared by
the micro-batches, so micro-batching never changes the gradient), as TRL's SFTTrainer with
`completion_only_loss` and OpenRLHF's SFT trainer do.

    turborlhf sft --config configs/tiny/sft.yaml --train.max_steps 10
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, Optional

import torch

from turborlhf.algo import reduce_loss, sft_nll_loss
from turborlhf.config import SFTConfig
from turborlhf.data.loaders import load_sft
from turborlhf.data.tokenize import encode_prompt_response, pad_batch
from turborlhf.engine.checkpoint import restore, save_checkpoint, trainer_state
from turborlhf.engine.lifecycle import checkpointed_steps, run_to_end, start_run
from turborlhf.engine.run import export_model, plan_steps, print_batch_table, resolve_hardware
from turborlhf.engine.train import (autocast, clip_and_step, make_optimizer, make_scheduler, seed_everything,
                                    set_threads)
from turborlhf.metrics import M, MetricsLogger, tracker_kwargs
from turborlhf.models.forward import response_logprobs
from turborlhf.models.load import load_tokenizer, load_trainable

__all__ = ["train", "train_steps", "fit", "fit_steps", "sft_step", "encode_examples", "sft_loss_on_batch", "evaluate_nll"]


def encode_examples(tokenizer, rows: list[dict], max_len: int) -> list[dict]:
    return [encode_prompt_response(tokenizer, r["prompt"], r["response"], max_len) for r in rows]


def sft_loss_on_batch(model, tokenizer, encoded: list[dict], num_tokens: int, dtype: str) -> tuple[torch.Tensor, int]:
    """Summed NLL of the batch's response tokens divided by the step's global `num_tokens`."""
    ids, attn = pad_batch([e["input_ids"] for e in encoded], tokenizer.pad_token_id)
    mask, _ = pad_batch([e["loss_mask"] for e in encoded], 0)
    with autocast(dtype):
        logp, _ = response_logprobs(model, ids, attn, mask)
    loss = reduce_loss(sft_nll_loss(logp, mask.float()), mask.float(), "token_mean", num_tokens=num_tokens)
    return loss, int(mask.sum())


@torch.no_grad()
def evaluate_nll(model, tokenizer, encoded: list[dict], dtype: str, batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(encoded), batch_size):
        chunk = encoded[s:s + batch_size]
        n = sum(sum(e["loss_mask"]) for e in chunk)
        loss, _ = sft_loss_on_batch(model, tokenizer, chunk, n, dtype)
        total += float(loss) * n
        count += n
    model.train()
    return total / max(count, 1)


def sft_step(model, tokenizer, batch: list[dict], micro_batch_size: int, dtype: str) -> float:
    """Backward of one optimizer step's `batch` in micro-batches of `micro_batch_size`; every
    micro-batch divides by the step's token count, so the accumulated gradient is the whole
    batch's token mean. Returns the step's loss."""
    num_tokens = sum(sum(e["loss_mask"]) for e in batch)
    step_loss = 0.0
    for s in range(0, len(batch), micro_batch_size):
        loss, _ = sft_loss_on_batch(model, tokenizer, batch[s:s + micro_batch_size], num_tokens, dtype)
        loss.backward()
        step_loss += float(loss.detach())
    return step_loss


def fit(cfg, model, tokenizer, train_enc: list[dict], test_enc: list[dict], plan: list[list[int]], out: Path,
        ckpt: Optional[Path], tag: str = "sft") -> None:
    """The SFT loop shared by `turborlhf sft` and `turborlhf conditional-sft`: optimizer and
    schedule (resumed from `ckpt`), `plan`'s optimizer steps (`sft_step`), periodic and final
    held-out NLL, checkpoints (model saved as ``policy``) and the exported model in `out`.

    cfg: any config with ``model.dtype``, ``optim`` (`OptimCfg`), ``train`` (`SFTTrainCfg`) and
    ``log`` (`LogCfg`). train_enc/test_enc: `encode_examples` records; plan: `plan_steps` output.
    """
    run_to_end(fit_steps(cfg, model, tokenizer, train_enc, test_enc, plan, out, ckpt, tag))


def fit_steps(cfg, model, tokenizer, train_enc: list[dict], test_enc: list[dict], plan: list[list[int]], out: Path,
              ckpt: Optional[Path], tag: str = "sft") -> Iterator[tuple[int, int, dict]]:
    """`fit` as a generator: yields ``(done, total, metrics)`` after each optimizer step (``done``: steps
    finished, 1-based, of ``total``; ``metrics``: that step's, logged or not); the final evaluation, checkpoint
    and export run when it is resumed after the last step (`turborlhf.api` drives it one step at
    a time)."""
    T = cfg.train
    optim = make_optimizer(model, cfg.optim)
    sched = make_scheduler(optim, cfg.optim, len(plan))
    start = restore(ckpt, optim, sched, tag)
    log = MetricsLogger(out, tag, len(plan), show=(M.LOSS, M.LR, M.TOKENS_PER_S), **tracker_kwargs(cfg),
                        progress=cfg.log.progress, resume=bool(ckpt), start_step=start)

    def checkpoint(step: int) -> Path:
        return save_checkpoint(out, step, {"policy": model}, tokenizer, trainer_state(optim, sched, step),
                               keep=T.keep_checkpoints)

    for step in checkpointed_steps(start, len(plan), checkpoint, T.save_every, tag):
        t0 = time.perf_counter()
        batch = [train_enc[i] for i in plan[step]]
        step_loss = sft_step(model, tokenizer, batch, T.micro_batch_size, cfg.model.dtype)
        lr = sched.get_last_lr()[0]
        gnorm = clip_and_step(model, optim, sched, cfg.optim.max_grad_norm)
        dt = time.perf_counter() - t0
        n_tok = sum(len(e["input_ids"]) for e in batch)
        metrics = {M.LOSS: step_loss, M.LR: lr, M.GRAD_NORM: gnorm, M.TOKENS_PER_S: n_tok / dt, M.T_STEP: dt}
        done = step + 1
        if test_enc and T.eval_every and done % T.eval_every == 0 and done < len(plan):
            metrics[M.EVAL_LOSS] = evaluate_nll(model, tokenizer, test_enc, cfg.model.dtype, T.micro_batch_size)
        if done % cfg.log.every == 0 or done == len(plan):
            log.log(done, metrics)
        yield done, len(plan), metrics

    if test_enc:
        log.log(len(plan), {M.EVAL_LOSS: evaluate_nll(model, tokenizer, test_enc, cfg.model.dtype, T.micro_batch_size)})
    checkpoint(len(plan))
    export_model(model, tokenizer, out)
    log.close()


def train(cfg: SFTConfig, resume: bool = False) -> Path:
    """`turborlhf sft`: the whole run (`train_steps` to its end); returns the output directory."""
    return run_to_end(train_steps(cfg, resume))


def train_steps(cfg: SFTConfig, resume: bool = False) -> Iterator[tuple[int, int, dict]]:
    """`train` as a generator of ``(done, total, metrics)`` per optimizer step (`fit_steps`); its return
    value (``StopIteration.value``) is the output directory."""
    # 1. run directory, threads, seed
    cfg = resolve_hardware(cfg, "sft")      # device and precision: auto → this host's choice
    out, ckpt = start_run(cfg, resume, "sft")
    set_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)

    # 2. tokenizer; data → token ids + response masks (read and checked before any model loads);
    #    a deterministic plan of optimizer steps
    tok = load_tokenizer(cfg.model.name_or_path)
    rows = load_sft(cfg.data.train_file, tok, **cfg.data.loader_kwargs())
    if cfg.data.max_samples:
        rows = rows[:cfg.data.max_samples]
    train_enc = encode_examples(tok, rows, cfg.data.max_len)
    test_enc = encode_examples(tok, load_sft(cfg.data.test_file, tok, **cfg.data.loader_kwargs()), cfg.data.max_len) if cfg.data.test_file else []
    T = cfg.train
    plan = plan_steps([len(e["input_ids"]) for e in train_enc], T.sequences_per_step, T.epochs, T.max_steps, T.seed)
    print_batch_table("sft", [("examples", len(train_enc)), ("sequences_per_step", T.sequences_per_step),
                              ("micro_batch_size", T.micro_batch_size), ("optimizer_steps", len(plan))])

    # 3. model (fp32 master weights, bf16 autocast compute; LoRA/QLoRA/checkpointing as model.* says)
    model = load_trainable("causal", cfg.model, tok, ckpt_dir=ckpt / "policy" if ckpt else None)

    # 4-6. optimizer, schedule and resume state; the loop (micro-batches share the step's token
    #      count as denominator); final evaluation, resumable checkpoint, exported HF model
    yield from fit_steps(cfg, model, tok, train_enc, test_enc, plan, out, ckpt, "sft")
    print(f"[sft] saved policy to {out}", flush=True)
    return out
