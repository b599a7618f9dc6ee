"""Fused RMSNorm and SwiGLU for training on CPUs: the same forward values as transformers' Llama
modules, with fewer tensors saved for backward.

Under bf16 autocast over fp32 master weights, a Llama decoder layer's two RMSNorms and its
SwiGLU MLP keep, per token (E = hidden size, I = intermediate size):

- each norm: its fp32 input (``pow`` saves it), the fp32 normalised copy (the weight product
  saves it), and one bf16 cast of the output per consuming projection (autocast casts the
  activation again for q, k and v, and for gate and up): 14E + 12E = **26E bytes**;
- the MLP: ``gate`` (SiLU's input), SiLU's output and ``up`` (the product's inputs) and the
  product (``down_proj``'s input), all bf16: **8I bytes**.

`fused_rms_norm` returns the output already in the autocast dtype, so the projections share one
copy, and saves only the normalised input in that dtype plus one fp32 rstd per token: 4E per norm
(**8E** per layer). `silu_mul` saves ``gate`` and ``up`` and recomputes SiLU in backward: **6I**.
With the attention's saved tensors (unchanged), a SmolLM2-135M layer (E 576, I 1536, 9 + 3
heads of 64) keeps 16,932 instead of 30,372 bytes per token: 44% less.

Numerics: the forward values are bit-identical to transformers' modules (the same ops in the same
order; the cast the projection would do happens inside the norm). The SwiGLU backward uses the same
ops as autograd does on the unfused module (``silu_backward`` in the compute dtype), so its
gradients are identical too. The RMSNorm backward is computed in fp32 from the saved normalised
input, which under bf16 autocast is rounded to bf16 (as a bf16 model's own RMSNorm saves its bf16
input, and as Liger-Kernel's fused RMSNorm does); without autocast everything stays fp32 and the
gradients equal the module's within fp32 rounding (tested in ``tests/models/test_fused.py``).

Only the decoder layers' ``input_layernorm`` / ``post_attention_layernorm`` are replaced (their
outputs feed linear projections only; the final norm's output is read by our own heads and is
left alone), and only for the module classes whose code is the Llama one (`NORM_CLASSES`,
`MLP_CLASSES`). Without grad, or with inputs that are not fp32 (a frozen bf16 model), the original
``forward`` runs.
"""
from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NORM_CLASSES", "MLP_CLASSES", "fused_rms_norm", "silu_mul", "use_fused_layers", "fused_layer_count"]

#: RMSNorm classes whose forward is ``weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)``
NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
#: MLP classes whose forward is ``down(act(gate(x)) * up(x))``
MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTE, weight_E, eps, out_dtype):  # type: ignore[override]
        rstd_BT1 = torch.rsqrt(x_BTE.pow(2).mean(-1, keepdim=True) + eps)
        xhat_BTE = x_BTE * rstd_BT1
        y_BTE = torch.empty(xhat_BTE.shape, dtype=out_dtype, device=x_BTE.device)
        torch.mul(weight_E, xhat_BTE, out=y_BTE)           # computed in fp32, rounded once to out_dtype
        ctx.save_for_backward(xhat_BTE.to(out_dtype), rstd_BT1, weight_E)
        ctx.x_dtype = x_BTE.dtype
        return y_BTE

    @staticmethod
    def backward(ctx, dy_BTE):  # type: ignore[override]
        xhat_BTE, rstd_BT1, weight_E = ctx.saved_tensors
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


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_BTI, up_BTI):  # type: ignore[override]
        ctx.save_for_backward(gate_BTI, up_BTI)
        return F.silu(gate_BTI) * up_BTI

    @staticmethod
    def backward(ctx, dh_BTI):  # type: ignore[override]
        gate_BTI, up_BTI = ctx.saved_tensors
        dgate = torch.ops.aten.silu_backward(dh_BTI * up_BTI, gate_BTI) if ctx.needs_input_grad[0] else None
        dup = dh_BTI * F.silu(gate_BTI) if ctx.needs_input_grad[1] else None
        return dgate, dup


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
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
    return type(self).forward(self, x)


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def use_fused_layers(model: nn.Module) -> int:
    """Give the decoder layers of a loaded transformers model (or peft wrapper) the fused
    `fused_rms_norm` / `silu_mul` forwards, per module instance (the class, ``config.json`` and
    checkpoints are unaffected). Only `NORM_CLASSES` norms named ``input_layernorm`` /
    ``post_attention_layernorm`` and `MLP_CLASSES` MLPs with a SiLU activation are changed.
    Returns the number of modules changed."""
    n = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        cls = type(module).__name__
        if cls in NORM_CLASSES and leaf in ("input_layernorm", "post_attention_layernorm"):
            module.forward = types.MethodType(_norm_forward, module)
            n += 1
        elif cls in MLP_CLASSES and _is_silu(getattr(module, "act_fn", None)):
            module.forward = types.MethodType(_mlp_forward, module)
            n += 1
    return n


def fused_layer_count(model: nn.Module) -> int:
    """How many modules of `model` run the fused forwards (for tests and logs)."""
    return sum(1 for m in model.modules() if getattr(m.__dict__.get("forward"), "__func__", None)
               in (_norm_forward, _mlp_forward))
