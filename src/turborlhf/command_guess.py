"""Which command a config file is for, from its keys and its name (`turborlhf plan` without
``--command``). Imports neither torch nor transformers."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

__all__ = ["COMMANDS", "guess_command"]

#: the commands a config file may be for
COMMANDS = ("conditional-sft", "dpo", "grpo", "kto", "pipeline", "ppo", "rejection-sampling", "rloo", "rm", "sft")


def _section(tree: dict, name: str) -> dict:
    """`tree[name]` when it is a mapping, ``{}`` when absent or null. Raises `ConfigError` naming the
    field when it is anything else (``algo: 3``)."""
    from turborlhf.config import ConfigError

    v = tree.get(name)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{name}: must be a mapping of {name}.* settings, got {type(v).__name__} {v!r:.40}")
    return v


def _ppo_only_fields() -> dict[str, set[str]]:
    """Per section, the keys only a ppo/grpo/rloo config has (not rejection sampling, DPO or KTO)."""
    from turborlhf import config as C

    others = set(C.RSAlgoCfg.model_fields) | set(C.DPOAlgoCfg.model_fields) | set(C.KTOAlgoCfg.model_fields)
    return {"": {"actor", "critic", "rewards", "distributed"},
            "algo": set(C.PPOAlgoCfg.model_fields) - others,
            "data": set(C.PPODataCfg.model_fields) - set(C.RSDataCfg.model_fields),
            "rollout": set(C.PPORolloutCfg.model_fields) - set(C.RolloutCfg.model_fields)}


def guess_command(path: Optional[str], tree: dict) -> str:
    """The command a config file belongs to: from its keys, else from the file name, else from keys
    several commands share. Raises `ConfigError` naming the section when ``algo``, ``data``,
    ``train`` or ``rollout`` is not a mapping, ValueError when nothing tells."""
    from turborlhf import config as C

    keys = set(tree)
    if {"run_dir", "stages"} & keys:
        return "pipeline"
    algo, data, train, rollout = (_section(tree, k) for k in ("algo", "data", "train", "rollout"))
    sections = {"": tree, "algo": algo, "data": data, "rollout": rollout}
    if any(set(sections[s]) & only for s, only in _ppo_only_fields().items()):
        # a grpo/rloo file that leaves the estimator to the preset is for that command
        preset = next((c for c in ("grpo", "rloo") if c in Path(path or "").stem.lower()), None)
        return preset if preset and "advantage_estimator" not in algo else "ppo"
    if "tags" in keys or ("reward_model" in keys and "train_file" in data):
        return "conditional-sft"
    if set(algo) & (set(C.RSAlgoCfg.model_fields) - set(C.PPOAlgoCfg.model_fields)):
        return "rejection-sampling"
    if "desirable_weight" in algo or "examples_per_step" in train:
        return "kto"
    if "loss" in algo or "reference" in keys:
        return "dpo"
    stem = Path(path).stem.lower().replace("_", "-") if path else ""
    for cmd in ("rejection-sampling", "conditional-sft", "sft", "rm", "dpo", "kto", "ppo", "grpo", "rloo"):
        if stem == cmd or stem.startswith(cmd + "-") or stem.endswith("-" + cmd):
            return cmd
    if "prompts_file" in data:        # prompts: rejection sampling (a `model`) or ppo (an `actor`, maybe default)
        if "model" in keys or ("reward_model" in keys and "rollout" in keys):
            return "rejection-sampling"
        if "reward_model" not in keys:
            return "ppo"
    if "pairs_per_step" in train:
        return "rm"
    if "sequences_per_step" in train:
        return "sft"
    raise ValueError(f"cannot tell which command {path} is for; pass --command ({', '.join(COMMANDS)})")
