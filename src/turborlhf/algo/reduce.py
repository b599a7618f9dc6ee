"""The one loss reduction used by every trainer.

Losses in :mod:`turborlhf.algo.losses` return per-token (``_BT``) or per-sequence (``_B``)
tensors; this module turns them into the scalar that is back-propagated. Reducing over
micro-batches (gradient accumulation) and data-parallel ranks is where peers most often go
wrong, so the denominators are explicit arguments:

* pass the **global** count (whole optimizer step: all micro-batches × all ranks) as
  ``num_tokens`` / ``num_seqs``, and
* **sum** the per-micro-batch results (and all-reduce-*sum* gradients across ranks, i.e.
  multiply by the DP world size if the DP wrapper averages),

and the gradient equals the whole-batch gradient exactly. Without the global counts the local
micro-batch counts are used (TRL PPO / "bnpo"-style local means).

Modes (``B`` sequences, ``T`` response tokens, ``M`` 0/1 mask, ``n_i = Σ_t M_it``):

================== =========================================================== ====================
mode               value                                                       peers
================== =========================================================== ====================
token_mean         ``Σ_it loss·M / N``, ``N = num_tokens or Σ M``               OpenRLHF default,
                                                                               TRL ``dapo``/``bnpo``
seq_mean_token_mean ``Σ_i 1(n_i>0)·(Σ_t loss·M)/n_i / S``,                        OpenRLHF seq level,
                   ``S = num_seqs or #{i: n_i>0}``                               TRL ``grpo``
token_sum_norm     ``Σ_it loss·M / (S·L)``, ``S = num_seqs or B``,               Dr. GRPO 2503.20783,
                   ``L = max_len or T``                                          TRL ``dr_grpo``
================== =========================================================== ====================

Source: OpenRLHF ``openrlhf/models/loss.py::aggregate_loss`` and its
``tests/test_loss_aggregation.py``; TRL ``grpo_trainer.py::_compute_loss``; docs/reference/formulas.md §4, §8.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["REDUCTION_MODES", "reduce_loss", "reduce_seq_loss"]

Count = int | float | torch.Tensor | None


def _check_counts(name: str, **counts: Count) -> None:
    """A negative count given as a number: the clamp to >= 1 would hide it (tensors are not read: no device sync)."""
    for arg, value in counts.items():
        if isinstance(value, (int, float)) and value < 0:
            raise ValueError(f"{name}: {arg} must be >= 0, got {value}")


def _as_den(value: Count, default: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    den = default if value is None else torch.as_tensor(value, device=like.device)
    return den.to(like.dtype).clamp(min=1)


def _token_mean(loss_BT, mask_b, num_tokens, num_seqs, max_len):
    total = torch.where(mask_b, loss_BT, torch.zeros((), dtype=loss_BT.dtype, device=loss_BT.device)).sum()
    return total / _as_den(num_tokens, mask_b.sum(), loss_BT)


def _seq_mean_token_mean(loss_BT, mask_b, num_tokens, num_seqs, max_len):
    zero = torch.zeros((), dtype=loss_BT.dtype, device=loss_BT.device)
    n_B = mask_b.sum(dim=1)
    seq_B = torch.where(mask_b, loss_BT, zero).sum(dim=1) / n_B.clamp(min=1).to(loss_BT.dtype)
    seq_B = torch.where(n_B > 0, seq_B, zero)  # fully masked sequences contribute nothing
    return seq_B.sum() / _as_den(num_seqs, (n_B > 0).sum(), loss_BT)


def _token_sum_norm(loss_BT, mask_b, num_tokens, num_seqs, max_len):
    total = torch.where(mask_b, loss_BT, torch.zeros((), dtype=loss_BT.dtype, device=loss_BT.device)).sum()
    seqs = _as_den(num_seqs, torch.tensor(loss_BT.shape[0]), loss_BT)
    length = _as_den(max_len, torch.tensor(loss_BT.shape[1]), loss_BT)
    return total / (seqs * length)


REDUCTION_MODES: dict[str, Callable[..., torch.Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "token_sum_norm": _token_sum_norm,
}


def reduce_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str = "token_mean",
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to the scalar to back-propagate.

    Args:
        loss_BT: per-token loss, shape (B, T). Values at masked positions are ignored (may be
            garbage).
        mask_BT: 0/1 (bool or numeric) valid-token mask, shape (B, T).
        mode: ``"token_mean"`` (default), ``"seq_mean_token_mean"`` or ``"token_sum_norm"``;
            see the module docstring for the formulas and which peer uses which.
        num_tokens: ``token_mean`` only: the GLOBAL number of valid tokens of the optimizer
            step (all micro-batches, all DP ranks). Default: ``Σ mask_BT`` (local).
        num_seqs: ``seq_mean_token_mean``: GLOBAL number of non-empty sequences (default: local
            non-empty count; fully masked sequences are excluded as in OpenRLHF).
            ``token_sum_norm``: GLOBAL number of sequences (default: ``B``).
        max_len: ``token_sum_norm`` only: the constant length normaliser ``L`` (Dr. GRPO uses
            the max generation length); default ``T``. Use a constant when micro-batching,
            since ``T`` varies between padded micro-batches.

    Returns:
        0-d tensor (differentiable). Denominators are clamped to ≥ 1, so an all-masked input
        gives exactly 0 (with a zero gradient), never ``nan``.

    Raises:
        ValueError: unknown ``mode``, ``loss_BT``/``mask_BT`` not 2-D of the same shape, or a
            negative ``num_tokens``/``num_seqs``/``max_len`` given as a number.

    Invariant (tested): with global ``num_tokens``/``num_seqs``/``max_len``, the sum of the
    values over any split of the batch into micro-batches equals the whole-batch value.
    """
    if mode not in REDUCTION_MODES:
        raise ValueError(f"reduce_loss: unknown mode {mode!r}; expected one of {sorted(REDUCTION_MODES)}")
    if loss_BT.dim() != 2 or mask_BT.shape != loss_BT.shape:
        raise ValueError(
            f"reduce_loss: expected 2-D loss_BT and mask_BT of equal shape, got {tuple(loss_BT.shape)} "
            f"and {tuple(mask_BT.shape)}"
        )
    _check_counts("reduce_loss", num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
    return REDUCTION_MODES[mode](loss_BT, mask_BT.bool(), num_tokens, num_seqs, max_len)


def reduce_seq_loss(loss_B: torch.Tensor, num_seqs: Count = None) -> torch.Tensor:
    """Reduce a per-sequence loss (DPO, KTO, reward model, sequence-level ratios) to a scalar.

    Args:
        loss_B: per-sequence (or per-pair / per-example) loss, shape (B,).
        num_seqs: GLOBAL number of sequences of the optimizer step (all micro-batches and DP
            ranks); default ``B`` (local mean). Summing the results over micro-batches with
            the global count gives the whole-batch mean.

    Returns:
        ``Σ_i loss_i / num_seqs`` as a 0-d tensor; 0 for an empty ``loss_B``.

    Raises:
        ValueError: if ``loss_B`` is not 1-D, or ``num_seqs`` is a negative number.
    """
    if loss_B.dim() != 1:
        raise ValueError(f"reduce_seq_loss: expected a 1-D loss_B, got shape {tuple(loss_B.shape)}")
    _check_counts("reduce_seq_loss", num_seqs=num_seqs)
    return loss_B.sum() / _as_den(num_seqs, torch.tensor(loss_B.shape[0]), loss_B)
