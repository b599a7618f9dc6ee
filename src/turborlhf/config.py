"""Typed, frozen configuration for every command: YAML file + dotted command-line overrides.

Every command has one config class (below), composed from shared parts (model, optimizer,
logging, rollout). Each field carries its help text; `turborlhf <cmd> --help` prints them all.

    cfg = load_config(SFTConfig, "configs/tiny/sft.yaml", ["optim.lr=1e-4", "train.max_steps=3"])

Errors: a bad file, an unknown key or a wrongly typed value raises `ConfigError`, whose message
names the dotted field (``optim.lr: Input should be a valid number``).

This module imports neither torch nor transformers, so help and validation stay instant.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ConfigError", "Cfg", "load_config", "config_help", "config_to_dict",
    "ModelCfg", "LoraCfg", "OptimCfg", "LogCfg", "TrainLoopCfg", "RolloutCfg",
    "SFTConfig", "RMConfig", "PPOConfig", "PipelineConfig", "PrepareCfg", "EvalCfg",
]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the dotted field."""


class Cfg(BaseModel):
    """Base for all config parts: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


C = TypeVar("C", bound=Cfg)


# ----------------------------------------------------------------------------------------------
# Shared parts
# ----------------------------------------------------------------------------------------------

class LoraCfg(Cfg):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 disables LoRA (full fine-tuning)")
    alpha: float = Field(16.0, description="LoRA scaling alpha")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="module names that get adapters")


class ModelCfg(Cfg):
    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="local HF directory, hub id, or a named model of the zoo (smollm2-135m-instruct)")
    dtype: Literal["bf16", "fp32"] = Field(
        "bf16", description="compute precision: bf16 autocast over fp32 master weights, or plain fp32")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    lora: LoraCfg = Field(default_factory=LoraCfg, description="LoRA adapters (peft)")


class OptimCfg(Cfg):
    lr: float = Field(1e-5, gt=0, description="peak learning rate of AdamW")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps (optimizer steps)")
    schedule: Literal["constant", "cosine", "linear"] = Field("cosine", description="decay after warm-up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr as a fraction of lr (cosine/linear)")
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping by global norm; 0 disables")


class LogCfg(Cfg):
    every: int = Field(1, ge=1, description="log metrics every N optimizer steps")
    tensorboard: bool = Field(True, description="write TensorBoard event files under <output_dir>/tb")
    progress: bool = Field(True, description="print a compact progress line per logged step")


class TrainLoopCfg(Cfg):
    seed: int = Field(42, description="random seed (data order, dropout, sampling)")
    epochs: float = Field(1.0, gt=0, description="passes over the training data (fractional allowed)")
    max_steps: int = Field(0, ge=0, description="stop after this many optimizer steps; 0 = run the epochs")
    micro_batch_size: int = Field(4, ge=1, description="sequences (or pairs) per forward/backward pass")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0 = only at the end)")
    eval_every: int = Field(0, ge=0, description="evaluate every N steps (0 = only at the end)")
    keep_checkpoints: int = Field(1, ge=1, description="how many resumable checkpoints to keep")
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = all cores")


class RolloutCfg(Cfg):
    engine: Literal["auto", "hf", "fast", "vllm"] = Field(
        "auto", description="rollout engine: auto = vllm if installed on GPU, else the embedded fast engine")
    max_new_tokens: int = Field(64, ge=1, description="maximum generated tokens per response")
    min_new_tokens: int = Field(0, ge=0, description="EOS/stop tokens are suppressed before this many tokens")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="top-k sampling; 0 = off")
    max_prompt_len: int = Field(256, ge=1, description="prompts are cut from the left to this many tokens")
    batch_size: int = Field(32, ge=1, description="sequences generated together")
    dtype: Literal["bf16", "fp32"] = Field("bf16", description="weights precision inside the engine")


# ----------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------

class SFTDataCfg(Cfg):
    train_file: str = Field(..., description="pair-format JSONL ({prompt, chosen, rejected}: trains on chosen) "
                                             "or SFT JSONL ({prompt, response})")
    test_file: Optional[str] = Field(None, description="held-out file in the same format")
    max_len: int = Field(512, ge=8, description="tokens per sequence (prompt cut from the left)")
    max_samples: int = Field(0, ge=0, description="use at most this many training examples (0 = all)")


class SFTTrainCfg(TrainLoopCfg):
    sequences_per_step: int = Field(16, ge=1, description="sequences per optimizer step (global batch)")


class SFTConfig(Cfg):
    """`turborlhf sft`: next-token loss on response tokens only."""

    model: ModelCfg = Field(default_factory=ModelCfg, description="the policy to fine-tune")
    data: SFTDataCfg
    optim: OptimCfg = Field(default_factory=lambda: OptimCfg(lr=2e-5))
    train: SFTTrainCfg = Field(default_factory=SFTTrainCfg)
    log: LogCfg = Field(default_factory=LogCfg)
    output_dir: str = Field("runs/sft", description="where checkpoints, metrics and the final model go")


class RMDataCfg(Cfg):
    train_file: str = Field(..., description="pairs: pair-format JSONL or raw HH lines (.jsonl/.jsonl.gz)")
    test_file: Optional[str] = Field(None, description="held-out pairs in the same formats")
    max_len: int = Field(384, ge=8, description="tokens per sequence (prompt cut from the left)")
    max_samples: int = Field(0, ge=0, description="use at most this many training pairs (0 = all)")


class RMTrainCfg(TrainLoopCfg):
    pairs_per_step: int = Field(8, ge=1, description="preference pairs per optimizer step (global batch)")
    margin: bool = Field(False, description="use the per-pair `margin` field in the loss (-logσ(rc-rr-m))")
    center_rewards_coef: float = Field(0.0, ge=0, description="Eisenstein et al. centring term c·mean((rc+rr)^2)")
    freeze_embeddings: bool = Field(False, description="keep the token embeddings fixed (less memory, faster)")


class RMConfig(Cfg):
    """`turborlhf rm`: pairwise Bradley-Terry reward model."""

    model: ModelCfg = Field(default_factory=ModelCfg, description="backbone (causal LM) that gets a scalar head")
    data: RMDataCfg
    optim: OptimCfg = Field(default_factory=lambda: OptimCfg(lr=1e-5))
    train: RMTrainCfg = Field(default_factory=RMTrainCfg)
    log: LogCfg = Field(default_factory=LogCfg)
    output_dir: str = Field("runs/rm", description="where checkpoints, metrics and the final model go")


class PPODataCfg(Cfg):
    prompts_file: str = Field(..., description="prompts: {prompt} JSONL, pair-format or raw HH lines")
    test_prompts_file: Optional[str] = Field(None, description="held-out prompts for periodic evaluation")
    max_samples: int = Field(0, ge=0, description="use at most this many prompts (0 = all)")


class PPOAlgoCfg(Cfg):
    prompts_per_step: int = Field(8, ge=1, description="prompts per rollout batch (one PPO step)")
    n_samples_per_prompt: int = Field(1, ge=1, description="responses sampled per prompt")
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    num_mini_batches: int = Field(1, ge=1, description="optimizer steps per PPO epoch")
    eps_clip: float = Field(0.2, gt=0, description="policy ratio clip ε (low side)")
    eps_clip_high: Optional[float] = Field(None, description="upper clip ε (asymmetric, DAPO); None = eps_clip")
    dual_clip: Optional[float] = Field(None, description="dual-clip constant c > 1 for negative advantages")
    value_clip: Optional[float] = Field(0.2, description="value clip ε_v; None disables value clipping")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount γ")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ")
    kl_coef: float = Field(0.05, ge=0, description="initial KL penalty coefficient β")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="per-token KL estimator (Schulman)")
    kl_target: Optional[float] = Field(None, description="adaptive KL (Ziegler et al.) target; None = fixed β")
    kl_horizon: int = Field(10000, ge=1, description="adaptive KL horizon (samples)")
    reward_clip: float = Field(10.0, gt=0, description="clip RM scores to [-c, c]")
    normalize_reward: bool = Field(False, description="scale scores by running mean/std of the RM")
    missing_eos_penalty: Optional[float] = Field(1.0, description="subtracted from the score of responses without EOS")
    whiten_advantages: bool = Field(True, description="whiten advantages over the rollout batch")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus coefficient")
    critic_lr: float = Field(1e-5, gt=0, description="critic learning rate (actor uses optim.lr)")
    critic_warmup_steps: int = Field(0, ge=0, description="PPO steps that train only the critic")


class PPOConfig(Cfg):
    """`turborlhf ppo`: actor, critic, reward model and reference model."""

    actor: ModelCfg = Field(default_factory=ModelCfg, description="policy to optimise (usually the SFT model)")
    critic: Optional[ModelCfg] = Field(None, description="value model; default = initialised from the reward model")
    reward_model: str = Field(..., description="directory of the reward model (AutoModelForSequenceClassification)")
    reference: Optional[str] = Field(None, description="reference policy; default = the actor's initial weights")
    data: PPODataCfg
    rollout: RolloutCfg = Field(default_factory=RolloutCfg)
    algo: PPOAlgoCfg = Field(default_factory=PPOAlgoCfg)
    optim: OptimCfg = Field(default_factory=lambda: OptimCfg(lr=1e-6, schedule="constant"))
    train: TrainLoopCfg = Field(default_factory=lambda: TrainLoopCfg(max_steps=20))
    log: LogCfg = Field(default_factory=LogCfg)
    output_dir: str = Field("runs/ppo", description="where checkpoints, metrics and the final actor go")


# ----------------------------------------------------------------------------------------------
# DPO / KTO configs (owned by the DPO/KTO trainers)
# ----------------------------------------------------------------------------------------------
# >>> dpo-kto configs
# <<< dpo-kto configs

# ----------------------------------------------------------------------------------------------
# Rejection sampling / conditional SFT configs
# ----------------------------------------------------------------------------------------------
# >>> rs-csft configs
# <<< rs-csft configs


class PrepareCfg(Cfg):
    input: str = Field("data/hh-rlhf/harmless-base-1800.jsonl.gz", description="raw HH-RLHF lines")
    test_fraction: float = Field(0.1, gt=0, lt=1, description="share of prompts held out (hash split)")
    strict: bool = Field(False, description="any malformed line is an error")


class EvalCfg(Cfg):
    n_prompts: int = Field(64, ge=1, description="test prompts scored for the reward comparison")
    n_samples_shown: int = Field(3, ge=0, description="sample responses printed before/after")
    seed: int = Field(1234, description="sampling seed for evaluation generation")
    rollout: RolloutCfg = Field(default_factory=lambda: RolloutCfg(temperature=0.7, top_p=0.9))


class PipelineConfig(Cfg):
    """`turborlhf pipeline`: prepare data → SFT → RM → PPO → evaluation, sharing one run directory.

    The stage sections hold the same keys as each command's config; paths between stages (data
    files, init checkpoints, output dirs) are filled in by the pipeline.
    """

    run_dir: str = Field("runs/demo", description="everything is written here")
    model: str = Field("smollm2-135m-instruct", description="base model for every stage")
    prepare: PrepareCfg = Field(default_factory=PrepareCfg)
    sft: dict[str, Any] = Field(default_factory=dict, description="overrides of SFTConfig")
    rm: dict[str, Any] = Field(default_factory=dict, description="overrides of RMConfig")
    ppo: dict[str, Any] = Field(default_factory=dict, description="overrides of PPOConfig")
    eval: EvalCfg = Field(default_factory=EvalCfg)
    stages: list[Literal["prepare", "sft", "rm", "ppo", "eval"]] = Field(
        default_factory=lambda: ["prepare", "sft", "rm", "ppo", "eval"], description="stages to run, in order")


# ----------------------------------------------------------------------------------------------
# Loading, overriding, help
# ----------------------------------------------------------------------------------------------

def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: cannot set a sub-field of non-mapping '{p}'")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=3"`` → ``("a.b", 3)``; the value is parsed as YAML (numbers, bools, lists, null)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _format_error(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        lines.append(f"{prefix}{loc}: {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = (),
                base: dict | None = None) -> C:
    """Build `cls` from a YAML file (optional), a base dict, then ``key.sub=value`` overrides.

    Order of precedence: overrides > YAML file > base > class defaults.
    Raises `ConfigError` naming the file or the dotted field.
    """
    tree: dict = json.loads(json.dumps(base)) if base else {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
        _deep_update(tree, data)
    for ov in overrides:
        key, value = parse_override(ov)
        _set_dotted(tree, key, value)
    try:
        return cls.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def _deep_update(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = v
    return dst


def validate_section(cls: type[C], tree: dict, section: str) -> C:
    """Validate a dict (e.g. a pipeline stage section) and prefix error paths with `section`."""
    try:
        return cls.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e, prefix=f"{section}.")) from None


def config_to_dict(cfg: Cfg) -> dict:
    return cfg.model_dump(mode="json")


def config_help(cls: type[Cfg], prefix: str = "", defaults: Cfg | None = None) -> list[str]:
    """One line per leaf field: ``--a.b  TYPE  default=X  help`` (defaults as the parent sets them)."""
    lines = []
    for name, f in cls.model_fields.items():
        key = f"{prefix}{name}"
        ann = f.annotation
        sub = _cfg_class(ann)
        value = getattr(defaults, name) if defaults is not None else (
            None if f.is_required() else f.get_default(call_default_factory=True))
        if sub is not None:
            lines.extend(config_help(sub, prefix=key + ".", defaults=value if isinstance(value, Cfg) else None))
            continue
        default = "required" if (f.is_required() and defaults is None) else f"default={_short(value)}"
        tname = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        lines.append(f"  --{key:<36} {tname:<14} {default:<22} {f.description or ''}")
    return lines


def _cfg_class(ann) -> type[Cfg] | None:
    if isinstance(ann, type) and issubclass(ann, Cfg):
        return ann
    for a in getattr(ann, "__args__", ()) or ():
        if isinstance(a, type) and issubclass(a, Cfg):
            return a
    return None


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 20 else s[:17] + "..."
