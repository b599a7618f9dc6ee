"""Algorithm presets: `turborlhf grpo` and `turborlhf rloo` run the ppo trainer with these defaults.

Each is `PPOConfig` with another default `algo` section (and output directory), so a YAML file or
an override of any algo.* field still wins. `turborlhf.config.GRPOConfig` / `RLOOConfig` resolve here.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from turborlhf.config import PPOAlgoCfg, PPOConfig

__all__ = ["GRPOConfig", "RLOOConfig"]


class _Preset(PPOConfig):
    """`PPOConfig` with other defaults. In its objects the fields whose default it changes (``algo``,
    ``output_dir``) count as set (``model_fields_set``), as a value given would: a config object
    carries its set fields over another command's defaults (`turborlhf.api`: a ``GRPOConfig`` given
    to ``PPOTrainer`` trains GRPO's settings, not PPO's GAE with a critic), while a value given for
    such a field (``algo={"kl_coef": 0}``) is still the one it holds."""

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        base = PPOConfig.model_fields
        self.model_fields_set.update(
            name for name, f in type(self).model_fields.items()
            if name in base and (f.default, f.default_factory) != (base[name].default, base[name].default_factory))


class GRPOConfig(_Preset):
    """`turborlhf grpo`: the ppo trainer with GRPO's settings (Shao et al. 2402.03300): group-normalised
    advantages over n_samples_per_prompt responses, no critic, KL(actor‖ref) as a k3 loss term,
    seq-mean-token-mean reduction. Any algo.* field still overrides."""

    algo: PPOAlgoCfg = Field(default_factory=lambda: PPOAlgoCfg(
        advantage_estimator="grpo", n_samples_per_prompt=4, kl_use_loss=True, kl_estimator="k3",
        loss_reduction="seq_mean_token_mean"))
    output_dir: str = Field("runs/grpo", description="where checkpoints, metrics and the final actor go")


class RLOOConfig(_Preset):
    """`turborlhf rloo`: the ppo trainer with RLOO's settings (Ahmadian et al. 2402.14740): the
    leave-one-out baseline over n_samples_per_prompt responses, no critic, a k1 KL penalty in the
    reward. Any algo.* field still overrides."""

    algo: PPOAlgoCfg = Field(default_factory=lambda: PPOAlgoCfg(
        advantage_estimator="rloo", n_samples_per_prompt=4, kl_use_loss=False, kl_estimator="k1"))
    output_dir: str = Field("runs/rloo", description="where checkpoints, metrics and the final actor go")
