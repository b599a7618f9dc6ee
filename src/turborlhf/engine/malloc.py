"""glibc malloc settings for training on the CPU: keep freed memory in the process.

PyTorch's CPU tensors come from ``malloc``. With glibc's defaults every block of 32 MiB or more
(activations, logits chunks, gradients of the large matrices) is its own ``mmap``, unmapped when
freed, and the top of the heap is trimmed back to the kernel as soon as it is free. The next
step then allocates the same sizes again and the kernel must fault in and zero every page anew.
On the 2-core VMs this project runs on a minor fault costs ~14 µs (hypervisor), so a PPO step on
SmolLM2-135M spent seconds in the kernel. Measured 2026-11-23 (`turborlhf ppo` with
configs/bench/ppo.yaml, steps 3-5 of 5, one process): glibc's defaults 77-101 k minor faults and
11.7-13.3 s per step; with `keep_freed_memory` no faults and 9.3-10.1 s per step.

The same runs peaked at the same RSS (7.63 GiB): memory that stays in the heap is reused by the
next step's tensors of the same sizes. `keep_freed_memory` sets ``M_MMAP_MAX = 0`` (every block
from the heap) and ``M_TRIM_THRESHOLD`` to its maximum (the heap is not trimmed); the first one or
two steps still fault in their memory once (the heap grows to its working size). A process that
moves to a smaller working set (the pipeline between stages) calls `release_freed_memory`
(``malloc_trim(0)``).

Each page the heap grows by is still faulted in once. `prefer_huge_pages` (every command, before
torch allocates anything) asks torch's CPU allocator for transparent huge pages on its blocks of 2
MiB or more (torch's own ``THP_MEM_ALLOC_ENABLE=1``: 2 MiB-aligned blocks, ``madvise(MADV_HUGEPAGE)``),
so where the kernel's THP mode is ``madvise`` or ``always`` one fault maps 2 MiB instead of 4 KiB.
Measured 2026-11-25 on a 2-core Xeon VM (THP ``madvise``), six fp32 RM steps of 8 pairs whose
working set grows to ~10-12 GiB: 2.93 M → 0.45 M minor faults, 57.4 → 52.4 s; the whole `make
demo` had taken 13.7 M minor faults before. Where THP is ``never`` it changes nothing.

``TURBORLHF_MALLOC=system`` keeps glibc's defaults (and torch's, without huge pages), and so does any malloc setting of the user's
own (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_MAX_``,
``MALLOC_TOP_PAD_`` or ``glibc.malloc.*`` in ``GLIBC_TUNABLES``). On other C libraries (musl, macOS) both
functions do nothing. jemalloc/tcmalloc through ``LD_PRELOAD`` (Intel's advice for PyTorch on
CPUs) solve the same problem but need a system package; these settings need nothing.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Optional

__all__ = ["keep_freed_memory", "keeps_freed_memory", "release_freed_memory", "prefer_huge_pages"]

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1
_state: dict[str, bool] = {}


def _glibc() -> Optional[ctypes.CDLL]:
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the kernel (see the
    module docstring). Idempotent; returns True if the settings are in effect, False when
    ``TURBORLHF_MALLOC=system``, the user tuned malloc in the environment, or the C library is not
    glibc."""
    if "on" in _state:
        return _state["on"]
    env = os.environ
    user_tuned = (any(k in env for k in _USER_SETTINGS) or "glibc.malloc." in env.get("GLIBC_TUNABLES", "")
                  or env.get("TURBORLHF_MALLOC", "").lower() == "system")
    libc = None if user_tuned else _glibc()
    on = bool(libc is not None and libc.mallopt(_M_MMAP_MAX, 0) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1)
    _state["on"] = on
    return on


def keeps_freed_memory() -> bool:
    """Whether `keep_freed_memory` put its settings in effect in this process."""
    return _state.get("on", False)


def release_freed_memory() -> None:
    """Return the heap's free memory to the kernel (``malloc_trim(0)``), e.g. between the stages
    of a pipeline, whose working sets differ. A no-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def prefer_huge_pages() -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` (torch's CPU allocator: transparent huge pages for blocks of
    2 MiB or more; see the module docstring) unless the user set it or ``TURBORLHF_MALLOC=system``.
    torch reads it once, at its first CPU allocation, so call this before torch allocates. Returns
    True if it is in effect for this process's later-started torch."""
    env = os.environ
    if env.get("TURBORLHF_MALLOC", "").lower() == "system":
        return False
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return env["THP_MEM_ALLOC_ENABLE"] == "1"
