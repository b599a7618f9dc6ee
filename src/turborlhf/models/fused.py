"""Fused RMSNorm and SwiGLU, and projections that keep no weight casts, for training on CPUs: the
same forward values as transformers' Llama modules, with fewer tensors saved for backward.

Under bf16 autocast over fp32 master weights, a Llama decoder layer's two RMSNorms, its SwiGLU
MLP and its seven projections keep, per token (E = hidden size, I = intermediate size):

- each norm: its fp32 input (``pow`` saves it), the fp32 normalised copy (the weight product
  saves it), and one bf16 cast of the output per consuming projection (autocast casts the
  activation again for q, k and v, and for gate and up): 14E + 12E = **26E bytes**;
- the MLP: ``gate`` (SiLU's input), SiLU's output and ``up`` (the product's inputs) and the
  product (``down_proj``'s input), all bf16: **8I bytes**;
- and per layer, not per token: each projection's bf16 cast of its fp32 weight (autocast's
  ``F.linear`` saves the cast it multiplied by): 2 bytes per weight, 202 MiB for SmolLM2-135M.

`fused_rms_norm` returns the output already in the autocast dtype, so the projections share one
copy, and saves only the normalised input in that dtype plus one fp32 rstd per token: 4E per norm
(**8E** per layer). `silu_mul_linear` (SwiGLU and ``down_proj`` in one function) saves ``gate``,
``up`` and the fp32 down weight itself, and recomputes SiLU, the product and the weight's cast in
backward: **4I**. The other projections run `cast_linear`, which saves the fp32 parameter (a
reference, no copy) instead of its cast and casts again in backward. With the attention's saved
tensors (unchanged), a SmolLM2-135M layer (E 576, I 1536, 9 + 3 heads of 64) keeps 13,860 instead
of 30,372 bytes per token, and no weight casts. On the PPO bench (8 × ~113 tokens) one trained
model's kept experience forward fell from 788 to 417 MiB, which lets PPO hold two such graphs at
once (`turborlhf.trainers.ppo.experience.use_fused_update`). The recasts and the recomputed
product cost about 4% of a backward (2-core AMX Xeon, SmolLM2-135M, 16 × 128 tokens).

Numerics: the forward values are bit-identical to transformers' modules (the same ops in the same
order; the cast the projection would do happens inside the norm). The SwiGLU backward follows the
ops autograd runs on the unfused module (``silu_backward`` in the compute dtype, with the same
roundings); the projections' gradients are the two matmuls autograd runs for ``F.linear``
(``dx = dy·W``, ``dW = dyᵀ·x``) on the same operands, bit-identical on the hosts tested. The
RMSNorm backward is computed in fp32 from the saved normalised input, which under bf16 autocast
is rounded to bf16 (as a bf16 model's own RMSNorm saves its bf16 input, and as Liger-Kernel's
fused RMSNorm does); without autocast everything stays fp32 and the gradients equal the module's
within fp32 rounding (tested in ``tests/models/test_fused.py``).

On the CPU the element-wise work runs as C passes where the kernels build (`turborlhf.engine.cbuild`;
torch ops otherwise, and off the CPU): the norm's forward after its per-row rstd (still torch's ops,
so the outputs stay bit-identical) and its backward (``engine/rmsnorm.c``, IEEE maths), and the
SwiGLU backward (``engine/swiglu.c``: glibc's vectorised ``expf``, whose last bit can move a bf16
rounding of SiLU's output by one step, rarely). Measured on a 2-core AMX Xeon, one norm over
820×576 tokens under bf16 autocast, forward + backward 1.7-2.0 → 0.6-1.0 ms; the SwiGLU backward
over 820×1536 bf16 values about 1.9 → 1.1 ms (the C pass alone 0.63 ms); the PPO bench's training
phase (actor and critic updates), steps alternating in one run, 2.87 → 2.65 s.

Only the decoder layers' ``input_layernorm`` / ``post_attention_layernorm`` are replaced (their
outputs feed linear projections only; the final norm's output is read by our own heads and is
left alone), and only for the module classes whose code is the Llama one (`NORM_CLASSES`,
`MLP_CLASSES`); of the linears, only plain bias-free ``nn.Linear`` projections (`PROJECTIONS`)
under autocast on the CPU. Without grad, or with inputs that are not fp32 (a frozen bf16 model),
the original ``forward`` runs.
"""
from __future__ import annotations

import ctypes
import types
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NORM_CLASSES", "MLP_CLASSES", "PROJECTIONS", "fused_rms_norm", "silu_mul", "silu_mul_linear", "cast_linear",
           "use_fused_layers", "use_plain_layers", "fused_layer_count"]

#: RMSNorm classes whose forward is ``weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)``
NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
#: MLP classes whose forward is ``down(act(gate(x)) * up(x))``
MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
#: a decoder layer's projections: under bf16 autocast on the CPU they run `cast_linear`
PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


_RMS_SRC = Path(__file__).resolve().parent.parent / "engine" / "rmsnorm.c"
_SWIGLU_SRC = _RMS_SRC.with_name("swiglu.c")
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _type_rms(lib: ctypes.CDLL) -> None:
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.rmsnorm_threads.argtypes, lib.rmsnorm_threads.restype = [], ctypes.c_int
    for suffix in _SUFFIX.values():
        fwd, bwd = getattr(lib, f"rmsnorm_fwd_tail_{suffix}"), getattr(lib, f"rmsnorm_bwd_{suffix}")
        fwd.argtypes, fwd.restype = [P, P, P, P, P, I64, I64], None
        bwd.argtypes, bwd.restype = [P, P, P, P, P, P, P, I64, I64], None


def load_rms_kernels(warn: bool = True) -> Optional[ctypes.CDLL]:
    """rmsnorm.c built on first use (`turborlhf.engine.cbuild`, IEEE maths: the forward's products
    must equal torch's), its functions typed; None where kernels are unavailable."""
    from turborlhf.engine.cbuild import load_library

    return load_library(_RMS_SRC, "RMSNorm: C kernel", warn, fast_math=False, prepare=_type_rms)


def _rms_kernels(x_dtype: torch.dtype, dtype: torch.dtype, weight: torch.Tensor,
                 *tensors: torch.Tensor) -> Optional[ctypes.CDLL]:
    """The C library when this call can use it: the norm's input dtype `x_dtype` fp32 (the kernels
    read x and write dx in fp32), its output dtype `dtype` bf16 or fp32, an fp32 `weight`, and it
    and `tensors` (x; or the saved input and the output gradient) on the CPU and contiguous."""
    if (x_dtype != torch.float32 or dtype not in _SUFFIX or weight.dtype != torch.float32
            or tensors[0].numel() == 0
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in (weight, *tensors))):
        return None
    return load_rms_kernels()


def _type_swiglu(lib: ctypes.CDLL) -> None:
    for suffix in _SUFFIX.values():
        fn = getattr(lib, f"swiglu_bwd_{suffix}")
        fn.argtypes, fn.restype = [ctypes.c_void_p] * 5 + [ctypes.c_int64], None


def load_swiglu_kernels(warn: bool = True) -> Optional[ctypes.CDLL]:
    """swiglu.c built on first use (-ffast-math: vectorised expf), its functions typed; None where
    kernels are unavailable."""
    from turborlhf.engine.cbuild import load_library

    return load_library(_SWIGLU_SRC, "SwiGLU backward: C kernel", warn, prepare=_type_swiglu)


def _swiglu_kernels(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor) -> Optional[ctypes.CDLL]:
    """The C library when this backward can use it: CPU tensors of one dtype, bf16 or fp32, with
    contiguous `gate` and `up` of one shape."""
    if (gate.device.type != "cpu" or gate.dtype not in _SUFFIX or not (gate.dtype == up.dtype == dh.dtype)
            or gate.shape != up.shape or gate.shape != dh.shape or dh.device.type != "cpu"
            or not gate.is_contiguous() or not up.is_contiguous() or gate.numel() == 0):
        return None
    return load_swiglu_kernels()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTE, weight_E, eps, out_dtype):  # type: ignore[override]
        rstd_BT1 = torch.rsqrt(x_BTE.pow(2).mean(-1, keepdim=True) + eps)
        ctx.x_dtype = x_BTE.dtype
        lib = _rms_kernels(x_BTE.dtype, out_dtype, weight_E, x_BTE)
        if lib is not None:
            E = x_BTE.shape[-1]
            y_BTE, xhat_BTE = (torch.empty(x_BTE.shape, dtype=out_dtype) for _ in range(2))
            getattr(lib, f"rmsnorm_fwd_tail_{_SUFFIX[out_dtype]}")(
                x_BTE.data_ptr(), rstd_BT1.data_ptr(), weight_E.data_ptr(), y_BTE.data_ptr(), xhat_BTE.data_ptr(),
                x_BTE.numel() // E, E)
            ctx.save_for_backward(xhat_BTE, rstd_BT1, weight_E)
            return y_BTE
        xhat_BTE = x_BTE * rstd_BT1
        y_BTE = torch.empty(xhat_BTE.shape, dtype=out_dtype, device=x_BTE.device)
        torch.mul(weight_E, xhat_BTE, out=y_BTE)           # computed in fp32, rounded once to out_dtype
        ctx.save_for_backward(xhat_BTE.to(out_dtype), rstd_BT1, weight_E)
        return y_BTE

    @staticmethod
    def backward(ctx, dy_BTE):  # type: ignore[override]
        xhat_BTE, rstd_BT1, weight_E = ctx.saved_tensors
        dy_BTE = dy_BTE.contiguous()
        lib = (_rms_kernels(ctx.x_dtype, xhat_BTE.dtype, weight_E, xhat_BTE, dy_BTE)
               if dy_BTE.dtype == xhat_BTE.dtype else None)
        if lib is not None:
            E = xhat_BTE.shape[-1]
            dx_BTE, dweight = torch.empty(xhat_BTE.shape), torch.empty(E)
            partial = torch.empty(lib.rmsnorm_threads(), E)
            getattr(lib, f"rmsnorm_bwd_{_SUFFIX[xhat_BTE.dtype]}")(
                xhat_BTE.data_ptr(), rstd_BT1.data_ptr(), weight_E.data_ptr(), dy_BTE.data_ptr(), dx_BTE.data_ptr(),
                dweight.data_ptr(), partial.data_ptr(), xhat_BTE.numel() // E, E)
            return (dx_BTE if ctx.needs_input_grad[0] else None,
                    dweight if ctx.needs_input_grad[1] else None, None, None)
        acc = torch.promote_types(weight_E.dtype, torch.float32)
        xhat, dy = xhat_BTE.to(acc), dy_BTE.to(acc)
        dweight = (dy * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight_E.dtype) if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            dxhat = dy * weight_E.to(acc)
            proj_BT1 = torch.linalg.vecdot(dxhat, xhat, dim=-1).unsqueeze(-1).div_(xhat.shape[-1])
            dx = torch.addcmul(dxhat, xhat, proj_BT1, value=-1).mul_(rstd_BT1).to(ctx.x_dtype)
        return dx, dweight, None, None


def fused_rms_norm(x_BTE: torch.Tensor, weight_E: torch.Tensor, eps: float,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``weight · x / sqrt(mean(x², -1) + eps)`` (Zhang & Sennrich 2019, eq. 4; transformers'
    ``LlamaRMSNorm``), returned in `out_dtype` (default: the autocast dtype when autocast is on,
    else ``x``'s dtype).

    Shapes: ``x`` ``…×E`` (fp32), ``weight`` ``E``; the result has ``x``'s shape. Saves the
    normalised input in `out_dtype` and one fp32 rstd per row for backward.
    """
    return _RMSNorm.apply(x_BTE, weight_E, float(eps), out_dtype or _compute_dtype(x_BTE))


def _silu_mul_grads(ctx, gate_BTI, up_BTI, dh_BTI):
    """Gradients of ``silu(gate) · up`` with respect to gate and up (None where not needed)."""
    lib = _swiglu_kernels(gate_BTI, up_BTI, dh_BTI)
    if lib is not None:
        dh_BTI = dh_BTI.contiguous()
        dgate, dup = torch.empty_like(gate_BTI), torch.empty_like(up_BTI)
        getattr(lib, f"swiglu_bwd_{_SUFFIX[gate_BTI.dtype]}")(
            gate_BTI.data_ptr(), up_BTI.data_ptr(), dh_BTI.data_ptr(), dgate.data_ptr(), dup.data_ptr(),
            gate_BTI.numel())
        return (dgate if ctx.needs_input_grad[0] else None, dup if ctx.needs_input_grad[1] else None)
    dgate = torch.ops.aten.silu_backward(dh_BTI * up_BTI, gate_BTI) if ctx.needs_input_grad[0] else None
    dup = dh_BTI * F.silu(gate_BTI) if ctx.needs_input_grad[1] else None
    return dgate, dup


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_BTI, up_BTI):  # type: ignore[override]
        ctx.save_for_backward(gate_BTI, up_BTI)
        return F.silu(gate_BTI) * up_BTI

    @staticmethod
    def backward(ctx, dh_BTI):  # type: ignore[override]
        return _silu_mul_grads(ctx, *ctx.saved_tensors, dh_BTI)


def _linear_grads(x_NI, w_OI, dy_NO, dtype, need_x: bool, need_w: bool):
    """``F.linear``'s input and weight gradients as autograd computes them for ``x·Wᵀ`` in `dtype`
    (the same two matmuls: ``dx = dy·W``, ``dW = dyᵀ·x``), from the saved parameter `w_OI`
    recast to `dtype`; the weight gradient is returned in the parameter's dtype, as autocast's
    cast backward does. Only the gradients asked for are computed (None otherwise); `x_NI` or
    `w_OI` may be None where the other's gradient is not needed."""
    dy2 = dy_NO.reshape(-1, dy_NO.shape[-1])
    dx = dy2.mm(w_OI.to(dtype)).view(*dy_NO.shape[:-1], w_OI.shape[1]) if need_x else None
    dw = dy2.t().mm(x_NI.reshape(-1, x_NI.shape[-1])).to(w_OI.dtype) if need_w else None
    return dx, dw


class _CastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI, w_OI, dtype):  # type: ignore[override]
        with torch.autocast(x_NI.device.type, enabled=False):
            x_c = x_NI.to(dtype)
            needs_x, needs_w = ctx.needs_input_grad[:2]          # a frozen W needs no input for its gradient
            ctx.save_for_backward(x_c if needs_w else None, w_OI if needs_x else None)
            ctx.dtype, ctx.x_dtype = dtype, x_NI.dtype
            return F.linear(x_c, w_OI.to(dtype))

    @staticmethod
    def backward(ctx, dy_NO):  # type: ignore[override]
        x_c, w_OI = ctx.saved_tensors
        dx, dw = _linear_grads(x_c, w_OI, dy_NO, ctx.dtype, *ctx.needs_input_grad[:2])
        return (dx.to(ctx.x_dtype) if dx is not None else None), dw, None


def cast_linear(x_NI: torch.Tensor, w_OI: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x · Wᵀ`` computed in `dtype`, as bf16 autocast computes ``F.linear(x, W)`` (both cast to
    `dtype`, same forward values, same gradient matmuls), but saving the parameter `W` for backward
    instead of its cast: the cast is made again in backward. Autocast keeps every projection's
    cast of its fp32 master weight alive until the backward (2 bytes per weight: for a trained
    SmolLM2-135M, 202 MiB per kept forward); recasting costs one read of the fp32 weight per
    backward. Shapes: ``x`` ``…×I``, ``W`` ``O×I``; returns ``…×O`` in `dtype`, no bias."""
    return _CastLinear.apply(x_NI, w_OI, dtype)


class _SiluMulLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_BTI, up_BTI, w_EI, dtype):  # type: ignore[override]
        with torch.autocast(gate_BTI.device.type, enabled=False):
            ctx.save_for_backward(gate_BTI, up_BTI, w_EI)
            ctx.dtype = dtype
            return F.linear((F.silu(gate_BTI) * up_BTI).to(dtype), w_EI.to(dtype))

    @staticmethod
    def backward(ctx, dy_BTE):  # type: ignore[override]
        gate_BTI, up_BTI, w_EI = ctx.saved_tensors
        h_BTI = (F.silu(gate_BTI) * up_BTI).to(ctx.dtype)          # the forward's product, recomputed
        dh_BTI, dw = _linear_grads(h_BTI, w_EI, dy_BTE, ctx.dtype, True, ctx.needs_input_grad[2])
        dgate, dup = _silu_mul_grads(ctx, gate_BTI, up_BTI, dh_BTI.to(gate_BTI.dtype))
        return dgate, dup, dw, None


def silu_mul_linear(gate_BTI: torch.Tensor, up_BTI: torch.Tensor, w_EI: torch.Tensor,
                    dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``down(silu(gate) · up)``: the SwiGLU MLP's last two steps, saving only ``gate``, ``up`` and
    the parameter ``W`` (not the product, down's input, nor W's cast): both are recomputed in
    backward, one element-wise pass and one cast. `dtype` (default: the autocast dtype when
    autocast is on, else gate's) is what the projection computes in, as autocast's
    ``F.linear`` would. Shapes: ``gate``, ``up`` ``…×I`` (one dtype), ``W`` ``E×I``; returns
    ``…×E``."""
    return _SiluMulLinear.apply(gate_BTI, up_BTI, w_EI, dtype or _compute_dtype(gate_BTI))


def silu_mul(gate_BTI: torch.Tensor, up_BTI: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` (SwiGLU, Shazeer 2020, eq. 6 with Swish₁), saving only ``gate`` and
    ``up`` for backward (SiLU is recomputed there). Shapes: both ``…×I``, same dtype."""
    return _SiluMul.apply(gate_BTI, up_BTI)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
        return fused_rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():
        gate, up, down = self.gate_proj(x), self.up_proj(x), self.down_proj
        if type(down) is nn.Linear and down.bias is None and down.weight.device.type == "cpu":
            return silu_mul_linear(gate, up, down.weight)
        return down(silu_mul(gate, up))         # e.g. a LoRA-wrapped down_proj
    return type(self).forward(self, x)


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    dev = w.device.type
    if (torch.is_grad_enabled() and dev == "cpu" and self.bias is None and w.dtype == torch.float32
            and torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != torch.float32):
        return cast_linear(x, w, torch.get_autocast_dtype(dev))
    return F.linear(x, w, self.bias)


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def use_fused_layers(model: nn.Module) -> int:
    """Give the decoder layers of a loaded transformers model (or peft wrapper) the fused
    `fused_rms_norm` / `silu_mul_linear` forwards and the `cast_linear` projections, per module
    instance (the class, ``config.json`` and checkpoints are unaffected). Only `NORM_CLASSES`
    norms named ``input_layernorm`` / ``post_attention_layernorm``, `MLP_CLASSES` MLPs with a SiLU
    activation and plain ``nn.Linear`` modules named as one of `PROJECTIONS` are changed.
    Returns the number of modules changed."""
    n = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        cls = type(module).__name__
        if cls in NORM_CLASSES and leaf in ("input_layernorm", "post_attention_layernorm"):
            module.forward = types.MethodType(_norm_forward, module)
        elif cls in MLP_CLASSES and _is_silu(getattr(module, "act_fn", None)):
            module.forward = types.MethodType(_mlp_forward, module)
        elif type(module) is nn.Linear and leaf in PROJECTIONS:
            module.forward = types.MethodType(_linear_forward, module)
        else:
            continue
        n += 1
    return n


def use_plain_layers(model: nn.Module) -> int:
    """Undo `use_fused_layers`: the modules get their class's forward back. For a model loaded on
    the CPU that trains on a GPU (FSDP shards it from the CPU): the fused forwards are tuned for
    the CPU, and off it they would differ from the plain model's rounding (the norm's backward
    from its bf16-rounded output under autocast). Returns the number of modules changed."""
    n = 0
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "__func__", None) in (_norm_forward, _mlp_forward, _linear_forward):
            del module.forward
            n += 1
    return n


def fused_layer_count(model: nn.Module) -> int:
    """How many modules of `model` run the fused forwards (for tests and logs)."""
    return sum(1 for m in model.modules() if getattr(m.__dict__.get("forward"), "__func__", None)
               in (_norm_forward, _mlp_forward, _linear_forward))
