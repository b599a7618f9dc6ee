"""FastEngine's weights (`FastEngineWeights`, a mixin of `turborlhf.rollout.fast.FastEngine`): the
engine's own converted copy of a Llama-family model's parameters, its layout (q/k/v fused into one
matrix, gate/up into one), in-place loading from (HF name, tensor) pairs, re-packing for the linear
backend (oneDNN, the `turborlhf.rollout.kernels` packed layout, int8 weight-only), and the linears
that read them. The decode loop and attention stay in `turborlhf.rollout.fast`.

Packed slots: 5 per layer (qkv, o, gate, up, down; the kernel backend keeps gate·up fused in the
gate slot), the LM head is slot 5·L.
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

import torch
import torch.nn.functional as F

from ._util import strip_wrapper_prefixes
from .llama_ops import _pack, _quantize_int8

__all__ = ["FastEngineWeights"]


class _Layer:
    """One decoder layer's tensors (a fused matrix is None where only its packed form exists)."""
    __slots__ = ("ln1", "wqkv", "bqkv", "wo", "bo", "ln2", "wgu", "bgu", "wd", "bd")


# packed slots per layer: qkv, o, gate, up, down; the LM head is slot 5·L
_QKV, _O, _GATE, _UP, _DOWN = range(5)


class FastEngineWeights:
    """The weight half of `FastEngine` (module docstring). It reads what the engine's constructor
    sets: the model sizes (hidden, n_heads, n_kv, head_dim, n_layers, vocab_size, config, tied,
    biases), `dtype`, `weight_dtype`, and the backend state (`_kl`/`_k` kernels, `_mkl` oneDNN, `int8_max_batch`,
    `_packed`, `_pbias`, `_q8`, `_out_features`)."""

    # ------------------------------------------------------------------ weights
    def _alloc_weights(self):
        E, H, KV, D, I = self.hidden, self.n_heads, self.n_kv, self.head_dim, self.config.intermediate_size
        dt = self.dtype
        z = lambda *s: torch.zeros(*s, dtype=dt)
        self.embed_VE = z(self.vocab_size, E)
        self.lm_head_VE = self.embed_VE if self.tied else z(self.vocab_size, E)
        self.norm_E = z(E)
        self.layers: list[_Layer] = []
        qkv = (H + 2 * KV) * D
        # name → (tensor, row slice or None); q/k/v and gate/up land in slices of fused matrices
        self._slots: dict[str, tuple[torch.Tensor, Optional[slice]]] = {
            "model.embed_tokens.weight": (self.embed_VE, None),
            "model.norm.weight": (self.norm_E, None),
            "lm_head.weight": (self.lm_head_VE, None),
        }
        # name → which packed group must be re-packed after it changes (layer i, or L = LM head)
        L = self.n_layers
        self._pack_group: dict[str, int] = {"lm_head.weight": L}
        if self.tied:
            self._pack_group["model.embed_tokens.weight"] = L
        # kernel backend: the layer matrices exist only packed, written by `load_weights`
        # (name → (slot, first row, its rows, rows of the whole matrix, gate/up fused))
        self._kslots: dict[str, tuple[int, int, int, int, bool]] = {}
        if self._kl:
            kz = lambda n, k, swiglu=False: self._k.new_packed(n, k, swiglu, self.dtype,  # noqa: E731
                                                               self.weight_dtype)
            self._kp: list[Optional[torch.Tensor]] = [None] * (5 * L + 1)
            self._kp[5 * L] = kz(self.vocab_size, E)
            self._out_features[5 * L] = self.vocab_size
            self._kslots["lm_head.weight"] = (5 * L, 0, self.vocab_size, self.vocab_size, False)
            if self.tied:
                self._kslots["model.embed_tokens.weight"] = self._kslots["lm_head.weight"]
        for i in range(self.n_layers):
            ly = _Layer()
            ly.ln1, ly.ln2 = z(E), z(E)
            if self._kl:
                ly.wqkv = ly.wo = ly.wgu = ly.wd = None
                s5 = 5 * i
                self._kp[s5 + _QKV], self._kp[s5 + _O] = kz(qkv, E), kz(E, H * D)
                self._kp[s5 + _GATE], self._kp[s5 + _DOWN] = kz(2 * I, E, True), kz(E, I)
                for slot, n in ((_QKV, qkv), (_O, E), (_GATE, 2 * I), (_DOWN, E)):
                    self._out_features[s5 + slot] = n
            else:
                ly.wqkv, ly.wo = z(qkv, E), z(E, H * D)
                ly.wgu, ly.wd = z(2 * I, E), z(E, I)
            ly.bqkv = z(qkv) if self._qkv_bias else None
            ly.bo = z(E) if self._o_bias else None
            ly.bgu = z(2 * I) if self._mlp_bias else None
            ly.bd = z(E) if self._mlp_bias else None
            self.layers.append(ly)
            p = f"model.layers.{i}."
            s = self._slots
            for nm in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                self._pack_group[p + nm + ".weight"] = self._pack_group[p + nm + ".bias"] = i
            s[p + "input_layernorm.weight"] = (ly.ln1, None)
            s[p + "post_attention_layernorm.weight"] = (ly.ln2, None)
            qs, ks, vs = slice(0, H * D), slice(H * D, (H + KV) * D), slice((H + KV) * D, qkv)
            for nm, sl in (("q", qs), ("k", ks), ("v", vs)):
                if self._kl:
                    self._kslots[p + f"self_attn.{nm}_proj.weight"] = (5 * i + _QKV, sl.start, sl.stop - sl.start,
                                                                       qkv, False)
                else:
                    s[p + f"self_attn.{nm}_proj.weight"] = (ly.wqkv, sl)
                if ly.bqkv is not None:
                    s[p + f"self_attn.{nm}_proj.bias"] = (ly.bqkv, sl)
            if ly.bo is not None:
                s[p + "self_attn.o_proj.bias"] = (ly.bo, None)
            if self._kl:
                ks_ = self._kslots
                ks_[p + "self_attn.o_proj.weight"] = (5 * i + _O, 0, E, E, False)
                ks_[p + "mlp.gate_proj.weight"] = (5 * i + _GATE, 0, I, 2 * I, True)
                ks_[p + "mlp.up_proj.weight"] = (5 * i + _GATE, I, I, 2 * I, True)
                ks_[p + "mlp.down_proj.weight"] = (5 * i + _DOWN, 0, E, E, False)
            else:
                s[p + "self_attn.o_proj.weight"] = (ly.wo, None)
                s[p + "mlp.gate_proj.weight"] = (ly.wgu, slice(0, I))
                s[p + "mlp.up_proj.weight"] = (ly.wgu, slice(I, 2 * I))
                s[p + "mlp.down_proj.weight"] = (ly.wd, None)
            if self._mlp_bias:
                s[p + "mlp.gate_proj.bias"] = (ly.bgu, slice(0, I))
                s[p + "mlp.up_proj.bias"] = (ly.bgu, slice(I, 2 * I))
                s[p + "mlp.down_proj.bias"] = (ly.bd, None)
        self._unloaded = (set(self._slots) | set(self._kslots)) - ({"lm_head.weight"} if self.tied else set())
        # kernel backend: the pointer table of `decode_layers` (weights are packed in place, so
        # the pointers stay valid across load_weights) and its scratch buffer
        self._ktable, self._kscratch = None, None
        self._one_call = True          # (tests switch it off to compare with the per-layer calls)
        if self._kl:
            self._ktable = self._k.layer_table([
                (ly.ln1, self._kp[5 * i + _QKV], ly.bqkv, self._kp[5 * i + _O], ly.bo, ly.ln2,
                 self._kp[5 * i + _GATE], ly.bgu, self._kp[5 * i + _DOWN], ly.bd) for i, ly in enumerate(self.layers)])

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF parameter name, tensor) pairs into the engine's weights in place (cast to the
        engine dtype), then re-pack the oneDNN weights of the layers touched. Partial updates
        are allowed. Wrapper prefixes ('module.', '_orig_mod.') are stripped; rotary buffers
        are ignored. With tied embeddings 'lm_head.weight' writes the shared embedding. Tensors
        on another device (a trainer on a GPU) are copied to the CPU first. Seconds spent are
        left in `last_weight_update` ({'copy_s', 'repack_s', 'tensors'}).
        Raises KeyError on an unknown name, ValueError on a bad shape."""
        t0 = time.perf_counter()
        dirty: set[int] = set()
        n = 0
        with torch.no_grad():
            for name, t in named_tensors:
                name = strip_wrapper_prefixes(name)
                t = t.detach().cpu()          # a trainer on a GPU: the engine and its C kernels are on the CPU
                if name.endswith("rotary_emb.inv_freq") or name.endswith("rotary_emb.original_inv_freq"):
                    continue
                if name not in self._slots and name not in self._kslots:
                    raise KeyError(f"FastEngine: unknown parameter {name!r}")
                if name in self._kslots:                      # kernel backend: pack the rows in place
                    slot, row0, rows, N, swiglu = self._kslots[name]
                    if t.dim() != 2 or t.shape[0] != rows or \
                            self._k.packed_numel(N, t.shape[1], swiglu, self.dtype) != self._kp[slot].numel():
                        raise ValueError(f"{name}: shape {tuple(t.shape)} does not fit the engine's "
                                         f"{rows}-row slice of a {N}-row packed matrix")
                    self._k.pack_rows(t, self._kp[slot], row0, N, swiglu, self.dtype)
                    if name not in self._slots:               # (a tied embedding is also kept dense)
                        self._unloaded.discard(name)
                        n += 1
                        continue
                dst, sl = self._slots[name]
                if sl is not None:
                    dst = dst[sl]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} != engine {tuple(dst.shape)}")
                src = t.detach()
                if t.dim() == 2 and self.weight_dtype != self.dtype:    # the embedding rounds as the matrices do
                    src = src.to(self.weight_dtype)
                dst.copy_(src)
                self._unloaded.discard(name)
                n += 1
                g = self._pack_group.get(name)
                if g is not None:
                    dirty.add(g)
        t1 = time.perf_counter()
        self._repack(dirty)
        self.last_weight_update = {"copy_s": t1 - t0, "repack_s": time.perf_counter() - t1, "tensors": n}

    def _repack(self, groups: Iterable[int]) -> None:
        """Rebuild the packed oneDNN weights of layers `groups` (L = the LM head) from the dense
        copies. Dense backend: only records output sizes. Kernel backend: nothing (packed by
        `load_weights` itself)."""
        if self._kl:
            return
        L, I = self.n_layers, self.config.intermediate_size
        with torch.no_grad():
            for g in sorted(groups):
                if g == L:
                    mats = [(5 * L, self.lm_head_VE, None)]
                else:
                    ly = self.layers[g]
                    bg = ly.bgu[:I] if ly.bgu is not None else None
                    bu = ly.bgu[I:] if ly.bgu is not None else None
                    mats = [(5 * g + _QKV, ly.wqkv, ly.bqkv), (5 * g + _O, ly.wo, ly.bo),
                            (5 * g + _GATE, ly.wgu[:I], bg), (5 * g + _UP, ly.wgu[I:], bu),
                            (5 * g + _DOWN, ly.wd, ly.bd)]
                for slot, w, b in mats:
                    self._out_features[slot] = w.shape[0]
                    if self._mkl:
                        self._packed[slot] = _pack(w)
                        self._pbias[slot] = None if b is None else b.contiguous()
                if self.int8_max_batch:
                    q8 = ([(5 * L, self.lm_head_VE, None)] if g == L else
                          [(5 * g + _QKV, ly.wqkv, ly.bqkv), (5 * g + _O, ly.wo, ly.bo),
                           (5 * g + _GATE, ly.wgu, ly.bgu), (5 * g + _DOWN, ly.wd, ly.bd)])  # gate·up fused
                    for slot, w, b in q8:
                        self._q8[slot] = (*_quantize_int8(w, self.dtype), b)

    # ------------------------------------------------------------------ linears
    def _plin(self, x: torch.Tensor, other: Optional[torch.Tensor], slot: int, attr: str) -> torch.Tensor:
        """Packed oneDNN linear of slot `slot` with a fused post-op:
        attr 'none' → xWᵀ+b; 'swish' → silu(xWᵀ+b); 'add' → xWᵀ+b+other; 'mul' → (xWᵀ+b)·other."""
        w, b = self._packed[slot], self._pbias[slot]
        if other is None:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, attr, [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, w, b, attr)

    def _klin(self, x: torch.Tensor, slot: int, op: int = 0, other: Optional[torch.Tensor] = None,
              out_f32: bool = False) -> torch.Tensor:
        """Kernel-backend linear of slot `slot` on x (…×in): op 0 → xWᵀ+b; ADD → xWᵀ+b+other;
        SWIGLU (the fused gate/up slot) → silu(x·Wgᵀ+bg)·(x·Wuᵀ+bu). Returns …×out (bf16, or
        fp32 with out_f32)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        o2 = None if other is None else other.reshape(-1, other.shape[-1]).contiguous()
        y = self._k.linear(x2, self._kp[slot], self._out_features[slot], self._kbias(slot), o2, op, out_f32)
        return y.view(*lead, y.shape[-1])

    def _kbias(self, slot: int) -> Optional[torch.Tensor]:
        l, k = divmod(slot, 5)
        if l == self.n_layers:
            return None
        ly = self.layers[l]
        return {_QKV: ly.bqkv, _O: ly.bo, _GATE: ly.bgu, _DOWN: ly.bd}[k]

    def _lin8(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """int8 weight-only linear of slot `slot` (x: 2-D)."""
        q, scale, b = self._q8[slot]
        y = torch._weight_int8pack_mm(x, q, scale)
        return y if b is None else y + b

    def _head(self, h: torch.Tensor, int8: bool = False) -> torch.Tensor:
        """LM head → float32 logits."""
        if int8:
            return self._lin8(h, 5 * self.n_layers).float()
        if self._kl:
            return self._klin(h, 5 * self.n_layers, out_f32=True)
        if self._mkl:
            return self._plin(h, None, 5 * self.n_layers, "none").float()
        return F.linear(h, self.lm_head_VE).float()
