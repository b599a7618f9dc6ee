"""Helpers for end-to-end tests: run a CLI command in-process, read metrics, compare weights."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from turborlhf.cli import main

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> None:
    rc = main([str(a) for a in args])
    assert rc == 0, f"turborlhf {' '.join(map(str, args))} exited with {rc}"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def rewind_to(run_dir: Path, step: int) -> None:
    """Simulate a crash after checkpoint `step`: drop newer checkpoints and the exported model."""
    root = Path(run_dir) / "checkpoints"
    for p in root.glob("step-*"):
        if int(p.name.split("-")[1]) > step:
            shutil.rmtree(p)
    (root / "latest").write_text(f"step-{step:06d}")
    (Path(run_dir) / "model.safetensors").unlink()


def with_score_stats(model_dir: Path, dest: Path) -> Path:
    """A copy of the reward model in `model_dir` (its checkpoints left out) whose config holds a
    final evaluation's score statistics, ``reward_mean`` 12.5 and ``reward_std`` 3.0."""
    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns("checkpoints"))
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "reward_mean": 12.5, "reward_std": 3.0}))
    return dest
