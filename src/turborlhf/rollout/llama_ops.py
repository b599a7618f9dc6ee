"""The pure pieces FastEngine is built from (`rollout/fast.py`): which configs it supports, RoPE
frequencies as transformers computes them, RMSNorm and RoPE in torch ops (the reference and
fallback paths), int8 weight quantisation, oneDNN weight packing, and reading an HF checkpoint.
Kept apart from the engine class so each can be read and tested on its own."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["is_supported", "unsupported_reason", "mkldnn_packing_available", "decode_mask"]

_ARCHS = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


def unsupported_reason(config) -> Optional[str]:
    """Why FastEngine cannot run a model with this `transformers` config (one phrase), or None."""
    archs = set(getattr(config, "architectures", None) or [])
    mt = getattr(config, "model_type", "")
    if not (archs & _ARCHS or mt in {"llama", "qwen2", "mistral"}):
        return f"model_type {mt!r} is not one of llama, qwen2, mistral"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if mt == "mistral" and getattr(config, "sliding_window", None):
        return "sliding-window attention (mistral sliding_window) is not implemented"
    if mt == "qwen2" and getattr(config, "use_sliding_window", False):
        return "sliding-window attention (qwen2 use_sliding_window) is not implemented"
    if _rope_parameters(config).get("rope_type", "default") in ("dynamic", "longrope"):
        # both change their frequencies with the sequence length (longrope: its long factors past
        # original_max_position_embeddings); FastEngine's table is one fixed set
        return f"{_rope_parameters(config)['rope_type']} RoPE scaling is not implemented"
    return None


def is_supported(config) -> bool:
    """True if FastEngine can run a model with this `transformers` config (`unsupported_reason`)."""
    return unsupported_reason(config) is None


def _rope_parameters(config) -> dict:
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rp = dict(rp)
    if "rope_theta" not in rp:
        rp["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


def _rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention_scaling) exactly as transformers computes them."""
    rp = _rope_parameters(config)
    if rp["rope_type"] == "default":
        theta = float(rp["rope_theta"])
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    return ROPE_INIT_FUNCTIONS[rp["rope_type"]](config, "cpu")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' LlamaRMSNorm: normalise in float32, cast back, scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin (the 'half' layout transformers uses for Llama)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Same value as `_rope`, bit for bit: rotate_half(x)·sin == roll(x, D/2)·sin± where sin± is
    sin with its first half negated (negation is exact). 4 ops instead of 7."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def _quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: w ≈ q · scale[:, None], |q| <= 127. Returns (q int8 N×K,
    scale N in `dtype`, the activation dtype `torch._weight_int8pack_mm` expects)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(dtype)


def mkldnn_packing_available() -> bool:
    """True if this torch build has oneDNN and the linear weight-packing ops Inductor uses."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def _pack(w: torch.Tensor) -> torch.Tensor:
    """Dense out×in weight → oneDNN blocked layout (an opaque MKLDNN tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Read the weights of an HF directory (or a hub id's cached snapshot) as transformers does:
    ``model.safetensors``, or the shards its ``model.safetensors.index.json`` lists (never other
    *.safetensors files there, such as Mistral's ``consolidated.safetensors`` with other names),
    else ``pytorch_model*.bin``."""
    import glob
    import json
    import os
    if not os.path.isdir(path):         # a hub id, as transformers reads it: from the cache (or the hub)
        from huggingface_hub import snapshot_download
        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "pytorch_model*.bin"])
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    else:
        files = [os.path.join(path, "model.safetensors")] if os.path.exists(os.path.join(path, "model.safetensors")) \
            else []
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file
        for f in files:
            state.update(load_file(f))
        return state
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    for f in files:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def decode_mask(start_B: torch.Tensor, col: int, T: int) -> torch.Tensor:
    """Additive float32 mask B×T for the torch decode paths: 0 on each row's valid columns
    [start_B, col], -inf elsewhere (left padding and columns not yet written)."""
    ar_T = torch.arange(T)
    valid_BT = (ar_T >= start_B[:, None]) & (ar_T <= col)
    return torch.zeros(valid_BT.shape).masked_fill_(~valid_BT, float("-inf"))
