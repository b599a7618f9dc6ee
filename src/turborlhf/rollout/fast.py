"""FastEngine: the embedded rollout engine, a hand-written decode loop for Llama-family models.

Supported: `LlamaForCausalLM` (RMSNorm, RoPE of any `rope_type` transformers knows except
"dynamic", grouped-query attention, SiLU-gated MLP, attention/MLP biases, tied or untied
lm_head), `Qwen2ForCausalLM` (q/k/v biases) and `MistralForCausalLM` without a sliding window.
Anything else → use `HFEngine` (see `turborlhf.rollout.make_engine`).

What makes it fast on a CPU, compared with `transformers` `generate` (benchmarks/rollout_speed.py
measures both in one process):
- the engine owns a converted copy of the weights (bf16 by default) with q/k/v fused into one
  matrix and gate/up fused into one, refreshed in place by `load_weights` (no disk);
- in bf16 the linears are our own AVX-512-BF16 kernels (`linear_backend='kernel'`,
  `turborlhf.rollout.kernels`; on AMX tiles where the CPU has them) on weights
  packed into 32-output blocks, with the residual add and silu(gate)·up fused in;
  `load_weights` packs the trainer's tensors straight into place (no dense copy of the layer
  matrices). Where they do not build: oneDNN with weights pre-packed into
  its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the op Inductor's freezing
  uses), about 2× faster than `F.linear` for the 1-32 rows of a decode step, post-ops fused,
  re-packed by `load_weights` (~0.1 s for all of SmolLM2-135M). A policy update never needs a
  recompile. In fp32 the kernel linears are AVX2/FMA ones on 16-output blocks (the fast path of
  CPUs without native bf16). Which backend can run is decided from the CPU's instruction sets
  (`turborlhf.rollout.backends`);
- prefill and scoring run the linears on the non-padding tokens only;
- RoPE, the KV-cache write and decode attention in one C call per layer, RMSNorm in another
  (`turborlhf.rollout.kernels`, built on first use; the torch ops below are the fallback); with
  the kernel linears, all layers of a decode step are a single C call (`decode_layers`);
- a static KV cache `K_LBKTD` allocated once per call; prompts are left-padded into columns
  [0, P) and generated token t is written at column P + t for every row;
- identical prompts (and the n samples of a prompt) are prefilled once and their cache rows
  copied;
- the prefix every prompt of a batch shares (a chat template's system prompt: 24 of ~40 tokens
  for SmolLM2's) is prefilled once, in one row; the rest of each prompt attends to its K/V, which
  are then copied into every row of the cache (automatic prefix caching, as vLLM and SGLang do it,
  within one call);
- decode attention is grouped-query attention done as one matmul per KV head (the G query heads
  that share a KV head form the "query length" dimension) instead of repeat_kv + SDPA;
- RoPE as x·cos + roll(x)·sin± (sin with the rotate-half sign folded in): 4 ops, exact;
- sampling by inverse CDF (see `sampling.py`), ~20× faster than `torch.multinomial`; plain
  temperature sampling in the kernel library's three-pass sampler when the kernel linears run;
- more requests than `max_batch_size` are batched by prompt length (less left padding in the
  prefill and in every step's attention), results returned in request order;
- finished rows are dropped: when half the rows are done the batch is compacted (cache rows
  gathered), and the loop stops when all rows are done;
- optional `torch.compile` of the decode step (`compile=True`, off by default): the step then
  attends over the whole (bucketed) cache with a mask so its shapes repeat: (batch bucket,
  cache-length bucket). The packed linears enter the graph as an opaque custom op
  (`turborlhf::packed_linear`) that reads the engine's current packed weights, so weight updates
  need no recompile (Inductor freezing would bake the weights into the compiled code). If
  compiling fails the engine warns and decodes eagerly. As measured (docs/rollout.md) the
  compiled step is not faster than the eager one on the 2-core CPU and each (batch, cache) bucket
  costs about a minute of cold compile, hence off by default.

The weights (layout, in-place loading, packing, the linears that read them) are
`turborlhf.rollout.fast_weights.FastEngineWeights`; this module has the forward and the decode loop.

Notation: L layers, B rows, S prompt positions, T cache length, H query heads, KV key/value
heads, G = H / KV, D head dim, E hidden size, I MLP size, V vocabulary.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ._util import check_prompts, resolve_dtype
# importing backends registers turborlhf::packed_linear
from .backends import _ENGINES, choose_linear_backend, kernel_linears_missing, warn_once
from .base import RolloutOutput, SamplingParams
from .fast_weights import _DOWN, _GATE, _O, _QKV, _UP, FastEngineWeights, _Layer
from .llama_ops import (_load_state_dict, _rms, _rope_inv_freq, _rope_signed, decode_mask, is_supported,
                        unsupported_reason)
from .sampling import sample, top_p_filter
from .tools import Tool, ToolCalls

__all__ = ["FastEngine", "is_supported"]


class FastEngine(FastEngineWeights):
    """Embedded decode engine for Llama-family causal LMs (see module docstring).

    model_or_path: a loaded `transformers` causal LM (weights are copied and cast, never shared)
        or an HF model directory.
    dtype: engine precision, 'auto' (default: bf16 where the CPU computes it natively, else fp32) | 'bf16' | 'fp32' | 'fp16'.
    max_batch_size: rows decoded together; larger requests run in consecutive chunks.
    compile: `torch.compile` the decode step (shapes bucketed; each new (batch, cache-length)
        bucket costs a cold compile of tens of seconds, then is cached).
    kv_bucket: cache length is rounded up to a multiple of this (compiled shapes repeat).
    compact: drop finished rows (gather the cache) once half of the rows are done.
    dedupe_prompts: prefill identical prompts once (always exact up to float rounding).
    share_prefix: prefill the longest prefix common to all prompts of a batch once, when it has at
        least `min_shared_prefix` tokens (exact up to float rounding).
    linear_backend: 'auto' ('kernel' where it can run, else in bf16 'mkldnn' where oneDNN can pack
        bf16 (avx512bw/vl/dq), else 'dense'; a fallback forced by a missing instruction set warns
        once, see `turborlhf.rollout.backends`),
        'kernel' (the linears of `turborlhf.rollout.kernels`: AVX-512-BF16 in bf16, AVX2/FMA in
        fp32; weights packed straight from `load_weights` with no dense copy of the layer
        matrices: the fastest at 1-32 rows; needs compile=False and int8_max_batch=0),
        'mkldnn' (oneDNN pre-packed weights) or 'dense' (`F.linear`; bit-exact with transformers
        in fp32, what the exactness tests use).
    int8_max_batch: decode steps with at most this many rows use int8 weight-only linears
        (symmetric per-output-row scales, re-quantized by every `load_weights`; half the weight
        bytes of bf16, for memory-bound small batches). 0 = off (default). This samples from an
        approximation of the policy: prefill, `score_logprobs` and larger batches stay exact.
    kernels: eager decode steps use the fused C kernels of `turborlhf.rollout.kernels` (RoPE +
        KV-cache write + attention in one pass per layer, and RMSNorm) when they build on this
        machine: 'auto' (default; torch ops if they do not build), True (require them), False.
    weight_dtype: storage of the weights: None or 'same' (default: `dtype`), or 'bf16' with an
        fp32 `dtype` and the kernel linears: every 2-D weight (embeddings, layer matrices, LM head) rounded to
        bf16 (nearest even; the matrices stored in bf16 and widened back exactly inside the
        kernel), norms, biases, activations, KV cache and arithmetic in fp32. Half the bytes a
        decode step reads, so small-batch decoding (bound by those reads) runs up to twice as
        fast on CPUs without native bf16. The engine then samples, prefills and scores the policy
        with bf16-rounded weights (a bf16 rollout engine's weights, with fp32 arithmetic), not the
        trainer's fp32 one; `turborlhf.rollout.sync` rounds the trainer's side of its check alike.
    Raises ValueError for an unsupported architecture, an unknown/unavailable backend, or a
    `weight_dtype` this configuration cannot run.
    """

    def __init__(self, model_or_path, dtype: str | torch.dtype = "auto", max_batch_size: int = 32,
                 compile: bool = False, kv_bucket: int = 64, compact: bool = True,
                 dedupe_prompts: bool = True, share_prefix: bool = True, min_shared_prefix: int = 8,
                 batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                 linear_backend: str = "auto", int8_max_batch: int = 0, kernels: bool | str = "auto",
                 weight_dtype: Optional[str] = None):
        self.dtype = resolve_dtype(dtype)
        if self.dtype == torch.float16:     # (bf16's case: the linear backend's choice warns, naming the ISA)
            from turborlhf.engine.hardware import warn_if_slower_than_fp32

            warn_if_slower_than_fp32(self.dtype, "cpu", "dtype")
        if kernels not in ("auto", True, False):
            raise ValueError(f"kernels must be 'auto', True or False, got {kernels!r}")
        self._k = None
        if kernels:
            from .kernels import load as load_kernels
            self._k = load_kernels()
            if self._k is not None and not self._k.supports(self.dtype):
                self._k = None
            if kernels is True and self._k is None:
                raise ValueError(f"kernels=True but the fused decode kernels are unavailable for {self.dtype} "
                                 "(no C compiler, a failed build, or TURBORLHF_KERNELS=0)")
        self.int8_max_batch = int(int8_max_batch)
        if self.int8_max_batch and not hasattr(torch, "_weight_int8pack_mm"):
            raise ValueError("int8_max_batch needs torch._weight_int8pack_mm (torch >= 2.4)")
        if isinstance(model_or_path, torch.nn.Module):
            config = copy.deepcopy(model_or_path.config)
            state = model_or_path.state_dict()
        else:
            from transformers import AutoConfig
            config = AutoConfig.from_pretrained(model_or_path)
            state = _load_state_dict(model_or_path)
        if not is_supported(config):
            raise ValueError(f"FastEngine does not support this model ({unsupported_reason(config)}); use HFEngine")
        widths = (config.hidden_size, config.intermediate_size,
                  config.num_attention_heads * (getattr(config, "head_dim", None)
                                                or config.hidden_size // config.num_attention_heads))
        self.linear_backend = choose_linear_backend(linear_backend, self.dtype, self._k, compile,
                                                    bool(self.int8_max_batch), odd_width=any(w % 2 for w in widths))
        self._kl, self._mkl = self.linear_backend == "kernel", self.linear_backend == "mkldnn"
        self.weight_dtype = self._resolve_weight_dtype(weight_dtype, host_lacks_kernels=(
            linear_backend == "auto" and kernels is not False and not compile and not self.int8_max_batch))
        self.config = config
        self.max_batch_size = int(max_batch_size)
        self.kv_bucket = int(kv_bucket)
        self.compact = compact
        self.dedupe_prompts = dedupe_prompts
        self.share_prefix = share_prefix
        self.min_shared_prefix = max(1, int(min_shared_prefix))
        self.batch_buckets = sorted(set(int(b) for b in batch_buckets) | {self.max_batch_size})
        c = config
        self.n_layers = c.num_hidden_layers
        self.n_heads = c.num_attention_heads
        self.n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.group = self.n_heads // self.n_kv
        self.hidden = c.hidden_size
        self.vocab_size = c.vocab_size
        self.eps = float(c.rms_norm_eps)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        self.max_positions = int(getattr(c, "max_position_embeddings", 4096))
        mt = getattr(c, "model_type", "llama")
        attn_bias = bool(getattr(c, "attention_bias", False))
        self._qkv_bias = attn_bias or mt == "qwen2"
        self._o_bias = attn_bias
        self._mlp_bias = bool(getattr(c, "mlp_bias", False))
        self._out_features: list[int] = [0] * (5 * self.n_layers + 1)
        self._alloc_weights()
        self._packed: list[Optional[torch.Tensor]] = [None] * (5 * self.n_layers + 1)
        self._pbias: list[Optional[torch.Tensor]] = [None] * (5 * self.n_layers + 1)
        self._q8: list[Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]] = [None] * (5 * self.n_layers + 1)
        self._key = id(self)
        _ENGINES[self._key] = self
        self.last_weight_update: dict = {}
        self.load_weights(state.items())
        missing = self._unloaded
        if missing:
            raise ValueError(f"checkpoint lacks parameters: {sorted(missing)[:5]}...")
        inv_freq, att_scale = _rope_inv_freq(c, self.head_dim)
        pos = torch.arange(self.max_positions, dtype=torch.float)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos_PD = (emb.cos() * att_scale).to(self.dtype)
        self._sin_PD = (emb.sin() * att_scale).to(self.dtype)
        h = self.head_dim // 2
        self._sins_PD = torch.cat((-self._sin_PD[:, :h], self._sin_PD[:, h:]), dim=-1)  # sin±
        self._compile = compile
        self._compiled_step = None
        self.compile_seconds: dict = {}       # (batch, cache length) → first-call seconds
        if compile:
            import torch._dynamo.config as dcfg
            dcfg.recompile_limit = max(dcfg.recompile_limit, 64)
            dcfg.accumulated_recompile_limit = max(dcfg.accumulated_recompile_limit, 512)
            self._compiled_step = torch.compile(self._step_graph, dynamic=False, fullgraph=True)

    def _resolve_weight_dtype(self, weight_dtype: Optional[str], host_lacks_kernels: bool = False) -> torch.dtype:
        """The packed matrices' storage dtype for the `weight_dtype` argument (docstring above).
        host_lacks_kernels: no option of this engine ruled the kernel linears out, so if they are
        not here this host cannot build them; bf16 storage then falls back to `dtype` with one warning
        (a Ray worker on another kind of host than the driver that resolved the config)."""
        if weight_dtype in (None, "same"):
            return self.dtype
        wdt = resolve_dtype(weight_dtype)
        if wdt == self.dtype:
            return wdt
        if (self.dtype, wdt) != (torch.float32, torch.bfloat16):
            raise ValueError(f"weight_dtype={weight_dtype!r} with dtype {self.dtype}: only bf16 weights with fp32 "
                             "compute are supported")
        if not self._kl:
            if host_lacks_kernels:
                missing = kernel_linears_missing() or "they did not load"
                warn_once(f"FastEngine: weight_dtype='bf16' needs the fp32 kernel linears ({missing}); "
                          f"keeping the weights in fp32 ({self.linear_backend} linears)")
                return self.dtype
            raise ValueError(f"weight_dtype='bf16' needs the fp32 kernel linears (linear_backend 'kernel'); this "
                             f"engine uses {self.linear_backend!r}")
        return wdt

    # ------------------------------------------------------------------ model maths
    def _norm(self, x: torch.Tensor, w: torch.Tensor, graph: bool = False) -> torch.Tensor:
        """RMSNorm: the fused kernel (eager, contiguous x) when loaded, else torch ops."""
        if self._k is not None and not graph and x.is_contiguous():
            return self._k.rms_norm(x.view(-1, x.shape[-1]), w, torch.empty_like(x), self.eps).view(x.shape)
        return _rms(x, w, self.eps)

    def _attn_mlp_out(self, l: int, ly: _Layer, x: torch.Tensor, a: torch.Tensor, graph: bool,
                      int8: bool = False) -> torch.Tensor:
        """x + o_proj(a), then x + down(silu(gate(h)) · up(h)) with h = RMSNorm(x): the rest of
        layer l after attention. `graph`: call the packed linears through the custom op;
        `int8`: int8 weight-only linears."""
        if int8:
            x = x + self._lin8(a, 5 * l + _O)
            g, u = self._lin8(self._norm(x, ly.ln2), 5 * l + _GATE).chunk(2, dim=-1)
            return x + self._lin8(F.silu(g) * u, 5 * l + _DOWN)
        if self._kl:
            k, s = self._k, 5 * l
            x = self._klin(a, s + _O, k.ADD, x)                       # x + a·Woᵀ
            h = self._norm(x, ly.ln2)
            return self._klin(self._klin(h, s + _GATE, k.SWIGLU), s + _DOWN, k.ADD, x)
        if self._mkl:
            lin = ((lambda x_, o_, s_, a_: torch.ops.turborlhf.packed_linear(x_, o_, self._key, s_, a_))
                   if graph else self._plin)
            s = 5 * l
            x = lin(a, x, s + _O, "add")                               # x + a·Woᵀ
            h = self._norm(x, ly.ln2, graph)
            g = lin(h, None, s + _GATE, "swish")                       # silu(h·Wgᵀ)
            return lin(lin(h, g, s + _UP, "mul"), x, s + _DOWN, "add")  # x + (h·Wuᵀ · g)·Wdᵀ
        x = x + F.linear(a, ly.wo, ly.bo)
        h = self._norm(x, ly.ln2, graph)
        g, u = F.linear(h, ly.wgu, ly.bgu).chunk(2, dim=-1)
        return x + F.linear(F.silu(g) * u, ly.wd, ly.bd)

    def _qkv(self, l: int, ly: _Layer, h: torch.Tensor, graph: bool, int8: bool = False) -> torch.Tensor:
        if int8:
            return self._lin8(h, 5 * l + _QKV)
        if self._kl:
            return self._klin(h, 5 * l + _QKV)
        if not self._mkl:
            return F.linear(h, ly.wqkv, ly.bqkv)
        if graph:
            return torch.ops.turborlhf.packed_linear(h, None, self._key, 5 * l + _QKV, "none")
        return self._plin(h, None, 5 * l + _QKV, "none")

    def _forward_full(self, ids_BS: torch.Tensor, pos_BS: torch.Tensor, allow_BSS: torch.Tensor,
                      K_LBKTD: Optional[torch.Tensor] = None, V_LBKTD: Optional[torch.Tensor] = None,
                      valid_BS: Optional[torch.Tensor] = None,
                      prefix_KV: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Forward S positions of B rows at once (prefill / scoring). Writes K/V into columns
        [0, S) of the cache when given. allow_BSS: bool, query i may attend key j.
        valid_BS (bool, optional): the non-padding positions; the linears, norms and MLPs then run
        on those N tokens only (padding is unpacked for attention alone), and padding positions
        come out as zeros (their K/V are zero too: every reader masks them).
        prefix_KV (optional): the K and V (each L×1×KV×C×D) of C positions that precede every row
        and that every query attends to (a shared prompt prefix; pos_BS then starts at C).
        Returns final-normed hidden states B×S×E."""
        B, S = ids_BS.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        W = (H + 2 * KV) * D
        packed = valid_BS is not None and not bool(valid_BS.all())
        if packed:
            idx_N = valid_BS.reshape(-1).nonzero().squeeze(1)          # positions in B·S
            x = self.embed_VE[ids_BS.reshape(-1)[idx_N]]                # N×E
            pos_N = pos_BS.reshape(-1)[idx_N]
            cos, sins = self._cos_PD[pos_N][:, None], self._sins_PD[pos_N][:, None]   # N×1×D
            qkv_BSW = x.new_zeros(B * S, W)       # padding rows stay zero; each layer refills the rest
        else:
            x = self.embed_VE[ids_BS]                                   # B×S×E
            cos = self._cos_PD[pos_BS][:, :, None]                      # B×S×1×D
            sins = self._sins_PD[pos_BS][:, :, None]
        mask = allow_BSS[:, None]                                   # B×1×S×S
        if prefix_KV is not None:                                   # every query sees the prefix
            C = prefix_KV[0].shape[3]
            mask = torch.cat([mask.new_ones(B, 1, S, C), mask], dim=-1)   # B×1×S×(C+S)
        for l, ly in enumerate(self.layers):
            h = self._norm(x, ly.ln1)
            qkv = self._qkv(l, ly, h, False)                        # B×S×(H+2KV)D (or N×W)
            if packed:                # RoPE on the N tokens, then unpacked to B×S for attention
                qkv[:, : (H + KV) * D] = _rope_signed(qkv[:, : (H + KV) * D].view(-1, H + KV, D), cos,
                                                      sins).view(-1, (H + KV) * D)
                qkv = qkv_BSW.index_copy_(0, idx_N, qkv).view(B, S, W)
                qk = qkv[..., : (H + KV) * D].view(B, S, H + KV, D).transpose(1, 2)
            else:
                qk = _rope_signed(qkv[..., : (H + KV) * D].view(B, S, H + KV, D), cos, sins).transpose(1, 2)
            q, k = qk[:, :H], qk[:, H:]                             # B×H×S×D, B×KV×S×D
            v = qkv[..., (H + KV) * D:].view(B, S, KV, D).transpose(1, 2)
            if K_LBKTD is not None:
                K_LBKTD[l, :, :, :S] = k
                V_LBKTD[l, :, :, :S] = v
            if prefix_KV is not None:
                k = torch.cat([prefix_KV[0][l].expand(B, -1, -1, -1), k], dim=2)   # B×KV×(C+S)×D
                v = torch.cat([prefix_KV[1][l].expand(B, -1, -1, -1), v], dim=2)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.group > 1)
            a = a.transpose(1, 2).reshape(B, S, H * D)
            if packed:
                a = a.reshape(B * S, H * D).index_select(0, idx_N)
            x = self._attn_mlp_out(l, ly, x, a, False)
        x = self._norm(x, self.norm_E)
        if packed:
            x = x.new_zeros(B * S, x.shape[-1]).index_copy_(0, idx_N, x).view(B, S, -1)
        return x

    def _step(self, ids_B: torch.Tensor, pos_B: torch.Tensor, col: int, T: int,
              K_LBKTD: torch.Tensor, V_LBKTD: torch.Tensor, maskadd_BT: Optional[torch.Tensor],
              graph: bool = False, nopad: bool = False, start_B: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
        """One decode step: token ids_B at positions pos_B, K/V written at cache column `col`.
        Returns float32 logits B×V. `graph`: traced by torch.compile (custom-op linears).

        With the fused kernels loaded (eager, `start_B` given: each row's first valid cache
        column), RoPE, the cache write and attention over columns [start_B, col] are one C call
        per layer and RMSNorm one more; with the kernel linears as well, all layers are one C
        call (`decode_layers`); otherwise torch ops, as follows.

        Attention, two ways (as measured per layer on the 2-core CPU, benchmarks in
        docs/rollout.md): rows without left padding (`nopad`) and B <= 4 use SDPA over the first
        T = col + 1 columns, no mask (29 µs vs 94 µs at B=1); otherwise grouped-query matmuls
        over the whole allocated cache with the additive mask maskadd_BT (B×Tmax): a contiguous
        cache avoids the copy a [:T] slice costs (292 µs vs 441 µs at B=32)."""
        B = ids_B.shape[0]
        H, KV, G, D = self.n_heads, self.n_kv, self.group, self.head_dim
        scale = 1.0 / math.sqrt(D)
        i8 = 0 < B <= self.int8_max_batch and not graph             # int8 weight-only small batches
        sdpa = nopad and B <= 4 and not graph
        kern = self._k is not None and not graph and start_B is not None
        x = self.embed_VE[ids_B]                                    # B×E
        cos_BD, sins_BD = self._cos_PD[pos_B], self._sins_PD[pos_B]
        if kern and self._kl and not i8 and self._one_call:         # every layer in one C call
            I = self.config.intermediate_size
            need = B * (2 * self.hidden + (H + 2 * KV) * D + H * D + I)
            if self._kscratch is None or self._kscratch.numel() < need:
                self._kscratch = torch.empty(need, dtype=self.dtype)
            self._k.decode_layers(self._ktable, x, cos_BD, sins_BD, K_LBKTD, V_LBKTD, start_B, col, H, I, scale,
                                  self.eps, self._kscratch, self.weight_dtype)
            return self._head(self._norm(x, self.norm_E))
        cos, sins = cos_BD[:, None], sins_BD[:, None]               # B×1×D
        m = None if kern else maskadd_BT[:, None, None, :]          # B×1×1×T
        for l, ly in enumerate(self.layers):
            h = self._norm(x, ly.ln1, graph)
            qkv = self._qkv(l, ly, h, graph, i8)                    # B×(H+2KV)D
            if kern:
                a = self._k.attention(qkv, cos_BD, sins_BD, K_LBKTD[l], V_LBKTD[l], start_B,
                                      x.new_empty(B, H * D), H, col, scale)
                x = self._attn_mlp_out(l, ly, x, a, graph, i8)
                continue
            qk = _rope_signed(qkv[:, : (H + KV) * D].view(B, H + KV, D), cos, sins)  # q and k at once
            Kl, Vl = K_LBKTD[l], V_LBKTD[l]                          # B×KV×Tmax×D
            Kl[:, :, col] = qk[:, H:]
            Vl[:, :, col] = qkv[:, (H + KV) * D:].view(B, KV, D)
            if sdpa:
                a = F.scaled_dot_product_attention(qk[:, :H, None], Kl[:, :, :T], Vl[:, :, :T],
                                                   enable_gqa=G > 1)  # B×H×1×D
            else:
                # grouped-query attention: the G query heads of a KV head are one matmul
                s = torch.matmul(qk[:, :H].reshape(B, KV, G, D), Kl.transpose(-1, -2))  # B×KV×G×Tmax
                p = torch.softmax(torch.add(m, s, alpha=scale), dim=-1).to(x.dtype)  # float32 softmax
                a = torch.matmul(p, Vl)                              # B×KV×G×D
            x = self._attn_mlp_out(l, ly, x, a.reshape(B, H * D), graph, i8)
        h = self._norm(x, self.norm_E, graph)
        if self._mkl and graph:
            return torch.ops.turborlhf.packed_linear(h, None, self._key, 5 * self.n_layers, "none").float()
        return self._head(h, i8)

    def _step_graph(self, ids_B, pos_B, col_1, K_LBKTD, V_LBKTD, maskadd_BT):
        """The compiled step: the cache column is a tensor and attention covers the whole
        (bucketed) cache, so one graph serves every step of a (batch, cache-length) bucket."""
        B = ids_B.shape[0]
        L = self.n_layers
        H, KV, G, D = self.n_heads, self.n_kv, self.group, self.head_dim
        scale = 1.0 / math.sqrt(D)
        x = self.embed_VE[ids_B]
        cos = self._cos_PD[pos_B][:, None]
        sins = self._sins_PD[pos_B][:, None]
        m = maskadd_BT[:, None, None, :]
        for l, ly in enumerate(self.layers):
            h = _rms(x, ly.ln1, self.eps)
            qkv = self._qkv(l, ly, h, True)
            qk = _rope_signed(qkv[:, : (H + KV) * D].view(B, H + KV, D), cos, sins)
            Kl, Vl = K_LBKTD[l], V_LBKTD[l]
            Kl.index_copy_(2, col_1, qk[:, H:, None, :])
            Vl.index_copy_(2, col_1, qkv[:, (H + KV) * D:].view(B, KV, 1, D))
            s = torch.matmul(qk[:, :H].reshape(B, KV, G, D), Kl.transpose(-1, -2))
            p = torch.softmax(torch.add(m, s, alpha=scale), dim=-1).to(x.dtype)
            x = self._attn_mlp_out(l, ly, x, torch.matmul(p, Vl).reshape(B, H * D), True)
        h = _rms(x, self.norm_E, self.eps)
        if self._mkl:
            return torch.ops.turborlhf.packed_linear(h, None, self._key, 5 * L, "none").float()
        return F.linear(h, self.lm_head_VE).float()

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 tool: Optional[Tool] = None) -> RolloutOutput:
        """See `RolloutEngine.generate`. Raises ValueError on empty prompts or prompts that do
        not fit `max_position_embeddings` with `max_new_tokens`. With a `tool`
        (`turborlhf.rollout.tools`) the tokens it writes are decoded like sampled ones (one step
        each, log-prob 0) and flagged in `RolloutOutput.tool_mask`."""
        prompts = check_prompts(prompts, self.vocab_size)
        t0 = time.perf_counter()
        reqs = [p for p in prompts for _ in range(params.n)]
        gen = torch.Generator()              # the call's own stream: torch's global one, shared with a
        if params.seed is not None:          # trainer that may run on another thread, is never drawn from
            gen.manual_seed(params.seed)
        else:
            gen.seed()                       # nondeterministic, from the OS
        resp: list[list[int]] = []
        fin: list[bool] = []
        lps: list[list[float]] = []
        tms: list[list[bool]] = []
        timings = {"prefill_s": 0.0, "decode_s": 0.0, "steps": 0}
        # more requests than one batch: batch them by prompt length (stable, so the samples of a
        # prompt stay together), so a short prompt is not left-padded to the longest of a random
        # chunk in the prefill and in every decode step's attention; results come back in order
        order = (sorted(range(len(reqs)), key=lambda i: len(reqs[i])) if len(reqs) > self.max_batch_size
                 else list(range(len(reqs))))
        with torch.inference_mode():
            for s in range(0, len(reqs), self.max_batch_size):
                r, f, lp, tm = self._generate_chunk([reqs[i] for i in order[s: s + self.max_batch_size]], params,
                                                    gen, timings, tool)
                resp += r
                fin += f
                lps += lp
                tms += tm
        back = sorted(range(len(order)), key=order.__getitem__)          # inverse permutation
        resp, fin, lps, tms = ([xs[i] for i in back] for xs in (resp, fin, lps, tms))
        timings["generate_s"] = time.perf_counter() - t0
        return RolloutOutput(resp, fin, lps if params.return_logprobs else None, timings=timings,
                             tool_mask=tms if tool is not None else None)

    def _compiled_call(self, ids_B, pos_B, col_1, K, V, maskadd_BT):
        """The compiled step, timing each new (batch, cache-length) bucket's first call (cold
        compile) into `compile_seconds`; on any compile error, warn once and decode eagerly."""
        key = (int(ids_B.shape[0]), int(K.shape[3]))
        t0 = time.perf_counter()
        try:
            out = self._compiled_step(ids_B, pos_B, col_1, K, V, maskadd_BT)
        except Exception as e:  # noqa: BLE001 - any Dynamo/Inductor failure → eager fallback
            warnings.warn(f"FastEngine: torch.compile of the decode step failed ({type(e).__name__}: "
                          f"{str(e)[:200]}); decoding eagerly from now on")
            self._compiled_step = None
            col = int(col_1.item())
            return self._step(ids_B, pos_B, col, col + 1, K, V, maskadd_BT)
        if key not in self.compile_seconds:
            self.compile_seconds[key] = time.perf_counter() - t0
        return out

    def _sample(self, logits_BV: torch.Tensor, params: SamplingParams, suppress: Optional[torch.Tensor],
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`sampling.sample`; sampling without top-k (temperature > 0) runs in the kernel
        library's three-pass sampler when the kernel linears are loaded, after `top_p_filter` on
        the temperature-scaled logits where top-p is on (the same uniforms from `gen`, so the same
        draws up to float rounding at a CDF boundary). With ``logprobs_mode="raw_logprobs"`` the
        log-probs are the temperature-1 ones: the log-softmax of the unmodified logits."""
        if params.logprobs_mode == "raw_logprobs":
            raw_BV = logits_BV.float().log_softmax(-1)        # before the sampler may touch the logits
            ids_B, _ = self._sample_processed(logits_BV, params, suppress, gen)
            return ids_B, raw_BV.gather(-1, ids_B[:, None].long()).squeeze(-1)
        return self._sample_processed(logits_BV, params, suppress, gen)

    def _sample_processed(self, logits_BV: torch.Tensor, params: SamplingParams, suppress: Optional[torch.Tensor],
                          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        V = logits_BV.shape[-1]
        if (self._kl and self._k.has_sampler and params.temperature > 0 and not 0 < params.top_k < V
                and logits_BV.dtype == torch.float32):
            x = logits_BV.contiguous()
            if suppress is not None and suppress.numel():
                x = x.clone() if x is logits_BV else x
                x[:, suppress] = float("-inf")
            temperature = params.temperature
            if params.top_p < 1.0:
                x, temperature = top_p_filter(x / temperature, params.top_p).contiguous(), 1.0
            u = torch.rand(x.shape[0], 1, generator=gen)
            return self._k.sample(x, temperature, u.view(-1))
        return sample(logits_BV, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                      suppress_ids=suppress, generator=gen)

    def _shared_prefix_len(self, prompts: list[list[int]]) -> int:
        """C, the number of leading tokens all `prompts` share and the prefill computes once: the
        longest common prefix, short of each prompt's last token (whose logits are needed), or 0
        when sharing is off, there is one prompt, or fewer than `min_shared_prefix` tokens are
        shared."""
        if not self.share_prefix or len(prompts) < 2:
            return 0
        first, C = prompts[0], min(len(p) for p in prompts) - 1
        for p in prompts[1:]:
            i = 0
            while i < C and p[i] == first[i]:
                i += 1
            C = i
        return C if C >= self.min_shared_prefix else 0

    def _bucket_batch(self, n: int) -> int:
        if not self._compile:
            return n
        return next((b for b in self.batch_buckets if b >= n), n)

    def _prefill(self, reqs: list[list[int]], P: int, T: int, Bc: int, zero_cache: bool = True):
        """Prefill the distinct prompts of `reqs` (left-padded to P), then copy their cache rows to
        every request (plus Bc - N filler rows); when every request is distinct and there are no
        filler rows, the prefill writes the decode cache itself. Returns (K_LBKTD, V_LBKTD,
        logits_BV float32 of the next token, position of the next token pos_B, first valid cache
        column start_B). zero_cache=False may leave the cache columns no prompt token fills (left
        padding, and P on) uninitialised: for readers of columns [start_B, col] only (the C
        attention; SDPA over the first col + 1 columns of unpadded rows), not for a masked read
        of the whole cache (0 · NaN is NaN)."""
        N = len(reqs)
        L, KV, D = self.n_layers, self.n_kv, self.head_dim
        # ---- prefill the distinct prompts, then copy cache rows to every request
        if self.dedupe_prompts:
            uniq: dict[tuple, int] = {}
            src = [uniq.setdefault(tuple(p), len(uniq)) for p in reqs]
            uprompts = [list(k) for k in uniq]
        else:
            src, uprompts = list(range(N)), reqs
        U = len(uprompts)
        direct = U == Bc and src == list(range(U))              # the prefill's cache is the decode cache
        lens_U = torch.tensor([len(p) for p in uprompts])
        pad_U = P - lens_U
        C = self._shared_prefix_len(uprompts)
        prefix_KV = None
        if C:                        # the shared prefix: one row, no padding
            Kc = torch.zeros(L, 1, KV, C, D, dtype=self.dtype)
            Vc = torch.zeros(L, 1, KV, C, D, dtype=self.dtype)
            self._forward_full(torch.tensor([uprompts[0][:C]]), torch.arange(C)[None],
                               torch.tril(torch.ones(C, C, dtype=torch.bool))[None], Kc, Vc)
            prefix_KV = (Kc, Vc)
        # the rest of each prompt (all of it when C = 0), left-padded to S = P - C
        S = P - C
        ids_US = torch.tensor([[0] * (P - len(p)) + p[C:] for p in uprompts])
        ar_S = torch.arange(S)
        valid_US = ar_S[None, :] >= pad_U[:, None]
        pos_US = C + (ar_S[None, :] - pad_U[:, None]).clamp(min=0)
        allow_USS = torch.tril(torch.ones(S, S, dtype=torch.bool))[None] & valid_US[:, None, :]
        allow_USS |= torch.eye(S, dtype=torch.bool)[None]         # padded queries see themselves
        new_cache = torch.zeros if zero_cache else torch.empty
        if direct:
            Kp, Vp = (new_cache(L, U, KV, T, D, dtype=self.dtype) for _ in "KV")
        else:
            Kp, Vp = (torch.zeros(L, U, KV, P, D, dtype=self.dtype) for _ in "KV")
        hid_UE = self._forward_full(ids_US, pos_US, allow_USS, Kp[:, :, :, C:], Vp[:, :, :, C:], valid_US,
                                    prefix_KV)[:, -1]
        if C:                        # row u holds [padding | prefix | rest]: the prefix goes at pad_u
            for pad in pad_U.unique().tolist():
                rows = (pad_U == pad).nonzero().squeeze(1)
                Kp[:, rows, :, pad: pad + C] = Kc
                Vp[:, rows, :, pad: pad + C] = Vc
        logits = self._head(hid_UE)
        src_t = torch.tensor(src + [src[0]] * (Bc - N))            # bucket filler rows
        if direct:
            K, V = Kp, Vp
        else:
            K, V = (new_cache(L, Bc, KV, T, D, dtype=self.dtype) for _ in "KV")
            K[:, :, :, :P] = Kp.index_select(1, src_t)
            V[:, :, :, :P] = Vp.index_select(1, src_t)
            del Kp, Vp
        logits_BV = logits.index_select(0, src_t)
        pos_B = lens_U.index_select(0, src_t).clone()              # position of the next token
        start_B = pad_U.index_select(0, src_t).to(torch.int64)     # first valid cache column
        return K, V, logits_BV, pos_B, start_B

    def _generate_chunk(self, reqs: list[list[int]], params: SamplingParams, gen: torch.Generator,
                        timings: dict, tool: Optional[Tool] = None):
        tp = time.perf_counter()
        N = len(reqs)
        new = params.max_new_tokens
        P = max(len(p) for p in reqs)
        if P + new > self.max_positions:
            raise ValueError(f"prompt ({P}) + max_new_tokens ({new}) > max_position_embeddings "
                             f"({self.max_positions})")
        T = -(-(P + new) // self.kv_bucket) * self.kv_bucket
        Bc = self._bucket_batch(N)
        torch_attention = self._compiled_step is not None or self._k is None   # needs the mask
        K, V, logits_BV, pos_B, start_B = self._prefill(reqs, P, T, Bc, zero_cache=torch_attention)
        nopad = all(len(p) == P for p in reqs)                     # no left padding in any row
        rows_B = torch.arange(Bc)                                  # request index of each row
        rows_B[N:] = -1
        done_B = rows_B < 0
        out_tok = torch.zeros(N, new, dtype=torch.long)
        out_lp = torch.zeros(N, new)
        out_len = torch.full((N,), new, dtype=torch.long)
        out_fin = torch.zeros(N, dtype=torch.bool)
        stop_t = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long)
        has_stop = stop_t.numel() > 0
        # tool calls: after a trigger token the tool may queue tokens for that request, which then
        # replace the sampled ones, one per step (the KV cache sees them like sampled tokens)
        trig_t = torch.tensor(sorted(tool.trigger_ids), dtype=torch.long) if tool is not None else None
        calls = ToolCalls(tool) if tool is not None else None      # keyed by request index
        out_tool = torch.zeros(N, new, dtype=torch.bool)
        timings["prefill_s"] += time.perf_counter() - tp
        td = time.perf_counter()
        col_1 = torch.zeros(1, dtype=torch.long)
        for t in range(new):
            suppress = stop_t if (has_stop and t < params.min_new_tokens) else None
            ids_B, lp_B = self._sample(logits_BV, params, suppress, gen)
            if calls:
                for b, req in enumerate(rows_B.tolist()):
                    tok = calls.next_token(req)
                    if tok is not None:
                        ids_B[b], lp_B[b] = tok, 0.0
                        out_tool[req, t] = True
            live = ~done_B
            r = rows_B[live]
            out_tok[r, t] = ids_B[live]
            out_lp[r, t] = lp_B[live]
            if has_stop:
                hit = live & torch.isin(ids_B, stop_t)
                if bool(hit.any()):
                    out_len[rows_B[hit]] = t + 1
                    out_fin[rows_B[hit]] = True
                    done_B = done_B | hit
            if trig_t is not None:
                called = ~done_B & torch.isin(ids_B, trig_t)
                for b in torch.nonzero(called).squeeze(1).tolist():
                    req = int(rows_B[b])
                    if not out_tool[req, t]:
                        calls.after(req, out_tok[req, : t + 1].tolist())
            if t == new - 1 or bool(done_B.all()):
                break
            # ---- drop finished rows once at least half of the batch is finished
            n_live = int((~done_B).sum())
            nb = self._bucket_batch(n_live)
            if self.compact and nb <= done_B.shape[0] // 2:
                keep = torch.nonzero(~done_B).squeeze(1)
                if nb > n_live:
                    keep = torch.cat([keep, torch.nonzero(done_B).squeeze(1)[: nb - n_live]])
                K, V = K.index_select(1, keep), V.index_select(1, keep)
                pos_B, start_B = pos_B.index_select(0, keep), start_B.index_select(0, keep)
                ids_B, rows_B, done_B = ids_B.index_select(0, keep), rows_B.index_select(0, keep), done_B.index_select(0, keep)
            col = P + t
            col_1.fill_(col)
            maskadd_BT = decode_mask(start_B, col, T) if torch_attention else None
            if self._compiled_step is not None:
                logits_BV = self._compiled_call(ids_B, pos_B, col_1, K, V, maskadd_BT)
            else:
                logits_BV = self._step(ids_B, pos_B, col, col + 1, K, V, maskadd_BT, nopad=nopad, start_B=start_B)
            pos_B = pos_B + 1
            timings["steps"] += 1
        timings["decode_s"] += time.perf_counter() - td
        resp, fin, lps, tms = [], [], [], []
        lens = out_len.tolist()
        tool_l = out_tool.tolist()
        toks = out_tok.tolist()
        lpl = out_lp.tolist() if params.return_logprobs else None
        fins = out_fin.tolist()
        for i in range(N):
            n_i = lens[i]
            resp.append(toks[i][:n_i])
            fin.append(fins[i])
            lps.append(lpl[i][:n_i] if lpl is not None else [])
            tms.append(tool_l[i][:n_i])
        return resp, fin, lps, tms

    # ------------------------------------------------------------------ scoring
    def score_logprobs(self, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """Temperature-1 log-probs of each response token given its prompt (one full forward
        per chunk of `max_batch_size` rows, left padding). Raises ValueError on empty prompts,
        mismatched lengths, token ids outside the vocabulary or a row past the context."""
        prompts = check_prompts(prompts, self.vocab_size)
        if len(prompts) != len(responses):
            raise ValueError("prompts and responses differ in length")
        for i, (p, r) in enumerate(zip(prompts, responses)):
            r = [int(t) for t in r]
            if r and (min(r) < 0 or max(r) >= self.vocab_size):
                raise ValueError(f"response {i} has token ids outside [0, {self.vocab_size})")
            if len(p) + len(r) > self.max_positions:
                raise ValueError(f"row {i}: prompt + response is {len(p) + len(r)} tokens, past the model's "
                                 f"{self.max_positions} positions")
        out: list[list[float]] = []
        with torch.inference_mode():
            for s in range(0, len(prompts), self.max_batch_size):
                ps = prompts[s: s + self.max_batch_size]
                rs = [[int(t) for t in r] for r in responses[s: s + self.max_batch_size]]
                seqs = [p + r for p, r in zip(ps, rs)]
                S = max(len(x) for x in seqs)
                pad = torch.tensor([S - len(x) for x in seqs])
                ids = torch.tensor([[0] * (S - len(x)) + x for x in seqs])
                ar = torch.arange(S)
                valid = ar[None] >= pad[:, None]
                pos = (ar[None] - pad[:, None]).clamp(min=0)
                allow = torch.tril(torch.ones(S, S, dtype=torch.bool))[None] & valid[:, None, :]
                allow |= torch.eye(S, dtype=torch.bool)[None]
                hid = self._forward_full(ids, pos, allow, valid_BS=valid)
                for i, (p, r) in enumerate(zip(ps, rs)):
                    if not r:
                        out.append([])
                        continue
                    a = int(pad[i]) + len(p) - 1                      # predicts response token 0
                    lg = self._head(hid[i, a: a + len(r)]).log_softmax(-1)
                    out.append(lg.gather(-1, torch.tensor(r)[:, None]).squeeze(-1).tolist())
        return out
