"""Shared by the peer scripts in this folder (run as child processes by `turborlhf bench`).

Every script takes the same core options, reads the data files the harness wrote (so both sides
see the same prompts and pairs), times each optimizer step with a `TrainerCallback`, and ends by
printing one line ``BENCH_RESULT {json}`` with at least ``step_times`` (seconds, in step order).
The harness measures memory itself (whole process tree), so the scripts do not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULT_TAG = "BENCH_RESULT "


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--data", required=True, help="JSONL written by the harness (prompts or pairs)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (warm-up included)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="compute precision (the harness passes the host's best: bf16 only where it is native; "
                        "auto: the same rule)")
    p.add_argument("--out", required=True, help="scratch output directory")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="TRL's default; off unless asked, to match turborlhf's default")
    return p


def setup_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def resolve_dtype(name: str) -> str:
    """'auto' → 'bf16' where the CPU computes bf16 natively (AVX-512-BF16 or AMX, as
    `turborlhf.engine.hardware.cpu_features` reports them, ATEN_CPU_CAPABILITY honoured), else
    'fp32' (bf16 matmuls are emulated there, ~10-100x slower); 'bf16' / 'fp32' as given. Both
    sides of `turborlhf bench generate` resolve it alike."""
    if name != "auto":
        return name
    try:
        from turborlhf.engine.hardware import compute_dtype
    except ImportError:                  # a peer's environment without turborlhf: the old default
        return "bf16"
    return compute_dtype("auto", "cpu")  # the trainers' rule: native bf16 confirmed by the cached probe


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def versions() -> dict:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads()}
    try:
        import trl

        out["trl"] = trl.__version__
    except ImportError:
        pass
    return out


def step_timer():
    """A `TrainerCallback` recording the wall time of each optimizer step (on_step_begin → on_step_end)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t = None
            self.times: list[float] = []

        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if self.t is not None:
                self.times.append(time.perf_counter() - self.t)
                print(f"[peer] step {len(self.times)}: {self.times[-1]:.2f} s", flush=True)
            self.t = None

    return StepTimer()


def emit(result: dict) -> None:
    """Print the result line the harness parses (always the script's last stdout line)."""
    sys.stdout.flush()
    print(RESULT_TAG + json.dumps(result), flush=True)
