"""Run scaffolding shared by trainers as plain functions (no base class): output directory and
config snapshot, the deterministic batch plan, and the final model export."""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import yaml

from turborlhf.config import Cfg, config_to_dict
from turborlhf.engine.checkpoint import _fsync_dir, _fsync_tree, _write_hf

__all__ = ["setup_run", "plan_steps", "export_model", "print_batch_table", "RunInterrupted"]


class RunInterrupted(RuntimeError):
    """The run stopped on SIGINT/SIGTERM after saving a resumable checkpoint (the message names it)."""


def setup_run(cfg: Cfg, output_dir: str) -> Path:
    """Create the run directory and write the resolved config as ``config.yaml``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return out


def plan_steps(lengths: list[int], per_step: int, epochs: float, max_steps: int, seed: int) -> list[list[int]]:
    """Deterministic list of optimizer steps, each a list of example indices.

    Within an epoch, examples are shuffled (seed + epoch), then grouped into mega-batches of
    ``50 · per_step`` sorted by length, so each step holds similar lengths and padding is small;
    step order is shuffled again. Epochs may be fractional; ``max_steps > 0`` caps the plan (and
    extends it with further epochs when the data is short). The plan depends only on its inputs,
    so a resumed run replays exactly the same batches.
    """
    import random

    n = len(lengths)
    if n == 0:
        raise ValueError("no training examples")
    steps_per_epoch = max(1, n // per_step)
    total = max_steps if max_steps > 0 else max(1, math.ceil(epochs * steps_per_epoch))
    plan: list[list[int]] = []
    epoch = 0
    while len(plan) < total:
        rng = random.Random(seed + epoch)
        idx = list(range(n))
        rng.shuffle(idx)
        mega = 50 * per_step
        batches = []
        for s in range(0, n, mega):
            chunk = sorted(idx[s:s + mega], key=lambda i: lengths[i])
            batches += [chunk[b:b + per_step] for b in range(0, len(chunk), per_step)]
        batches = [b for b in batches if len(b) == per_step] or batches
        rng.shuffle(batches)
        plan += batches
        epoch += 1
    return plan[:total]


def export_model(model, tokenizer, output_dir: str | Path, extra_config: dict | None = None) -> Path:
    """Write the final HF model files (config, safetensors, tokenizer) into `output_dir`.

    Files are staged in a temporary directory and moved in one by one with ``os.replace`` (each
    move is atomic), weights last; the run's other files (metrics, checkpoints) stay beside them,
    so `output_dir` itself is loadable with ``from_pretrained``.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=out, prefix=".export-"))
    try:
        _write_hf(model, tokenizer, staged, extra_config)
        _fsync_tree(staged)
        files = sorted(staged.iterdir(), key=lambda p: p.suffix == ".safetensors")
        for f in files:
            os.replace(f, out / f.name)
        _fsync_dir(out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out


def print_batch_table(name: str, rows: list[tuple[str, object]]) -> None:
    """Start-up table of derived batch sizes (habit: sizes carry their unit in their names)."""
    width = max(len(k) for k, _ in rows)
    print(f"[{name}] " + ", ".join(f"{k}={v}" for k, v in rows) if width > 60 else
          "\n".join([f"[{name}] batch sizes:"] + [f"  {k:<{width}}  {v}" for k, v in rows]), flush=True)
