"""FastEngine's fused decode kernels (`decode.c`): built once per machine with the system C
compiler (`turborlhf.engine.cbuild`: cached, keyed by source, compiler, flags and CPU, written
atomically), called through ctypes on raw data pointers.

`load()` returns a `DecodeKernels` or None. None means "use the torch path": no C compiler, a
failed build, a non-x86/Linux host, or `TURBORLHF_KERNELS=0` in the environment. The kernels use
torch's OpenMP runtime and `torch.set_num_threads` (see cbuild).

What is built depends on the instruction sets this process may use (`cbuild.isa_flags`, from
`turborlhf.engine.hardware.cpu_features`): attention and RMSNorm always (portable C, with an
AVX-512-BF16 inner loop for bf16 attention where available); the bf16 linears only with
AVX-512-BF16, multiplying on AMX tiles where the CPU has AMX (`set_amx`); the
fp32 linears with AVX2 + FMA; the sampler everywhere (AVX-512
intrinsics, else plain loops). `linear_dtypes` says which linears
exist; FastEngine uses nothing else to decide.
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
    has_linear: the bf16 decode linears below were built (the compiler targets AVX-512-BF16).
    amx: they run on AMX tiles (`set_amx`).
    linear_dtypes: the dtypes with packed linears and `decode_layers` (bf16: AVX-512-BF16;
        float32: AVX2 + FMA). The float32 linears also read weights stored in bf16
        (`weight_dtype=torch.bfloat16`: half the bytes, the same fp32 arithmetic, each weight
        widened exactly). has_sampler: `sample` exists (always; AVX-512 intrinsics or
        vectorised plain loops).
    new_packed / pack_rows → a packed weight; linear(x_MK, packed, N, ...) → y (see decode.c).
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
        self.has_linear = bool(lib.bf16_linear_available())
        self.linear_dtypes: frozenset = frozenset(
            ([torch.bfloat16] if self.has_linear else []) + ([torch.float32] if lib.f32_linear_available() else []))
        self.has_sampler = True            # (AVX-512 intrinsics, or loops GCC vectorises for AVX2)
        lib.amx_enable.argtypes, lib.amx_enable.restype = [I], I
        if not getattr(lib, "amx_initialised", False):      # once per library: the switch is the library's
            lib.amx_initialised = True
            self.set_amx(True)
        layers_args = [P, I, I, ctypes.POINTER(ctypes.c_void_p), P, P, P, P, ctypes.c_int64, P, I, I, I, I, I, I, I,
                       F, F, P]
        self._pack, self._lin, self._layers = {}, {}, {}
        lib.sample_rows_f32.argtypes = [P, I, I, F, P, P, P]
        lib.sample_rows_f32.restype = None
        if self.has_linear:
            lib.bf16_linear_pack_rows.argtypes = [P, P, I, I, I, I, I]
            lib.bf16_linear_pack_rows.restype = None
            lib.bf16_linear.argtypes = [P, P, P, P, P, I, I, I, I, I]
            lib.bf16_linear.restype = None
            lib.decode_layers_bf16.argtypes = layers_args
            lib.decode_layers_bf16.restype = None
        if torch.float32 in self.linear_dtypes:
            for suf in ("f32", "w16"):            # fp32 activations on fp32 / bf16 weights
                for name, args in ((f"{suf}_linear_pack_rows", [P, P, I, I, I, I, I]),
                                   (f"{suf}_linear", [P, P, P, P, P, I, I, I, I]),
                                   (f"decode_layers_{suf}", layers_args)):
                    getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
        for dt, suf in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
            if dt in self.linear_dtypes:
                self._pack[dt] = getattr(lib, f"{suf}_linear_pack_rows")
                self._layers[dt] = getattr(lib, f"decode_layers_{suf}")

    def set_amx(self, on: bool) -> bool:
        """Whether the bf16 linears multiply on AMX tiles (at every row count: on a 2-core AMX Xeon
        they read the weights faster than the AVX-512-BF16 dot products even at 1 row, 1.31
        against 1.77 ms for one SmolLM2 layer and its LM head). True only where the library was built for AMX (a compiler targeting
        amx-tile and amx-bf16) and Linux granted this process the tile state; False turns them
        off (the AVX-512-BF16 dot products then do all rows). Returns the state now in force. The
        switch belongs to the library, so it holds for every engine of the process; `load()`
        leaves it as it is after the first time."""
        return bool(self.lib.amx_enable(int(bool(on))))

    @property
    def amx(self) -> bool:
        """Whether the bf16 linears use AMX tiles now (the switch is the loaded library's, shared
        by every `DecodeKernels` of this process)."""
        return bool(self.lib.amx_enable(-1))

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


    # ---- decode linears (bf16: has_linear; fp32: float32 in linear_dtypes)
    ADD, SWIGLU = 1, 2

    @staticmethod
    def packed_numel(N: int, K: int, swiglu: bool = False, dtype: torch.dtype = torch.bfloat16) -> int:
        """Elements of the packed layout of an N × K weight for activations of `dtype`: bf16,
        32-output blocks of K/2 bf16 pairs; float32, 16-output blocks of K weights (fp32 or bf16)."""
        if dtype == torch.float32:
            return ((N // 2 + 7) // 8 if swiglu else (N + 15) // 16) * K * 16
        return ((N // 2 + 15) // 16 if swiglu else (N + 31) // 32) * ((K + 1) // 2) * 64

    def _pack_fn(self, dtype: torch.dtype, weight_dtype: torch.dtype):
        """The C packer for (activation dtype, weight storage dtype), or None if not built."""
        if (dtype, weight_dtype) == (torch.float32, torch.bfloat16):
            return self.lib.w16_linear_pack_rows if torch.float32 in self.linear_dtypes else None
        return self._pack.get(dtype) if weight_dtype == dtype else None

    def new_packed(self, N: int, K: int, swiglu: bool = False, dtype: torch.dtype = torch.bfloat16,
                   weight_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A zero packed weight for N × K, for activations of `dtype`, stored in `weight_dtype`
        (default `dtype`; float32 activations also take bf16 weights). Fill it with `pack_rows`.
        Raises ValueError for a combination without linears on this CPU (`linear_dtypes`)."""
        wdt = dtype if weight_dtype is None else weight_dtype
        if self._pack_fn(dtype, wdt) is None:
            raise ValueError(f"no {dtype} decode linears with {wdt} weights on this CPU "
                             f"(built: {sorted(map(str, self.linear_dtypes))})")
        packed = torch.zeros(self.packed_numel(N, K, swiglu, dtype), dtype=wdt)
        # the layout follows the activations' dtype, which the storage dtype does not tell apart
        # (bf16 weights for fp32 x, or for bf16 x, can have the same size): `linear` checks it
        packed.act_dtype = dtype
        return packed

    def pack_rows(self, rows_nK: torch.Tensor, packed: torch.Tensor, row0: int, N: int, swiglu: bool = False,
                  dtype: Optional[torch.dtype] = None) -> None:
        """Write rows [row0, row0 + n) of an N × K weight into `packed` (from `new_packed` with the
        same activation `dtype`, default the packed tensor's dtype).
        swiglu: the weight is the fused [gate; up] (N = 2I; rows < I are gate rows), packed so
        `linear(..., op=SWIGLU)` yields silu(gate)·up. Casts to the packed tensor's dtype (bf16:
        round to nearest even). Raises ValueError on a row range outside the weight or a
        mismatched packed size."""
        n, K = rows_nK.shape
        if not 0 <= row0 <= row0 + n <= N or (swiglu and N % 2):
            raise ValueError(f"pack_rows: rows [{row0}, {row0 + n}) do not fit a {'fused gate/up ' if swiglu else ''}"
                             f"weight of {N} rows")
        wdt = packed.dtype
        adt = dtype or getattr(packed, "act_dtype", None) or wdt
        fn = self._pack_fn(adt, wdt)
        if fn is None or packed.numel() != self.packed_numel(N, K, swiglu, adt):
            raise ValueError(f"pack_rows: packed tensor does not match a {N}×{K} weight")
        src = rows_nK.detach().to(wdt).contiguous()
        fn(src.data_ptr(), packed.data_ptr(), n, row0, N, K, int(swiglu))

    def linear(self, x_MK: torch.Tensor, packed: torch.Tensor, N: int, bias_N: Optional[torch.Tensor] = None,
               other_MN: Optional[torch.Tensor] = None, op: int = 0, out_f32: bool = False) -> torch.Tensor:
        """y = x·Wᵀ (+ bias) of a `new_packed`/`pack_rows` weight with N output rows, then op 0: y;
        ADD: y + other_MN; SWIGLU: silu(gate)·up, N/2 columns (W packed with swiglu=True, bias of
        the fused [gate; up]). x_MK: contiguous, the activation dtype the weight was packed for
        (bf16: K even; fp32 x reads fp32 or bf16 weights; a weight from `new_packed` remembers it
        and any other x dtype raises ValueError). Returns M × N (or N/2) in x's dtype, or
        fp32 with out_f32. Arithmetic: bf16 products summed in fp32 (vdpbf16ps); fp32 FMAs (bf16
        weights widened exactly first)."""
        M, K = x_MK.shape
        dt = x_MK.dtype                  # the activations' dtype picks the layout and the arithmetic
        w16 = dt == torch.float32 and packed.dtype == torch.bfloat16
        if self._pack_fn(dt, packed.dtype) is None:
            raise ValueError(f"linear: no linears for {dt} x with {packed.dtype} weights on this CPU "
                             f"(built: {sorted(map(str, self.linear_dtypes))}; fp32 x also takes bf16 weights)")
        if getattr(packed, "act_dtype", dt) != dt:
            raise ValueError(f"linear: the weight was packed for {packed.act_dtype} x, got {dt} x "
                             "(the layout does not match)")
        if not x_MK.is_contiguous() or (dt == torch.bfloat16 and K % 2):
            raise ValueError(f"linear: x must be contiguous{' with an even width' if dt == torch.bfloat16 else ''}, "
                             f"got {x_MK.dtype} {tuple(x_MK.shape)} (contiguous={x_MK.is_contiguous()})")
        if packed.numel() != self.packed_numel(N, K, op == self.SWIGLU, dt):
            raise ValueError(f"linear: packed weight does not match a {N}×{K} weight")
        n_out = N // 2 if op == self.SWIGLU else N
        if op == self.ADD:
            if other_MN is None or other_MN.shape != (M, N) or other_MN.dtype != dt \
                    or not other_MN.is_contiguous():
                raise ValueError(f"linear: op ADD needs a contiguous {dt} `other` of shape M×N")
        out = torch.empty(M, n_out, dtype=torch.float32 if out_f32 else dt)
        if dt == torch.float32:
            fn = self.lib.w16_linear if w16 else self.lib.f32_linear
            fn(x_MK.data_ptr(), packed.data_ptr(), None if bias_N is None else bias_N.data_ptr(),
               None if other_MN is None else other_MN.data_ptr(), out.data_ptr(), M, K, N, op)
            return out
        self.lib.bf16_linear(x_MK.data_ptr(), packed.data_ptr(), None if bias_N is None else bias_N.data_ptr(),
                             None if other_MN is None else other_MN.data_ptr(), out.data_ptr(), M, K, N, op,
                             int(out_f32))
        return out

    def layer_table(self, layers: list) -> "ctypes.Array":
        """The weight pointers `decode_layers` reads: per layer (ln1, qkv packed, b_qkv, o packed,
        b_o, ln2, gate/up packed, b_gu, down packed, b_d), None for an absent bias. The tensors must
        stay alive and in place (the engine packs new weights into the same storage)."""
        ptrs = []
        for ly in layers:
            ptrs += [None if t is None else t.data_ptr() for t in ly]
        return (ctypes.c_void_p * len(ptrs))(*ptrs)

    def decode_layers(self, table, x_BE: torch.Tensor, cos_BD: torch.Tensor, sins_BD: torch.Tensor,
                      K_LBKTD: torch.Tensor, V_LBKTD: torch.Tensor, start_B: torch.Tensor, col: int,
                      n_heads: int, intermediate: int, scale: float, eps: float,
                      scratch: Optional[torch.Tensor] = None,
                      weight_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Every decoder layer of one decode step in one call (see decode.c): x_BE, the residual
        stream (contiguous, a dtype of `linear_dtypes`), is updated in place and returned. K/V:
        the whole cache L×B×KV×Tmax×D (contiguous). weight_dtype: the table's packed weights'
        dtype (default x's; float32 activations with bf16 weights use the w16 linears). Raises
        ValueError on a dtype/layout mismatch."""
        L, B, KV, Tmax, D = K_LBKTD.shape
        E = x_BE.shape[1]
        dt = x_BE.dtype
        wdt = dt if weight_dtype is None else weight_dtype
        if dt not in self._layers or self._pack_fn(dt, wdt) is None:
            raise ValueError(f"decode_layers: no {dt} decode linears with {wdt} weights on this CPU")
        layers_fn = self.lib.decode_layers_w16 if wdt != dt else self._layers[dt]
        for name, t in (("x", x_BE), ("cos", cos_BD), ("sins", sins_BD), ("K", K_LBKTD), ("V", V_LBKTD)):
            if t.dtype != dt or not t.is_contiguous():
                raise ValueError(f"decode_layers: {name} must be contiguous {dt}")
        if start_B.dtype != torch.int64 or not start_B.is_contiguous() or len(table) != 10 * L:
            raise ValueError("decode_layers: start_B must be contiguous int64 and the table hold 10 pointers per layer")
        if not 0 <= col < Tmax:
            raise ValueError(f"decode_layers: column {col} outside the cache (0..{Tmax - 1})")
        need = B * (2 * E + (n_heads + 2 * KV) * D + n_heads * D + intermediate)
        if scratch is None or scratch.numel() < need or scratch.dtype != dt:
            scratch = torch.empty(need, dtype=dt)
        layers_fn(x_BE.data_ptr(), B, L, table, cos_BD.data_ptr(), sins_BD.data_ptr(), K_LBKTD.data_ptr(),
                  V_LBKTD.data_ptr(), B * KV * Tmax * D, start_B.data_ptr(), E, n_heads, KV, D, intermediate,
                  Tmax, col, scale, eps, scratch.data_ptr())
        return x_BE

    def sample(self, logits_BV: torch.Tensor, temperature: float, u_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draw per row from softmax(logits / temperature) by inverting the CDF at u_B·total
        (`turborlhf.rollout.sampling.inverse_cdf_sample` without top-k/top-p, in three passes).
        logits_BV: contiguous float32 (-inf = probability 0, at least one finite per row); u_B:
        float32 uniforms in [0, 1). Returns (ids_B int64, logp_B float32). Raises ValueError on a
        bad dtype, layout or temperature."""
        B, V = logits_BV.shape
        if logits_BV.dtype != torch.float32 or not logits_BV.is_contiguous() or temperature <= 0:
            raise ValueError("sample: logits must be contiguous float32 and temperature > 0")
        u = u_B.to(torch.float32).contiguous()
        if u.numel() != B:
            raise ValueError(f"sample: {u.numel()} uniforms for {B} rows")
        ids = torch.empty(B, dtype=torch.int64)
        logp = torch.empty(B, dtype=torch.float32)
        self.lib.sample_rows_f32(logits_BV.data_ptr(), B, V, float(temperature), u.data_ptr(), ids.data_ptr(),
                                 logp.data_ptr())
        return ids, logp


def load(warn: bool = True) -> Optional[DecodeKernels]:
    """The kernels, built on first use; None if unavailable (then FastEngine uses torch ops).
    A failed build warns once (`warn`) and is not retried in this process."""
    lib = load_library(_SRC, "FastEngine: fused decode kernels", warn)
    return None if lib is None else DecodeKernels(lib)
