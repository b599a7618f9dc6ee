"""FastEngine's fused decode kernels (`decode.c`): built once per machine with the system C
compiler (`turborlhf.engine.cbuild`: cached, keyed by source, compiler, flags and CPU, written
atomically), called through ctypes on raw data pointers.

`load()` returns a `DecodeKernels` or None. None means "use the torch path": no C compiler, a
failed build, a non-x86/Linux host, or `TURBORLHF_KERNELS=0` in the environment. The kernels use
torch's OpenMP runtime and `torch.set_num_threads` (see cbuild).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from turborlhf.engine.cbuild import load_library

__all__ = ["DecodeKernels", "load"]

_SRC = Path(__file__).with_name("decode.c")


class DecodeKernels:
    """ctypes bindings of decode.c (see its comments for the exact maths).

    attention(qkv_BW, cos_BD, sins_BD, K_BKTD, V_BKTD, start_B, out_BHD, n_heads, col, scale):
        RoPE of q and k, k and v written at cache column `col`, softmax(q·Kᵀ·scale)·V over
        columns [start_B[b], col] of each row. qkv_BW: B×(H+2KV)·D; cos/sins: B×D; K/V: one
        layer's cache B×KV×Tmax×D; start_B: int64; out: B×H·D. All contiguous, same dtype
        (float32 or bfloat16). Raises ValueError on a dtype/layout mismatch.
    rms_norm(x_BE, w_E, out_BE, eps): transformers' LlamaRMSNorm.
    """

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self._attn, self._rms = {}, {}
        for dt, suf in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            f = getattr(lib, f"decode_attention_{suf}")
            f.argtypes = [P, P, P, P, P, P, P, I, I, I, I, I, I, F]
            f.restype = None
            self._attn[dt] = f
            g = getattr(lib, f"rms_norm_{suf}")
            g.argtypes = [P, P, P, I, I, F]
            g.restype = None
            self._rms[dt] = g

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._attn

    def attention(self, qkv_BW, cos_BD, sins_BD, K_BKTD, V_BKTD, start_B, out_BHD, n_heads: int,
                  col: int, scale: float) -> torch.Tensor:
        B, KV, Tmax, D = K_BKTD.shape
        dt = K_BKTD.dtype
        for name, t in (("qkv", qkv_BW), ("cos", cos_BD), ("sins", sins_BD), ("K", K_BKTD), ("V", V_BKTD),
                        ("out", out_BHD)):
            if t.dtype != dt or not t.is_contiguous():
                raise ValueError(f"decode attention: {name} must be contiguous {dt}, got {t.dtype} "
                                 f"(contiguous={t.is_contiguous()})")
        if start_B.dtype != torch.int64 or not start_B.is_contiguous():
            raise ValueError("decode attention: start_B must be contiguous int64")
        if not 0 <= col < Tmax:
            raise ValueError(f"decode attention: column {col} outside the cache (0..{Tmax - 1})")
        self._attn[dt](qkv_BW.data_ptr(), cos_BD.data_ptr(), sins_BD.data_ptr(), K_BKTD.data_ptr(),
                       V_BKTD.data_ptr(), start_B.data_ptr(), out_BHD.data_ptr(), B, n_heads, KV, D, Tmax,
                       col, scale)
        return out_BHD

    def rms_norm(self, x_BE: torch.Tensor, w_E: torch.Tensor, out_BE: torch.Tensor, eps: float) -> torch.Tensor:
        B, E = x_BE.shape
        self._rms[x_BE.dtype](x_BE.data_ptr(), w_E.data_ptr(), out_BE.data_ptr(), B, E, eps)
        return out_BE


def load(warn: bool = True) -> Optional[DecodeKernels]:
    """The kernels, built on first use; None if unavailable (then FastEngine uses torch ops).
    A failed build warns once (`warn`) and is not retried in this process."""
    lib = load_library(_SRC, "FastEngine: fused decode kernels", warn)
    return None if lib is None else DecodeKernels(lib)
