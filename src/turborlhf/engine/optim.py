"""AdamW with bf16 moments (``optim.state_dtype: bf16``): 4 bytes of optimizer state per
trainable parameter instead of 8.

The weights stay fp32 (master weights) and the update is computed in fp32; only exp_avg and
exp_avg_sq are stored in bf16, with stochastic rounding. This is the choice Megatron-Core's
precision-aware optimizer offers (``exp_avg_dtype`` / ``exp_avg_sq_dtype`` = bf16), and what
torchao's low-precision optimizers do for bf16 tensors (stochastic rounding). Why stochastic:
at beta2 = 0.999 a step moves exp_avg_sq by 0.1%, below bf16's resolution (2⁻⁸ ≈ 0.4%), so
round-to-nearest would freeze it; stochastic rounding makes every store unbiased.

On the CPU the step is one pass of a C kernel (`adamw.c`, OpenMP, built once per machine by
`turborlhf.engine.cbuild`); elsewhere, or without a C compiler, the same maths runs as torch ops
(`_step_torch`, also the tests' reference). The rounding bits are a counter-based hash of
(step, parameter index, element index), so a step is deterministic: a resumed run repeats the
uninterrupted one.

State dict: AdamW's layout (``step``, ``exp_avg``, ``exp_avg_sq``), the moments in bf16. Loading
an fp32 AdamW state converts it (rounded to nearest), and torch's AdamW loads ours (widened), so
a run can resume with the option flipped.
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Optional

import torch

__all__ = ["BF16StateAdamW", "load_kernel", "sum_of_squares", "count_nonfinite"]

_SRC = Path(__file__).with_name("adamw.c")


def _type_adamw(lib: ctypes.CDLL) -> None:
    P, F, I64 = ctypes.c_void_p, ctypes.c_float, ctypes.c_int64
    lib.adamw_bf16_step.argtypes = [P, P, P, P, I64, F, F, F, F, F, F, F, ctypes.c_uint32, F]
    lib.adamw_bf16_step.restype = I64
    lib.sumsq_f32.argtypes, lib.sumsq_f32.restype = [P, I64], ctypes.c_double
    lib.count_nonfinite_f32.argtypes, lib.count_nonfinite_f32.restype = [P, I64], I64


def _library(warn: bool = True) -> Optional[ctypes.CDLL]:
    """adamw.c built on first use, its functions typed; None when unavailable (no C compiler, not
    x86-64 Linux, `TURBORLHF_KERNELS=0`, or a failed build, which warns once)."""
    from turborlhf.engine.cbuild import load_library

    # IEEE maths, not -ffast-math: its sqrt approximation is NaN for denormal or infinite exp_avg_sq,
    # and isfinite() would be folded to true
    return load_library(_SRC, "BF16StateAdamW: C kernel", warn, fast_math=False, prepare=_type_adamw)


def load_kernel(warn: bool = True):
    """The C step function (`adamw_bf16_step`: returns how many updated weights are NaN/inf),
    built on first use; None when unavailable (see `_library`)."""
    lib = _library(warn)
    return None if lib is None else lib.adamw_bf16_step


def _plain_cpu_f32(tensors) -> bool:
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32
               and t.is_contiguous() for t in tensors)


def sum_of_squares(tensors) -> Optional[float]:
    """Σ x² over `tensors` in one C pass per tensor (squares in fp32, so |x| ≥ ~1.8e19 gives inf as
    in torch's fp32 norm; sums in fp64; NaN/inf propagate). None unless every tensor is a plain,
    contiguous fp32 CPU tensor and the kernel loads: the caller then uses torch's norm.
    About 2.5× torch's per-tensor norms on SmolLM2-135M's gradients (2-core Xeon)."""
    lib = _library(warn=False) if _plain_cpu_f32(tensors) else None
    return None if lib is None else sum(lib.sumsq_f32(t.data_ptr(), t.numel()) for t in tensors)


def count_nonfinite(tensors) -> Optional[int]:
    """How many values of `tensors` are NaN/inf, in one C pass per tensor; None as `sum_of_squares`."""
    lib = _library(warn=False) if _plain_cpu_f32(tensors) else None
    return None if lib is None else sum(lib.count_nonfinite_f32(t.data_ptr(), t.numel()) for t in tensors)


def _mix32(x):
    """lowbias32 (adamw.c's `mix32`) on a Python int or an int64 tensor holding uint32 values."""
    M = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M
    return x ^ (x >> 16)


def _round_bf16_stochastic(x_N: torch.Tensor, r_N: torch.Tensor) -> torch.Tensor:
    """fp32 → bf16 with stochastic rounding by the low 16 bits of `r_N` (int64); inf/NaN kept."""
    u = x_N.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    special = (u & 0x7F800000) == 0x7F800000
    out = ((u + (r_N & 0xFFFF)) & 0xFFFFFFFF) >> 16
    out = torch.where(special, (u >> 16) | ((u & 0xFFFF) != 0).to(torch.int64) * 0x40, out)
    out = torch.where(out >= 0x8000, out - 0x10000, out)       # as a signed 16-bit pattern
    return out.to(torch.int16).view(torch.bfloat16)


def _seed(step: int, index: int) -> int:
    """Per-(step, parameter) seed of the rounding bits."""
    return _mix32((step * 0x632BE5AB + index * 0x85157AF5) & 0xFFFFFFFF)


class BF16StateAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (decoupled weight decay, bias correction) with exp_avg and exp_avg_sq
    stored in bf16 by stochastic rounding; parameters and gradients fp32.

    Args:
        params: parameters or parameter groups (fp32 tensors; others raise ValueError at `step`).
        lr, betas, eps, weight_decay: as torch.optim.AdamW.
        use_kernel: None = the C kernel for CPU tensors when it builds; False = torch ops always.

    Memory: 4 bytes of state per parameter (torch AdamW: 8). Speed on the CPU: one pass reading
    20 bytes and writing 8 per parameter (torch's fused fp32 AdamW: 16 and 12). `step_scaled`
    also folds gradient clipping into that pass and counts the non-finite weights it writes, so
    `clip_and_step` needs no pass over the gradients to clip them and none over the weights to
    check them: on SmolLM2-135M (2-core AMX Xeon) norm + clip + step + check took ~280 ms, now
    ~175 (the norm by `sum_of_squares`).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, use_kernel: Optional[bool] = None) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._use_kernel = use_kernel
        self.last_nonfinite: Optional[int] = None      # `step`'s count of NaN/inf weights written (see there)

    def _state_for(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
        return st

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        """AdamW's step on the gradients times `grad_scale` (`step_scaled`); what `step_scaled`
        returns is left in ``last_nonfinite``. Through `step`, an LR scheduler sees the optimizer
        step (it warns of a scheduler step "before optimizer.step()" otherwise)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_nonfinite = self.step_scaled(grad_scale)
        return loss

    @torch.no_grad()
    def step_scaled(self, grad_scale: float) -> Optional[int]:
        """`step` on the gradients times `grad_scale` (the clipping coefficient of
        `turborlhf.engine.train.clip_and_step`; the ``.grad`` tensors are not written). Returns how
        many updated weights are NaN/inf when every updated tensor went through the C kernel
        (which counts them as it writes), else None (unchecked)."""
        kernel = None if self._use_kernel is False else load_kernel()
        if self._use_kernel and kernel is None:
            raise RuntimeError("BF16StateAdamW(use_kernel=True): the C kernel is unavailable")
        index, bad, checked = 0, 0, True
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
                    raise ValueError(f"BF16StateAdamW needs fp32 parameters and gradients, got {p.dtype} / "
                                     f"{p.grad.dtype} (optim.state_dtype=bf16 keeps fp32 master weights)")
                if p.grad.is_sparse:
                    raise ValueError("BF16StateAdamW does not support sparse gradients")
                st = self._state_for(p)
                st["step"] += 1
                step = int(st["step"].item())
                step_size = lr / (1.0 - b1 ** step)
                inv_sqrt_bc2 = 1.0 / math.sqrt(1.0 - b2 ** step)
                seed = _seed(step, index)
                # FSDP2 parameters, gradients and states are DTensors: update this rank's shards
                pl, gl, ml, vl = (_local(t) for t in (p, p.grad, st["exp_avg"], st["exp_avg_sq"]))
                gl = gl if gl.is_contiguous() else gl.contiguous()
                if not (gl.shape == ml.shape == vl.shape == pl.shape):
                    raise ValueError(f"BF16StateAdamW: parameter {tuple(pl.shape)}, gradient {tuple(gl.shape)}, "
                                     f"exp_avg {tuple(ml.shape)}, exp_avg_sq {tuple(vl.shape)}: shapes differ")
                if (kernel is not None and pl.device.type == "cpu" and pl.is_contiguous() and ml.is_contiguous()
                        and vl.is_contiguous()):
                    bad += kernel(pl.data_ptr(), gl.data_ptr(), ml.data_ptr(), vl.data_ptr(),
                                  pl.numel(), lr, b1, b2, eps, wd, step_size, inv_sqrt_bc2, seed, grad_scale)
                else:
                    _step_torch(pl, gl if grad_scale == 1.0 else gl * grad_scale, ml, vl, lr, b1, b2, eps, wd,
                                step_size, inv_sqrt_bc2, seed)
                    checked = False
        return bad if checked else None

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts floating-point states to the parameter's dtype (fp32) on load: store them
        # back in bf16 (an fp32 AdamW state is rounded to nearest once)
        super().load_state_dict(state_dict)
        for st in self.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st and st[k].dtype != torch.bfloat16:
                    st[k] = st[k].to(torch.bfloat16).contiguous()
            if "step" in st:
                st["step"] = st["step"].to(torch.float32).cpu()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place updates reach the DTensor); other tensors as is."""
    return t.to_local() if hasattr(t, "to_local") else t


# elements per slice of `_step_torch`: its temporaries take ~50 bytes per element (fp32 moments,
# int64 indices and hashes), 200 MB per slice instead of 25 GB for a 500M-element embedding
_TORCH_SLICE = 1 << 22


def _step_torch(p: torch.Tensor, g: torch.Tensor, m_bf16: torch.Tensor, v_bf16: torch.Tensor, lr: float,
                b1: float, b2: float, eps: float, wd: float, step_size: float, inv_sqrt_bc2: float,
                seed: int) -> None:
    """adamw.c's `adamw_bf16_step` as torch ops (any device, e.g. a GPU; the kernel's reference in
    tests), slice by slice of `_TORCH_SLICE` elements where the tensors are contiguous (the same
    result: each element's rounding draw depends on its index in the whole tensor)."""
    args = (lr, b1, b2, eps, wd, step_size, inv_sqrt_bc2, seed)
    n = p.numel()
    if n <= _TORCH_SLICE or not all(t.is_contiguous() for t in (p, g, m_bf16, v_bf16)):
        _step_torch_slice(p, g, m_bf16, v_bf16, *args, start=0)
        return
    flat = [t.view(-1) for t in (p, g, m_bf16, v_bf16)]
    for s in range(0, n, _TORCH_SLICE):
        _step_torch_slice(*(t[s:s + _TORCH_SLICE] for t in flat), *args, start=s)


def _step_torch_slice(p: torch.Tensor, g: torch.Tensor, m_bf16: torch.Tensor, v_bf16: torch.Tensor, lr: float,
                      b1: float, b2: float, eps: float, wd: float, step_size: float, inv_sqrt_bc2: float,
                      seed: int, start: int) -> None:
    m = m_bf16.float() * b1 + (1.0 - b1) * g
    v = v_bf16.float() * b2 + (1.0 - b2) * g * g
    idx = torch.arange(start, start + p.numel(), device=p.device, dtype=torch.int64)
    r = _mix32(((idx * 0x9E3779B9) & 0xFFFFFFFF) ^ seed)
    m_bf16.copy_(_round_bf16_stochastic(m.reshape(-1), r).view_as(m_bf16))
    v_bf16.copy_(_round_bf16_stochastic(v.reshape(-1), r >> 16).view_as(v_bf16))
    p.mul_(1.0 - lr * wd).sub_(step_size * m / (v.sqrt() * inv_sqrt_bc2 + eps))
