"""Log-probabilities (and entropies) of chosen tokens from the LM head, with the log-softmax done
by one C pass per row of logits (`turborlhf/engine/headsoftmax.c`).

The plain way (``head(h).float() / T``, ``logsumexp``, ``gather``, autograd) keeps every chunk's
fp32 logits for the backward and runs six to eight element-wise passes over ``N×V`` fp32 values
between the two matmuls (200 MB per 1024 positions of a 49k vocabulary), which cost more than
the matmuls on a CPU. `head_logprobs` keeps the logits in the matmul's dtype (bf16 under
autocast: half the memory), finds each row's log-sum-exp, chosen log-prob and entropy in one C
pass, and in the backward writes the logit gradient ``g·(onehot − p)/T`` in one more.

Measured on a 2-core AMX Xeon (SmolLM2's 49152×576 head, T = 0.7, with the entropy metric,
best of 4), forward / backward against the plain path: 512 positions under bf16 autocast 109 / 126
→ 37 / 97 ms; 512 in fp32 181 / 226 → 115 / 196 ms; 2048 under bf16 autocast 410 / 431 → 100 / 354
ms. The C passes themselves take 8 (forward) and 18 ms (backward) for 512 bf16 rows; the rest is
the three matmuls.

Numerics follow the plain path: logits are the head's matmul in the compute dtype (autocast's,
else the weight's), widened to fp32 and divided by the temperature; softmax sums in fp32.
Exponents are clamped at −80 and probabilities below 1e-30 are 0 (changes below 1e-25 in any
log-sum-exp over a vocabulary under 10⁵ tokens; denormal floats would slow the matmuls that
follow). A row holding a NaN/inf logit gets NaN outputs. The entropy is ``log s − Σ p·y`` with
y the scaled logits minus their maximum and s = Σ exp y: both terms are non-negative, so nothing
cancels (the reason TRL and OpenRLHF use ``−Σ p·log p`` is unshifted logits).

Above `MAX_KEPT_LOGITS_BYTES` of logits the backward recomputes each chunk's instead of keeping
them all (docs/memory.md): one more head matmul per chunk, 376 → 491 ms for the 512 fp32
positions above.

Where the C library is unavailable (no compiler, `TURBORLHF_KERNELS=0`, not x86-64 Linux) or the
tensors are not on the CPU, the same maths runs as torch ops on the kept logits.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from turborlhf.algo.logprobs import entropy_from_logits

__all__ = ["head_logprobs", "fusable_head", "keeps_logits", "load_kernels", "MAX_KEPT_LOGITS_BYTES"]

_SRC = Path(__file__).resolve().parent.parent / "engine" / "headsoftmax.c"
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}

MAX_KEPT_LOGITS_BYTES = 1 << 30
"""The most logit bytes `head_logprobs` keeps for the backward. Larger (long rows, large
vocabularies: 8192 positions of a 152k vocabulary are 2.5 GB in bf16) the backward recomputes each
chunk's logits instead, one more head matmul (about a third more of the head's cost), as Liger's
fused linear cross-entropy does; the kept memory is then the hidden states (``N×H``)."""


def _type_kernels(lib: ctypes.CDLL) -> None:
    P, I64, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for which in ("fwd", "bwd"):        # (logits, n, V, labels, T, 3 float pointers)
        for suffix in _SUFFIX.values():
            fn = getattr(lib, f"head_logsoftmax_{which}_{suffix}")
            fn.argtypes, fn.restype = [P, I64, I64, P, F, P, P, P], None


def load_kernels(warn: bool = True) -> Optional[ctypes.CDLL]:
    """headsoftmax.c built on first use (`turborlhf.engine.cbuild`), its functions typed; None where
    kernels are unavailable."""
    from turborlhf.engine.cbuild import load_library

    return load_library(_SRC, "LM-head log-softmax: C kernel", warn, prepare=_type_kernels)


def fusable_head(head: torch.nn.Module) -> bool:
    """Whether `head` is a plain bias-free ``nn.Linear`` without hooks, so `head_logprobs`
    computes exactly what calling it would. PEFT-wrapped heads and heads with a bias or hooks take
    the plain path."""
    return (type(head) is torch.nn.Linear and head.bias is None and not head._forward_hooks
            and not head._forward_pre_hooks)


def _kernel(z: torch.Tensor, which: str):
    if z.device.type != "cpu" or z.dtype not in _SUFFIX or not z.is_contiguous():
        return None
    lib = load_kernels(warn=False)
    return None if lib is None else getattr(lib, f"head_logsoftmax_{which}_{_SUFFIX[z.dtype]}")


def _forward(z_NV: torch.Tensor, labels_N: torch.Tensor, T: float, with_entropy: bool):
    """(lse, logp, entropy or None), fp32, of the scaled logits z/T."""
    N, V = z_NV.shape
    lse, logp = (torch.empty(N, dtype=torch.float32, device=z_NV.device) for _ in range(2))
    ent = torch.empty(N, dtype=torch.float32, device=z_NV.device) if with_entropy else None
    fn = _kernel(z_NV, "fwd")
    if fn is not None and N:
        fn(z_NV.data_ptr(), N, V, labels_N.data_ptr(), T, lse.data_ptr(), logp.data_ptr(),
           ent.data_ptr() if ent is not None else None)
        return lse, logp, ent
    y = z_NV.float() / T
    lse = torch.logsumexp(y, -1)
    logp = y.gather(-1, labels_N[:, None]).squeeze(-1) - lse
    if with_entropy:
        ent = entropy_from_logits(y)
    return lse, logp, ent


def _forward_rows(z_NV: torch.Tensor, labels_N: torch.Tensor, T: float, with_entropy: bool, rows: int):
    """`_forward` over kept logits: in one call where the C kernel takes them (no fp32 copy),
    else `rows` rows at a time, so torch's path (a GPU) never holds an fp32 N×V either."""
    N = z_NV.shape[0]
    if _kernel(z_NV, "fwd") is not None or N <= rows:
        return _forward(z_NV, labels_N, T, with_entropy)
    parts = [_forward(z_NV[i:i + rows], labels_N[i:i + rows], T, with_entropy) for i in range(0, N, rows)]
    lse, logp = (torch.cat([p[k] for p in parts]) for k in (0, 1))
    return lse, logp, torch.cat([p[2] for p in parts]) if with_entropy else None


def _backward(z_NV: torch.Tensor, labels_N: torch.Tensor, T: float, lse_N: torch.Tensor, g_N: torch.Tensor):
    """d(Σ g·logp)/dz in z's dtype."""
    N, V = z_NV.shape
    g_N = g_N.float().contiguous()
    fn = _kernel(z_NV, "bwd")
    if fn is not None and N:
        dz = torch.empty_like(z_NV)
        fn(z_NV.data_ptr(), N, V, labels_N.data_ptr(), T, lse_N.data_ptr(), g_N.data_ptr(), dz.data_ptr())
        return dz
    p = torch.exp(z_NV.float() / T - lse_N[:, None])
    dz = p.mul_(-g_N[:, None]).scatter_add_(-1, labels_N[:, None], g_N[:, None]).div_(T)
    return dz.to(z_NV.dtype)


class _HeadLogprobs(torch.autograd.Function):
    """(log p(label), entropy or None) per row of ``h_NH`` under ``softmax(h·Wᵀ / T)``, h in the
    compute dtype `cdt`, the head weight cast to it here; the entropy carries no gradient. With
    `keep`, every row's logits are kept for the backward, which goes `rows` rows at a time; without,
    the forward goes `rows` rows at a time too and the backward recomputes each chunk's logits with
    the same matmul (the same bits). The weight's gradient is summed over the chunks in fp32 and
    returned in the weight's own dtype: summed in bf16, each chunk added a rounding (8 chunks of
    bf16 doubled the error of one bf16 matmul, 64 chunks nearly quintupled it)."""

    @staticmethod
    def forward(ctx, h_NH, W_master, labels_N, temperature: float,  # type: ignore[override]
                with_entropy: bool, rows: int, keep: bool, cdt: torch.dtype):
        W_VH = W_master.to(cdt)
        if keep:
            z_NV = torch.mm(h_NH, W_VH.t())                              # N×V, compute dtype
            lse, logp, ent = _forward_rows(z_NV, labels_N, temperature, with_entropy, rows)
        else:
            z_NV = None
            logp, ent, lse = _no_grad(h_NH, W_VH, labels_N, temperature, with_entropy, rows, with_lse=True)
        # the hidden states for the head's own gradient (a frozen head, as under LoRA, needs none
        # unless the logits are recomputed)
        h_kept = h_NH if ctx.needs_input_grad[1] or not keep else None
        ctx.save_for_backward(h_kept, W_VH, labels_N, z_NV, lse)
        ctx.temperature, ctx.rows, ctx.master_dtype = temperature, rows, W_master.dtype
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp_N, g_ent_N):  # type: ignore[override]
        h_NH, W_VH, labels_N, z_NV, lse = ctx.saved_tensors
        N, rows = labels_N.shape[0], ctx.rows
        dh = torch.empty(N, W_VH.shape[1], dtype=W_VH.dtype, device=W_VH.device) if ctx.needs_input_grad[0] else None
        dW = torch.zeros(W_VH.shape, dtype=torch.float32, device=W_VH.device) if ctx.needs_input_grad[1] else None
        for s in range(0, N, rows):
            z = z_NV[s:s + rows] if z_NV is not None else torch.mm(h_NH[s:s + rows], W_VH.t())
            dz = _backward(z, labels_N[s:s + rows], ctx.temperature, lse[s:s + rows], g_logp_N[s:s + rows])
            del z
            if dh is not None:
                torch.mm(dz, W_VH, out=dh[s:s + rows])
            if dW is not None:
                dW.add_(torch.mm(dz.t(), h_NH[s:s + rows]))
        return dh, (dW.to(ctx.master_dtype) if dW is not None else None), None, None, None, None, None, None


def _no_grad(h_NH, W_VH, labels_N, temperature: float, with_entropy: bool, rows: int, with_lse: bool = False):
    """`_HeadLogprobs.forward` without keeping logits: `rows` rows at a time. Returns
    ``(logp, entropy or None)``, and the log-sum-exp third with `with_lse`."""
    out = [_forward(torch.mm(h_NH[s:s + rows], W_VH.t()), labels_N[s:s + rows], temperature, with_entropy)
           for s in range(0, h_NH.shape[0], rows)] or [_forward(h_NH.new_empty(0, W_VH.shape[0]), labels_N,
                                                                temperature, with_entropy)]
    logp = torch.cat([o[1] for o in out])
    ent = torch.cat([o[2] for o in out]) if with_entropy else None
    return (logp, ent, torch.cat([o[0] for o in out])) if with_lse else (logp, ent)


def keeps_logits(positions: int, vocab: int, itemsize: int) -> bool:
    """Whether `head_logprobs` keeps the ``positions×vocab`` logits (`itemsize` bytes each) for the
    backward: up to `MAX_KEPT_LOGITS_BYTES`; above, the backward recomputes them chunk by chunk."""
    return positions * vocab * itemsize <= MAX_KEPT_LOGITS_BYTES


def _check_labels(labels_N: torch.Tensor, V: int) -> None:
    """ValueError where a label is outside ``[0, V)``, checked on the host for CPU labels (the C
    kernel indexes the logits with them unchecked). On CUDA the check is queued on the device
    (``torch._assert_async``: a bad label fails the device's next synchronisation, as torch's own
    gather and scatter would) instead of waiting for the device's queue on every call; other
    devices are checked on the host."""
    if not labels_N.numel():
        return
    if labels_N.device.type == "cuda":
        torch._assert_async(((labels_N >= 0) & (labels_N < V)).all(), f"head_logprobs: token ids must be in [0, {V})")
        return
    lo, hi = torch.stack(labels_N.aminmax()).tolist()
    if not 0 <= lo <= hi < V:
        raise ValueError(f"head_logprobs: token ids must be in [0, {V}), got {lo}..{hi}")


def head_logprobs(h_NH: torch.Tensor, head: torch.nn.Linear, labels_N: torch.Tensor, temperature: float = 1.0,
                  with_entropy: bool = False, rows: int = 1024,
                  keep_logits: Optional[bool] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-position log-probability of ``labels_N`` (and the entropy, without gradient) under
    ``softmax(head(h_NH) / temperature)``, differentiable in `h_NH` and the head's weight.

    Args:
        h_NH: final hidden states ``N×H`` (any float dtype; the matmuls run in autocast's dtype
            when autocast is on for their device, else in the head weight's dtype).
        head: a bias-free ``nn.Linear`` ``H → V`` (`fusable_head`).
        labels_N: int64 token ids ``N``, each in ``[0, V)``.
        temperature: the logits are divided by it (> 0).
        with_entropy: also return the entropy per position (a metric: no gradient flows from it).
        rows: positions per chunk where chunks are used: the whole forward without grad or
            without kept logits, the backward's logit gradients (``rows·V`` values in the compute
            dtype at a time, twice that when the logits are recomputed).
        keep_logits: keep the ``N×V`` logits for the backward (True) or recompute them there chunk
            by chunk (False); None: keep them up to `MAX_KEPT_LOGITS_BYTES` (`keeps_logits`).

    Returns:
        ``(logp_N, entropy_N or None)``, fp32. Memory kept for the backward: the ``N×V`` logits in
        the compute dtype when they are kept, the head weight's cast and the hidden states in the
        compute dtype (when the head trains or the logits are recomputed).

    Raises:
        ValueError: a label outside ``[0, V)`` (the C passes index the logits with it).
    """
    V = head.weight.shape[0]
    _check_labels(labels_N, V)
    dev = h_NH.device.type
    cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else head.weight.dtype
    args = (labels_N.long().contiguous(), float(temperature), bool(with_entropy), int(rows))
    with torch.autocast(dev, enabled=False):
        if not (torch.is_grad_enabled() and (h_NH.requires_grad or head.weight.requires_grad)):
            return _no_grad(h_NH.to(cdt), head.weight.to(cdt), *args)
        if keep_logits is None:
            keep_logits = keeps_logits(h_NH.shape[0], V, cdt.itemsize)
        # the weight's cast inside the Function, which sums its gradient in fp32
        return _HeadLogprobs.apply(h_NH.to(cdt), head.weight, *args, bool(keep_logits), cdt)
