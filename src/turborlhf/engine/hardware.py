"""What this host can compute fast: CPU instruction sets, as torch and oneDNN will use them.

`cpu_features()` is the one place that reads the CPU's flags. It honours the documented switches
that limit torch and oneDNN to a smaller instruction set, so a host with AVX-512 behaves, for
every decision in turborlhf, like an AVX2-only one when they are set:

- ``ATEN_CPU_CAPABILITY`` (torch's kernel dispatch: ``default``, ``avx2``, ``avx512``, ...);
- ``ONEDNN_MAX_CPU_ISA`` (oneDNN's: ``AVX2``, ``AVX512_CORE``, ``AVX512_CORE_BF16``,
  ``AVX512_CORE_AMX``, ...).

    >>> "avx2" in cpu_features()
    True                       # on any x86-64 CPU of the last ten years

This module imports no torch at import time.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import time
import warnings
from pathlib import Path
from typing import Optional

from turborlhf.errors import UserError

__all__ = ["cpu_features", "host_cpu_features", "isa_limits", "cpu_model", "AVX512_FEATURES", "BF16_FEATURES",
           "host_summary",
           "gpu_summary", "HardwareError", "resolve_device", "Precision", "choose_precision", "compute_dtype",
           "choose_state_dtype", "state_dtype_for", "cpu_bf16_slowdown", "DEVICES", "DTYPES", "weight_dtype_conflict",
           "cached_probe", "best_time", "cpu_fp16_slowdown", "warn_if_slower_than_fp32"]

# Flags (as /proc/cpuinfo spells them) that decide turborlhf's CPU paths
_KNOWN = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
          "amx_tile", "amx_bf16", "amx_int8")
AVX512_FEATURES = frozenset(f for f in _KNOWN if f.startswith("avx512"))
AMX_FEATURES = frozenset(f for f in _KNOWN if f.startswith("amx"))
# Either of these makes bf16 matmuls native on a CPU (AVX-512-BF16 dot products, AMX tiles)
BF16_FEATURES = frozenset({"avx512_bf16", "amx_bf16"})

# ONEDNN_MAX_CPU_ISA values (oneDNN's documented names, lower-cased) → the features they keep
_ONEDNN_LIMITS = {
    "sse41": frozenset(),
    "avx": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx2_vnni": frozenset({"avx2", "fma", "f16c"}),
    "avx2_vnni_2": frozenset({"avx2", "fma", "f16c"}),
    "avx512_core": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_core_vnni": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                                   "avx512_vnni"}),
    "avx512_core_bf16": frozenset({"avx2", "fma", "f16c", *AVX512_FEATURES}),
}


def _raw_flags() -> frozenset[str]:
    """The CPU's flags: /proc/cpuinfo on Linux, else torch's dispatch capability."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        import torch

        cap = torch.backends.cpu.get_cpu_capability().lower()     # "avx512", "avx2", "default", ...
    except Exception:  # noqa: BLE001 - no torch or an old one: assume nothing
        return frozenset()
    return frozenset({"avx2", "fma", *(["avx512f", "avx512bw", "avx512vl", "avx512dq"] if "avx512" in cap else [])})


@functools.lru_cache(maxsize=None)
def _features(aten: str, onednn: str) -> frozenset[str]:
    feats = _raw_flags() & frozenset(_KNOWN)
    if aten in ("default", "no_avx", "avx", "sse", "sse41", "sse42"):
        feats = frozenset()
    elif aten == "avx2":
        feats -= AVX512_FEATURES | AMX_FEATURES
    if onednn in _ONEDNN_LIMITS:
        feats &= _ONEDNN_LIMITS[onednn]
    return feats


def cpu_features() -> frozenset[str]:
    """The instruction sets of `_KNOWN` this process may use, as /proc/cpuinfo names them
    (``avx2``, ``fma``, ``avx512f``, ``avx512_bf16``, ``amx_bf16``, ...), less what
    ``ATEN_CPU_CAPABILITY`` or ``ONEDNN_MAX_CPU_ISA`` switch off. Empty off x86-64."""
    return _features(os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower(),
                     os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().lower())


def isa_limits() -> dict[str, str]:
    """The instruction-set switches set in this process's environment: torch's, oneDNN's and
    MKL's (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``)."""
    return {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
            if os.environ.get(k)}


def host_cpu_features() -> frozenset[str]:
    """The instruction sets of `_KNOWN` the CPU has, whatever ``ATEN_CPU_CAPABILITY`` or
    ``ONEDNN_MAX_CPU_ISA`` allow this process (`cpu_features` honours them). Empty off x86-64."""
    return _features("", "")


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's model name (``AMD EPYC 9R14``...), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_summary() -> dict:
    """What benchmarks and run records say about the host: CPU model, the features that matter
    (``avx2``, ``avx512f``, ``avx512_bf16``, ``amx_bf16``) as used by this process, cores, the
    limiting switches in force, and the GPUs this process sees (`gpu_summary`; none: no key)."""
    feats = cpu_features()
    out = {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        "isa": sorted(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in feats),
        "limits": isa_limits(),
    }
    gpus = gpu_summary()
    if gpus:
        out["gpu"] = gpus
    return out


def gpu_summary() -> list[dict]:
    """The CUDA devices this process sees: name, compute capability, memory (GiB) and the CUDA
    version torch was built with; ``[{"name": "mps"}]`` on Apple silicon; ``[]`` without either."""
    import torch

    if torch.cuda.is_available():
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                        "memory_gib": round(p.total_memory / 2 ** 30, 1), "cuda": torch.version.cuda})
        return out
    mps = getattr(torch.backends, "mps", None)
    return [{"name": "mps"}] if mps is not None and mps.is_available() else []


# ----------------------------------------------------------------------------------------------
# Device and precision: the one place that turns ``device: auto`` and ``dtype: auto`` into a choice
# ----------------------------------------------------------------------------------------------

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "bf16", "fp32")


class HardwareError(UserError, ValueError):
    """A requested device is not available on this host, or an unknown device/dtype name (the
    message says which and why): a `UserError`, so the command line prints one line."""


def resolve_device(name: str = "auto", field: str = "device"):
    """``"auto"`` → the first of cuda, mps, cpu that torch can use; an explicit name is checked.

    Returns a ``torch.device`` (``cuda`` means the current CUDA device: under Ray each GPU worker
    sees one). Raises `HardwareError` for an unknown name or a device torch cannot use here, its
    message naming `field` (the setting the name came from, e.g. ``model.device``)."""
    import torch

    name = (name or "auto").lower()
    if name not in DEVICES:
        raise HardwareError(f"{field} must be one of {', '.join(DEVICES)}, got {name!r}")
    has_cuda = torch.cuda.is_available()
    has_mps = bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()
    if name == "auto":
        name = "cuda" if has_cuda else "mps" if has_mps else "cpu"
    if name == "cuda" and not has_cuda:
        raise HardwareError(f"{field}=cuda but torch sees no CUDA device (torch.cuda.is_available() is False)")
    if name == "mps" and not has_mps:
        raise HardwareError(f"{field}=mps but torch.backends.mps.is_available() is False")
    return torch.device(name)


@dataclasses.dataclass(frozen=True)
class Precision:
    """A resolved compute precision: ``dtype`` is ``"bf16"`` or ``"fp32"``; ``reason`` is the one
    line printed in the start-up table and saved with the run (``hardware.json``)."""

    dtype: str
    reason: str


def _probe_key() -> str:
    import torch

    parts = [cpu_model(), ",".join(sorted(cpu_features())), torch.__version__, str(torch.get_num_threads()),
             os.environ.get("ATEN_CPU_CAPABILITY", ""), os.environ.get("ONEDNN_MAX_CPU_ISA", "")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _probe_path() -> Path:
    root = os.environ.get("TURBORLHF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "turborlhf")
    return Path(root) / "host" / f"probe-{_probe_key()}.json"


def _time_linear(dtype, M: int = 256, K: int = 576, N: int = 1536, reps: int = 5) -> float:
    """Best-of-`reps` seconds of one ``F.linear`` M×K @ K×N in `dtype` (SmolLM2-135M's MLP shape)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    return best_time(lambda: torch.nn.functional.linear(x, w), reps)


def best_time(fn, reps: int) -> float:
    """Best-of-`reps` seconds of `fn()`, after one untimed call (warm-up: oneDNN primitive
    creation, first-touch allocation)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def cached_probe(name: str, measure) -> float:
    """`measure()` once per host: its float is cached as `name` in ``$TURBORLHF_CACHE/host/
    probe-<key>.json`` (key: CPU model, usable instruction sets, torch version, threads, the ISA
    limits), beside the other probes of that host. A read-only cache only costs a re-probe."""
    import torch

    path = _probe_path()
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        rec = {}
    try:
        return float(rec[name])
    except (KeyError, TypeError, ValueError):
        pass
    value = float(measure())
    rec = {**(rec if isinstance(rec, dict) else {}), name: value, "host": host_summary(), "torch": torch.__version__}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, path)
    except OSError:
        pass
    return value


@functools.lru_cache(maxsize=None)
def cpu_bf16_slowdown() -> float:
    """Measured time of a bf16 ``F.linear`` over the fp32 one on this CPU (below 1: bf16 is faster).

    A short probe (~0.1 s where bf16 is native, up to ~1 s where it is emulated), cached per host
    (`cached_probe`). Measured on 2-core AMD EPYCs: ~0.3 with AVX-512-BF16 (Zen 4), ~5 with AVX2
    only (Zen 3); 0.22 on a 2-core Xeon with AMX."""
    import torch

    return cached_probe("bf16_over_fp32",
                        lambda: _time_linear(torch.bfloat16) / max(_time_linear(torch.float32), 1e-9))


@functools.lru_cache(maxsize=None)
def cpu_fp16_slowdown() -> float:
    """Measured time of an fp16 ``F.linear`` over the fp32 one on this CPU, cached per host as
    `cpu_bf16_slowdown` (CPUs without AVX-512-FP16 convert fp16 for every product)."""
    import torch

    return cached_probe("fp16_over_fp32",
                        lambda: _time_linear(torch.float16) / max(_time_linear(torch.float32), 1e-9))


_warned: set[str] = set()


def warn_if_slower_than_fp32(dtype, device="cpu", what: str = "dtype") -> None:
    """One warning, with the measured slowdown, where an explicit `dtype` (a ``torch.dtype``) is
    slower than fp32 on `device`: bf16 where it is emulated (`choose_precision`'s warning), fp16 on a
    CPU whose fp16 linear measured slower than fp32 (`cpu_fp16_slowdown`). `what` names the setting.
    The rollout engines call it for their compute dtype: the trainers' precisions go through
    `choose_precision` already."""
    import torch

    dev = getattr(device, "type", None) or str(device).split(":")[0]
    if dtype == torch.bfloat16:
        choose_precision("bf16", dev)
    elif dtype == torch.float16 and dev == "cpu":
        slow = cpu_fp16_slowdown()
        if slow <= 1.0:
            return
        msg = (f"{what}=fp16 on this CPU: a linear measured {slow:.1f}x slower than fp32; "
               f"{what}=auto would choose {compute_dtype('auto', 'cpu')}")
        if msg not in _warned:
            _warned.add(msg)
            warnings.warn(msg, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _choose(requested: str, device_type: str) -> Precision:
    import torch

    if requested not in DTYPES:
        raise HardwareError(f"dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    if requested == "fp32":
        return Precision("fp32", "fp32 as configured")
    if device_type == "cuda":
        if not torch.cuda.is_available() and requested == "auto":
            # the driver of a Ray cluster whose GPUs are on other nodes (distributed.device: gpu)
            return Precision("bf16", "bf16: assumed for GPUs this process cannot see (Ampere or newer compute it "
                                     "natively, as OpenRLHF and verl assume; set dtype fp32 for older ones)")
        # compute capability 8.0+ (Ampere); torch's default also counts emulated bf16 (V100, T4)
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
        if ok:
            return Precision("bf16", "bf16: the CUDA device computes it natively")
        if requested == "bf16":
            if torch.cuda.is_available():
                msg = (f"dtype=bf16 on {torch.cuda.get_device_name()}, which has no native bf16 (compute capability "
                       "below 8.0): torch emulates it, slower than fp32; dtype=auto would choose fp32")
                if msg not in _warned:
                    _warned.add(msg)
                    warnings.warn(msg, stacklevel=3)
                return Precision("bf16", "bf16 as configured (emulated on this GPU)")
            return Precision("bf16", "bf16 as configured")
        return Precision("fp32", "fp32: this CUDA device has no native bf16")
    if device_type == "mps":
        # bf16 on MPS needs macOS 14+; it was never run for this project, so auto stays fp32 there
        return Precision(requested if requested == "bf16" else "fp32",
                         "bf16 as configured" if requested == "bf16" else "fp32: the default on Apple MPS")
    native = sorted(cpu_features() & BF16_FEATURES)
    if native:
        slow = cpu_bf16_slowdown()
        if slow <= 1.0:
            return Precision("bf16", f"bf16: native on this CPU ({'/'.join(native)}; a bf16 linear measured "
                                     f"{1 / max(slow, 1e-9):.1f}x as fast as fp32)")
        if requested == "auto":
            return Precision("fp32", f"fp32: bf16 measured {slow:.1f}x slower than fp32 here despite "
                                     f"{'/'.join(native)}")
        return Precision("bf16", f"bf16 as configured ({slow:.1f}x slower than fp32 on this CPU)")
    if requested == "auto":
        switched_off = sorted(host_cpu_features() & BF16_FEATURES)
        limits = ", ".join(f"{k}={v}" for k, v in isa_limits().items() if k != "MKL_ENABLE_INSTRUCTIONS")
        if switched_off and limits:                  # the CPU has them; this process was told not to use them
            return Precision("fp32", f"fp32: native bf16 ({'/'.join(switched_off)}) switched off by {limits}")
        return Precision("fp32", "fp32: this CPU has no native bf16 (no avx512_bf16 or amx_bf16)")
    slow = cpu_bf16_slowdown()
    msg = (f"dtype=bf16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16): bf16 is emulated, "
           f"a linear measured {slow:.1f}x slower than fp32; dtype=auto would choose fp32")
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)
    return Precision("bf16", f"bf16 as configured (emulated: {slow:.1f}x slower than fp32)")


def choose_precision(requested: str = "auto", device="cpu") -> Precision:
    """The compute precision for `device` (a ``torch.device``, ``"cpu"``, ``"cuda"`` or ``"mps"``).

    ``fp32`` stays fp32. ``auto`` gives bf16 only where the device computes it natively and fast:
    a CUDA device with bf16 (or one this process cannot see, on another node of a Ray cluster:
    assumed to have it), or a CPU with AVX-512-BF16 or AMX whose measured bf16 linear
    (`cpu_bf16_slowdown`) is not slower than fp32; otherwise fp32. An explicit ``bf16`` is kept
    everywhere, with one warning giving the measured slowdown where the CPU emulates it. Decided
    once per process and device type. Raises `HardwareError` for an unknown value."""
    dev = getattr(device, "type", None) or str(device).split(":")[0]
    return _choose((requested or "auto").lower(), dev)


def compute_dtype(requested: str = "auto", device="cpu") -> str:
    """``"bf16"`` or ``"fp32"``: `choose_precision(...)`.dtype."""
    return choose_precision(requested, device).dtype


def choose_state_dtype(compute: list[str], devices: list[str]) -> tuple[str, str]:
    """``optim.state_dtype: auto`` for models computing in `compute` (``"bf16"``/``"fp32"`` each)
    on `devices` (``"cpu"``, ``"cuda"``, ...): (``"bf16"`` or ``"fp32"``, the reason).

    bf16 moments (`turborlhf.engine.optim.BF16StateAdamW`: stochastic rounding, fp32 update and
    master weights) where every model trains on the CPU and its C kernel builds (built here on
    first call, cached per host), whatever the
    compute precision: there it saves 4 bytes per trainable parameter at fp32 AdamW's speed (PPO
    bench in fp32, 2-core Xeon limited to AVX2: 1.03 GiB less peak RSS, step time within 1%).
    fp32 moments (torch's AdamW, fused on a GPU) everywhere else, as TRL, OpenRLHF and verl keep
    them: on a GPU (the kernel is CPU-only, and its torch-ops fallback runs ~90 tensor ops per
    parameter tensor per step: tens of thousands of kernel launches for a whole model) and on a CPU without the
    kernel. An explicit ``optim.state_dtype: bf16`` still runs there, through that fallback.
    `compute` is kept for the reason's wording."""
    if devices and all(d == "cpu" for d in devices):
        from turborlhf.engine.cbuild import compiler
        from turborlhf.engine.optim import load_kernel

        # built (once per host, cached), not merely a compiler found: a failed build's torch fallback
        # runs ~70x slower per step than the kernel (its warning comes where the optimizer asks)
        if load_kernel(warn=False) is not None:
            what = "beside bf16 compute" if compute and all(c == "bf16" for c in compute) else "on the CPU"
            return "bf16", f"bf16 moments {what} (C kernel; fp32 update): half the state at fp32 AdamW's speed"
        why = "cannot be built here" if compiler() is None else "failed to build here"
        return "fp32", f"fp32 moments: the bf16-moment C kernel {why}"
    return "fp32", "fp32 moments (torch's AdamW, fused on a GPU): the bf16-moment kernel is CPU-only"


def state_dtype_for(state_dtype: str, device="cpu", compute: str = "auto") -> str:
    """`state_dtype` itself, or for ``"auto"`` what `choose_state_dtype` picks for one model
    computing in `compute` (``auto`` = `compute_dtype`'s choice) on `device`: for the places that
    size or build an optimizer outside `turborlhf.engine.run.resolve_hardware`."""
    if state_dtype != "auto":
        return state_dtype
    dev = getattr(device, "type", device)
    return choose_state_dtype([compute_dtype(compute, dev)], [dev])[0]


def weight_dtype_conflict(weight_dtype: str, dtype: str, engine: str, device: str) -> Optional[str]:
    """Why `rollout.weight_dtype` cannot go with the rest of the rollout section (None if it can).
    Decided only where the values are explicit ('auto' resolves in
    `turborlhf.rollout.backends.choose_weight_dtype`)."""
    if weight_dtype == "bf16" and dtype == "fp32" and (engine in ("hf", "vllm") or device in ("cuda", "mps")):
        return (f"rollout.weight_dtype=bf16 with rollout.dtype fp32 is FastEngine's (on the CPU); rollout.engine "
                f"{engine} on device {device} keeps the weights at rollout.dtype: set rollout.weight_dtype auto or same")
    return None
