"""Per-token KL estimators (k1/k2/k3) and the fixed / adaptive KL-coefficient controllers.

Estimators (Schulman, http://joschu.net/blog/kl-approx.html), for tokens sampled from the
policy ``q = πθ`` against the reference ``p = πref``, with ``log r = logπref - logπθ``:

* ``k1 = -log r = logπθ - logπref`` — unbiased for KL(πθ‖πref), can be negative;
* ``k2 = ½ (log r)²`` — biased, ≥ 0, low variance;
* ``k3 = (r - 1) - log r`` — unbiased, ≥ 0.

OpenRLHF (``openrlhf/models/utils.py::compute_approx_kl``) clamps every estimate to
[-10, 10]; TRL does not clamp. Here clamping is the ``clamp`` option, default ``None`` (TRL /
paper behaviour); pass ``clamp=10.0`` to reproduce OpenRLHF. See docs/reference/formulas.md §6.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["KL_ESTIMATORS", "kl_estimate", "FixedKLController", "AdaptiveKLController"]


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio**2


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # with log r = -log_ratio:  (r - 1) - log r
    return torch.expm1(-log_ratio) + log_ratio


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def kl_estimate(
    logp_BT: torch.Tensor,
    ref_logp_BT: torch.Tensor,
    estimator: str = "k1",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(πθ ‖ πref) at the sampled tokens.

    Args:
        logp_BT: log-prob of each sampled response token under the policy, shape (B, T)
            (per-token, natural log; not summed).
        ref_logp_BT: the same under the reference model, shape (B, T).
        estimator: ``"k1"`` (default; OpenRLHF's and TRL PPO's default for the reward
            penalty), ``"k2"`` or ``"k3"`` (GRPO's KL-as-loss term).
        clamp: if given, clamp the estimate to ``[-clamp, clamp]`` (OpenRLHF uses 10).
            Default ``None`` = no clamping (TRL, the paper formulas).

    Returns:
        kl_BT, shape (B, T), float32 for half-precision inputs, else the input dtype.
        Padded positions are NOT masked here: mask the result (or the inputs) yourself.

    Raises:
        ValueError: unknown ``estimator``, shape mismatch, or ``clamp <= 0``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimate: unknown estimator {estimator!r}; expected one of {sorted(KL_ESTIMATORS)}")
    if logp_BT.shape != ref_logp_BT.shape:
        raise ValueError(f"kl_estimate: shape mismatch {tuple(logp_BT.shape)} vs {tuple(ref_logp_BT.shape)}")
    if clamp is not None and clamp <= 0:
        raise ValueError(f"kl_estimate: clamp must be > 0, got {clamp}")
    kl_BT = KL_ESTIMATORS[estimator](_upcast(logp_BT) - _upcast(ref_logp_BT))
    if clamp is not None:
        kl_BT = kl_BT.clamp(-clamp, clamp)
    return kl_BT


class FixedKLController:
    """Constant KL coefficient β (same interface as :class:`AdaptiveKLController`).

    Source: Ziegler et al. 1909.08593 author code / OpenRLHF
    ``openrlhf/trainer/ppo_utils/kl_controller.py::FixedKLController``.

    Args:
        kl_coef: β ≥ 0, the weight of the KL penalty (``reward_t -= β·kl_t``).

    Raises:
        ValueError: if ``kl_coef < 0``.
    """

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"FixedKLController: kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current: float, n_steps: int) -> float:
        """No-op; returns the (unchanged) coefficient."""
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 1909.08593 §2.2).

    Update (author code ``lm_human_preferences/train_policy.py::AdaptiveKLController``,
    identical in OpenRLHF and TRL ≤ 0.13)::

        e     = clip(current / target - 1, -0.2, 0.2)
        value = value · (1 + e · n_steps / horizon)

    Args:
        init_kl_coef: initial β (> 0; the author code uses 0.15–0.2).
        target: target KL in nats (> 0). Unit: the author code feeds the batch mean of the
            **sequence-summed** k1 KL (``mean_i Σ_t (logπθ - logπref)``), so ``target=6``
            means 6 nats per response, not per token. (OpenRLHF feeds a per-token mean,
            which its own code marks as incompatible.)
        horizon: number of samples (episodes) over which the error is integrated (> 0;
            author default 10000).

    Raises:
        ValueError: if a parameter is not positive.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if init_kl_coef <= 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                "AdaptiveKLController: init_kl_coef, target and horizon must be > 0, got "
                f"{init_kl_coef}, {target}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current: float, n_steps: int) -> float:
        """Update β from the measured KL.

        Args:
            current: measured KL of the last rollout batch (same unit as ``target``).
            n_steps: number of samples (sequences) in that batch, summed over DP ranks.

        Returns:
            The new coefficient (also stored in ``self.value``).
        """
        proportional_error = min(max(float(current) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])
