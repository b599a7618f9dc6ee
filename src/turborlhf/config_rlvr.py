"""The RLVR fields of `ppo`'s ``algo`` section (DAPO, GSPO, CISPO, rollout correction), kept in
their own file to keep config.py short; `turborlhf.config.PPOAlgoCfg` inherits them, so they are
``algo.<name>`` like every other algorithm field. Names follow DAPO/verl. Equations and the peers'
names: docs/algorithms/critic_free.md. Imports neither torch nor transformers."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["RLVRAlgoFields", "check_rlvr"]


class RLVRAlgoFields(BaseModel):
    """Policy-loss variants and the tricks used for reinforcement learning with verifiable rewards."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), allow_inf_nan=False)

    policy_loss: Literal["ppo", "gspo", "cispo"] = Field(
        "ppo", description="ppo: token-ratio clipped surrogate; gspo: sequence-level ratio (geometric mean of the "
        "token ratios) clipped per response (Zheng et al. 2025; needs loss_reduction=seq_mean_token_mean, paper "
        "eps_clip=3e-4, eps_clip_high=4e-4); cispo: REINFORCE with the stop-gradient ratio capped at 1+eps_clip_high "
        "(MiniMax-M1; no lower bound)")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose n_samples_per_prompt scores are all equal (zero "
                           "advantage) and sample more prompts until prompts_per_step groups are kept (group "
                           "estimators only)")
    dynamic_sampling_max_tries: int = Field(
        10, ge=1, description="rollout rounds per step with dynamic_sampling (the first included); if still short, the "
                              "batch is filled with dropped groups (logged as rollout/groups_filled)")
    dynamic_sampling_fill: bool = Field(
        True, description="after dynamic_sampling_max_tries rounds, fill a short batch with dropped groups (every step "
                          "trains on prompts_per_step groups; the fillers have zero advantage (reinforce_pp_baseline: the "
                          "whitening's shift), so they add only the KL "
                          "term and, with token_mean, shrink the policy gradient); false trains on the kept groups "
                          "alone (fewer rows, DAPO's batch of only informative groups), filling only when none is kept")
    overlong_buffer_len: int = Field(
        0, ge=0, description="DAPO soft overlong punishment: the score falls linearly by up to overlong_penalty_factor "
                             "over the last this-many tokens before rollout.max_new_tokens; 0 = off")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="largest overlong penalty (at max_new_tokens)")
    overlong_filter: bool = Field(
        False, description="DAPO overlong filtering: responses cut at max_new_tokens (no EOS) get no actor loss "
                           "(masked out of the policy, KL and entropy terms and their token counts)")
    rollout_is: Literal["none", "tis", "mis"] = Field(
        "none", description="correct the policy loss for the rollout engine's own sampling policy with importance "
                            "weights ρ = π_old/π_engine: tis = min(ρ, threshold) (truncated, Yao et al. 2025), "
                            "mis = ρ·1(ρ <= threshold) (masked); needs untruncated sampling (top_p 1, "
                            "top_k 0; any temperature: the trainer scores at it)")
    rollout_is_level: Literal["token", "sequence"] = Field(
        "token", description="ratio per token, or one per response (product of its token ratios)")
    rollout_is_threshold: float = Field(2.0, ge=1.0, description="C of TIS/MIS")
    mismatch_kl_alarm: Optional[float] = Field(
        None, gt=0, description="alarm when rollout/mismatch_kl (engine-vs-trainer KL per token) exceeds this "
                                "or is NaN; None = only log it")
    mismatch_kl_action: Literal["warn", "error"] = Field(
        "warn", description="what the alarm does: warn (RolloutMismatchWarning) or error (stop the run with "
                            "RolloutMismatchError before the step's update)")

    @model_validator(mode="after")
    def _check_rlvr_algo(self) -> Any:
        from turborlhf.config import GROUP_ESTIMATORS    # config.py imports this module first

        est, red = getattr(self, "advantage_estimator", None), getattr(self, "loss_reduction", None)
        if self.dynamic_sampling and est not in GROUP_ESTIMATORS:
            raise ValueError(f"algo.dynamic_sampling drops groups of equal scores, which only have zero advantage "
                             f"under a group baseline: needs advantage_estimator in {GROUP_ESTIMATORS}, got {est}")
        if self.dynamic_sampling and getattr(self, "kl_coef", 0) > 0 and not getattr(self, "kl_use_loss", True):
            raise ValueError(f"algo.dynamic_sampling drops groups whose scores are all equal as having zero advantage, "
                             f"but with algo.kl_coef={self.kl_coef} in the reward (kl_use_loss false) their tokens' "
                             "advantages carry the KL penalty: set algo.kl_use_loss=true (GRPO's KL loss term) or "
                             "algo.kl_coef=0 (DAPO)")
        if self.policy_loss == "gspo" and red != "seq_mean_token_mean":
            raise ValueError(f"algo.policy_loss=gspo averages over responses (its ratio is per response): set "
                             f"algo.loss_reduction=seq_mean_token_mean (got {red})")
        if self.policy_loss != "ppo" and getattr(self, "dual_clip", None) is not None:
            raise ValueError(f"algo.dual_clip applies to policy_loss=ppo only (got policy_loss={self.policy_loss})")
        return self


def check_rlvr(cfg: Any) -> None:
    """Checks across sections of a `PPOConfig` (``algo`` against ``rollout``); ValueError naming the field."""
    A, R = cfg.algo, cfg.rollout
    if A.overlong_buffer_len >= R.max_new_tokens:
        raise ValueError(f"algo.overlong_buffer_len={A.overlong_buffer_len} must be < rollout.max_new_tokens="
                         f"{R.max_new_tokens}")
    if R.max_staleness > 0 and A.rollout_is == "none":
        raise ValueError(f"rollout.max_staleness={R.max_staleness} trains on rollouts sampled by older weights: set "
                         "algo.rollout_is=tis (or mis) so the engine's log-probs correct for it (decoupled PPO)")
    if R.max_staleness > 0 and cfg.distributed.rollout_sleep:
        raise ValueError(f"rollout.max_staleness={R.max_staleness} keeps the engines generating while the actor "
                         "trains: distributed.rollout_sleep must be false")
    if getattr(A, "old_logprobs", "trainer") == "rollout":
        clash = [(f"rollout.temperature={R.temperature}", R.temperature != 1.0),
                 (f"rollout.max_staleness={R.max_staleness}", R.max_staleness > 0),
                 (f"rollout.tool={getattr(R, 'tool', 'none')}", getattr(R, "tool", "none") != "none"),
                 (f"algo.rollout_is={A.rollout_is}", A.rollout_is != "none"),
                 (f"algo.mismatch_kl_alarm={A.mismatch_kl_alarm}", A.mismatch_kl_alarm is not None)]
        bad = [name for name, on in clash if on]
        if bad:
            raise ValueError(f"algo.old_logprobs=rollout takes the old log-probs from the engine's temperature-1 "
                             f"log-probs of the current weights' samples, which {', '.join(bad)} rule out: use "
                             "temperature 1, max_staleness 0, no tool, rollout_is none and no mismatch alarm, or "
                             "old_logprobs=trainer")
    transformed = R.top_p < 1.0 or R.top_k > 0     # the trainer scores at the temperature, not the truncation
    for name, on in (("rollout_is", A.rollout_is != "none"), ("mismatch_kl_alarm", A.mismatch_kl_alarm is not None)):
        if on and transformed:
            raise ValueError(f"algo.{name} compares the engine's log-probs with the trainer's, but with "
                             f"rollout.top_p={R.top_p}, top_k={R.top_k} the engine samples from a truncated "
                             "distribution the trainer does not score: use top_p 1, top_k 0")
