"""Algorithm presets: `turborlhf grpo` and `turborlhf rloo` run the ppo trainer with these defaults.

Each is `PPOConfig` with another default `algo` section (and output directory), so a YAML file or
an override of any algo.* field still wins. `turborlhf.config.GRPOConfig` / `RLOOConfig` resolve here.
"""
from __future__ import annotations

from pydantic import Field

from turborlhf.config import PPOAlgoCfg, PPOConfig

__all__ = ["GRPOConfig", "RLOOConfig"]


class GRPOConfig(PPOConfig):
    """`turborlhf grpo`: the ppo trainer with GRPO's settings (Shao et al. 2402.03300): group-normalised
    advantages over n_samples_per_prompt responses, no critic, KL(actor‖ref) as a k3 loss term,
    seq-mean-token-mean reduction. Any algo.* field still overrides."""

    algo: PPOAlgoCfg = Field(default_factory=lambda: PPOAlgoCfg(
        advantage_estimator="grpo", n_samples_per_prompt=4, kl_use_loss=True, kl_estimator="k3",
        loss_reduction="seq_mean_token_mean"))
    output_dir: str = Field("runs/grpo", description="where checkpoints, metrics and the final actor go")


class RLOOConfig(PPOConfig):
    """`turborlhf rloo`: the ppo trainer with RLOO's settings (Ahmadian et al. 2402.14740): the
    leave-one-out baseline over n_samples_per_prompt responses, no critic, a k1 KL penalty in the
    reward. Any algo.* field still overrides."""

    algo: PPOAlgoCfg = Field(default_factory=lambda: PPOAlgoCfg(
        advantage_estimator="rloo", n_samples_per_prompt=4, kl_use_loss=False, kl_estimator="k1"))
    output_dir: str = Field("runs/rloo", description="where checkpoints, metrics and the final actor go")
