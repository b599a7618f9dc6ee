"""Masked statistics over padded tensors: sum, mean, variance, whitening.

Notation: ``x`` is any tensor, ``mask`` a 0/1 tensor (bool or numeric) broadcastable to ``x``;
1 marks a valid position (e.g. a response token), 0 a padded one. Values at masked positions
are never read arithmetically (``torch.where`` is used, not ``x * mask``), so padding may hold
garbage, including ``inf``/``nan``, without changing any result.

Sources: TRL ``trl/experimental/ppo/ppo_trainer.py::masked_mean/masked_var/masked_whiten``;
OpenRLHF ``experience_maker.py::compute_advantages_and_returns`` (global whitening,
biased variance); Ziegler et al. 2019 author code ``lm_human_preferences/utils/core.py::whiten``
(biased ``tf.nn.moments``). See ``docs/reference/formulas.md`` §5.
"""

from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]


def _valid(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (x with masked positions set to 0, mask as bool broadcast to x's shape)."""
    mask_b = mask.bool()
    if mask_b.shape != x.shape:
        mask_b = mask_b.expand_as(x)
    return torch.where(mask_b, x, torch.zeros((), dtype=x.dtype, device=x.device)), mask_b


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over valid positions.

    Args:
        x: any shape, e.g. ``loss_BT``.
        mask: 0/1 (bool or numeric), broadcastable to ``x``.
        dim: reduce over this dim (result keeps the other dims); ``None`` reduces everything
            to a 0-d tensor.

    Returns:
        ``Σ x·M`` (0-d tensor for ``dim=None``). Masked positions contribute exactly 0 even if
        they hold ``nan``/``inf``.

    Raises:
        RuntimeError: (from torch) if ``mask`` does not broadcast to ``x``.
    """
    xv, _ = _valid(x, mask)
    return xv.sum() if dim is None else xv.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid positions: ``Σ x·M / Σ M``.

    Args:
        x: any shape, e.g. ``adv_BT``.
        mask: 0/1 (bool or numeric), broadcastable to ``x``.
        dim: reduce over this dim only (e.g. ``dim=1`` gives a per-sequence mean ``_B``);
            ``None`` reduces everything to a 0-d tensor.

    Returns:
        The masked mean. Convention for empty masks: where ``Σ M == 0`` (over the whole tensor
        for ``dim=None``, or for one slice when ``dim`` is given) the result is ``0.0`` rather
        than ``nan`` and no error is raised; a fully padded micro-batch therefore contributes a
        zero (with a valid, zero gradient).

    Source: TRL ``masked_mean`` (which divides by ``ΣM`` unguarded); OpenRLHF ``masked_mean``
    (adds ``1e-8`` to the count). Both equal this for non-empty masks.

    Raises:
        RuntimeError: (from torch) if ``mask`` does not broadcast to ``x``.
    """
    xv, mask_b = _valid(x, mask)
    if dim is None:
        count = mask_b.sum()
        return xv.sum() / count.clamp(min=1).to(xv.dtype)
    count = mask_b.sum(dim=dim)
    return xv.sum(dim=dim) / count.clamp(min=1).to(xv.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """Variance of ``x`` over all valid positions (a 0-d tensor).

    ``var = Σ (x - μ)²·M / N`` with ``μ = masked_mean(x, mask)`` and ``N = Σ M``; with
    ``unbiased=True`` it is multiplied by Bessel's ``N / (N - 1)``.

    Args:
        x: any shape, e.g. ``adv_BT``.
        mask: 0/1, broadcastable to ``x``.
        unbiased: ``False`` (default) = biased/population variance as in OpenRLHF and the
            Ziegler et al. author code; ``True`` = Bessel-corrected as in TRL ``masked_var``
            and ``torch.var``.

    Raises:
        ValueError: if ``Σ M == 0``, or if ``unbiased`` and ``Σ M == 1`` (as TRL does).
    """
    xv, mask_b = _valid(x, mask)
    n = int(mask_b.sum().item())
    if n == 0:
        raise ValueError("masked_var: the mask selects no element")
    if unbiased and n == 1:
        raise ValueError("masked_var: unbiased variance of a single element is undefined")
    mean = xv.sum() / n
    centered = torch.where(mask_b, xv - mean, torch.zeros((), dtype=xv.dtype, device=xv.device))
    var = (centered**2).sum() / n
    if unbiased:
        var = var * (n / (n - 1))
    return var


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    unbiased: bool = False,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``x`` with statistics taken over the valid positions only.

    ``y = (x - μ) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back
    (``y = (x - μ) / sqrt(var + eps) + μ``, scale-only, used for whitening rewards). Masked
    positions of the result are set to 0 (OpenRLHF leaves ``-μ/σ`` there; TRL zero-fills).

    Args:
        x: any shape, e.g. ``adv_BT`` (B sequences × T response tokens). Statistics are taken
            over *all* valid tokens together (token-weighted: longer sequences weigh more),
            which is the OpenRLHF rollout-batch convention when called on the whole rollout.
        mask: 0/1, broadcastable to ``x``.
        shift_mean: keep the result centred (``True``) or add the mean back (``False``).
        unbiased: default ``False`` = biased variance (OpenRLHF, Ziegler et al. author code);
            ``True`` = Bessel-corrected (TRL ``masked_whiten``, cleanrl's ``Tensor.std``).
        eps: added to the variance inside the square root (TRL/Ziegler: ``rsqrt(var+1e-8)``;
            OpenRLHF uses ``rsqrt(max(var, 1e-8))`` — identical unless ``var ≲ 1e-8``).

    Returns:
        Tensor with the shape of ``x``; 0 at masked positions.

    Raises:
        ValueError: from :func:`masked_var` (empty mask; single element with ``unbiased``).
    """
    xv, mask_b = _valid(x, mask)
    mean = masked_mean(xv, mask_b)
    var = masked_var(xv, mask_b, unbiased=unbiased)
    y = (xv - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return torch.where(mask_b, y, torch.zeros((), dtype=y.dtype, device=y.device))
