"""Memory-bounded token log-probs and entropies from logits.

Both functions process the logits in chunks of rows, up-casting one chunk at a time to
float32 (float64 stays float64), so the full fp32 ``B×T×V`` tensor is never materialised —
neither in the forward pass nor for autograd: each is a custom ``autograd.Function`` that
saves only the original (e.g. bf16) logits plus one float per row, and recomputes the softmax
chunk by chunk in the backward pass. Gradients are returned in the logits' dtype.

Source: TRL ``trl/trainer/utils.py::selective_log_softmax`` / ``entropy_from_logits`` (row
loops for half precision, chunked entropy); OpenRLHF ``openrlhf/models/utils.py::
compute_entropy`` (``logsumexp - Σ softmax·logits``).
"""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["logprobs_from_logits", "entropy_from_logits"]

_DEFAULT_CHUNK_ELEMENTS = 1 << 24  # 64 MiB of fp32 per chunk


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """View (..., T, V) as (A, T, V) without copying when possible (1-D rows → (1, N, V))."""
    if x.dim() == 2:
        return x.unsqueeze(0)
    return x.reshape(-1, *x.shape[-2:])


def _blocks(A: int, T: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """Cover an (A, T) grid with blocks of about ``rows`` rows each."""
    if rows >= T:
        step = max(1, rows // max(T, 1))
        for a in range(0, A, step):
            yield slice(a, min(a + step, A)), slice(0, T)
    else:
        for a in range(A):
            for t in range(0, T, rows):
                yield slice(a, a + 1), slice(t, min(t + rows, T))


def _rows_per_chunk(chunk_size: int | None, V: int) -> int:
    if chunk_size is None:
        return max(1, _DEFAULT_CHUNK_ELEMENTS // max(V, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk_size


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_ATV, labels_AT, rows):  # type: ignore[override]
        A, T, _ = logits_ATV.shape
        cdtype = _compute_dtype(logits_ATV.dtype)
        ignore_AT = labels_AT < 0
        safe_AT = labels_AT.clamp(min=0)
        lse_AT = torch.empty((A, T), dtype=cdtype, device=logits_ATV.device)
        out_AT = torch.empty((A, T), dtype=cdtype, device=logits_ATV.device)
        for sa, st in _blocks(A, T, rows):
            chunk = logits_ATV[sa, st].to(cdtype)
            lse = torch.logsumexp(chunk, dim=-1)
            lse_AT[sa, st] = lse
            out_AT[sa, st] = chunk.gather(-1, safe_AT[sa, st].unsqueeze(-1)).squeeze(-1) - lse
        out_AT = out_AT.masked_fill(ignore_AT, 0.0)
        ctx.save_for_backward(logits_ATV, safe_AT, ignore_AT, lse_AT)
        ctx.rows = rows
        return out_AT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_AT):  # type: ignore[override]
        logits_ATV, safe_AT, ignore_AT, lse_AT = ctx.saved_tensors
        A, T, _ = logits_ATV.shape
        cdtype = lse_AT.dtype
        grad_AT = grad_AT.to(cdtype).masked_fill(ignore_AT, 0.0)
        grad_logits = torch.empty_like(logits_ATV)
        for sa, st in _blocks(A, T, ctx.rows):
            g = grad_AT[sa, st].unsqueeze(-1)
            probs = torch.exp(logits_ATV[sa, st].to(cdtype) - lse_AT[sa, st].unsqueeze(-1))
            chunk_grad = -probs * g
            chunk_grad.scatter_add_(-1, safe_AT[sa, st].unsqueeze(-1), g)
            grad_logits[sa, st] = chunk_grad.to(logits_ATV.dtype)
        return grad_logits, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_ATV, rows):  # type: ignore[override]
        A, T, _ = logits_ATV.shape
        cdtype = _compute_dtype(logits_ATV.dtype)
        lse_AT = torch.empty((A, T), dtype=cdtype, device=logits_ATV.device)
        ent_AT = torch.empty((A, T), dtype=cdtype, device=logits_ATV.device)
        for sa, st in _blocks(A, T, rows):
            chunk = logits_ATV[sa, st].to(cdtype)
            lse = torch.logsumexp(chunk, dim=-1)
            logp = chunk - lse.unsqueeze(-1)
            lse_AT[sa, st] = lse
            # -Σ p·log p, not lse - Σ p·z: the latter subtracts two large numbers and loses ~1e-4
            # in fp32 at logit scale ~10 (TRL and OpenRLHF keep ~1e-6 with this form)
            ent_AT[sa, st] = -(torch.exp(logp) * logp).sum(dim=-1)
        ctx.save_for_backward(logits_ATV, lse_AT, ent_AT)
        ctx.rows = rows
        return ent_AT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_AT):  # type: ignore[override]
        # dH/dz_j = -p_j (log p_j + H) = -p_j (z_j - lse + H)
        logits_ATV, lse_AT, ent_AT = ctx.saved_tensors
        A, T, _ = logits_ATV.shape
        cdtype = lse_AT.dtype
        grad_AT = grad_AT.to(cdtype)
        grad_logits = torch.empty_like(logits_ATV)
        for sa, st in _blocks(A, T, ctx.rows):
            chunk = logits_ATV[sa, st].to(cdtype)
            lse = lse_AT[sa, st].unsqueeze(-1)
            probs = torch.exp(chunk - lse)
            chunk_grad = -probs * (chunk - lse + ent_AT[sa, st].unsqueeze(-1)) * grad_AT[sa, st].unsqueeze(-1)
            grad_logits[sa, st] = chunk_grad.to(logits_ATV.dtype)
        return grad_logits, None


def logprobs_from_logits(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probability of each label token: ``logits[label] - logsumexp(logits)`` ("selective log-softmax").

    Args:
        logits_BTV: shape (B, T, V) (or (N, V), or any (..., V)); any float dtype, typically
            bf16. Already aligned with the labels (i.e. ``logits[:, :-1]`` for next-token
            prediction). Non-contiguous slices are fine and are not copied when 3-D.
        labels_BT: int64 token ids, shape ``logits.shape[:-1]``. Negative labels (e.g. the
            ``-100`` ignore index) give log-prob 0 and no gradient.
        chunk_size: rows (token positions) up-cast to fp32 at a time. ``None`` picks
            ``2**24 // V`` rows (≈64 MiB of fp32 per chunk).

    Returns:
        logp_BT in natural-log units, per token (not summed), float32 (float64 for float64
        logits). Differentiable w.r.t. the logits; gradient memory equals the logits'.

    Raises:
        ValueError: if ``labels_BT.shape != logits_BTV.shape[:-1]`` or ``chunk_size < 1``.
    """
    if labels_BT.shape != logits_BTV.shape[:-1] or logits_BTV.dim() < 2:
        raise ValueError(
            f"logprobs_from_logits: labels shape {tuple(labels_BT.shape)} must equal logits shape "
            f"{tuple(logits_BTV.shape)} without the vocabulary dim"
        )
    rows = _rows_per_chunk(chunk_size, logits_BTV.shape[-1])
    logits_ATV = _as_3d(logits_BTV)
    labels_AT = labels_BT.reshape(logits_ATV.shape[:2]).long()
    out_AT = _SelectiveLogSoftmax.apply(logits_ATV, labels_AT, rows)
    return out_AT.reshape(labels_BT.shape)


def entropy_from_logits(logits_BTV: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of the softmax distribution at every position: ``-Σ p·log p`` with ``log p = z - logsumexp(z)``.

    Args:
        logits_BTV: shape (..., V), any float dtype (bf16 is computed in fp32 per chunk).
        chunk_size: rows per fp32 chunk; ``None`` picks ``2**24 // V``.

    Returns:
        entropy with shape ``logits.shape[:-1]`` in nats, float32 (float64 for float64
        input). Differentiable (for an entropy bonus) without storing fp32 probabilities.

    Raises:
        ValueError: if ``chunk_size < 1`` or the logits have no vocabulary dim.
    """
    if logits_BTV.dim() < 1 or logits_BTV.shape[-1] == 0:
        raise ValueError(f"entropy_from_logits: bad logits shape {tuple(logits_BTV.shape)}")
    rows = _rows_per_chunk(chunk_size, logits_BTV.shape[-1])
    lead = logits_BTV.shape[:-1]
    logits_ATV = _as_3d(logits_BTV if logits_BTV.dim() >= 2 else logits_BTV.unsqueeze(0))
    return _Entropy.apply(logits_ATV, rows).reshape(lead)
