"""FastEngine: the embedded rollout engine, a hand-written decode loop for Llama-family models.

Supported: `LlamaForCausalLM` (RMSNorm, RoPE of any `rope_type` transformers knows except
"dynamic", grouped-query attention, SiLU-gated MLP, attention/MLP biases, tied or untied
lm_head), `Qwen2ForCausalLM` (q/k/v biases) and `MistralForCausalLM` without a sliding window.
Anything else → use `HFEngine` (see `turborlhf.rollout.make_engine`).

What makes it fast on a CPU, compared with `transformers` `generate` (benchmarks/generate_probe.py
measures both in one process):
- the engine owns a converted copy of the weights (bf16 by default) with q/k/v fused into one
  matrix and gate/up fused into one, refreshed in place by `load_weights` (no disk);
- a static KV cache `K_LBKTD` allocated once per call; prompts are left-padded into columns
  [0, P) and generated token t is written at column P + t for every row;
- identical prompts (and the n samples of a prompt) are prefilled once and their cache rows
  copied;
- decode attention is grouped-query attention done as one matmul per KV head (the G query heads
  that share a KV head form the "query length" dimension) instead of repeat_kv + SDPA;
- sampling by inverse CDF (see `sampling.py`), ~20× faster than `torch.multinomial`;
- finished rows are dropped: when half the rows are done the batch is compacted (cache rows
  gathered), and the loop stops when all rows are done;
- optional `torch.compile` of the decode step (`compile=True`, off by default): the step then
  attends over the whole (bucketed) cache with a mask so its shapes repeat: (batch bucket,
  cache-length bucket). Inductor freezing is deliberately not used: it bakes the weights into the
  compiled code, so every `load_weights` would need a recompile. As measured so far the compiled
  step is slower than eager at batch 8/32 (cold compile 85-450 s per shape on a loaded machine);
  keep it off until that is understood.

Notation: L layers, B rows, S prompt positions, T cache length, H query heads, KV key/value
heads, G = H / KV, D head dim, E hidden size, I MLP size, V vocabulary.
"""
from __future__ import annotations

import copy
import math
import time
from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from ._util import check_prompts, resolve_dtype, strip_wrapper_prefixes
from .base import RolloutOutput, SamplingParams
from .sampling import sample

__all__ = ["FastEngine", "is_supported"]

_ARCHS = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


def is_supported(config) -> bool:
    """True if FastEngine can run a model with this `transformers` config."""
    archs = set(getattr(config, "architectures", None) or [])
    mt = getattr(config, "model_type", "")
    if not (archs & _ARCHS or mt in {"llama", "qwen2", "mistral"}):
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    if mt == "mistral" and getattr(config, "sliding_window", None):
        return False
    if mt == "qwen2" and getattr(config, "use_sliding_window", False):
        return False
    rp = _rope_parameters(config)
    if rp.get("rope_type", "default") == "dynamic":
        return False
    return True


def _rope_parameters(config) -> dict:
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rp = dict(rp)
    if "rope_theta" not in rp:
        rp["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


def _rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention_scaling) exactly as transformers computes them."""
    rp = _rope_parameters(config)
    if rp["rope_type"] == "default":
        theta = float(rp["rope_theta"])
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    return ROPE_INIT_FUNCTIONS[rp["rope_type"]](config, "cpu")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' LlamaRMSNorm: normalise in float32, cast back, scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin (the 'half' layout transformers uses for Llama)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


class _Layer:
    __slots__ = ("ln1", "wqkv", "bqkv", "wo", "bo", "ln2", "wgu", "bgu", "wd", "bd")


class FastEngine:
    """Embedded decode engine for Llama-family causal LMs (see module docstring).

    model_or_path: a loaded `transformers` causal LM (weights are copied and cast, never shared)
        or an HF model directory.
    dtype: engine precision, 'bf16' (default) | 'fp32' | 'fp16'.
    max_batch_size: rows decoded together; larger requests run in consecutive chunks.
    compile: `torch.compile` the decode step (shapes bucketed; each new (batch, cache-length)
        bucket costs a cold compile of tens of seconds, then is cached).
    kv_bucket: cache length is rounded up to a multiple of this (compiled shapes repeat).
    compact: drop finished rows (gather the cache) once half of the rows are done.
    dedupe_prompts: prefill identical prompts once (always exact up to float rounding).
    Raises ValueError for an unsupported architecture.
    """

    def __init__(self, model_or_path, dtype: str | torch.dtype = "bf16", max_batch_size: int = 32,
                 compile: bool = False, kv_bucket: int = 64, compact: bool = True,
                 dedupe_prompts: bool = True, batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256)):
        self.dtype = resolve_dtype(dtype)
        if isinstance(model_or_path, torch.nn.Module):
            config = copy.deepcopy(model_or_path.config)
            state = model_or_path.state_dict()
        else:
            from transformers import AutoConfig
            config = AutoConfig.from_pretrained(model_or_path)
            state = _load_state_dict(model_or_path)
        if not is_supported(config):
            raise ValueError(f"FastEngine does not support {getattr(config, 'architectures', None)} "
                             f"(model_type {getattr(config, 'model_type', None)!r}); use HFEngine")
        self.config = config
        self.max_batch_size = int(max_batch_size)
        self.kv_bucket = int(kv_bucket)
        self.compact = compact
        self.dedupe_prompts = dedupe_prompts
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
        self._alloc_weights()
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
        self._compile = compile
        self._compiled_step = None
        if compile:
            import torch._dynamo.config as dcfg
            dcfg.recompile_limit = max(dcfg.recompile_limit, 64)
            dcfg.accumulated_recompile_limit = max(dcfg.accumulated_recompile_limit, 512)
            self._compiled_step = torch.compile(self._step, dynamic=False, fullgraph=True)

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
        for i in range(self.n_layers):
            ly = _Layer()
            ly.ln1, ly.ln2 = z(E), z(E)
            ly.wqkv, ly.wo = z(qkv, E), z(E, H * D)
            ly.wgu, ly.wd = z(2 * I, E), z(E, I)
            ly.bqkv = z(qkv) if self._qkv_bias else None
            ly.bo = z(E) if self._o_bias else None
            ly.bgu = z(2 * I) if self._mlp_bias else None
            ly.bd = z(E) if self._mlp_bias else None
            self.layers.append(ly)
            p = f"model.layers.{i}."
            s = self._slots
            s[p + "input_layernorm.weight"] = (ly.ln1, None)
            s[p + "post_attention_layernorm.weight"] = (ly.ln2, None)
            qs, ks, vs = slice(0, H * D), slice(H * D, (H + KV) * D), slice((H + KV) * D, qkv)
            for nm, sl in (("q", qs), ("k", ks), ("v", vs)):
                s[p + f"self_attn.{nm}_proj.weight"] = (ly.wqkv, sl)
                if ly.bqkv is not None:
                    s[p + f"self_attn.{nm}_proj.bias"] = (ly.bqkv, sl)
            s[p + "self_attn.o_proj.weight"] = (ly.wo, None)
            if ly.bo is not None:
                s[p + "self_attn.o_proj.bias"] = (ly.bo, None)
            s[p + "mlp.gate_proj.weight"] = (ly.wgu, slice(0, I))
            s[p + "mlp.up_proj.weight"] = (ly.wgu, slice(I, 2 * I))
            s[p + "mlp.down_proj.weight"] = (ly.wd, None)
            if self._mlp_bias:
                s[p + "mlp.gate_proj.bias"] = (ly.bgu, slice(0, I))
                s[p + "mlp.up_proj.bias"] = (ly.bgu, slice(I, 2 * I))
                s[p + "mlp.down_proj.bias"] = (ly.bd, None)
        self._unloaded = set(self._slots) - ({"lm_head.weight"} if self.tied else set())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF parameter name, tensor) pairs into the engine's weights in place (cast to the
        engine dtype). Partial updates are allowed. Wrapper prefixes ('module.', '_orig_mod.')
        are stripped; rotary buffers are ignored. With tied embeddings 'lm_head.weight' writes
        the shared embedding. Raises KeyError on an unknown name, ValueError on a bad shape."""
        with torch.no_grad():
            for name, t in named_tensors:
                name = strip_wrapper_prefixes(name)
                if name.endswith("rotary_emb.inv_freq") or name.endswith("rotary_emb.original_inv_freq"):
                    continue
                if name not in self._slots:
                    raise KeyError(f"FastEngine: unknown parameter {name!r}")
                dst, sl = self._slots[name]
                if sl is not None:
                    dst = dst[sl]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} != engine {tuple(dst.shape)}")
                dst.copy_(t.detach())
                self._unloaded.discard(name)

    # ------------------------------------------------------------------ model maths
    def _linear(self, x, w, b):
        return F.linear(x, w, b)

    def _forward_full(self, ids_BS: torch.Tensor, pos_BS: torch.Tensor, allow_BSS: torch.Tensor,
                      K_LBKTD: Optional[torch.Tensor] = None, V_LBKTD: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
        """Forward S positions of B rows at once (prefill / scoring). Writes K/V into columns
        [0, S) of the cache when given. allow_BSS: bool, query i may attend key j.
        Returns final-normed hidden states B×S×E."""
        B, S = ids_BS.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        x = self.embed_VE[ids_BS]                                   # B×S×E
        cos = self._cos_PD[pos_BS][:, None]                         # B×1×S×D
        sin = self._sin_PD[pos_BS][:, None]
        mask = allow_BSS[:, None]                                   # B×1×S×S
        for l, ly in enumerate(self.layers):
            h = _rms(x, ly.ln1, self.eps)
            qkv = self._linear(h, ly.wqkv, ly.bqkv)                 # B×S×(H+2KV)D
            q = qkv[..., : H * D].view(B, S, H, D).transpose(1, 2)  # B×H×S×D
            k = qkv[..., H * D:(H + KV) * D].view(B, S, KV, D).transpose(1, 2)
            v = qkv[..., (H + KV) * D:].view(B, S, KV, D).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            if K_LBKTD is not None:
                K_LBKTD[l, :, :, :S] = k
                V_LBKTD[l, :, :, :S] = v
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.group > 1)
            x = x + self._linear(a.transpose(1, 2).reshape(B, S, H * D), ly.wo, ly.bo)
            h = _rms(x, ly.ln2, self.eps)
            g, u = self._linear(h, ly.wgu, ly.bgu).chunk(2, dim=-1)
            x = x + self._linear(F.silu(g) * u, ly.wd, ly.bd)
        return _rms(x, self.norm_E, self.eps)

    def _step(self, ids_B: torch.Tensor, pos_B: torch.Tensor, col_1: torch.Tensor,
              maskadd_BT: torch.Tensor, K_LBKTD: torch.Tensor, V_LBKTD: torch.Tensor) -> torch.Tensor:
        """One decode step: token ids_B at positions pos_B, K/V written at cache column col_1,
        attention over the first T' = maskadd_BT.shape[1] columns (additive float mask).
        Returns float32 logits B×V."""
        B = ids_B.shape[0]
        H, KV, G, D = self.n_heads, self.n_kv, self.group, self.head_dim
        T = maskadd_BT.shape[1]
        scale = 1.0 / math.sqrt(D)
        x = self.embed_VE[ids_B]                                    # B×E
        cos = self._cos_PD[pos_B][:, None]                          # B×1×D
        sin = self._sin_PD[pos_B][:, None]
        m = maskadd_BT[:, None, None, :]                            # B×1×1×T
        for l, ly in enumerate(self.layers):
            h = _rms(x, ly.ln1, self.eps)
            qkv = self._linear(h, ly.wqkv, ly.bqkv)                 # B×(H+2KV)D
            qk = _rope(qkv[:, : (H + KV) * D].view(B, H + KV, D), cos, sin)  # q and k at once
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + KV) * D:].view(B, KV, D)
            Kl, Vl = K_LBKTD[l], V_LBKTD[l]                          # B×KV×Tmax×D
            Kl.index_copy_(2, col_1, k[:, :, None, :])
            Vl.index_copy_(2, col_1, v[:, :, None, :])
            # grouped-query attention: the G query heads of a KV head are one matmul
            s = torch.matmul(q.view(B, KV, G, D), Kl[:, :, :T].transpose(-1, -2))  # B×KV×G×T
            p = torch.softmax(s.float() * scale + m, dim=-1).to(x.dtype)
            a = torch.matmul(p, Vl[:, :, :T])                        # B×KV×G×D
            x = x + self._linear(a.reshape(B, H * D), ly.wo, ly.bo)
            h = _rms(x, ly.ln2, self.eps)
            g, u = self._linear(h, ly.wgu, ly.bgu).chunk(2, dim=-1)
            x = x + self._linear(F.silu(g) * u, ly.wd, ly.bd)
        return F.linear(_rms(x, self.norm_E, self.eps), self.lm_head_VE).float()

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        """See `RolloutEngine.generate`. Raises ValueError on empty prompts or prompts that do
        not fit `max_position_embeddings` with `max_new_tokens`."""
        prompts = check_prompts(prompts, self.vocab_size)
        t0 = time.perf_counter()
        reqs = [p for p in prompts for _ in range(params.n)]
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        else:
            gen = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        resp: list[list[int]] = []
        fin: list[bool] = []
        lps: list[list[float]] = []
        timings = {"prefill_s": 0.0, "decode_s": 0.0, "steps": 0}
        with torch.inference_mode():
            for s in range(0, len(reqs), self.max_batch_size):
                r, f, lp = self._generate_chunk(reqs[s: s + self.max_batch_size], params, gen, timings)
                resp += r
                fin += f
                lps += lp
        timings["generate_s"] = time.perf_counter() - t0
        return RolloutOutput(resp, fin, lps if params.return_logprobs else None, timings=timings)

    def _bucket_batch(self, n: int) -> int:
        if not self._compile:
            return n
        return next((b for b in self.batch_buckets if b >= n), n)

    def _prefill(self, reqs: list[list[int]], P: int, T: int, Bc: int):
        """Prefill the distinct prompts of `reqs` (left-padded to P), then copy their cache rows to
        every request (plus Bc - N filler rows). Returns (K_LBKTD, V_LBKTD, logits_BV float32 of
        the next token, additive mask_BT, position of the next token pos_B)."""
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
        lens_U = torch.tensor([len(p) for p in uprompts])
        pad_U = P - lens_U
        ids_US = torch.tensor([[0] * (P - len(p)) + p for p in uprompts])
        ar_S = torch.arange(P)
        valid_US = ar_S[None, :] >= pad_U[:, None]
        pos_US = (ar_S[None, :] - pad_U[:, None]).clamp(min=0)
        allow_USS = torch.tril(torch.ones(P, P, dtype=torch.bool))[None] & valid_US[:, None, :]
        allow_USS |= torch.eye(P, dtype=torch.bool)[None]         # padded queries see themselves
        Kp = torch.zeros(L, U, KV, P, D, dtype=self.dtype)
        Vp = torch.zeros(L, U, KV, P, D, dtype=self.dtype)
        hid_UE = self._forward_full(ids_US, pos_US, allow_USS, Kp, Vp)[:, -1]
        logits = F.linear(hid_UE, self.lm_head_VE).float()
        src_t = torch.tensor(src + [src[0]] * (Bc - N))            # bucket filler rows
        K = torch.zeros(L, Bc, KV, T, D, dtype=self.dtype)
        V = torch.zeros(L, Bc, KV, T, D, dtype=self.dtype)
        K[:, :, :, :P] = Kp.index_select(1, src_t)
        V[:, :, :, :P] = Vp.index_select(1, src_t)
        del Kp, Vp
        logits_BV = logits.index_select(0, src_t)
        maskadd_BT = torch.full((Bc, T), float("-inf"))
        maskadd_BT[:, :P] = torch.where(valid_US, 0.0, float("-inf")).index_select(0, src_t)
        pos_B = lens_U.index_select(0, src_t).clone()              # position of the next token
        return K, V, logits_BV, maskadd_BT, pos_B

    def _generate_chunk(self, reqs: list[list[int]], params: SamplingParams, gen: torch.Generator,
                        timings: dict):
        tp = time.perf_counter()
        N = len(reqs)
        new = params.max_new_tokens
        P = max(len(p) for p in reqs)
        if P + new > self.max_positions:
            raise ValueError(f"prompt ({P}) + max_new_tokens ({new}) > max_position_embeddings "
                             f"({self.max_positions})")
        T = -(-(P + new) // self.kv_bucket) * self.kv_bucket
        Bc = self._bucket_batch(N)
        K, V, logits_BV, maskadd_BT, pos_B = self._prefill(reqs, P, T, Bc)
        rows_B = torch.arange(Bc)                                  # request index of each row
        rows_B[N:] = -1
        done_B = rows_B < 0
        out_tok = torch.zeros(N, new, dtype=torch.long)
        out_lp = torch.zeros(N, new)
        out_len = torch.full((N,), new, dtype=torch.long)
        out_fin = torch.zeros(N, dtype=torch.bool)
        stop_t = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long)
        has_stop = stop_t.numel() > 0
        timings["prefill_s"] += time.perf_counter() - tp
        td = time.perf_counter()
        step_fn = self._compiled_step if self._compile else self._step
        col_1 = torch.zeros(1, dtype=torch.long)
        for t in range(new):
            suppress = stop_t if (has_stop and t < params.min_new_tokens) else None
            ids_B, lp_B = sample(logits_BV, temperature=params.temperature, top_k=params.top_k,
                                 top_p=params.top_p, suppress_ids=suppress, generator=gen)
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
                maskadd_BT, pos_B = maskadd_BT.index_select(0, keep), pos_B.index_select(0, keep)
                ids_B, rows_B, done_B = ids_B.index_select(0, keep), rows_B.index_select(0, keep), done_B.index_select(0, keep)
            col = P + t
            col_1.fill_(col)
            maskadd_BT[:, col] = 0.0
            mask_view = maskadd_BT if self._compile else maskadd_BT[:, : col + 1]
            logits_BV = step_fn(ids_B, pos_B, col_1, mask_view, K, V)
            pos_B = pos_B + 1
            timings["steps"] += 1
        timings["decode_s"] += time.perf_counter() - td
        resp, fin, lps = [], [], []
        lens = out_len.tolist()
        toks = out_tok.tolist()
        lpl = out_lp.tolist() if params.return_logprobs else None
        fins = out_fin.tolist()
        for i in range(N):
            n_i = lens[i]
            resp.append(toks[i][:n_i])
            fin.append(fins[i])
            lps.append(lpl[i][:n_i] if lpl is not None else [])
        return resp, fin, lps

    # ------------------------------------------------------------------ scoring
    def score_logprobs(self, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """Temperature-1 log-probs of each response token given its prompt (one full forward
        per chunk of `max_batch_size` rows, left padding). Raises ValueError on empty prompts
        or mismatched lengths."""
        prompts = check_prompts(prompts, self.vocab_size)
        if len(prompts) != len(responses):
            raise ValueError("prompts and responses differ in length")
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
                hid = self._forward_full(ids, pos, allow)
                for i, (p, r) in enumerate(zip(ps, rs)):
                    if not r:
                        out.append([])
                        continue
                    a = int(pad[i]) + len(p) - 1                      # predicts response token 0
                    lg = F.linear(hid[i, a: a + len(r)], self.lm_head_VE).float().log_softmax(-1)
                    out.append(lg.gather(-1, torch.tensor(r)[:, None]).squeeze(-1).tolist())
        return out


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Read every *.safetensors (or pytorch_model*.bin) file of an HF directory."""
    import glob
    import os
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file
        for f in files:
            state.update(load_file(f))
        return state
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    for f in files:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state
