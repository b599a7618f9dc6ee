"""Training attention for CPUs: SDPA's forward speed without its slow backward.

On the CPU, in bf16, torch's flash-attention backward (``_scaled_dot_product_flash_attention_for_cpu_backward``)
is the single most expensive op of a PPO step at RLHF lengths: 23 ms per layer for 8 × 160
tokens of SmolLM2, against ~8 ms for the same gradients from plain matmuls and a softmax. The
attention implementation registered here (``"turborlhf"``, with SDPA's mask format) therefore:

- without grad (rollout scoring, reward and critic passes, evaluation): calls transformers'
  ``sdpa`` attention unchanged;
- with grad, or inside `kernels_of_training` (PPO's reference and old log-probs, which must round
  as the training forward does), on short sequences (at most `MATH_MAX_KEYS` keys and
  `MATH_MAX_SCORES` scores):
  computes the attention with matmuls and a fused fp32 softmax (`_SoftmaxAttention`). As with
  flash attention only q, k, v, the output and the row log-sum-exp are saved (no ``T×T``
  probabilities kept between forward and backward); the backward recomputes the scores once and
  applies the softmax-attention gradients with plain matmuls;
- with grad on longer sequences: ``sdpa`` again, whose tiled kernel wins beyond ~300 keys;
- packed sequences (padding removed, `turborlhf.models.forward`): padded to the longest with a
  mask for the matmul path above (bf16, short, training), otherwise causal ``sdpa`` one sequence
  at a time (`_per_sequence_attention`: no padding, and the flash kernel skips the masked half).
  "bf16" is the dtype the attention computes in (`_compute_dtype`): under bf16 autocast with fp32
  master weights the queries arrive in fp32 (fp32 rotary cos/sin times bf16 projections). Judging
  by the tensor's dtype instead once sent every bf16 PPO step to per-sequence flash attention: on
  a 2-core AMX Xeon the PPO bench's train phase took 4.05 s instead of 3.10 s.

Measured on a 2-core AMD EPYC Zen 4 (bf16, 9 query / 3 KV heads of 64, per layer, forward +
backward): 8×128 19-25 ms sdpa → 9 ms; 8×160 26-28 → 12-13; 8×256 33-42 → 24-26; 32×128 106-118
→ 38-40; but 16×384 108-158 → 246-248 and 2×1024 62-65 → 232-242, hence the key-length cut-off.
In fp32 on a 2-core Xeon without bf16 the matmul path only ties with ``sdpa`` at 8×128 (14 vs 15
ms) and loses at 8×256 (58 vs 42 ms); the cut-off is kept for bf16's sake.

Grouped-query attention is done without materialising repeated K/V: the query heads of one KV
head are stacked along the query axis (``B×KV×(rep·Tq)×D``), the same trick as vLLM's and
transformers' single-token GQA path.

The numerics follow transformers' ``eager_attention_forward`` (scores in the compute dtype,
softmax in fp32, probabilities cast back before the value matmul). Masked scores get `MASKED`
rather than ``-inf``, so fully masked query rows (left padding) give finite outputs.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
from torch import nn

__all__ = ["ATTN_IMPLEMENTATION", "MASKED", "MATH_MAX_KEYS", "MATH_MAX_SCORES", "register", "use_training_attention",
           "attention_for_compute_device", "math_attention", "kernels_of_training"]

ATTN_IMPLEMENTATION = "turborlhf"
#: longest key axis done by the matmul path (flash attention is faster beyond ~300 keys here)
MATH_MAX_KEYS = 256
#: largest ``B·H·Tq·Tk`` done by the matmul path (32 Mi scores: a 128 MiB fp32 transient in backward)
MATH_MAX_SCORES = 1 << 25
#: additive score of a masked position. Finite and small enough that a fully masked query row (left
#: padding) keeps an exact log-sum-exp in fp32 (so forward and backward agree on it), and far below
#: any real score, so a partly masked row puts probability < 1e-34 on it.
MASKED = -1.0e4


def _acc(x: torch.Tensor) -> torch.dtype:
    """Softmax dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """In-place ``exp`` of log-probabilities, with those below −69 (probability < 1e-30) set to 0.

    The clamp at −80 first: torch's vectorised exp takes a slow path for arguments that underflow
    (−100 costs ~100× −50 on a Zen 4), and masked scores sit near `MASKED`. Then the zeros: a
    masked probability of exp(−80) ≈ 2e-35 times a gradient below 1 is a denormal float, and the
    backward's matmuls over half a causal T×T matrix of denormals ran ~10× slower on an Intel Xeon
    (microcode assists; a 16-sequence fp32 SFT step 43 s instead of 16 s). The forward's softmax
    gives those positions exactly 0 too, so forward and backward agree on them."""
    return torch.threshold_(x.clamp_(min=-80.0).exp_(), 1e-30, 0.0)


class _SoftmaxAttention(torch.autograd.Function):
    """``softmax(q·kᵀ·scale + bias)·v`` on GQA-stacked heads, saving only q, k, v, the output and
    the row log-sum-exp (like flash attention); the backward recomputes the probabilities from the
    log-sum-exp and applies the standard softmax-attention gradients (Dao et al. 2022, FlashAttention,
    Algorithm 2 without tiling)::

        P = exp(S − lse);  dV = Pᵀ·dO;  dP = dO·Vᵀ;  dS = P ⊙ (dP − rowsum(dO ⊙ O));
        dQ = dS·K·scale;   dK = dSᵀ·Q·scale

    Shapes: q ``B×KV×M×D`` (M = rep·Tq query rows per KV head), k/v ``B×KV×Tk×D``, bias fp32
    broadcastable to ``B×KV×rep×Tq×Tk`` (None = no mask). Matmuls run in q's dtype, the softmax
    and its gradient in fp32. Autocast must be off around `apply` (`math_attention` does that).
    """

    @staticmethod
    def _probs(q, k, bias, lse, scale, rep):
        B, KV, M, _ = q.shape
        S = torch.matmul(q.to(_acc(q)), k.to(_acc(q)).transpose(-1, -2)).mul_(scale)  # fp32 scores, as flash
        if bias is not None:
            S = S.view(B, KV, rep, M // rep, -1).add_(bias).view(B, KV, M, -1)
        return S if lse is None else _exp_(S.sub_(lse[..., None]))

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, rep):  # type: ignore[override]
        S = _SoftmaxAttention._probs(q, k, bias, None, scale, rep)           # B×KV×M×Tk fp32
        P = torch.softmax(S, dim=-1)
        # lse = max(S) − log(max(P)): read off the fused softmax (max(P) ≥ 1/Tk, so the log is safe);
        # torch.logsumexp would take three more passes over S
        lse = S.amax(-1).sub_(P.amax(-1).log_())                             # B×KV×M
        out = torch.matmul(P.to(v.dtype), v)                                 # B×KV×M×D
        ctx.save_for_backward(q, k, v, bias, lse, out)
        ctx.scale, ctx.rep = scale, rep
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, bias, lse, out = ctx.saved_tensors
        dout = dout.to(v.dtype)
        P = _SoftmaxAttention._probs(q, k, bias, lse, ctx.scale, ctx.rep)   # B×KV×M×Tk fp32
        dv = torch.matmul(P.to(v.dtype).transpose(-1, -2), dout)
        dP = torch.matmul(dout.to(_acc(q)), v.to(_acc(q)).transpose(-1, -2))
        delta = (dout.to(_acc(q)) * out.to(_acc(q))).sum(-1, keepdim=True)          # rowsum(dO ⊙ O)
        dS = P.mul_(dP.sub_(delta)).mul_(ctx.scale).to(q.dtype)
        dq = torch.matmul(dS, k)
        dk = torch.matmul(dS.transpose(-1, -2), q)
        return dq, dk, dv, None, None, None


def math_attention(query_BHQD: torch.Tensor, key_BKTD: torch.Tensor, value_BKTD: torch.Tensor,
                   mask: Optional[torch.Tensor], scaling: float, causal: bool) -> torch.Tensor:
    """Softmax attention from matmuls with a flash-style backward (`_SoftmaxAttention`).
    Returns ``B×Tq×H×D`` (the layout transformers' attention functions return).

    Args:
        query_BHQD: ``B×H×Tq×D`` queries; H must be a multiple of the KV heads.
        key_BKTD, value_BKTD: ``B×KV×Tk×D``.
        mask: None, a boolean mask broadcastable to ``B×1×Tq×Tk`` (True = may attend), or an
            additive float mask of that shape.
        scaling: score scale (usually ``D**-0.5``).
        causal: apply a causal mask aligned to the last key (used when `mask` is None).

    Runs in the autocast dtype when autocast is on (else in the query's dtype).
    """
    B, H, Tq, D = query_BHQD.shape
    KV, Tk = key_BKTD.shape[1], key_BKTD.shape[2]
    rep = H // KV
    dtype = _compute_dtype(query_BHQD)
    if mask is None and causal and Tq > 1:
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=query_BHQD.device).tril(Tk - Tq)[None, None]
    bias = None
    if mask is not None:                      # B|1 × 1 × Tq × Tk → B|1 × 1 × 1 × Tq × Tk (broadcast over KV, rep)
        bias = (torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, MASKED)
                if mask.dtype == torch.bool else mask.to(_acc(mask)).clamp(min=MASKED))[:, :, None]
    with torch.autocast(query_BHQD.device.type, enabled=False):      # the inputs' device: its autocast is on
        q = query_BHQD.to(dtype).reshape(B, KV, rep * Tq, D)               # query heads of one KV head stacked
        out = _SoftmaxAttention.apply(q, key_BKTD.to(dtype), value_BKTD.to(dtype), bias, scaling, rep)
    return out.view(B, H, Tq, D).transpose(1, 2).contiguous()


def _varlen_attention(module: nn.Module, query_1HND: torch.Tensor, key_1KND: torch.Tensor, value_1KND: torch.Tensor,
                      cu_seqlens: torch.Tensor, max_len: int, dropout: float, scaling: Optional[float], **kwargs):
    """Causal attention within each of the packed sequences of one row (``cu_seqlens``: B + 1
    offsets into the N packed tokens, the `cu_seq_lens_q` of flash-attention's varlen API).

    The linears of the layer ran on the N real tokens only; here q, k and v are scattered into a
    right-padded ``B×heads×max_len×D`` batch (a copy of q, k, v: small next to the layer's
    linears), attended with a causal + key-length mask by the padded path below, and gathered back
    to the packed layout ``1×N×H×D``. Per sequence this is exactly the padded computation,
    including a sliding-window layer's window (the ``sliding_window`` argument the layer passes:
    key j is seen from query i when j > i − window, transformers' ``sliding_window_overlay``)."""
    window = kwargs.pop("sliding_window", None)
    if not window and not _pads_for_matmul_path(query_1HND, int(max_len)):
        return _per_sequence_attention(module, query_1HND, key_1KND, value_1KND, cu_seqlens, dropout, scaling,
                                       **kwargs)
    lens_B = cu_seqlens.diff().long()
    B, Tm = lens_B.shape[0], int(max_len)
    seq_N = torch.repeat_interleave(torch.arange(B, device=lens_B.device), lens_B)
    dest_N = seq_N * Tm + (torch.arange(seq_N.shape[0], device=lens_B.device) - cu_seqlens.long()[seq_N])

    # Cast to the compute dtype first (the attention would cast the padded copy anyway: same values),
    # and scatter with index_put, whose backward keeps only the indices: index_copy's also keeps its
    # source, which held fp32 queries and keys per layer until the backward (the rotary embedding's
    # fp32 output; 80 MiB of a SmolLM2 PPO actor's 790 MiB of saved tensors at 8 × 113 tokens).
    dtype = _compute_dtype(query_1HND)

    def pad(x_1HND: torch.Tensor) -> torch.Tensor:                   # 1×h×N×D → B×h×Tm×D
        x_NhD = x_1HND[0].transpose(0, 1).to(dtype)
        return (x_NhD.new_zeros((B * Tm,) + x_NhD.shape[1:]).index_put((dest_N,), x_NhD)
                .view(B, Tm, *x_NhD.shape[1:]).transpose(1, 2))

    ar = torch.arange(Tm, device=lens_B.device)
    mask_B1TT = (ar[:, None] >= ar[None, :])[None, None] & (ar < lens_B[:, None])[:, None, None, :]
    if window:
        mask_B1TT = mask_B1TT & (ar[None, :] > ar[:, None] - int(window))[None, None]
    out_BTHD, _ = _attention_forward(module, pad(query_1HND), pad(key_1KND), pad(value_1KND), mask_B1TT,
                                     dropout=dropout, scaling=scaling, is_causal=False, **kwargs)
    return out_BTHD.reshape(B * Tm, *out_BTHD.shape[2:]).index_select(0, dest_N).unsqueeze(0)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's for x's device when autocast is on there, else x's.
    Under bf16 autocast with fp32 master weights the rotary embedding hands back fp32 queries and
    keys (fp32 cos/sin times bf16 projections), while SDPA and `math_attention` run in bf16."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


_as_in_training = threading.local()


@contextlib.contextmanager
def kernels_of_training():
    """Within the block, forwards without grad choose their attention kernels as the training
    forward with grad does (`_math_path`, `_pads_for_matmul_path`). For the forwards whose
    log-probs are compared with the policy's training forward: PPO's reference and old log-probs.
    On SDPA they rounded differently from the matmul path, by up to 0.14 nats per token on SmolLM2
    in bf16: a GRPO step whose advantages were all zero moved the policy by a full Adam step (the
    gradient of that noise through the KL term), and PPO's step-0 KL and whitened advantages were
    that noise. Same kernels on the same micro-batches give bit-identical log-probs. Other no-grad
    forwards (reward model, critic, evaluation) keep SDPA, whose forward is faster here."""
    before = getattr(_as_in_training, "on", False)
    _as_in_training.on = True
    try:
        yield
    finally:
        _as_in_training.on = before


def _trains(*tensors: torch.Tensor) -> bool:
    """Whether this forward chooses kernels as a training one: with grad through `tensors`, or
    inside `kernels_of_training`."""
    return getattr(_as_in_training, "on", False) or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _pads_for_matmul_path(query_1HND: torch.Tensor, max_len: int) -> bool:
    """Whether packed sequences are padded to their longest for the matmul path: training
    (`_trains`), computed below fp32 (bf16, autocast included), at most `MATH_MAX_KEYS` tokens.
    Everything else goes `_per_sequence_attention`."""
    return _trains(query_1HND) and _compute_dtype(query_1HND) != torch.float32 and max_len <= MATH_MAX_KEYS


def _math_path(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, **kwargs) -> bool:
    """Whether `_attention_forward` computes with `math_attention` rather than SDPA: training
    (`_trains`), short keys (`MATH_MAX_KEYS`, `MATH_MAX_SCORES`), no dropout, softcap or position bias."""
    B, H, Tq, _ = query.shape
    Tk = key.shape[2]
    return (_trains(query, key, value) and dropout == 0.0 and Tk <= MATH_MAX_KEYS and B * H * Tq * Tk <= MATH_MAX_SCORES
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None)


def _per_sequence_attention(module: nn.Module, query_1HND: torch.Tensor, key_1KND: torch.Tensor,
                            value_1KND: torch.Tensor, cu_seqlens: torch.Tensor, dropout: float,
                            scaling: Optional[float], **kwargs) -> torch.Tensor:
    """`_varlen_attention` one sequence at a time: causal SDPA on each sequence's own slice of the
    packed tokens, outputs concatenated back to ``1×N×H×D``. No padding and no explicit mask, so
    the flash kernel skips the blocks above the diagonal: for micro-batches of 8 HH sequences of
    100-500 tokens it does about a quarter of the padded, masked computation's work. Measured on a
    2-core Xeon (fp32, SmolLM2, 16-sequence SFT step of ~3,100 tokens): attention forward and
    backward 4.9 s → 1.5 s per step; on micro-batches of 8 sequences of at most 256 tokens it also
    beat the padded matmul path in fp32 (5.0-6.0 s against 6.0-7.7 s per SFT micro-step). Used for
    every packed forward but bf16 training ones on sequences of at most `MATH_MAX_KEYS` tokens, where
    the padded matmul path was measured faster (Zen 4; the module docstring). The slices are views, so the backward writes each sequence's gradients straight into
    the packed q, k and v."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = cu_seqlens.tolist()
    outs = [sdpa_attention_forward(module, query_1HND[:, :, s:e], key_1KND[:, :, s:e], value_1KND[:, :, s:e], None,
                                   dropout=dropout, scaling=scaling, is_causal=True, **kwargs)[0]
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outs, dim=1)                                    # 1×N×H×D


def _segment_attention(module: nn.Module, query_1HND: torch.Tensor, key_1KND: torch.Tensor,
                       value_1KND: torch.Tensor, plan, dropout: float, scaling: Optional[float], **kwargs):
    """Attention of a packed row whose sequences share prompts (`turborlhf.models.forward.SegmentPlan`):
    each segment's queries and keys are gathered from the packed tokens into an ``S×heads×Q|K×D``
    batch (a shared prompt's keys into every segment of its group; their gradients add up in the
    backward of the gather), attended by the padded path below with the plan's mask, and the
    outputs gathered back to the packed layout ``1×N×H×D``."""
    def gather(x_1hND: torch.Tensor, idx_SX: torch.Tensor) -> torch.Tensor:
        x_hND = torch.cat([x_1hND[0], x_1hND.new_zeros(x_1hND.shape[1], 1, x_1hND.shape[3])], 1)
        return x_hND[:, idx_SX].transpose(0, 1)                      # h×S×X×D → S×h×X×D

    mask = plan.mask(kwargs.pop("sliding_window", None))
    out_SQHD, _ = _attention_forward(module, gather(query_1HND, plan.q_idx_SQ), gather(key_1KND, plan.k_idx_SK),
                                     gather(value_1KND, plan.k_idx_SK), mask, dropout=dropout, scaling=scaling,
                                     is_causal=False, **kwargs)
    return out_SQHD.reshape(-1, *out_SQHD.shape[2:]).index_select(0, plan.out_slot_N).unsqueeze(0)


def _attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                       scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan = kwargs.pop("turborlhf_segments", None)
    if plan is not None:                      # shared prompts (`turborlhf.models.forward.shared_prompt_hidden_states`)
        return _segment_attention(module, query, key, value, plan, dropout, scaling, **kwargs), None
    cu = kwargs.pop("cu_seq_lens_q", None)
    if cu is not None:                        # packed sequences (`turborlhf.models.forward.hidden_states`)
        for k in ("cu_seq_lens_k", "max_length_k"):
            kwargs.pop(k, None)
        max_len = kwargs.pop("max_length_q", None) or int(cu.diff().max())
        return _varlen_attention(module, query, key, value, cu, max_len, dropout, scaling, **kwargs), None
    if not _math_path(query, key, value, dropout, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    return math_attention(query, key, value, attention_mask, scale, causal), None


_registered = False


def register() -> str:
    """Register the ``"turborlhf"`` attention (and SDPA's mask builder under that name) with
    transformers; idempotent. Returns the implementation name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(ATTN_IMPLEMENTATION, _attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True
    return ATTN_IMPLEMENTATION


def use_training_attention(model: nn.Module) -> nn.Module:
    """Switch a loaded transformers model (or peft wrapper) to the ``"turborlhf"`` attention when
    it currently uses ``sdpa``; other implementations (flash-attention on GPUs, eager) are left
    alone. The saved ``config.json`` is unaffected (transformers does not serialise the attention
    implementation), so checkpoints still load anywhere."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return model
    if next(base.parameters()).device.type != "cpu":
        return model
    base.set_attn_implementation(register())
    return model


def attention_for_compute_device(model: nn.Module, device) -> nn.Module:
    """`use_training_attention` decided by where `model` computes rather than where it was loaded:
    a model loaded on the CPU that computes on a GPU (a reference or reward model offloaded between
    uses, ``distributed.ref_reward_offload``) goes back to ``sdpa``, since the ``"turborlhf"``
    attention's packed path attends one sequence at a time (a host sync per layer there) and its
    other paths are tuned for the CPU; the fused layers of `turborlhf.models.fused` go too
    (`use_plain_layers`). `device`: a ``torch.device`` or its name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    if torch.device(device).type != "cpu":
        from turborlhf.models.fused import use_plain_layers

        use_plain_layers(model)
    if (torch.device(device).type != "cpu" and cfg is not None
            and getattr(cfg, "_attn_implementation", None) == ATTN_IMPLEMENTATION):
        base.set_attn_implementation("sdpa")
    return model
