"""Rollout engines behind one interface (`base.RolloutEngine`): `FastEngine` (embedded decode loop
for Llama-family models), `HFEngine` (transformers `generate`, any causal LM) and `VLLMEngine`
(vLLM's offline `LLM`, optional extra). `sync.py` pushes trainer weights and verifies them.

Heavy modules are imported lazily so `import turborlhf.rollout` stays cheap.
"""
from __future__ import annotations

import os

from typing import Optional

from .base import RolloutEngine, RolloutOutput, SamplingParams

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "make_engine"]

_KINDS = ("auto", "hf", "fast", "vllm")


def _config_of(model_or_path):
    if hasattr(model_or_path, "config"):
        return model_or_path.config
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_or_path)


def _other_engine_weights(weight_dtype: Optional[str], dtype, engine: str) -> None:
    """One warning where bf16 weight storage was asked of an engine that keeps its weights at its
    dtype (only FastEngine rounds them)."""
    if weight_dtype in (None, "same"):
        return
    from ._util import resolve_dtype
    from .backends import warn_once
    if resolve_dtype(weight_dtype) != resolve_dtype(dtype):
        warn_once(f"rollout engine: {engine} keeps its weights at rollout.dtype ({dtype}); "
                  f"rollout.weight_dtype={weight_dtype} applies to FastEngine only")


def make_engine(kind: str, model_or_path, dtype: str = "auto", device="cpu", weight_dtype: Optional[str] = None,
                device_field: str = "device", **kw) -> RolloutEngine:
    """Build a rollout engine.

    kind: 'auto' | 'fast' → FastEngine when the architecture is supported, else HFEngine
          (on CPU), with one warning naming the architecture and the reason; on a CUDA/MPS
          `device`, 'auto' is HFEngine there (FastEngine is CPU-only);
          'hf' → HFEngine; 'vllm' → turborlhf.rollout.vllm.VLLMEngine (imported lazily; vLLM
          places itself, `device` is not used).
    model_or_path: a loaded transformers causal LM (weights copied) or an HF directory.
    dtype: 'auto' | 'bf16' | 'fp32' | 'fp16' ('auto': bf16 where the engine's device computes it
        natively, else fp32; `turborlhf.engine.hardware`).
    device: 'cpu' | 'cuda' | 'mps' | 'auto' (cuda, then mps, then cpu) or a ``torch.device``.
    weight_dtype: None or 'same' (default: the weights at `dtype`), or 'bf16' (`rollout.weight_dtype`
        as `turborlhf.engine.run.resolve_hardware` resolved it): FastEngine's storage of its weights
        (bf16 with an fp32 `dtype`: fp32 arithmetic on bf16-rounded weights). An engine that
        cannot store them so (HFEngine, vLLM) keeps them at `dtype`, with one warning.
    device_field: the setting `device` came from (``rollout.device``, ``--device``), which a
        `HardwareError` names.
    kw: passed to the engine constructor.
    Raises ValueError for an unknown kind, or 'fast' on a non-CPU device; ImportError (with
    install instructions) for 'vllm' when the vllm package is not installed; `HardwareError` for a
    device this host lacks (``rollout.device=cuda but torch sees no CUDA device ...``).
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown rollout engine kind {kind!r}; choose one of {_KINDS}")
    if isinstance(model_or_path, (str, os.PathLike)):
        from turborlhf.models.load import check_causal_lm
        check_causal_lm(os.fspath(model_or_path))          # a reward model's directory: a random LM head
    if kind == "vllm":
        from .vllm import VLLMEngine  # vllm itself is imported by the constructor
        _other_engine_weights(weight_dtype, dtype, "vLLM")
        return VLLMEngine(model_or_path, dtype=dtype, **kw)
    import torch

    from turborlhf.engine.hardware import resolve_device
    dev = device if isinstance(device, torch.device) else resolve_device(device, device_field)
    if dev.type != "cpu":
        if kind == "fast":
            raise ValueError(f"rollout.engine=fast runs on the CPU only, not on {dev.type}; use rollout.engine "
                             "hf or vllm there, or the CPU (rollout.device=cpu; --device cpu for generate)")
        kind = "hf"
    if kind == "hf":
        from .hf import HFEngine
        _other_engine_weights(weight_dtype, dtype, "HFEngine")
        return HFEngine(model_or_path, dtype=dtype, device=dev, **kw)
    from .fast import FastEngine
    from .llama_ops import unsupported_reason
    config = _config_of(model_or_path)
    why = unsupported_reason(config)
    if why is None:
        return FastEngine(model_or_path, dtype=dtype, weight_dtype=weight_dtype, **kw)
    from .backends import warn_once
    arch = ", ".join(getattr(config, "architectures", None) or []) or getattr(config, "model_type", "?")
    warn_once(f"rollout engine: FastEngine cannot run {arch} ({why}); using HFEngine (transformers' generate, "
              "slower)")
    from .hf import HFEngine
    _other_engine_weights(weight_dtype, dtype, "HFEngine")
    hf_kw = {k: v for k, v in kw.items() if k in ("max_batch_size",)}
    return HFEngine(model_or_path, dtype=dtype, device=dev, **hf_kw)
