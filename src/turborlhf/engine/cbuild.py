"""Build a C source of the package into a shared library, once per machine, for ctypes.

Used by FastEngine's decode kernels (`turborlhf.rollout.kernels`), the bf16-moment AdamW
(`turborlhf.engine.optim`) and the trainers' LM-head, RMSNorm and SwiGLU passes
(`turborlhf.models.head_logprobs`, `turborlhf.models.fused`). The library goes to
`$TURBORLHF_CACHE/kernels` (default `~/.cache/turborlhf/kernels`), keyed by a hash of the source
(with the headers it includes from its own folder, e.g. `engine/bf16.h`), the compiler version, the
flags and the CPU's model name and flags (so a cache shared between different CPUs rebuilds), and is
written atomically (temp file, then rename): concurrent first uses never load a half-written library.
`-march=native` is safe because the library is built on the machine that runs it; it is narrowed
to the instruction sets this process may use (`isa_flags`: `-mno-avx512f` where
`turborlhf.engine.hardware.cpu_features` reports no AVX-512; the x86-64-v3 baseline where
`ATEN_CPU_CAPABILITY=avx2` limits an AVX-512 CPU), and those flags are part of the cache key.

Threading: the libraries link `libgomp.so.1`, which resolves to the copy torch has already loaded
(same SONAME), so the kernels use torch's OpenMP runtime and `torch.set_num_threads`. Compile and
link are separate steps so `-ffast-math` (needed for glibc's vectorised `expf`) never links
`crtfastmath.o`, which would switch the whole process to flush-denormals-to-zero.

`fast_math=False` builds a library without `-ffast-math` (with `-fno-math-errno`, so `sqrtf` still
vectorises): for code whose inputs may be denormal, infinite or zero. The AdamW kernel needs it:
under `-ffast-math` gcc computes `sqrtf(v)` as `v * rsqrt(v)` with a Newton step, which is NaN
for denormal `v` on 256-bit lanes (`vrsqrtps` treats them as zero: `v * inf`) and for `v = inf`.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional

__all__ = ["CFLAGS", "isa_flags", "cache_dir", "compiler", "build_shared_library", "load_library"]

_lock = threading.Lock()
_loaded: dict[str, Optional[ctypes.CDLL]] = {}     # source path → library (None: the build failed)
_unwarned: dict[str, str] = {}     # key of a failed build → its warning, not yet given (probed with warn=False)

CFLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11"]     # + isa_flags()
LDFLAGS = ["-shared", "-fopenmp"]
LIBS = ["-lmvec", "-lm"]


def cache_dir() -> Path:
    root = os.environ.get("TURBORLHF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "turborlhf")
    return Path(root) / "kernels"


def _cpu_model() -> str:
    """The first CPU's ``model name`` and ``flags`` lines of /proc/cpuinfo: the name alone does not
    tell CPU generations apart (a VM may report just "AMD EPYC" for a Zen 3 and a Zen 4), and a
    ``-march=native`` build from one must not load on the other through a shared cache."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    model = next((ln for ln in lines if ln.startswith("model name")), "")
    flags = next((ln for ln in lines if ln.startswith("flags")), "")
    return f"{model}\n{flags}" if model or flags else platform.processor()


def isa_flags() -> list[str]:
    """The target flags for what `cpu_features()` says this process may use:
    - everything the CPU has: ``-march=native``;
    - AVX2 and FMA but no AVX-512 on a CPU that has it (``ATEN_CPU_CAPABILITY=avx2`` /
      ``ONEDNN_MAX_CPU_ISA=AVX2``, which stand in for an AVX2-only CPU): ``-march=x86-64-v3
      -mtune=native``, the AVX2 baseline every such CPU has, so GCC emits none of the extensions
      (AVX-VNNI, AMX...) a real AVX2-only CPU such as AMD Zen 3 lacks;
    - otherwise no AVX-512 at all → ``-march=native -mno-avx512f`` (GCC then drops every AVX-512
      subset); AVX-512 without AVX-512-BF16 → ``-march=native -mno-avx512bf16``; and on a CPU
      with AMX that this process may not use (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``), no AMX.
    So the C sources' ``#ifdef __AVX512F__`` / ``__AVX512BF16__`` paths are compiled exactly where
    they may run."""
    from turborlhf.engine import hardware

    feats = hardware.cpu_features()
    if "avx512f" not in feats and {"avx2", "fma"} <= feats and "avx512f" in hardware.host_cpu_features():
        return ["-march=x86-64-v3", "-mtune=native"]
    flags = ["-march=native"]
    if "avx512f" not in feats:
        flags.append("-mno-avx512f")
    elif "avx512_bf16" not in feats:
        flags.append("-mno-avx512bf16")
    if "amx_bf16" not in feats and "amx_bf16" in hardware.host_cpu_features():
        flags += ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
    return flags


def compiler() -> Optional[str]:
    """The C compiler to use ($CC, gcc or cc), or None where the kernels are not supported (no
    compiler, not x86-64 Linux, or `TURBORLHF_KERNELS=0` in the environment). $CC is a command
    line as make reads it (``ccache gcc``, ``gcc -pipe``): `build_shared_library` splits it."""
    if os.environ.get("TURBORLHF_KERNELS", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cflags(fast_math: bool) -> list[str]:
    """CFLAGS, or without `-ffast-math` (plus `-fno-math-errno`) when `fast_math` is False."""
    return list(CFLAGS) if fast_math else [f for f in CFLAGS if f != "-ffast-math"] + ["-fno-math-errno"]


def _source_text(src: Path) -> str:
    """`src`'s text followed by that of each header it includes with quotes (``#include "x.h"``,
    looked up beside it, one level deep), so that editing a shared header rebuilds its users."""
    text = src.read_text()
    headers = re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, flags=re.MULTILINE)
    return "\0".join([text] + [(src.parent / h).read_text() for h in headers])


def build_shared_library(src: Path, cc: str, fast_math: bool = True) -> Path:
    """Compile `src` into the cache (once); returns the library's path. `cc`: the compiler's
    command line (`compiler`; split as a shell would, so ``ccache gcc`` works). `fast_math=False`
    drops `-ffast-math` (IEEE semantics for denormals, inf and NaN). Raises RuntimeError with the
    compiler's message on failure."""
    cc_argv = shlex.split(cc)
    cflags = _cflags(fast_math) + isa_flags()
    ver = subprocess.run([*cc_argv, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([_source_text(src), ver, " ".join(cflags + LDFLAGS + LIBS),
                                    _cpu_model()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{src.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = os.path.join(tmp, f"{src.stem}.o"), os.path.join(tmp, f"{src.stem}.so")
        for cmd in ([*cc_argv, *cflags, "-c", str(src), "-o", obj], [*cc_argv, *LDFLAGS, obj, "-o", lib, *LIBS]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        os.replace(lib, out)
    return out


def load_library(src: Path, what: str, warn: bool = True, fast_math: bool = True,
                 prepare: Optional[Callable[[ctypes.CDLL], None]] = None) -> Optional[ctypes.CDLL]:
    """`src` built (`build_shared_library`, `fast_math` as there) and loaded, once per process; None where kernels are
    not supported (`compiler`, `TURBORLHF_KERNELS=0`) or the build or load failed. `prepare(lib)`
    runs once, after the load (e.g. to set the functions' ctypes types). A failure is not retried in
    this process, and warns once ("<what> unavailable (...); using torch ops") at the first call with
    `warn`, even when a ``warn=False`` probe (e.g. `turborlhf.engine.hardware.choose_state_dtype`)
    met it first. After the first call this is a dictionary lookup: the trainers ask for their
    kernels in every layer's forward and backward."""
    if os.environ.get("TURBORLHF_KERNELS", "1") == "0":
        return None
    key = f"{src}|fast_math={fast_math}"
    if key in _loaded:
        if warn and key in _unwarned:
            with _lock:
                msg = _unwarned.pop(key, None)
            if msg is not None:
                warnings.warn(msg)
        return _loaded[key]
    with _lock:
        if key not in _loaded:
            lib, cc = None, compiler()
            if cc is not None:
                try:
                    lib = ctypes.CDLL(str(build_shared_library(src, cc, fast_math)))
                    if prepare is not None:
                        prepare(lib)
                except Exception as e:  # noqa: BLE001 - any build/load failure → the caller's torch path
                    lib = None
                    msg = f"{what} unavailable ({type(e).__name__}: {str(e)[:300]}); using torch ops"
                    if warn:
                        warnings.warn(msg)
                    else:
                        _unwarned[key] = msg
            _loaded[key] = lib
        return _loaded[key]
