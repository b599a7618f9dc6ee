"""Typed, frozen configuration for every command: YAML file + dotted command-line overrides.

Every command has one config class (below), composed from shared parts (model, optimizer,
logging, rollout). Each field carries its help text; `turborlhf <cmd> --help` prints them all.

    cfg = load_config(SFTConfig, "configs/tiny/sft.yaml", ["optim.lr=1e-4", "train.max_steps=3"])

Errors: a bad file, an unknown key or a wrongly typed value raises `ConfigError`, whose message
names the dotted field (``optim.lr: Input should be a valid number``).

This module imports neither torch nor transformers, so help and validation stay instant.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, TypeVar

from pydantic import BaseModel, Field, field_validator, model_validator

from turborlhf.config_base import Cfg, ConfigError, _scalar_kinds, check_complete, run_input  # noqa: F401
from turborlhf.config_distributed import DistributedCfg, RoleResourcesCfg
from turborlhf.config_rlvr import RLVRAlgoFields, check_rlvr
from turborlhf.config_rollout import SYNC_TOLERANCE, RolloutFields

__all__ = [
    "ConfigError", "Cfg", "load_config", "config_help", "config_to_dict",
    "ModelCfg", "LoraCfg", "OptimCfg", "LogCfg", "TrainLoopCfg", "EvalLoopCfg", "RolloutCfg", "PPORolloutCfg",
    "DistributedCfg", "RoleResourcesCfg", "SFTConfig", "RMConfig", "PPOConfig", "PipelineConfig", "PrepareCfg", "EvalCfg",
    "DPOConfig", "KTOConfig", "DataFormatCfg", "default_tree", "SYNC_TOLERANCE",
]


C = TypeVar("C", bound=Cfg)


# Fields that recur across commands, with their help text written once
def _max_len(default: int = 512, note: str = " (prompt cut from the left)", what: str = "sequence") -> Any:
    return Field(default, ge=8, description=f"tokens per {what}{note}")


def _at_most(what: str, verb: str = "use") -> Any:
    return Field(0, ge=0, description=f"{verb} at most this many {what} (0 = all)")


def _held_out(what: str = "file in the same format", note: str = "") -> Any:
    return Field(None, description=f"held-out {what}{note}")


def _data_input(description: str) -> Any:
    """The training data file of a command the Python API has a trainer for: required for a run,
    but a config may be built without it (`run_input`), as TRL's, and get it from ``train_dataset=``."""
    return run_input(description, api="train_dataset=")


def _policy(description: str = "the policy to fine-tune") -> Any:
    return Field(default_factory=ModelCfg, description=description)


def _preference_output_dir(default: str) -> Any:
    return Field(default, description="where checkpoints, metrics, cached reference log-probs and the final policy go")


def _initial_reference() -> Any:
    return Field(None, description="reference policy; default = the policy's initial weights "
                                   "(its log-probs are computed once, then cached)")


# ----------------------------------------------------------------------------------------------
# Shared parts
# ----------------------------------------------------------------------------------------------

class LoraCfg(Cfg):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 disables LoRA (full fine-tuning)")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha (the adapters' update is scaled by alpha/rank)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="module names that get adapters")

    @model_validator(mode="after")
    def _check_targets(self):
        if self.rank > 0 and not self.target_modules:
            raise ValueError("target_modules is empty: name the modules that get adapters (or set lora.rank=0)")
        return self


class ModelCfg(Cfg):
    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="local HF directory, hub id, or a named model of the zoo (smollm2-135m-instruct)")
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="compute precision: bf16 autocast over fp32 master weights, or plain fp32; auto = bf16 "
                            "only where the device computes it natively and fast (a CUDA GPU with bf16, a CPU with "
                            "AVX-512-BF16 or AMX), else fp32 (README: Hardware)")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="where the model trains and scores: auto = cuda, then mps, then cpu "
                            "(ppo places its roles by distributed.device)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory "
                                                            "(HF gradient_checkpointing_enable, non-reentrant)")
    lora: LoraCfg = Field(default_factory=LoraCfg, description="LoRA adapters (peft)")
    load_in_4bit: bool = Field(False, description="QLoRA: frozen base in 4-bit NF4 (bitsandbytes, CUDA GPU only); "
                                                  "needs lora.rank > 0")
    freeze_layers: int = Field(
        0, ge=0, description="keep the token embeddings and the first N decoder layers fixed (freeze tuning): "
                             "no backward below layer N, so a step costs about 1 + 2(L-N)/L forwards instead of 3; "
                             "with tied embeddings the LM head stays fixed too. 0 = train every layer")

    @model_validator(mode="after")
    def _check_qlora(self):
        if self.load_in_4bit and self.lora.rank <= 0:
            raise ValueError("load_in_4bit (QLoRA) trains adapters on a frozen 4-bit base: set lora.rank > 0")
        if self.freeze_layers and self.lora.rank > 0:
            raise ValueError("freeze_layers and lora both choose what trains: set one of them")
        return self


class OptimCfg(Cfg):
    lr: float = Field(1e-5, gt=0, description="peak learning rate of AdamW")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps (optimizer steps)")
    schedule: Literal["constant", "cosine", "linear"] = Field("cosine", description="decay after warm-up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr as a fraction of lr (cosine/linear)")
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping by global norm; 0 disables")

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_are_numbers(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)) and any(isinstance(b, bool) for b in v):
            raise ValueError(f"expected two numbers, got {list(v)}")
        return v

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v
    state_dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="dtype of AdamW's exp_avg/exp_avg_sq: bf16 (stochastic rounding, fp32 update and "
                            "master weights; 4 B/param instead of 8: docs/memory.md) or fp32 (torch's fused AdamW); "
                            "auto = bf16 on the CPU where its C kernel builds (bf16 or fp32 compute: the same speed "
                            "there as fp32 AdamW), fp32 on a GPU and elsewhere")
    offload: bool = Field(False, description="keep AdamW states (and the fp32 update) in CPU memory, step on the "
                                             "CPU, copy the new weights back: frees 8 bytes/trainable parameter of "
                                             "GPU memory; a no-op when the model is on the CPU already. With "
                                             "distributed.dp_strategy=fsdp: FSDP2's CPUOffloadPolicy (parameter, "
                                             "gradient and optimizer shards in CPU memory)")


class LogCfg(Cfg):
    every: int = Field(1, ge=1, description="log metrics every N optimizer steps")
    tensorboard: bool = Field(True, description="TensorBoard events in <output_dir>/tb (when report_to is unset)")
    report_to: Optional[list[Literal["tensorboard", "wandb", "mlflow", "trackio"]]] = Field(
        None, description="experiment trackers, as HF report_to (settings: their env vars, turborlhf/trackers.py); "
                          "None = [tensorboard] if log.tensorboard else []")
    project: str = Field("turborlhf", description="W&B project, MLflow experiment, Trackio project")
    run_name: Optional[str] = Field(None, description="tracker run name; None = the output directory's name")
    progress: bool = Field(True, description="print a compact progress line per logged step")

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker(cls, v: Any) -> Any:   # HF's report_to also takes one name, and "none"
        return ([] if v == "none" else [v]) if isinstance(v, str) else v


class TrainLoopCfg(Cfg):
    seed: int = Field(42, description="random seed (data order, dropout, sampling)")
    epochs: float = Field(1.0, gt=0, description="passes over the training data (fractional allowed)")
    max_steps: int = Field(0, ge=0, description="stop after this many optimizer steps; 0 = run the epochs")
    micro_batch_size: int = Field(4, ge=1, description="sequences (or pairs) per forward/backward pass")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = Field(1, ge=1, description="how many resumable checkpoints to keep")
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = all cores")


class EvalLoopCfg(TrainLoopCfg):
    """A training loop with a held-out evaluation (``data.test_file``): sft, rm, dpo, kto."""

    eval_every: int = Field(0, ge=0, description="evaluate every N steps (0 = only at the end)")


class RolloutCfg(Cfg, RolloutFields):   # the engine settings: config_rollout.py
    """The ``rollout`` section of the commands that generate (`ppo`, `rejection-sampling`,
    `conditional-sft`)."""


class PPORolloutCfg(RolloutCfg):
    """`ppo`'s rollout section: the engine settings, plus asynchronous rollouts."""

    max_staleness: int = Field(
        0, ge=0, description="asynchronous rollouts: the engines generate the rollouts of step n+k while the actor "
                             "trains on step n (k=1: one-step-off-policy), so a batch is trained up to k actor updates "
                             "after the weights that sampled it; needs algo.rollout_is (the IS correction of decoupled "
                             "PPO); 0 = synchronous (docs/distributed.md)")
    tool: Literal["none", "calculator"] = Field(
        "none", description="a tool the engine calls while sampling (turborlhf.rollout.tools): calculator = GSM8K's "
                            "<<expression=value>> calculator; the tokens a tool writes get no actor loss; fast and hf "
                            "engines only")

    @model_validator(mode="after")
    def _check_tool(self):
        if self.tool != "none" and self.engine == "vllm":
            raise ValueError(f"rollout.tool={self.tool} needs rollout.engine fast, hf or auto (vLLM's sampling loop "
                             "has no hook for a tool)")
        return self


class DataFormatCfg(Cfg):
    """Key names and chat template of a command's data (every ``data`` section; data/loaders.py)."""

    prompt_key: str = Field("prompt", description="the data's prompt key (OpenRLHF --input_key); text or messages")
    chosen_key: str = Field("chosen", description="the data's key of the preferred response")
    rejected_key: str = Field("rejected", description="the data's key of the dispreferred response")
    response_key: str = Field("response", description="the data's key of the SFT response / KTO completion")
    chat_template: Optional[str] = Field(None, description="chatml, plain or a Jinja string; None = the tokenizer's "
                                                           "own (a base model has none); saved with the model")

    @model_validator(mode="after")
    def _check_chat_template(self):
        from turborlhf.data.chat import resolve_chat_template  # pure Python: raises for an unknown name
        return self if not self.chat_template or resolve_chat_template(self.chat_template) else self

    def loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the data loaders (``turborlhf.data.loaders``)."""
        keys = {"prompt": self.prompt_key, "chosen": self.chosen_key, "rejected": self.rejected_key}
        return {"keys": {**keys, "response": self.response_key}, "chat_template": self.chat_template}


class SFTDataCfg(DataFormatCfg):
    train_file: Optional[str] = _data_input("pair-format JSONL ({prompt, chosen, rejected}: trains on chosen) "
                                            "or SFT JSONL ({prompt, response})")
    test_file: Optional[str] = _held_out()
    max_len: int = _max_len()
    max_samples: int = _at_most("training examples")
    max_test_samples: int = _at_most("test examples (the file's first)", verb="evaluate on")
    multiturn: bool = Field(False, description="message-list data: train on every assistant turn of a conversation "
                                               "(OpenRLHF --multiturn, TRL assistant_only_loss); false = its last "
                                               "turn only, the earlier ones are context")

    def loader_kwargs(self) -> dict[str, Any]:
        return {**super().loader_kwargs(), "multiturn": self.multiturn}


class SFTTrainCfg(EvalLoopCfg):
    sequences_per_step: int = Field(16, ge=1, description="sequences per optimizer step (global batch)")


class _HeldOutEval(Cfg):
    """A command whose ``train.eval_every`` evaluates ``data.test_file`` (sft, rm, dpo, kto,
    conditional-sft): a ``train.eval_every`` without a ``data.test_file`` is an error."""

    test_file_in_api: ClassVar[str] = " (eval_dataset= in the Python API)"     # where the API has a trainer

    @model_validator(mode="after")
    def _eval_needs_a_test_file(self):       # it evaluated nothing, silently (TRL refuses it too)
        if self.train.eval_every and not self.data.test_file:
            raise ValueError(f"train.eval_every={self.train.eval_every} evaluates data.test_file, which is not set"
                             + self.test_file_in_api)
        return self


class SFTConfig(_HeldOutEval):
    """`turborlhf sft`: next-token loss on response tokens only."""

    model: ModelCfg = _policy()
    data: SFTDataCfg = Field(default_factory=SFTDataCfg)
    optim: OptimCfg = Field(default_factory=lambda: OptimCfg(lr=2e-5))
    train: SFTTrainCfg = Field(default_factory=SFTTrainCfg)
    log: LogCfg = Field(default_factory=LogCfg)
    output_dir: str = Field("runs/sft", description="where checkpoints, metrics and the final model go")


class RMDataCfg(DataFormatCfg):
    train_file: Optional[str] = _data_input("pairs: pair-format JSONL or raw HH lines (.jsonl/.jsonl.gz)")
    test_file: Optional[str] = _held_out("pairs in the same formats")
    max_len: int = _max_len(384)
    max_samples: int = _at_most("training pairs")
    max_test_samples: int = _at_most("test pairs (the file's first)", verb="evaluate on")


class RMTrainCfg(EvalLoopCfg):
    pairs_per_step: int = Field(8, ge=1, description="preference pairs per optimizer step (global batch)")
    margin: bool = Field(False, description="use the per-pair `margin` field in the loss (-logσ(rc-rr-m))")
    center_rewards_coef: float = Field(0.0, ge=0, description="Eisenstein et al. centring term c·mean((rc+rr)^2)")
    freeze_embeddings: bool = Field(False, description="keep the token embeddings fixed (less memory, faster)")


class RMConfig(_HeldOutEval):
    """`turborlhf rm`: pairwise Bradley-Terry reward model."""

    model: ModelCfg = Field(default_factory=ModelCfg, description="backbone (causal LM) that gets a scalar head")
    data: RMDataCfg = Field(default_factory=RMDataCfg)
    optim: OptimCfg = Field(default_factory=lambda: OptimCfg(lr=1e-5))
    train: RMTrainCfg = Field(default_factory=RMTrainCfg)
    log: LogCfg = Field(default_factory=LogCfg)
    output_dir: str = Field("runs/rm", description="where checkpoints, metrics and the final model go")


class PPODataCfg(DataFormatCfg):
    prompts_file: Optional[str] = _data_input("prompts: {prompt} JSONL, pair-format or raw HH lines")
    max_samples: int = _at_most("prompts")
    ptx_file: Optional[str] = Field(None, description="PPO-ptx: SFT data ({prompt, response}, messages or pair "
                                                      "format: trains on chosen) mixed into the actor loss")
    ptx_max_len: int = Field(512, ge=8, description="PPO-ptx: tokens per SFT sequence (prompt cut from the left)")


class RewardSourceCfg(Cfg):
    """One reward source; the PPO score is Σ weight · score over all sources."""

    kind: Literal["model", "function", "remote", "callable"] = Field(
        ..., description="model = RM directory, function = Python rule, remote = `serve-rm` URL, callable = Python API's")
    path: str = Field(..., description="RM directory | path/to/module.py:function | http://host:port | callable's key")
    weight: float = Field(1.0, description="weight of this source in the combined score")
    name: Optional[str] = Field(None, description="metric name (rollout/reward_<name>_mean); default <kind><index>")
    timeout_s: float = Field(60.0, gt=0, description="remote: seconds one try may take, from connecting to the "
                                                     "answer's last byte (a timed-out try is retried)")
    retries: int = Field(2, ge=0, description="remote: further tries after a failed one (exponential backoff)")


# advantage estimators that need no critic, and those that need several samples per prompt
CRITIC_FREE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


class PPOAlgoCfg(Cfg, RLVRAlgoFields):   # + policy_loss, dynamic sampling, overlong, rollout IS: config_rlvr.py
    prompts_per_step: int = Field(8, ge=1, description="prompts per rollout batch (one PPO step)")
    n_samples_per_prompt: int = Field(1, ge=1, description="responses sampled per prompt (> 1 for group estimators)")
    advantage_estimator: Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = Field(
        "gae", description="gae (needs a critic) or a critic-free estimator: grpo, dr_grpo, rloo, reinforce_pp, "
                           "reinforce_pp_baseline (docs/algorithms/critic_free.md)")
    loss_reduction: Literal["token_mean", "seq_mean_token_mean", "token_sum_norm"] = Field(
        "token_mean", description="policy-loss reduction over a mini-batch: token_mean (OpenRLHF), "
                                  "seq_mean_token_mean (GRPO paper), token_sum_norm (Dr. GRPO: / (seqs·max_new_tokens))")
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    num_mini_batches: int = Field(1, ge=1, description="optimizer steps per PPO epoch")
    fused_update: Literal["auto", "actor", "both", "always", "never"] = Field(
        "auto", description="with ppo_epochs=1 and num_mini_batches=1 the old log-probs and values are what the "
        "training forward computes: keep the experience forward's graph and backpropagate through it instead of a "
        "second forward. auto = the actor's graph when each rank's rows fit one micro-batch, and the critic's too "
        "where the roles train on the CPU in bf16 or with bf16 AdamW moments (there both graphs together cost ~5% "
        "more peak memory, or what the bf16 moments save; elsewhere more); actor = the actor's graph only; "
        "both = as auto for the actor and the critic on every host; always = both whenever the schedule allows "
        "(a rank's whole share of activations held at once); never")
    old_logprobs: Literal["trainer", "rollout"] = Field(
        "trainer", description="where the old log-probs (PPO's ratio denominator, the KL to the reference) come "
        "from: trainer = the actor's forward over the rollout batch (OpenRLHF, TRL, verl); rollout = the engine's "
        "temperature-1 log-probs of the tokens it sampled (logprobs_mode raw_logprobs), which saves that forward "
        "(slime's --use-rollout-logprobs). The weight sync is verified on the canary after every push either way. "
        "rollout needs rollout.temperature 1, rollout.max_staleness 0, rollout.tool none, rollout_is none and no "
        "mismatch_kl_alarm (they compare the engine's log-probs with the trainer's); a fused actor update computes "
        "the forward anyway and uses it")
    share_prompts: bool = Field(
        True, description="with n_samples_per_prompt > 1, the actor's and reference's forwards compute each prompt "
        "once for its G responses (same results; CPU training attention only), and mini-batches are drawn as whole "
        "groups so the update's micro-batches share their prompts too (row by row when there are fewer groups "
        "than num_mini_batches)")
    eps_clip: float = Field(0.2, gt=0, lt=1, description="policy ratio clip ε (low side: the ratio is kept >= 1-ε)")
    eps_clip_high: Optional[float] = Field(None, gt=0, description="upper clip ε (asymmetric, DAPO); None = eps_clip")
    dual_clip: Optional[float] = Field(None, gt=1, description="dual-clip constant c > 1 for negative advantages")
    value_clip: Optional[float] = Field(0.2, gt=0, description="value clip ε_v; None disables value clipping")
    gamma: float = Field(1.0, ge=0, le=1, description="discount γ (GAE, reinforce_pp); group estimators need 1")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ")
    kl_coef: float = Field(0.05, ge=0, description="initial KL coefficient β; 0 (and no kl_target) = no reference model")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="per-token KL estimator (Schulman); "
                                                                      "k1 for the reward, k3 typical for kl_use_loss")
    kl_use_loss: bool = Field(False, description="KL(actor‖ref) as a loss term β·reduce(kl) with the current "
                                                 "log-probs (GRPO) instead of a per-token reward penalty")
    kl_target: Optional[float] = Field(None, gt=0, description="adaptive KL (Ziegler et al.) target; None = fixed β")
    kl_horizon: int = Field(10000, ge=1, description="adaptive KL horizon (samples)")
    reward_clip: float = Field(10.0, gt=0, description="clip combined scores to [-c, c] (before any group baseline)")
    normalize_reward: bool = Field(False, description="standardise scores by the running mean/std of the combined "
                                                      "score: (s - mean)/std, as OpenRLHF (moments over every "
                                                      "generated row: with dynamic_sampling, dropped groups' too)")
    missing_eos_penalty: Optional[float] = Field(1.0, description="subtracted from the score of responses without EOS")
    whiten_advantages: bool = Field(True, description="gae only: whiten advantages over the rollout batch "
                                                      "(reinforce_pp* always whiten, grpo/dr_grpo/rloo never)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus coefficient")
    ptx_coef: float = Field(0.0, ge=0, description="PPO-ptx (InstructGPT): weight of the SFT loss on data.ptx_file, "
                                                   "one micro-batch per actor optimizer step")
    ema_beta: Optional[float] = Field(None, gt=0, lt=1, description="EMA of the actor, ema = β·ema + (1-β)·θ after "
                                                                    "each actor step, exported to <output_dir>/ema")
    critic_lr: float = Field(1e-5, gt=0, description="critic learning rate (actor uses optim.lr)")
    critic_warmup_steps: int = Field(0, ge=0, description="PPO steps that train only the critic")

    @property
    def needs_critic(self) -> bool:
        return self.advantage_estimator not in CRITIC_FREE_ESTIMATORS

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0 or self.kl_target is not None

    def model_post_init(self, context: Any) -> None:
        est = self.advantage_estimator
        if est in GROUP_ESTIMATORS and self.n_samples_per_prompt < 2:
            raise ValueError(f"advantage_estimator={est} needs a group: set n_samples_per_prompt > 1 "
                             f"(got {self.n_samples_per_prompt})")
        if est in GROUP_ESTIMATORS and self.gamma != 1.0:
            raise ValueError(f"advantage_estimator={est} needs gamma=1 (the baseline is on the whole-response "
                             f"score); got gamma={self.gamma}")
        if self.kl_target is not None and self.kl_coef <= 0:
            raise ValueError(f"kl_target={self.kl_target} adapts kl_coef multiplicatively, so it needs an initial "
                             "kl_coef > 0 (got 0)")
        if not self.needs_critic and self.critic_warmup_steps:
            raise ValueError(f"critic_warmup_steps={self.critic_warmup_steps} but advantage_estimator={est} "
                             "trains no critic")
        rows = self.prompts_per_step * self.n_samples_per_prompt
        if self.num_mini_batches > rows:     # a mini-batch is at least one row: fewer updates than asked, silently
            raise ValueError(f"num_mini_batches={self.num_mini_batches} is more than the {rows} rows of a step "
                             f"(prompts_per_step × n_samples_per_prompt): at most {rows}")


class PPOConfig(Cfg):
    """`turborlhf ppo`: actor, critic, reward model(s) and reference model; critic-free estimators
    (GRPO, Dr. GRPO, RLOO, REINFORCE++) via `algo.advantage_estimator`."""

    actor: ModelCfg = Field(default_factory=ModelCfg, description="policy to optimise (usually the SFT model)")
    critic: Optional[ModelCfg] = Field(None, description="value model (gae only); without critic.name_or_path "
                                                         "initialised from the reward model (or the first `kind: "
                                                         "model` reward source)")
    reward_model: Optional[str] = Field(None, description="directory of a reward model "
                                                          "(AutoModelForSequenceClassification), weight 1")
    rewards: list[RewardSourceCfg] = Field(default_factory=list, description="further reward sources "
                                           "(model/function/remote); the score is Σ weight·score")
    reference: Optional[str] = Field(None, description="reference policy; default = the actor's initial weights")
    data: PPODataCfg = Field(default_factory=PPODataCfg)
    rollout: PPORolloutCfg = Field(default_factory=PPORolloutCfg)
    algo: PPOAlgoCfg = Field(default_factory=PPOAlgoCfg)
    optim: OptimCfg = Field(default_factory=lambda: OptimCfg(lr=1e-6, schedule="constant"))
    train: TrainLoopCfg = Field(default_factory=lambda: TrainLoopCfg(max_steps=20))
    log: LogCfg = Field(default_factory=LogCfg)
    distributed: DistributedCfg = Field(default_factory=DistributedCfg,
                                        description="placement of the roles: local or Ray, devices, colocation")
    output_dir: str = Field("runs/ppo", description="where checkpoints, metrics and the final actor go")

    @model_validator(mode="before")
    @classmethod
    def _critic_section_starts_from_the_reward_model(cls, data: Any) -> Any:
        """A critic section without ``name_or_path`` (``critic.freeze_layers=N`` alone) gets the
        reward model's path written in, so the critic starts from the RM, not from ModelCfg's
        default model, and the saved config says so (it then survives a dump and reload)."""
        if not isinstance(data, dict) or data.get("critic") is None:
            return data
        critic = data["critic"]
        if isinstance(critic, BaseModel):
            if "name_or_path" in critic.model_fields_set:
                return data
            critic = critic.model_dump(exclude_unset=True)
        elif not isinstance(critic, dict) or "name_or_path" in critic:
            return data
        get = lambda r, k: r.get(k) if isinstance(r, dict) else getattr(r, k, None)     # noqa: E731
        init = data.get("reward_model") or next((get(r, "path") for r in data.get("rewards") or []
                                                 if get(r, "kind") == "model"), None)
        return {**data, "critic": {**critic, "name_or_path": init}} if init else data

    @property
    def critic_init(self) -> Optional[str]:
        """Where the critic starts: `critic.name_or_path` (a critic section without it gets the
        reward model's), else the reward model, else the first model source."""
        if self.critic is not None:
            return self.critic.name_or_path
        if self.reward_model:
            return self.reward_model
        return next((r.path for r in self.rewards if r.kind == "model"), None)

    def missing_inputs(self, prefix: str = "") -> list[str]:
        """`Cfg.missing_inputs`, and a reward: ``reward_model`` or ``rewards`` (the Python API's
        ``reward_funcs=``), which a config may be built without, as TRL's ``GRPOConfig``."""
        no_reward = [] if self.reward_model or self.rewards else [
            f"no reward: set {prefix}reward_model or {prefix}rewards (a list of {{kind, path, weight}}), or pass "
            "reward_funcs= to the Python API's trainer"]
        return super().missing_inputs(prefix) + no_reward

    def model_post_init(self, context: Any) -> None:
        # no reward yet (the Python API's reward_funcs= come later): what depends on it waits for it
        has_reward = bool(self.reward_model or self.rewards)
        # the names `turborlhf.rewards.combine.build_reward` gives (metrics rollout/reward_<name>_mean)
        names = (["rm"] if self.reward_model else []) + [r.name or f"{r.kind}{i}" for i, r in enumerate(self.rewards)]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            which = ", ".join(f"rewards[{i}]" + (f".name={r.name}" if r.name else f" (default name {n})")
                              for i, r in enumerate(self.rewards) if (n := r.name or f"{r.kind}{i}") in dup)
            rm = "; reward_model is rm" if "rm" in dup else ""
            raise ValueError(f"rewards: two sources named {dup[0]!r} ({which}{rm}): give each a distinct name")
        est = self.algo.advantage_estimator
        if self.reference is not None and not self.algo.needs_reference:
            raise ValueError(f"reference={self.reference} is unused with algo.kl_coef=0 and no algo.kl_target (no KL "
                             "term): drop one of them")
        if (has_reward and self.algo.needs_critic and self.critic is not None
                and "name_or_path" not in self.critic.model_fields_set):
            # no reward model to write in (`_critic_section_starts_from_the_reward_model`): the critic
            # would start from ModelCfg's default model, whatever the actor is
            raise ValueError("critic.name_or_path: a critic section without it starts from the reward model, and no "
                             "reward source is a model: set critic.name_or_path")
        if has_reward and self.algo.needs_critic and self.critic_init is None:
            raise ValueError("advantage_estimator=gae needs a critic: set critic.name_or_path (no model reward "
                             "source to initialise it from)")
        if not self.algo.needs_critic and self.critic is not None:
            raise ValueError(f"critic is set but advantage_estimator={est} trains no critic")
        if self.algo.ptx_coef > 0 and not self.data.ptx_file:
            raise ValueError("algo.ptx_coef > 0 needs data.ptx_file (SFT-format or pair-format data)")
        lora = [f"{n}.lora.rank" for n, m in (("actor", self.actor), ("critic", self.critic))
                if m is not None and m.lora.rank > 0]
        if self.distributed.dp_strategy == "fsdp" and lora:
            # the gathered state would carry peft's names and unmerged adapters to the engines and the export
            raise ValueError(f"distributed.dp_strategy: fsdp does not shard LoRA models ({' and '.join(lora)} > 0); "
                             "use distributed.dp_strategy=ddp")
        from turborlhf.distributed.roles import check_colocation, check_fsdp_batches  # pure Python, no torch/Ray
        check_colocation(self.distributed, self.active_roles)
        check_fsdp_batches(self.distributed, self.algo, self.train.micro_batch_size)
        check_rlvr(self)

    @property
    def active_roles(self) -> tuple[str, ...]:
        """The roles this run builds: critic only for gae, reference only with a KL term and not for
        a LoRA actor that is its own reference (its adapters off: `trainers.ppo.driver.lora_reference`,
        which also compares resolved paths)."""
        own_reference = self.actor.lora.rank > 0 and self.reference in (None, self.actor.name_or_path)
        return tuple(r for r, on in (("actor", True), ("critic", self.algo.needs_critic), ("reward", True),
                                     ("reference", self.algo.needs_reference and not own_reference),
                                     ("rollout", True)) if on)


# ----------------------------------------------------------------------------------------------
# DPO / KTO configs (owned by the DPO/KTO trainers)
# ----------------------------------------------------------------------------------------------
# >>> dpo-kto configs
class DPODataCfg(DataFormatCfg):
    train_file: Optional[str] = _data_input("pairs: pair-format JSONL or raw HH lines (.jsonl/.jsonl.gz)")
    test_file: Optional[str] = _held_out("pairs in the same formats", " (eval/* metrics)")
    max_len: int = _max_len(note="; chosen and rejected keep the same (left-cut) prompt")
    max_samples: int = _at_most("training pairs")
    max_test_samples: int = _at_most("test pairs (the file's first)", verb="evaluate on")


class DPOAlgoCfg(Cfg):
    loss: Literal["dpo", "ipo", "cdpo", "robust"] = Field(
        "dpo", description="dpo: -logσ(βh); cdpo: -(1-ε)logσ(βh)-ε·logσ(-βh); robust: Chowdhury et al. "
                           "(unbiased, ε<0.5); ipo: (h-1/(2β))²  [h = policy minus reference log-ratio margin]")
    beta: float = Field(0.1, gt=0, description="β: strength of the implicit KL to the reference (τ for IPO)")
    label_smoothing: float = Field(0.0, ge=0, le=0.5, description="ε: assumed label-noise rate for cdpo/robust "
                                                                  "(also turns dpo into cdpo, as in OpenRLHF)")
    reference_free: bool = Field(False, description="drop the reference log-ratio (h = π_c - π_r); no reference "
                                                    "model is loaded and rewards/* are β·logπ")
    ipo_normalize_by_length: bool = Field(
        False, description="ipo only: divide each log-ratio by its response length (TRL); default summed "
                           "log-probs (IPO author code, OpenRLHF)")
    nll_coef: float = Field(0.0, ge=0, description="add coef · NLL of the chosen response (per-pair token mean, "
                                                   "averaged over pairs; OpenRLHF nll_loss_coef / RPO)")

    @model_validator(mode="after")
    def _check_variant(self):
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError("label_smoothing is not defined for loss=ipo")
        if self.loss == "robust" and self.label_smoothing >= 0.5:
            raise ValueError("loss=robust needs label_smoothing < 0.5")
        if self.ipo_normalize_by_length and self.loss != "ipo":
            raise ValueError("ipo_normalize_by_length needs loss=ipo")
        return self


class DPOTrainCfg(EvalLoopCfg):
    pairs_per_step: int = Field(8, ge=1, description="preference pairs per optimizer step (global batch); "
                                                     "micro_batch_size counts pairs (2 sequences each)")


class DPOConfig(_HeldOutEval):
    """`turborlhf dpo`: direct preference optimisation (DPO, cDPO, robust DPO, IPO, reference-free)."""

    model: ModelCfg = _policy("the policy to optimise (usually an SFT model)")
    reference: Optional[str] = _initial_reference()
    data: DPODataCfg = Field(default_factory=DPODataCfg)
    algo: DPOAlgoCfg = Field(default_factory=DPOAlgoCfg)
    optim: OptimCfg = Field(default_factory=lambda: OptimCfg(lr=1e-6, warmup_steps=5))
    train: DPOTrainCfg = Field(default_factory=DPOTrainCfg)
    log: LogCfg = Field(default_factory=LogCfg)
    output_dir: str = _preference_output_dir("runs/dpo")

    @model_validator(mode="after")
    def _check_reference(self):
        if self.algo.reference_free and self.reference is not None:
            raise ValueError("reference is unused with algo.reference_free=true; drop one of them")
        return self


class KTODataCfg(DataFormatCfg):
    train_file: Optional[str] = _data_input("KTO JSONL {prompt, completion, label} or any pair format "
                                            "(each pair = 1 desirable + 1 undesirable example)")
    test_file: Optional[str] = _held_out("examples in the same formats", " (eval/* metrics)")
    max_len: int = _max_len()
    max_samples: int = _at_most("training examples")
    max_test_samples: int = _at_most("test examples (the file's first)", verb="evaluate on")


class KTOAlgoCfg(Cfg):
    beta: float = Field(0.1, gt=0, description="β of KTO (TRL/HALOs 0.1; OpenRLHF used 0.01)")
    desirable_weight: float = Field(1.0, gt=0, description="λ_D, weight of desirable examples")
    undesirable_weight: float = Field(1.0, gt=0, description="λ_U, weight of undesirable examples; keep "
                                                             "λ_D·N_D/(λ_U·N_U) in [1, 4/3] (paper, TRL)")


class KTOTrainCfg(EvalLoopCfg):
    examples_per_step: int = Field(16, ge=2, description="examples per optimizer step (global batch); the KL "
                                                         "reference point z0 is estimated over these")


class KTOConfig(_HeldOutEval):
    """`turborlhf kto`: Kahneman-Tversky optimisation on unpaired desirable/undesirable examples."""

    model: ModelCfg = _policy("the policy to optimise (usually an SFT model)")
    reference: Optional[str] = _initial_reference()
    data: KTODataCfg = Field(default_factory=KTODataCfg)
    algo: KTOAlgoCfg = Field(default_factory=KTOAlgoCfg)
    optim: OptimCfg = Field(default_factory=lambda: OptimCfg(lr=1e-6, warmup_steps=5))
    train: KTOTrainCfg = Field(default_factory=KTOTrainCfg)
    log: LogCfg = Field(default_factory=LogCfg)
    output_dir: str = _preference_output_dir("runs/kto")
# <<< dpo-kto configs

# ----------------------------------------------------------------------------------------------
# Rejection sampling / conditional SFT configs
# ----------------------------------------------------------------------------------------------
# >>> rs-csft configs
class RSDataCfg(DataFormatCfg):
    prompts_file: str = Field(..., description="prompts: {prompt} JSONL, pair-format or raw HH lines")
    max_samples: int = _at_most("prompts")
    max_len: int = _max_len(what="SFT sequence")


class RSAlgoCfg(Cfg):
    rounds: int = Field(3, ge=1, description="sample → score → select → SFT iterations")
    prompts_per_round: int = Field(
        128, ge=1, description="prompts per round; round k takes the next slice of a seeded shuffle (wrapping)")
    n_samples_per_prompt: int = Field(4, ge=1, description="responses sampled per prompt (the n of best-of-n)")
    min_score: Optional[float] = Field(
        None, description="keep a prompt's best response only if its selection score is > this; None keeps all")
    missing_eos_penalty: Optional[float] = Field(
        None, description="subtracted from the selection score of responses cut at max_new_tokens; None = no penalty")
    accumulate: bool = Field(
        False, description="SFT each round on the best responses of all rounds so far (Llama 2), not only this one's")
    score_truncated_with_eos: bool = Field(
        False, description="score a response cut at max_new_tokens with an EOS appended (judged as if it ended "
                           "there); default false scores the sampled tokens as they are, as `eval-policy` and `ppo` do")
    score_batch_size: int = Field(16, ge=1, description="sequences per reward-model forward pass")


class RejectionSamplingConfig(Cfg):
    """`turborlhf rejection-sampling`: iterative best-of-n; train.* (epochs, max_steps, ...) apply per round.
    A ``train.save_every`` or ``train.eval_every`` other than 0 is an error (checkpoints are per round,
    there is no held-out evaluation)."""

    model: ModelCfg = Field(default_factory=ModelCfg, description="the policy to improve (sampled from and trained)")
    reward_model: str = Field(..., description="directory of the reward model (AutoModelForSequenceClassification)")
    data: RSDataCfg
    rollout: RolloutCfg = Field(default_factory=lambda: RolloutCfg(temperature=0.9),
                                description="sampling of the candidates")
    algo: RSAlgoCfg = Field(default_factory=RSAlgoCfg, description="rounds, best-of-n and selection")
    optim: OptimCfg = Field(default_factory=lambda: OptimCfg(lr=1e-5, schedule="constant"),
                            description="AdamW, re-created at the start of every round")
    train: SFTTrainCfg = Field(default_factory=lambda: SFTTrainCfg(epochs=1.0),
                               description="the SFT phase of each round")
    log: LogCfg = Field(default_factory=LogCfg, description="metrics output")
    output_dir: str = Field("runs/rejection_sampling", description="where rounds, checkpoints and the final model go")

    @model_validator(mode="after")
    def _refuse_unread_train_fields(self):     # the SFT loop's fields this trainer never reads were a silent no-op
        if self.train.save_every:
            raise ValueError(f"train.save_every={self.train.save_every} is not used by rejection sampling: it "
                             "checkpoints after every round; drop it")
        if self.train.eval_every:
            raise ValueError(f"train.eval_every={self.train.eval_every} is not used by rejection sampling: it has "
                             "no held-out evaluation; drop it")
        return self


class CSFTDataCfg(DataFormatCfg):
    train_file: str = Field(..., description="pair-format JSONL or raw HH (chosen AND rejected are used), "
                                             "or SFT JSONL ({prompt, response})")
    test_file: Optional[str] = _held_out(note=" (tagged NLL at the end)")
    max_len: int = _max_len()
    max_samples: int = Field(0, ge=0, description="use at most this many lines' records (pairs or examples; 0 = all)")
    max_test_samples: int = Field(0, ge=0, description="evaluate on at most this many of the test file's records "
                                                       "(its first; pairs or examples; 0 = all)")
    score_batch_size: int = Field(16, ge=1, description="sequences per reward-model forward pass when scoring")
    policy_samples_per_prompt: int = Field(
        0, ge=0, description="also sample this many responses per training prompt from the starting policy "
                             "(settings rollout.*) and train on them, tagged like the rest; 0 = data only")
    dataset_responses: bool = Field(
        True, description="train on the data file's own responses (both of a pair); false: the file only "
                          "supplies prompts and every example is a policy sample (needs policy_samples_per_prompt)")

    @model_validator(mode="after")
    def _check_sources(self):
        if not self.dataset_responses and not self.policy_samples_per_prompt:
            raise ValueError("dataset_responses=false leaves no examples: set policy_samples_per_prompt > 0")
        return self


class CSFTTagCfg(Cfg):
    n_bins: int = Field(5, ge=2, description="number of score bins (tags 0 … n_bins-1; higher = better)")
    binning: Literal["quantile", "uniform"] = Field(
        "quantile", description="bin edges: score quantiles (equal counts) or equal-width over [min, max]")
    format: str = Field("<rm_score>={k}", description="tag text; {k} is replaced by the bin index")
    position: Literal["last_user", "system", "prefix"] = Field(
        "last_user", description="where the tag goes: end of the last user message, start of the system "
                                 "message, or before the whole prompt text")
    separator: str = Field(" ", description="text between the tag and the message content")
    generation_bin: Optional[int] = Field(None, ge=0, description="bin used at generation; None = the best (n_bins-1)")

    @model_validator(mode="after")
    def _check_tags(self):
        if "{k}" not in self.format:     # without it every bin gets the same tag: nothing conditions
            raise ValueError(f"format {self.format!r} has no {{k}} for the bin index: every bin would get the same tag")
        if self.generation_bin is not None and self.generation_bin >= self.n_bins:
            raise ValueError(f"generation_bin={self.generation_bin} must be < n_bins={self.n_bins}")
        return self


class ConditionalSFTConfig(_HeldOutEval):
    """`turborlhf conditional-sft`: SFT on prompts tagged with the RM score bin of their response.
    A ``train.eval_every`` without a ``data.test_file`` is an error."""

    test_file_in_api: ClassVar[str] = ""          # no trainer object in the Python API

    model: ModelCfg = _policy()
    reward_model: str = Field(..., description="directory of the reward model that scores the training responses")
    data: CSFTDataCfg
    tags: CSFTTagCfg = Field(default_factory=CSFTTagCfg, description="score → tag mapping and its placement")
    rollout: RolloutCfg = Field(default_factory=lambda: RolloutCfg(temperature=0.8, top_p=0.95),
                                description="sampling of the policy's own responses (data.policy_samples_per_prompt)")
    optim: OptimCfg = Field(default_factory=lambda: OptimCfg(lr=2e-5), description="AdamW and its schedule")
    train: SFTTrainCfg = Field(default_factory=SFTTrainCfg, description="the SFT loop")
    log: LogCfg = Field(default_factory=LogCfg, description="metrics output")
    output_dir: str = Field("runs/conditional_sft", description="where scores, tags, checkpoints and the model go")
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

    @model_validator(mode="after")
    def _check_rollout(self):      # the evaluation reads these of eval.rollout: any other set is refused
        used = ("engine", "max_new_tokens", "max_prompt_len", "temperature", "top_p", "dtype", "device",
                "sync_tolerance")
        default = type(self).model_fields["rollout"].get_default(call_default_factory=True)
        if unused := [f for f in type(self.rollout).model_fields if f not in used
                      and getattr(self.rollout, f) != getattr(default, f)]:
            raise ValueError(f"eval.rollout.{unused[0]}: the evaluation samples with eval.rollout's "
                             f"{', '.join(used[:-1])} only")
        return self


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
    # the config class each stage section holds overrides of (a `key=value` override reads its type there)
    stage_configs: ClassVar[dict[str, type]] = {"sft": SFTConfig, "rm": RMConfig, "ppo": PPOConfig}


# ----------------------------------------------------------------------------------------------
# Loading, overriding, help: config_io.py (re-exported here)
# ----------------------------------------------------------------------------------------------

from turborlhf.config_io import (_cfg_class, _deep_update, _format_error, _set_dotted, _short,  # noqa: E402,F401
                                 config_help, config_to_dict, default_tree, load_config, parse_override,
                                 validate_section)


def __getattr__(name: str) -> Any:  # the ppo presets of `turborlhf grpo` / `rloo` live in presets.py
    if name in ("GRPOConfig", "RLOOConfig"):
        from turborlhf import presets
        return getattr(presets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
