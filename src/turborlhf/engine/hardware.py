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

import functools
import os
import platform
from pathlib import Path

__all__ = ["cpu_features", "cpu_model", "AVX512_FEATURES", "BF16_FEATURES", "host_summary"]

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
    (``avx2``, ``avx512f``, ``avx512_bf16``, ``amx_bf16``) as used by this process, cores, and the
    limiting switches in force."""
    feats = cpu_features()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 1,
        "isa": sorted(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in feats),
        "limits": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k)},
    }
