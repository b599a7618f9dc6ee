"""`turborlhf sft`: supervised fine-tuning with the next-token loss on response tokens only.

Loss: token mean over all response tokens of the optimizer step (a global denominator shared by
the micro-batches, so micro-batching never changes the gradient), as TRL's SFTTrainer with
`completion_only_loss` and OpenRLHF's SFT trainer do.

    turborlhf sft --config configs/tiny/sft.yaml --train.max_steps 10
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

from turborlhf.config import SFTConfig
from turborlhf.data.loaders import load_sft
from turborlhf.data.tokenize import encode_examples, report_truncation
from turborlhf.engine.lifecycle import run_to_end, start_run
from turborlhf.engine.run import plan_steps, print_batch_table, resolve_hardware
from turborlhf.engine.train import seed_everything, set_threads
from turborlhf.models.load import load_tokenizer, load_trainable
from turborlhf.trainers.common import evaluate_nll, fit, fit_steps, sft_loss_on_batch, sft_step

# the loss and loop live in `turborlhf.trainers.common` (shared with conditional-sft, rejection
# sampling and PPO-ptx); re-exported here, where `turborlhf sft` users look for them
__all__ = ["phases", "train", "train_steps", "fit", "fit_steps", "sft_step", "encode_examples", "sft_loss_on_batch",
           "evaluate_nll"]

logger = logging.getLogger(__name__)


def phases(cfg: SFTConfig) -> tuple[str, ...]:
    """The memory phases of one optimizer step, in order (`turborlhf plan` sizes each one and refuses a config whose phases it does not model):
    the micro-batches' forward/backward, then the optimizer step."""
    return ("train", "optimizer step")


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
    report_truncation("sft", train_enc, cfg.data.max_len)
    test_rows = load_sft(cfg.data.test_file, tok, **cfg.data.loader_kwargs()) if cfg.data.test_file else []
    if cfg.data.max_test_samples:
        test_rows = test_rows[:cfg.data.max_test_samples]
    test_enc = encode_examples(tok, test_rows, cfg.data.max_len)
    loop = cfg.train
    plan = plan_steps([len(e["input_ids"]) for e in train_enc], loop.sequences_per_step,
                      loop.epochs, loop.max_steps, loop.seed)
    print_batch_table("sft", [("examples", len(train_enc)), ("sequences_per_step", loop.sequences_per_step),
                              ("micro_batch_size", loop.micro_batch_size), ("optimizer_steps", len(plan))])

    # 3. model (fp32 master weights, bf16 autocast compute; LoRA/QLoRA/checkpointing as model.* says)
    model = load_trainable("causal", cfg.model, tok, ckpt_dir=ckpt / "policy" if ckpt else None)

    # 4-6. optimizer, schedule and resume state; the loop (micro-batches share the step's token
    #      count as denominator); final evaluation, resumable checkpoint, exported HF model
    yield from fit_steps(cfg, model, tok, train_enc, test_enc, plan, out, ckpt, "sft")
    logger.info(f"[sft] saved policy to {out}")
    return out
