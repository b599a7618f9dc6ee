"""What several trainers share, so no trainer module imports another: the SFT loss and loop.

- `sft_loss_on_batch` / `sft_step` / `evaluate_nll`: the token-mean NLL of response tokens with
  the optimizer step's global token count as denominator (TRL's SFTTrainer with
  ``completion_only_loss``, OpenRLHF's SFT trainer): used by `turborlhf sft`, `conditional-sft`,
  `rejection-sampling` (SFT on the winners) and `ppo` (the PPO-ptx term);
- `fit` / `fit_steps`: the whole SFT loop of `turborlhf sft` and `turborlhf conditional-sft`.

Examples are `turborlhf.data.tokenize.encode_examples` records (``input_ids``, ``loss_mask``).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, Optional

import torch

from turborlhf.algo import reduce_loss, sft_nll_loss
from turborlhf.data.tokenize import pad_batch
from turborlhf.engine.checkpoint import PlanDigest, restore, save_checkpoint, trainer_state
from turborlhf.engine.lifecycle import checkpointed_steps, eval_due, log_due, run_to_end
from turborlhf.engine.run import export_model
from turborlhf.engine.train import autocast, clip_and_step, make_optimizer, make_scheduler
from turborlhf.metrics import M, MetricsLogger, tracker_kwargs
from turborlhf.models.forward import response_logprobs

__all__ = ["sft_loss_on_batch", "evaluate_nll", "sft_step", "fit", "fit_steps"]


def sft_loss_on_batch(model, tokenizer, encoded: list[dict], num_tokens: int, dtype: str) -> tuple[torch.Tensor, int]:
    """Summed NLL of the batch's response tokens divided by the step's global `num_tokens`."""
    ids, attn = pad_batch([e["input_ids"] for e in encoded], tokenizer.pad_token_id)
    mask, _ = pad_batch([e["loss_mask"] for e in encoded], 0)
    with autocast(dtype, model):
        logp, _ = response_logprobs(model, ids, attn, mask)
    loss = reduce_loss(sft_nll_loss(logp, mask.float()), mask.float(), "token_mean", num_tokens=num_tokens)
    return loss, int(mask.sum())


@torch.no_grad()
def evaluate_nll(model, tokenizer, encoded: list[dict], dtype: str, batch_size: int) -> float:
    """Mean response-token NLL of `encoded` (`encode_examples` records), in batches of similar
    length (the demo's 184 held-out examples: 52 → 45 s in fp32 on a 2-core Xeon)."""
    model.eval()
    total, count = 0.0, 0
    encoded = sorted(encoded, key=lambda e: len(e["input_ids"]))
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
    loop = cfg.train
    optim = make_optimizer(model, cfg.optim)
    sched = make_scheduler(optim, cfg.optim, len(plan))
    steps_digest = PlanDigest(plan, train_enc)      # resuming with other data or batches is refused
    start = restore(ckpt, optim, sched, tag, steps_digest)
    log = MetricsLogger(out, tag, len(plan), show=(M.LOSS, M.LR, M.TOKENS_PER_S), **tracker_kwargs(cfg),
                        progress=cfg.log.progress, resume=bool(ckpt), start_step=start)
    try:
        def checkpoint(step: int) -> Path:
            return save_checkpoint(out, step, {"policy": model}, tokenizer,
                                   trainer_state(optim, sched, step, steps_digest),
                                   keep=loop.keep_checkpoints)

        for step in checkpointed_steps(start, len(plan), checkpoint, loop.save_every, tag):
            t0 = time.perf_counter()
            batch = [train_enc[i] for i in plan[step]]
            step_loss = sft_step(model, tokenizer, batch, loop.micro_batch_size, cfg.model.dtype)
            lr = sched.get_last_lr()[0]
            gnorm = clip_and_step(model, optim, sched, cfg.optim.max_grad_norm)
            dt = time.perf_counter() - t0
            n_tok = sum(len(e["input_ids"]) for e in batch)
            metrics = {M.LOSS: step_loss, M.LR: lr, M.GRAD_NORM: gnorm, M.TOKENS_PER_S: n_tok / dt, M.T_STEP: dt}
            done = step + 1
            evaluated = eval_due(done, len(plan), loop.eval_every, bool(test_enc))
            if evaluated:
                metrics[M.EVAL_LOSS] = evaluate_nll(model, tokenizer, test_enc, cfg.model.dtype, loop.micro_batch_size)
            if log_due(done, len(plan), cfg.log.every, evaluated):
                log.log(done, metrics)
            yield done, len(plan), metrics

        if test_enc:     # after the last step's checkpoint (`checkpointed_steps`): a signal here finds it
            log.log(len(plan), {M.EVAL_LOSS: evaluate_nll(model, tokenizer, test_enc, cfg.model.dtype,
                                                          loop.micro_batch_size)})
        export_model(model, tokenizer, out)
    finally:
        log.close()   # trackers and callbacks end whatever stops the run
