"""What each `turborlhf bench` subcommand runs on each side, with one source for the shared settings.

Training commands (ppo, dpo, rm, grpo): ``configs/bench/<command>.yaml`` holds the settings. The
harness fills in the run-specific fields (model, data, output_dir, steps, seed, threads), writes
the resolved config next to the logs and runs ``python -m turborlhf <trainer> --config`` on it;
the peer script (``benchmarks/peers/trl_<command>.py``) gets the same numbers as arguments, read
from that config by `peer_args`. Our per-step times are the ``timing/step`` rows of the run's
``metrics.jsonl`` (`turborlhf.metrics.M.T_STEP`); the peer prints its own (``BENCH_RESULT`` line).

``generate``: ``benchmarks/ours_generate.py`` (our rollout engine) and
``benchmarks/peers/hf_generate.py`` (HF ``generate``) take the same options.

Everything here is plain data and string handling (no torch), so it is unit-tested directly.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import yaml

from turborlhf.bench.measure import GIB

__all__ = ["Workload", "WORKLOADS", "RunContext", "SideRun", "repo_root", "our_config", "peer_args",
           "parse_metrics_jsonl", "parse_bench_result", "parse_reference_pass", "set_dotted", "data_needed"]

RESULT_TAG = "BENCH_RESULT "


@dataclass(frozen=True)
class Workload:
    """One subcommand: its trainer, config, peer script and targets.

    trainer: our CLI command (``ppo`` also runs grpo); None for ``generate``.
    samples_per_step: config keys whose product is the samples of one step (pairs or sequences).
    data_kind: ``prompts`` or ``pairs`` (the file both sides read).
    targets: name → (comparison, bound): ``speedup`` ≥, ``rss_ratio`` ≤, ``tokens_per_s@B`` ≥.
    """

    command: str
    trainer: Optional[str]
    config: Optional[str]
    peer_script: str
    peer_name: str
    trl_version: Optional[str]
    data_kind: str
    samples_per_step: tuple[str, ...] = ()
    sample_unit: str = "samples"
    targets: dict = field(default_factory=dict)
    description: str = ""


WORKLOADS: dict[str, Workload] = {
    "ppo": Workload("ppo", "ppo", "configs/bench/ppo.yaml", "benchmarks/peers/trl_ppo.py", "TRL 1.12.0 PPOTrainer",
                    "1.12.0", "prompts", ("algo.prompts_per_step", "algo.n_samples_per_prompt"), "samples",
                    {"speedup": (">=", 3.0), "rss_ratio": ("<=", 0.6)},
                    "PPO step (actor, critic, RM, reference): 8 prompts, 64-token responses, 1 PPO epoch, 1 mini-batch"),
    "dpo": Workload("dpo", "dpo", "configs/bench/dpo.yaml", "benchmarks/peers/trl_dpo.py", "TRL 1.16.0 DPOTrainer",
                    "1.16.0", "pairs", ("train.pairs_per_step",), "pairs", {"speedup": (">=", 2.0)},
                    "DPO step: 4 pairs, max length 512"),
    "rm": Workload("rm", "rm", "configs/bench/rm.yaml", "benchmarks/peers/trl_rm.py", "TRL 1.16.0 RewardTrainer",
                   "1.16.0", "pairs", ("train.pairs_per_step",), "pairs", {"speedup": (">=", 2.0)},
                   "reward-model step: 8 pairs, max length 384"),
    "grpo": Workload("grpo", "ppo", "configs/bench/grpo.yaml", "benchmarks/peers/trl_grpo.py",
                     "TRL 1.16.0 GRPOTrainer", "1.16.0", "prompts",
                     ("algo.prompts_per_step", "algo.n_samples_per_prompt"), "samples", {"speedup": (">=", 2.0)},
                     "GRPO step: 2 prompts x 4 samples, 48 new tokens"),
    "generate": Workload("generate", None, None, "benchmarks/peers/hf_generate.py", "HF generate", None, "prompts",
                         (), "tokens", {"tokens_per_s@32": (">=", 1000.0), "tokens_per_s@1": (">=", 100.0)},
                         "rollout generation: 64 new tokens per row, batch 1/8/32"),
}


@dataclass
class RunContext:
    """Run-wide inputs shared by both sides."""

    repo: Path
    model_dir: str
    data: dict[str, Path]          # "prompts" / "pairs" → file
    threads: int
    warmup: int
    steps: int                     # measured steps (or timed calls) per child
    force_length: bool = True
    gradient_checkpointing: bool = False
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    new_tokens: int = 64
    response_tokens: Optional[int] = None   # ppo/grpo: rollout.max_new_tokens (and min, when forced); None = config's
    max_prompt_len: int = 96
    dtype: str = "bf16"            # both sides' compute precision: the host's best (`bench.cli`)
    rollout_dtype: Optional[str] = None   # our rollout engine's `rollout.dtype` ("auto" under `--dtype auto`,
                                          # see `bench.cli`); None = `dtype`
    reward_model_dir: Optional[str] = None   # ppo: the base model with a fresh scalar head (`bench.data`)

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


@dataclass
class SideRun:
    """One child's parsed timings: ``step_times`` in step order (warm-up included) plus extras."""

    step_times: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def repo_root() -> Path:
    """The source checkout holding this package (``<repo>/src/turborlhf``); the harness needs its
    ``benchmarks/``, ``configs/bench/`` and ``data/`` folders."""
    return Path(__file__).resolve().parents[3]


def set_dotted(tree: dict, dotted: str, value) -> None:
    """``set_dotted(t, "a.b", 1)`` → ``t["a"]["b"] = 1`` (creating mappings on the way)."""
    node = tree
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def get_dotted(tree: dict, dotted: str):
    """``get_dotted(t, "a.b")`` → ``t["a"]["b"]``; raises KeyError naming the dotted key."""
    node = tree
    for p in dotted.split("."):
        if not isinstance(node, dict) or p not in node:
            raise KeyError(f"config has no '{dotted}'")
        node = node[p]
    return node


def samples_per_step(w: Workload, cfg: dict) -> int:
    n = 1
    for key in w.samples_per_step:
        n *= int(get_dotted(cfg, key))
    return n


def data_needed(w: Workload, cfg: Optional[dict], ctx: RunContext) -> tuple[int, int]:
    """(pairs, prompts) the run's children consume: each side does exactly one pass over the file,
    so both see the same examples (in their own order)."""
    if w.command == "generate":
        return 0, max(ctx.batch_sizes)
    n_prompts_or_pairs = ctx.total_steps * int(get_dotted(cfg, "algo.prompts_per_step" if w.data_kind == "prompts"
                                                          else "train.pairs_per_step"))
    return (0, n_prompts_or_pairs) if w.data_kind == "prompts" else (n_prompts_or_pairs, 0)


def describe(w: Workload, ctx: RunContext) -> str:
    """`w`'s description with the sizes this run changed (``--new-tokens``, ``--batch-sizes``)."""
    if w.command == "generate":
        return (f"rollout generation: {ctx.new_tokens} new tokens per row, batch "
                f"{'/'.join(str(b) for b in ctx.batch_sizes)}")
    if ctx.response_tokens is not None:
        return f"{w.description}; responses set to {ctx.response_tokens} tokens (--new-tokens)"
    return w.description


def our_config(w: Workload, ctx: RunContext, output_dir: Path, seed: int) -> dict:
    """The YAML config of our side with the run-specific fields filled in."""
    cfg = yaml.safe_load((ctx.repo / w.config).read_text())
    set_dotted(cfg, "output_dir", str(output_dir))
    set_dotted(cfg, "train.max_steps", ctx.total_steps)
    set_dotted(cfg, "train.seed", seed)
    set_dotted(cfg, "train.threads", ctx.threads)
    set_dotted(cfg, "log.tensorboard", False)
    set_dotted(cfg, "log.every", 1)
    _FILL[w.command](cfg, ctx)
    for section in ("model", "actor"):          # the same precision as the peer's, not pinned by the YAML
        if section in cfg:
            set_dotted(cfg, f"{section}.dtype", ctx.dtype)
            # on the CPU, where the peer scripts run (TRL's `use_cpu`): a GPU host's `device: auto`
            # would otherwise compare our GPU run with TRL's CPU run
            set_dotted(cfg, f"{section}.device", "cpu")
    if "rollout" in cfg:
        set_dotted(cfg, "rollout.dtype", ctx.rollout_dtype or ctx.dtype)
        set_dotted(cfg, "rollout.device", "cpu")
    if ctx.rollout_dtype not in (None, "auto"):     # an explicit --dtype: no bf16 weights or moments under fp32
        if "rollout" in cfg:
            set_dotted(cfg, "rollout.weight_dtype", "same")
        set_dotted(cfg, "optim.state_dtype", ctx.dtype)
    if w.command in ("ppo", "grpo"):
        set_dotted(cfg, "distributed.device", "cpu")
    return cfg


def _fill_ppo(cfg: dict, ctx: RunContext) -> None:
    set_dotted(cfg, "actor.name_or_path", ctx.model_dir)
    set_dotted(cfg, "data.prompts_file", str(ctx.data["prompts"]))
    if "reward_model" in cfg:
        cfg["reward_model"] = ctx.reward_model_dir or ctx.model_dir
    for src in cfg.get("rewards", []):
        if src.get("kind") == "function" and not Path(src["path"].rpartition(":")[0]).is_absolute():
            src["path"] = str(ctx.repo / src["path"])
    if ctx.response_tokens is not None:
        set_dotted(cfg, "rollout.max_new_tokens", ctx.response_tokens)
        set_dotted(cfg, "rollout.min_new_tokens", ctx.response_tokens)
    if not ctx.force_length:
        set_dotted(cfg, "rollout.min_new_tokens", 0)
    if ctx.gradient_checkpointing:
        set_dotted(cfg, "actor.gradient_checkpointing", True)
        if cfg.get("algo", {}).get("advantage_estimator", "gae") == "gae":
            cfg["critic"] = {"name_or_path": ctx.model_dir, "gradient_checkpointing": True}


def _fill_pairs(cfg: dict, ctx: RunContext) -> None:
    set_dotted(cfg, "model.name_or_path", ctx.model_dir)
    set_dotted(cfg, "data.train_file", str(ctx.data["pairs"]))
    set_dotted(cfg, "data.max_samples", ctx.total_steps * int(get_dotted(cfg, "train.pairs_per_step")))
    set_dotted(cfg, "train.epochs", 1)
    if ctx.gradient_checkpointing:
        set_dotted(cfg, "model.gradient_checkpointing", True)


_FILL: dict[str, Callable[[dict, RunContext], None]] = {"ppo": _fill_ppo, "grpo": _fill_ppo,
                                                        "dpo": _fill_pairs, "rm": _fill_pairs}


def _g(cfg: dict, key: str) -> str:
    return str(get_dotted(cfg, key))


# peer script options ← our config keys (so the two sides cannot drift apart)
_PEER_OPTIONS: dict[str, list[tuple[str, str]]] = {
    "ppo": [("--batch", "algo.prompts_per_step"), ("--resp-len", "rollout.max_new_tokens"),
            ("--max-prompt-len", "rollout.max_prompt_len"), ("--temperature", "rollout.temperature"),
            ("--lr", "optim.lr")],
    "dpo": [("--batch", "train.pairs_per_step"), ("--max-length", "data.max_len"), ("--lr", "optim.lr"),
            ("--beta", "algo.beta")],
    "rm": [("--batch", "train.pairs_per_step"), ("--max-length", "data.max_len"), ("--lr", "optim.lr")],
    "grpo": [("--prompts", "algo.prompts_per_step"), ("--group", "algo.n_samples_per_prompt"),
             ("--new-tokens", "rollout.max_new_tokens"), ("--lr", "optim.lr")],
}


def peer_args(w: Workload, cfg: dict, ctx: RunContext, out_dir: Path, seed: int) -> list[str]:
    """Arguments of the peer script (after the script path), the shared numbers taken from `cfg`."""
    if w.command == "generate":
        return _generate_args(ctx, seed, ctx.dtype)
    args = ["--model", ctx.model_dir, "--data", str(ctx.data[w.data_kind]), "--steps", str(ctx.total_steps),
            "--threads", str(ctx.threads), "--seed", str(seed), "--out", str(out_dir), "--dtype", ctx.dtype]
    for opt, key in _PEER_OPTIONS[w.command]:
        args += [opt, _g(cfg, key)]
    if ctx.force_length and w.command in ("ppo", "grpo"):
        if int(get_dotted(cfg, "rollout.min_new_tokens")) != int(get_dotted(cfg, "rollout.max_new_tokens")):
            raise ValueError(f"configs/bench/{w.command}.yaml: rollout.min_new_tokens must equal "
                             "rollout.max_new_tokens when lengths are forced")
        args.append("--force-length")
    if ctx.gradient_checkpointing:
        args.append("--gradient-checkpointing")
    return args


def _generate_args(ctx: RunContext, seed: int, dtype: str) -> list[str]:
    return ["--model", ctx.model_dir, "--data", str(ctx.data["prompts"]),
            "--batch-sizes", ",".join(str(b) for b in ctx.batch_sizes), "--new", str(ctx.new_tokens),
            "--max-prompt-len", str(ctx.max_prompt_len), "--warmup", str(ctx.warmup), "--calls", str(ctx.steps),
            "--threads", str(ctx.threads), "--seed", str(seed), "--dtype", dtype]


def our_command(w: Workload, ctx: RunContext, config_path: Optional[Path], seed: int) -> list[str]:
    """Our child's command line."""
    if w.command == "generate":
        return [sys.executable, str(ctx.repo / "benchmarks" / "ours_generate.py"),
                *_generate_args(ctx, seed, ctx.rollout_dtype or ctx.dtype),   # an explicit --dtype: its weights too
                "--weight-dtype", "auto" if ctx.rollout_dtype in (None, "auto") else "same"]
    return [sys.executable, "-m", "turborlhf", w.trainer, "--config", str(config_path)]


# ----------------------------------------------------------------------------------------------
# Parsing what the children report
# ----------------------------------------------------------------------------------------------

def parse_metrics_jsonl(text: str, step_key: str = "timing/step") -> SideRun:
    """Per-step times from our ``metrics.jsonl`` text: rows that carry `step_key`, ordered by
    ``step``; PPO's phase timings (``timing/*``) and mean response length go to ``extra``.

    Raises ValueError naming the line for a line that is not JSON, and if no row has `step_key`.
    """
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"metrics.jsonl line {i}: not JSON: {e}") from None
        if isinstance(row, dict) and step_key in row:
            rows.append(row)
    if not rows:
        raise ValueError(f"metrics.jsonl has no '{step_key}' rows")
    rows.sort(key=lambda r: r.get("step", 0))
    phases = [{k.split("/", 1)[1]: r[k] for k in r if k.startswith("timing/") and k != step_key} for r in rows]
    extra: dict = {"phases": phases} if any(phases) else {}
    if any("rollout/response_length" in r for r in rows):
        extra["response_length"] = [r.get("rollout/response_length") for r in rows]
    return SideRun([float(r[step_key]) for r in rows], extra)


def parse_bench_result(stdout: str) -> dict:
    """The JSON object of the last ``BENCH_RESULT {...}`` line of a child's stdout.

    Raises ValueError if there is none or it is not a JSON object.
    """
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            obj = json.loads(line[len(RESULT_TAG):])
            if not isinstance(obj, dict):
                raise ValueError("BENCH_RESULT is not a JSON object")
            return obj
    raise ValueError("the child printed no BENCH_RESULT line")


_REF_RE = re.compile(r"reference log-probs of (\d+) sequences in ([0-9.]+)s")


def parse_reference_pass(stdout: str) -> Optional[tuple[int, float]]:
    """``(sequences, seconds)`` of the DPO trainer's one-off reference pass, from its log line
    ``[dpo] reference log-probs of N sequences in Xs``; None if the line is absent."""
    m = None
    for m in _REF_RE.finditer(stdout):
        pass
    return (int(m.group(1)), float(m.group(2))) if m else None


def bytes_to_gib(n: Optional[int]) -> Optional[float]:
    return None if n is None else n / GIB
