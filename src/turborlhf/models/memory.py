"""Memory formulas of one model: its shape from ``config.json`` alone, the bytes a training
micro-batch saves for backward, a no-grad forward's working set, and the rollout engine's KV
cache. `turborlhf plan` adds these up per role, phase and device.

The activation terms were read off the tensors Hugging Face's Llama code (and
`turborlhf.models.fused`) saves for backward; `tests/test_plan.py` compares them with the exact
saved-tensor bytes of tiny models, and docs/memory.md with the peak RSS of real runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelShape", "model_shape", "fused_layers_for", "train_activation_bytes",
           "inference_activation_bytes", "kv_cache_bytes", "HEAD_CHUNK", "KV_BUCKET"]

# Chunk of response positions that goes through the LM head at once (models.forward.response_logprobs).
HEAD_CHUNK = 1024
KV_BUCKET = 64           # FastEngine rounds the cache length up to this multiple


# ----------------------------------------------------------------------------------------------
# Model shapes from config.json only
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """What the memory formulas need of a decoder-only model (Llama-family names).

    params: parameters of the causal LM (a tied embedding counted once); layer_linear: weights of
    the Linear layers of all decoder layers (what bf16 autocast casts); lm_head: V·E;
    lora_in_out: Σ (in_features + out_features) over the Linear layers whose name is a LoRA
    target, so a rank-r adapter set has ``r · lora_in_out`` parameters.
    """

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    params: int
    layer_linear: int
    lm_head: int
    lora_in_out: int
    fused_layers: bool = False   # decoder norms/MLPs that `turborlhf.models.fused` replaces on CPU

    def scalar_params(self) -> int:
        """Parameters of the reward-model/critic form: no LM head, a scalar ``score`` head (E)."""
        return self.params - (0 if self.tied else self.lm_head) + self.hidden


def model_shape(name_or_path: str, lora_targets: tuple[str, ...] = ()) -> ModelShape:
    """Shape of a model from its config only: `AutoConfig`, then the model built on the meta
    device (no memory, no weights read) to count parameters exactly.

    Raises FileNotFoundError when a local path has no config.json (e.g. the output of a stage
    that has not run yet).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from turborlhf.models.zoo import is_zoo_name, resolve_model_path

    path = resolve_model_path(name_or_path, fetch=False) if is_zoo_name(name_or_path) else name_or_path
    text = str(path)
    hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~")) and not Path(text).exists()
    if (os.sep in text or text.startswith(".")) and not hub_id and not (Path(path) / "config.json").exists():
        raise FileNotFoundError(f"{name_or_path}: no config.json there (not trained yet?)")
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    seen: set[int] = set()
    params = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params += p.numel()
    layer_linear = lora = 0
    targets = set(lora_targets)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}":
            layer_linear += mod.weight.numel()
            if name.rsplit(".", 1)[-1] in targets:
                lora += mod.in_features + mod.out_features
    from turborlhf.models.fused import use_fused_layers

    fused = use_fused_layers(model) > 0
    E, H = cfg.hidden_size, cfg.num_attention_heads
    return ModelShape(
        name=str(name_or_path), vocab=cfg.vocab_size, hidden=E, layers=cfg.num_hidden_layers, heads=H,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or H,
        head_dim=getattr(cfg, "head_dim", None) or E // H, intermediate=cfg.intermediate_size,
        tied=bool(getattr(cfg, "tie_word_embeddings", False)), params=params, layer_linear=layer_linear,
        lm_head=cfg.vocab_size * E, lora_in_out=lora, fused_layers=fused)


# ----------------------------------------------------------------------------------------------
# Activations: bytes autograd keeps for backward (validated against saved-tensor bytes in tests)
# ----------------------------------------------------------------------------------------------

def _layer_bytes_per_token(s: ModelShape, dtype: str, packed_row_len: int = 0, lora_rank: int = 0,
                           fused: bool = False) -> int:
    """Bytes one decoder layer saves for backward per token (HF Llama code, torch SDPA).

    bf16 autocast: the fp32 residual stream and RMSNorm inputs (4·4E), two rsqrt (8), the bf16
    casts of the q/k/v and gate/up inputs (5·2E), the MLP (3·2I + 2I), q and the attention
    output (2·2·HD), k and v (2·2·KV·D) and the attention log-sum-exp (4H). fp32: 4-byte tensors
    and no casts (the norm outputs are shared: 2·4E). With a 4-D mask (shared-prefix pairs) k and
    v are expanded to H heads and the additive mask is kept per layer (row length L per token).
    LoRA (all seven projections adapted): frozen norms keep only 2 fp32 E tensors, the o_proj
    input is kept for its adapter (2·HD in bf16), and each adapter keeps its r-dim output (7·r).
    `fused` (`turborlhf.models.fused`): each norm keeps its normalised input and its output in the
    compute dtype (2·2w·E) and an fp32 rstd, the projections share that output, and the MLP keeps
    gate and up (2·w·I; with a LoRA-wrapped down projection also its input, 3·w·I). With LoRA in
    bf16, peft casts the bf16 norm output to fp32 before each adapter, so the adapters keep their
    own bf16 casts (10E) as without fusion.
    """
    E, I, H, KV, D = s.hidden, s.intermediate, s.heads, s.kv_heads, s.head_dim
    w = 2 if dtype == "bf16" else 4
    if fused:   # normalised inputs, rstds, then the norm outputs (LoRA: peft's fp32 → bf16 casts per adapter)
        outs = (10 * E + 2 * H * D if dtype == "bf16" else 8 * E) if lora_rank else 2 * w * E
        resid = 2 * w * E + 8 + outs + 7 * w * lora_rank
    elif lora_rank:
        resid = 8 * E + 8 + (10 * E + 2 * H * D if dtype == "bf16" else 8 * E) + 7 * w * lora_rank
    else:
        resid = 16 * E + 8 + (10 * E if dtype == "bf16" else 8 * E)
    mlp = ((3 if lora_rank else 2) if fused else 4) * w * I   # fused: gate and up (+ down's input under LoRA)
    attn = 2 * w * H * D + (2 * w * H * D if packed_row_len else 2 * w * KV * D) + 4 * H
    mask = w * packed_row_len
    return resid + mlp + attn + mask


def fused_layers_for(s: ModelShape, device_kind: str) -> bool:
    """Whether training `s` on `device_kind` runs the fused norms/MLP (the loaders use them on CPU)."""
    return s.fused_layers and device_kind == "cpu"


def train_activation_bytes(s: ModelShape, rows: int, row_len: int, resp_tokens: int, dtype: str = "bf16",
                           head: str = "lm", packed: bool = False, gradient_checkpointing: bool = False,
                           lora_rank: int = 0, fused_layers: bool = False) -> dict[str, int]:
    """Activation memory of one training micro-batch (bytes).

    Args:
        s: the model.
        rows: sequences (or packed pair rows) in the micro-batch.
        row_len: tokens per row (padded length).
        resp_tokens: positions that go through the LM head (head="lm"); ignored otherwise.
        dtype: "bf16" (autocast over fp32 weights) or "fp32".
        head: "lm" (log-probs of response tokens), "values" (critic: scalar at every token) or
            "score" (reward model: scalar at the last token).
        packed: rows are shared-prefix pairs with a 4-D attention mask (RM).
        gradient_checkpointing: only each layer's input is kept; one layer is recomputed at a time.
        lora_rank: LoRA adapters of rank r on all seven projections (`_layer_bytes_per_token`).
        fused_layers: the decoder layers run `turborlhf.models.fused`'s norms and MLP (what the
            loaders do on CPU for `ModelShape.fused_layers` models; see `fused_layers_for`).

    Returns ``{"saved": ..., "casts": ..., "transient": ..., "peak": ...}``: the bytes saved for
    backward (the bf16 weight casts included, and also listed as "casts"), the largest
    short-lived buffer on top of them (the LM-head chunk's logit gradients in backward; with
    checkpointing, a recomputed layer, or every layer's weight cast held by the autocast cache
    until the forward ends), and "peak" = saved + transient. Raises ValueError for an unknown
    head or dtype.
    """
    if head not in ("lm", "values", "score") or dtype not in ("bf16", "fp32"):
        raise ValueError(f"head must be lm|values|score and dtype bf16|fp32, got {head!r}, {dtype!r}")
    E, V, D = s.hidden, s.vocab, s.head_dim
    w = 2 if dtype == "bf16" else 4
    N = rows * row_len
    per_layer = _layer_bytes_per_token(s, dtype, row_len if packed else 0, lora_rank, fused_layers) * N
    # bf16 casts of the projections' weights kept for backward; fused projections (`cast_linear`)
    # keep the fp32 parameter itself and cast again in backward, so only LoRA adapters keep casts
    casts = 2 * ((0 if fused_layers else s.layer_linear) + lora_rank * s.lora_in_out) if dtype == "bf16" else 0
    # final norm (its input and rstd; its normalised copy only when its weight trains), embedding
    # indices (only when the embedding trains), target mask
    const = N * ((4 * E + 4 if lora_rank else 8 * E + 4 + 8) + (1 if head == "lm" else 0))
    rope = N * 8 * D                                                # cos/sin, kept outside checkpointed layers
    if head == "lm":   # `head_logprobs`: the logits in the compute dtype, log-sum-exp, labels, the head's cast
        from turborlhf.models.head_logprobs import keeps_logits
        if keeps_logits(resp_tokens, V, w):
            hidden = 0 if lora_rank else w * E                      # a frozen head needs no input for its grad
            out = resp_tokens * (w * V + hidden + 12) + (2 * s.lm_head if dtype == "bf16" else 0)
            transient = min(resp_tokens, HEAD_CHUNK) * V * w        # one chunk of logit gradients
        else:          # the logits recomputed chunk by chunk in backward: the hidden states kept instead
            out = resp_tokens * (w * E + 12) + (2 * s.lm_head if dtype == "bf16" else 0)
            transient = 2 * min(resp_tokens, HEAD_CHUNK) * V * w    # a chunk's logits and their gradients
    elif head == "values":   # the scalar head runs in fp32 (`apply_score_head`): it keeps an fp32 input
        out, transient = N * 4 * E, 0
    else:
        out, transient = rows * (2 if packed else 1) * 4 * E, 0
    if gradient_checkpointing:
        saved = s.layers * N * 4 * E + const + out
        layer_casts = casts // max(s.layers, 1)
        transient = max(transient, per_layer + layer_casts, casts)
        return {"saved": saved, "casts": casts, "transient": transient, "peak": saved + transient}
    saved = s.layers * per_layer + casts + const + rope + out
    if lora_rank:   # the first layer's input needs no grad (frozen embeddings): its input norm keeps
        # nothing, and in bf16 the q/k/v weight casts are not kept either
        saved -= ((w if fused_layers else 4) * E + 4) * N
        if dtype == "bf16" and not fused_layers:
            saved -= 2 * E * (s.heads + 2 * s.kv_heads) * D
    return {"saved": saved, "casts": casts, "transient": transient, "peak": saved + transient}


def shared_prompt_train_bytes(s: ModelShape, rows: int, group: int, prompt_len: int, resp_len: int,
                              dtype: str = "bf16", lora_rank: int = 0, fused_layers: bool = False) -> dict[str, int]:
    """`train_activation_bytes` (head "lm") of a micro-batch of `rows` responses whose prompts are
    computed once per `group` of rows (PPO's ``share_prompts`` on the CPU's training attention,
    `turborlhf.models.forward.shared_prompt_hidden_states`).

    The layers run on ``p·prompts + rows·r`` packed tokens instead of ``rows·(p + r)``, and each
    attention keeps its segment tensors instead of per-token q/k/v: the gathered queries and the
    padded outputs (S·Q·H·D, S = prompts + rows segments, Q = max(p, r)), keys and values over
    K = p + r positions (expanded to H heads on SDPA's path, K > `MATH_MAX_KEYS`; KV heads on the
    matmul path), the log-sum-exp and the mask (S·Q·K; fp32 on the matmul path, the compute dtype on
    SDPA's), and the o_proj input per packed token.
    Measured on SmolLM2-135M's shape (8 rows; 2-core Xeon): fp32, one prompt: saved 4.707 GiB
    against 4.708 here at 32 + 480 tokens, 1.243 against 1.247 at 128 + 128 (the unshared formula:
    3.90 and 1.78); fp32, two prompts at 64 + 192: 1.814 against 1.815; bf16 at 64 + 448: 2.389
    against 2.39."""
    from turborlhf.models.attention import MATH_MAX_KEYS, MATH_MAX_SCORES

    L = prompt_len + resp_len
    base = train_activation_bytes(s, rows, L, rows * resp_len, dtype, "lm", lora_rank=lora_rank,
                                  fused_layers=fused_layers)
    H, KV, D = s.heads, s.kv_heads, s.head_dim
    w = 2 if dtype == "bf16" else 4
    prompts = -(-rows // max(1, group))
    N, n = rows * L, prompts * prompt_len + rows * resp_len
    S, Q, K = prompts + rows, max(prompt_len, resp_len), L
    attn_tok = 2 * w * H * D + 2 * w * KV * D + 4 * H           # `_layer_bytes_per_token`'s attention part
    rest_tok = _layer_bytes_per_token(s, dtype, 0, lora_rank, fused_layers) - attn_tok
    sdpa = K > MATH_MAX_KEYS or S * H * Q * K > MATH_MAX_SCORES
    kv_heads, mask = (H, w) if sdpa else (KV, 4)     # SDPA: repeated kv, the mask in the compute dtype
    seg = 2 * S * Q * H * D * w + 2 * S * kv_heads * K * D * w + S * H * Q * 4 + S * Q * K * mask + n * H * D * w
    saved = base["saved"] + s.layers * (rest_tok * (n - N) + seg - attn_tok * N) + (n - N) * 8 * D
    return {**base, "saved": saved, "peak": saved + base["transient"]}


def inference_activation_bytes(s: ModelShape, rows: int, row_len: int, resp_tokens: int = 0,
                               dtype: str = "bf16", head: str = "lm") -> int:
    """Peak transient bytes of a no-grad forward (experience, reference log-probs, RM scoring):
    one layer's working set (fp32 residual, bf16 q/k/v, MLP intermediates) and the LM-head chunk
    (its logits in the compute dtype, `turborlhf.models.head_logprobs`) for head="lm"."""
    E, I, V = s.hidden, s.intermediate, s.vocab
    w = 2 if dtype == "bf16" else 4
    N = rows * row_len
    layer = N * (12 * E + 4 * w * I + 2 * w * (s.heads + 2 * s.kv_heads) * s.head_dim)
    headb = min(resp_tokens, HEAD_CHUNK) * V * w if head == "lm" else N * 4 * E
    return N * 8 * E + layer + headb


def kv_cache_bytes(s: ModelShape, rows: int, prompt_len: int, new_tokens: int, dtype: str = "bf16") -> int:
    """Static KV cache of the embedded engine: K and V for every layer, row and KV head over
    ``ceil64(prompt + new)`` positions."""
    T = -(-(prompt_len + new_tokens) // KV_BUCKET) * KV_BUCKET
    return 2 * s.layers * rows * s.kv_heads * T * s.head_dim * (2 if dtype in ("bf16", "fp16") else 4)
