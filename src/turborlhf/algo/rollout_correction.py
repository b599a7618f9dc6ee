"""Rollout correction: the engine that samples is not the model that trains.

The rollout engine (its own bf16 copy of the actor, other kernels, vLLM) samples from a policy
``μ`` that differs slightly from the trainer's ``π_old`` on the same weights, so "on-policy" PPO
is in fact off-policy (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training", https://fengyao.notion.site/off-policy-rl). With the engine's own
log-probs of the sampled tokens, ``log μ``, and the trainer's, ``log π_old``:

* :func:`rollout_mismatch_stats` measures the gap (KL(μ‖π_old) per token, the largest ratio);
* :func:`rollout_is_weights` gives per-token importance weights for the policy loss: truncated
  (TIS, Yao et al.: ``min(ρ, C)``) or masked (MIS: ``ρ·1(ρ ≤ C)``, the IcePop / "Seq-MIS" of
  Liu et al. 2025 "When speed kills stability"), at token or sequence level, with
  ``ρ = π_old/μ``.

Peers: verl ``algorithm.rollout_correction.rollout_is: token|sequence`` + ``rollout_is_threshold``
(TIS) and ``rollout_rs`` (masking); OpenRLHF ``PolicyLoss(enable_vllm_is_correction,
vllm_is_truncated_threshold, vllm_is_correction_type="tis"|"icepop"|"seq-mask-tis")``; TRL
``vllm_importance_sampling_mode="token_truncate"|"token_mask"|"sequence_truncate"|"sequence_mask"``.
Shapes: ``B`` sequences, ``T`` response tokens; masks 0/1 with 1 = valid token.
"""

from __future__ import annotations

import torch

from turborlhf.algo.masked import masked_mean

__all__ = ["ROLLOUT_IS_MODES", "rollout_is_weights", "rollout_mismatch_stats"]

ROLLOUT_IS_MODES = ("tis", "mis")
_LOG_CLAMP = 20.0          # ratios are bounded to [e^-20, e^20] (verl's safety bound, OpenRLHF's ratio clamp)


def _log_ratio(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor):
    if old_logp_BT.shape != rollout_logp_BT.shape or old_logp_BT.shape != mask_BT.shape or old_logp_BT.dim() != 2:
        raise ValueError(f"expected 2-D (B, T) tensors of equal shape, got {tuple(old_logp_BT.shape)}, "
                         f"{tuple(rollout_logp_BT.shape)}, {tuple(mask_BT.shape)}")
    mask_b = mask_BT.bool()
    diff = (old_logp_BT.detach().double() - rollout_logp_BT.detach().double()).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    return torch.where(mask_b, diff, torch.zeros((), dtype=diff.dtype)), mask_b


@torch.no_grad()
def rollout_is_weights(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str = "tis",
    threshold: float = 2.0,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights ``w`` that correct the policy loss for the engine/trainer mismatch.

    ``ρ_t = exp(log π_old(y_t) - log μ(y_t))`` per token (``level="token"``) or
    ``ρ = exp(Σ_t (log π_old - log μ))`` per sequence, broadcast to its tokens
    (``level="sequence"``), each log-ratio clamped to [-20, 20]. Then

    * ``mode="tis"`` (truncated IS, Yao et al. 2025): ``w = min(ρ, C)``;
    * ``mode="mis"`` (masked IS): ``w = ρ · 1(ρ ≤ C)`` (tokens or sequences whose ratio exceeds
      ``C`` get no gradient; the rest keep the untruncated weight).

    The trainer multiplies the per-token policy loss by ``w`` (detached; the KL and entropy terms
    are not weighted), keeping the loss denominators: the policy gradient
    ``E_μ[w ∇ log π ...]`` then estimates the one under ``π_old``.

    Args:
        old_logp_BT: the trainer's log-probs of the sampled tokens (``π_old``), shape (B, T).
        rollout_logp_BT: the engine's log-probs of the same tokens (``μ``), shape (B, T).
        mask_BT: 0/1 response-token mask, shape (B, T).
        mode: ``"tis"`` or ``"mis"``.
        threshold: C > 0 (Yao et al. use 2; verl's default 2.0).
        level: ``"token"`` (default) or ``"sequence"``.

    Returns:
        ``(w_BT, stats)``: w_BT in the dtype of ``old_logp_BT``, 0 at masked positions; stats
        (detached 0-d tensors, masked over valid tokens): ``is_weight_mean`` (mean w),
        ``is_clipfrac`` (fraction of tokens whose ρ > C: truncated or masked).

    Raises:
        ValueError: shape mismatch, unknown ``mode``/``level``, ``threshold <= 0``.
    """
    if mode not in ROLLOUT_IS_MODES or level not in ("token", "sequence"):
        raise ValueError(f"rollout_is_weights: mode must be one of {ROLLOUT_IS_MODES} and level token|sequence, "
                         f"got {mode!r}, {level!r}")
    if threshold <= 0:
        raise ValueError(f"rollout_is_weights: threshold must be > 0, got {threshold}")
    log_rho_BT, mask_b = _log_ratio(old_logp_BT, rollout_logp_BT, mask_BT)
    if level == "sequence":
        log_rho_BT = log_rho_BT.sum(dim=1, keepdim=True).clamp(-_LOG_CLAMP, _LOG_CLAMP).expand_as(log_rho_BT)
    rho_BT = torch.exp(log_rho_BT)
    over_BT = rho_BT > threshold
    w_BT = rho_BT.clamp(max=threshold) if mode == "tis" else torch.where(over_BT, 0.0, rho_BT)
    w_BT = torch.where(mask_b, w_BT, 0.0)
    stats = {"is_weight_mean": masked_mean(w_BT, mask_b).float(),
             "is_clipfrac": masked_mean(over_BT.double(), mask_b).float()}
    return w_BT.to(old_logp_BT.dtype), stats


@torch.no_grad()
def rollout_mismatch_stats(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
) -> dict[str, float]:
    """How far the engine's sampling policy ``μ`` is from the trainer's ``π_old``.

    With ``log ρ_t = log π_old(y_t) - log μ(y_t)`` over the valid tokens of the batch (sampled
    from ``μ``):

    * ``kl``: k3 estimate of KL(μ ‖ π_old) per token, ``mean((ρ - 1) - log ρ)`` (unbiased, ≥ 0;
      Schulman's k3, as ``turborlhf.algo.kl``);
    * ``k1``: ``mean(log μ - log π_old)``, the plain estimate of the same KL (can be < 0);
    * ``max_ratio``: ``max_t ρ_t`` (what TIS truncates; 1 when the two agree);
    * ``min_ratio``: ``min_t ρ_t``.

    Args:
        old_logp_BT: the trainer's log-probs of the sampled tokens, shape (B, T).
        rollout_logp_BT: the engine's log-probs of the same tokens, shape (B, T).
        mask_BT: 0/1 response-token mask, shape (B, T).

    Returns:
        dict of Python floats (0 / 1 for an empty mask), ratios from log-ratios clamped to
        [-20, 20].

    Raises:
        ValueError: shape mismatch.
    """
    log_rho_BT, mask_b = _log_ratio(old_logp_BT, rollout_logp_BT, mask_BT)
    if not bool(mask_b.any()):
        return {"kl": 0.0, "k1": 0.0, "max_ratio": 1.0, "min_ratio": 1.0}
    valid = log_rho_BT[mask_b]
    return {"kl": float((torch.expm1(valid) - valid).mean()), "k1": float((-valid).mean()),
            "max_ratio": float(torch.exp(valid.max())), "min_ratio": float(torch.exp(valid.min()))}
