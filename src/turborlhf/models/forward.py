"""Forward passes shared by all trainers, written so no work is wasted:

- log-probs are computed only at the positions that need them (response tokens), through the LM
  head in chunks, so the fp32 ``B×T×V`` logits tensor is never materialised;
- reward scores read one position per sequence (one head application each): the position
  transformers' ``*ForSequenceClassification`` pools, so a saved reward model scores the same in
  plain transformers (`score_index`);
- position ids come from the attention mask (``cumsum - 1``), so right-padded batches and PPO's
  left-padded-prompt / right-padded-response layout both get the positions the engine used;
- padding is removed: with turborlhf's CPU training attention the decoder stack runs on the real
  tokens of all rows packed into one row (`packs_sequences`), and hidden states are scattered
  back to the padded layout, so callers never see the difference;
- shared prompts (GRPO's G responses to one prompt, `shared_prompt_hidden_states`): with
  ``share_prompts`` each distinct prompt goes through the stack once, its responses attend to it.

Notation: B sequences, T tokens (prompt + response, right-padded), H hidden size, V vocabulary,
N selected positions. ``logp_BT[b, t] = log p(ids[b, t] | ids[b, <t])``; entries where the mask
is 0 are 0.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from turborlhf.algo.losses import entropy_from_logits
from turborlhf.data.tokenize import pad_batch, pad_masks
from turborlhf.engine.train import autocast, compute_device
from turborlhf.models.head_logprobs import fusable_head, head_logprobs, keeps_logits
from turborlhf.models.load import backbone_of
from turborlhf.models.trunk import trunk_hidden_states

__all__ = ["hidden_states", "packs_sequences", "shared_prompt_hidden_states", "prompt_end", "SegmentPlan",
           "response_logprobs", "summed_logps", "sequence_logps", "last_token_scores", "token_values", "last_index",
           "apply_score_head", "pooling_pad_id", "score_index",
           "SharedPrefixBatch", "pack_shared_prefix", "shared_prefix_scores"]


def _on_model_device(fn):
    """Run `fn(model, *tensors, ...)` on the model's device: tensor arguments are moved there and
    tensor results come back to the device of the first tensor argument (trainers keep their
    batches on the CPU; a model on a GPU then computes there and only per-token or per-sequence
    results travel back). A no-op when both are the CPU."""

    def moved(x, dev):
        if isinstance(x, torch.Tensor):
            # asynchronous only towards an accelerator: a non-blocking copy to the CPU returns before
            # the data has arrived, and the caller would read stale memory
            return x.to(dev, non_blocking=dev.type != "cpu")
        if isinstance(x, tuple):
            return tuple(moved(t, dev) for t in x)
        return x

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        home = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        dev = compute_device(model)
        if home is None or home == dev:
            return fn(model, *args, **kwargs)
        out = fn(model, *(moved(a, dev) for a in args), **{k: moved(v, dev) for k, v in kwargs.items()})
        return moved(out, home)

    return wrapper


def hidden_states(model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                  position_ids_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Final-layer hidden states ``B×T×H`` of the decoder stack (no LM head, no cache).

    `attention_mask_BT` is a 2-D padding mask, or a 4-D boolean ``B×1×T×T`` mask (True = may
    attend), in which case `position_ids_BT` must be given. A 4-D mask is handed to the model in
    the form its attention needs (`_custom_mask`: additive for eager attention, with the sliding
    window of sliding-window layers applied), as transformers does for the masks it builds.
    A model that shares frozen lower layers with others (`turborlhf.models.trunk`) reads their
    output from the shared cache for a 2-D mask and runs only its upper layers.
    """
    backbone = backbone_of(model)
    if attention_mask_BT.dim() == 2:
        trunk = getattr(backbone, "_turborlhf_trunk", None)
        if position_ids_BT is None:
            position_ids_BT = (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)
            if trunk is not None:        # positions follow from the mask, so a row's tokens are its key
                return trunk_hidden_states(backbone, trunk, input_ids_BT, attention_mask_BT, position_ids_BT,
                                           _stack_hidden_states)
        return _stack_hidden_states(backbone, input_ids_BT, attention_mask_BT, position_ids_BT)
    mask = _custom_mask(backbone, attention_mask_BT, position_ids_BT)
    out = backbone(input_ids=input_ids_BT, attention_mask=mask, position_ids=position_ids_BT, use_cache=False)
    return out.last_hidden_state


def _stack_hidden_states(backbone: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                         position_ids_BT: torch.Tensor,
                         inputs_embeds_BTH: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The decoder stack over a 2-D padding mask (packed without the padding where
    `packs_sequences`), from the token ids or from `inputs_embeds_BTH` (the hidden states a
    shared trunk computed, `turborlhf.models.trunk`)."""
    if packs_sequences(backbone) and not bool(attention_mask_BT.all()):
        return _packed_hidden_states(backbone, input_ids_BT, attention_mask_BT.bool(), position_ids_BT,
                                     inputs_embeds_BTH)
    src = dict(input_ids=input_ids_BT) if inputs_embeds_BTH is None else dict(inputs_embeds=inputs_embeds_BTH)
    out = backbone(**src, attention_mask=attention_mask_BT, position_ids=position_ids_BT, use_cache=False)
    return out.last_hidden_state


def _custom_mask(backbone: nn.Module, allowed_B1TT: torch.Tensor, position_ids_BT: torch.Tensor):
    """A boolean ``B×1×T×T`` mask (True = may attend) as the decoder stack's attention needs it.

    transformers passes a 4-D mask to every layer unchanged, so what its own mask builders
    (``create_causal_mask``, ``create_sliding_window_causal_mask``) would add is added here:

    - sliding-window layers (``config.sliding_window``; Gemma2/3 alternate them with full layers,
      Mistral uses them everywhere, Qwen2 with ``use_sliding_window``): a query at position i sees
      keys at positions j > i − window only (transformers' ``sliding_window_overlay``, on position
      ids so packed rows keep each sequence's own distances). With ``config.layer_types`` the model
      receives ``{"full_attention": mask, "sliding_attention": mask}``, the per-layer-type form
      those models accept in place of building masks;
    - eager attention (Gemma2's only implementation, for its logit soft-capping) adds the mask to
      the scores, so it gets an additive mask (0 or the dtype's minimum, as transformers'
      ``eager_mask``); SDPA and the training attention take the boolean mask.
    """
    cfg = backbone.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    dtype = backbone.get_input_embeddings().weight.dtype

    def fmt(m: torch.Tensor) -> torch.Tensor:
        if getattr(cfg, "_attn_implementation", None) != "eager":
            return m
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)

    if not window:
        return fmt(allowed_B1TT)
    pos = position_ids_BT.to(allowed_B1TT.device)
    sliding = allowed_B1TT & (pos[:, None, None, :] > pos[:, None, :, None] - int(window))
    if layer_types is None:                      # Mistral-style: every layer slides
        return fmt(sliding)
    return {"full_attention": fmt(allowed_B1TT), "sliding_attention": fmt(sliding)}


def packs_sequences(backbone: nn.Module) -> bool:
    """Whether `hidden_states` runs this decoder stack on the real tokens only (padding removed):
    with turborlhf's training attention (`turborlhf.models.attention`, CPU models loaded by
    `turborlhf.models.load`), which attends within each packed sequence."""
    from turborlhf.models.attention import ATTN_IMPLEMENTATION

    return getattr(getattr(backbone, "config", None), "_attn_implementation", None) == ATTN_IMPLEMENTATION


def _packed_hidden_states(backbone: nn.Module, input_ids_BT: torch.Tensor, valid_BT: torch.Tensor,
                          position_ids_BT: torch.Tensor,
                          inputs_embeds_BTH: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`hidden_states` without the padding: the N real tokens of the B rows go through the stack as
    one row ``1×N`` (positions restart with each sequence; attention stays within a sequence via
    flash-attention's varlen arguments ``cu_seq_lens_q/k``, ``max_length_q/k``), and the hidden
    states are scattered back to ``B×T×H`` (zeros at padding). The embeddings, norms, linears and
    MLPs, which are most of the work, skip the padding: OpenRLHF's ``--packing_samples`` and
    verl's ``use_remove_padding``. A row's real tokens may sit anywhere in it (left-padded prompt,
    right-padded response); each row is one sequence."""
    B, T = input_ids_BT.shape
    idx_N = valid_BT.reshape(-1).nonzero().squeeze(1)
    lens_B = valid_BT.sum(-1)
    cu = torch.nn.functional.pad(lens_B.cumsum(0), (1, 0)).to(torch.int32)
    max_len = int(lens_B.max())
    N = idx_N.shape[0]
    src = (dict(input_ids=input_ids_BT.reshape(-1)[idx_N][None]) if inputs_embeds_BTH is None
           else dict(inputs_embeds=inputs_embeds_BTH.reshape(B * T, -1)[idx_N][None]))
    out = backbone(**src, position_ids=position_ids_BT.reshape(-1)[idx_N][None],
                   # no padding in the one packed row: the mask builder returns None (the varlen attention masks)
                   attention_mask=torch.ones(1, N, dtype=torch.long, device=input_ids_BT.device), use_cache=False,
                   cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    h_NH = out.last_hidden_state[0]
    return h_NH.new_zeros((B * T, h_NH.shape[-1])).index_copy(0, idx_N, h_NH).view(B, T, -1)


# model types whose causal-LM class scales the head's logits: (config attribute, multiply or divide)
_LOGIT_SCALES = {"granite": ("logits_scaling", False), "granitemoe": ("logits_scaling", False),
                 "granitemoeshared": ("logits_scaling", False), "granitemoehybrid": ("logits_scaling", False),
                 "granite_swa": ("logits_scaling", False), "granitemoe_swa": ("logits_scaling", False),
                 "minicpm3": ("logits_scaling", False), "hyperclovax": ("logits_scaling", True),
                 "cohere": ("logit_scale", True), "cohere2": ("logit_scale", True),
                 "falcon_h1": ("lm_head_multiplier", True)}


def final_logit_transform(model: nn.Module) -> tuple[float, Optional[float]]:
    """``(scale, softcap)``: what the model's causal-LM class does to its head's output before
    returning logits, ``softcap · tanh(scale · z / softcap)`` (no cap where None). transformers'
    Gemma2/Gemma3 cap them (``final_logit_softcapping``), Granite and MiniCPM3 divide them by
    ``logits_scaling``, Cohere multiplies by ``logit_scale``, Falcon-H1 by ``lm_head_multiplier``;
    scoring with the bare head would train another distribution than the model samples from.
    Raises ValueError for a model type not in `_LOGIT_SCALES` whose config scales its logits
    (``logits_scaling``/``logit_scale`` ≠ 1): whether it multiplies or divides is the class's
    choice."""
    cfg = getattr(backbone_of(model), "config", None) or getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    cap = getattr(cfg, "final_logit_softcapping", None)
    model_type = getattr(cfg, "model_type", "")
    scale = 1.0
    if model_type in _LOGIT_SCALES:
        attr, multiply = _LOGIT_SCALES[model_type]
        value = float(getattr(cfg, attr, 1.0) or 1.0)
        scale = value if multiply else 1.0 / value
    else:
        for attr in ("logits_scaling", "logit_scale"):
            value = getattr(cfg, attr, None)
            if isinstance(value, (int, float)) and float(value) != 1.0:
                raise ValueError(f"model type {model_type!r} sets {attr}={value}, which its class applies to the "
                                 "logits in a way turborlhf does not know: not supported for training")
    return scale, (float(cap) if cap else None)


def _plain_head_chunk(head: nn.Module, h_nH: torch.Tensor, labels_n: torch.Tensor, temperature: float,
                      with_entropy: bool, entropy_grad: bool,
                      scale: float = 1.0,
                      softcap: Optional[float] = None,
                      own_cast: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`response_logprobs`' plain path for one chunk of positions: (log-probs, entropies or None).
    The model's logits (`final_logit_transform`: `scale`, `softcap`), then the sampling temperature.
    `own_cast`: the chunk casts the head's weights for autocast itself instead of sharing autocast's
    cached cast, so that each chunk's weight gradient reaches the fp32 weight on its own (through
    the shared cast, the chunks' gradients were summed in bf16 first: 64 chunks had 4.7× the
    error of one)."""
    dev = h_nH.device.type
    if own_cast and torch.is_autocast_enabled(dev):
        with torch.autocast(dev, dtype=torch.get_autocast_dtype(dev), cache_enabled=False):
            logits = head(h_nH).float()                                      # n×V
    else:
        logits = head(h_nH).float()
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.gather(-1, labels_n[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, entropy_from_logits(logits if entropy_grad else logits.detach())


@_on_model_device
def response_logprobs(model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                      target_mask_BT: torch.Tensor, with_entropy: bool = False,
                      entropy_grad: bool = False, chunk_tokens: int = 1024,
                      temperature: float = 1.0,
                      share_prompts: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs (and entropies) of the tokens where ``target_mask_BT`` is 1.

    Args:
        model: causal LM (HF, optionally peft-wrapped).
        input_ids_BT, attention_mask_BT: right-padded token ids and mask.
        target_mask_BT: 1 on the tokens to score (response tokens incl. EOS). Position 0 is
            never scored (it has no context).
        with_entropy: also return the entropy of the predictive distribution at those positions.
        entropy_grad: keep the entropy in the autograd graph (for an entropy bonus); otherwise
            it is computed without grad (a metric only).
        chunk_tokens: positions per LM-head chunk (`head_logprobs`'s ``rows``; the plain path, for
            a wrapped head or an entropy bonus, goes chunk by chunk too). With grad, the logits of
            all positions are kept for the backward up to `MAX_KEPT_LOGITS_BYTES`; above it each
            chunk's are recomputed there.
        temperature: the logits are divided by it first: the distribution the rollout engine samples
            from at that temperature (PPO/GRPO score their samples this way, as verl, OpenRLHF and
            TRL do). Must be > 0. The logits are the model class's own (its scale or soft cap,
            `final_logit_transform`, applied before the temperature).
        share_prompts: rows whose tokens before their first target are identical (the G samples
            of one prompt in GRPO/RLOO) compute those tokens once (`shared_prompt_hidden_states`);
            same results. Only with turborlhf's training attention (`packs_sequences`).

    Returns:
        ``(logp_BT, entropy_BT or None)`` in fp32, zero where the target mask is 0.
    """
    hidden = None
    if share_prompts:
        hidden = shared_prompt_hidden_states(model, input_ids_BT, attention_mask_BT,
                                             prompt_end(target_mask_BT, attention_mask_BT))
    if hidden is None:
        hidden = hidden_states(model, input_ids_BT, attention_mask_BT)      # B×T×H
    B, T = input_ids_BT.shape
    # flat indices into B×T of the positions that score a target (position t scores token t + 1): the
    # one read of the data this forward waits for on a GPU, since their count sizes the head's work
    # (a boolean-mask index per tensor would wait once for each: hidden states, labels, outputs)
    idx_N = nn.functional.pad(target_mask_BT[:, 1:].bool(), (0, 1)).reshape(-1).nonzero().squeeze(1)
    h_NH = hidden.reshape(B * T, -1).index_select(0, idx_N)                # N×H
    labels_N = input_ids_BT.reshape(-1).index_select(0, idx_N + 1)          # N
    head = model.get_output_embeddings()
    scale, softcap = final_logit_transform(model)
    logps, ents = [], []
    if (fusable_head(head) and softcap is None
            and not (with_entropy and entropy_grad and torch.is_grad_enabled())):
        # the log-softmax in one C pass per row, the logits kept in the matmul's dtype (`head_logprobs`)
        lp, ent = head_logprobs(h_NH, head, labels_N, temperature / scale, with_entropy, chunk_tokens)
        logps, ents = [lp], ([ent] if with_entropy else [])
    else:                               # a wrapped head, or an entropy bonus (its gradient): plain autograd
        # each chunk's fp32 logits are kept for the backward, or recomputed there where all of them
        # would pass `head_logprobs`' limit
        recompute = torch.is_grad_enabled() and not keeps_logits(h_NH.shape[0], head.weight.shape[0], 4)
        own_cast = torch.is_grad_enabled() and h_NH.shape[0] > chunk_tokens
        for s in range(0, max(h_NH.shape[0], 1), chunk_tokens):     # no position: one empty chunk, in the graph
            args = (head, h_NH[s:s + chunk_tokens], labels_N[s:s + chunk_tokens], temperature, with_entropy,
                    entropy_grad, scale, softcap, own_cast)
            lp, ent = checkpoint(_plain_head_chunk, *args, use_reentrant=False) if recompute else _plain_head_chunk(*args)
            logps.append(lp)
            if with_entropy:
                ents.append(ent)
    def scatter(parts: list[torch.Tensor]) -> torch.Tensor:        # N → B×T, zeros elsewhere
        out = hidden.new_zeros(B * T, dtype=torch.float32)
        return (out.index_copy(0, idx_N + 1, torch.cat(parts)) if parts else out).view(B, T)

    return scatter(logps), (scatter(ents) if with_entropy else None)


# ----------------------------------------------------------------------------------------------
# Shared prompts: the G responses to one prompt (GRPO, RLOO) compute the prompt once
# ----------------------------------------------------------------------------------------------

def prompt_end(target_mask_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Column ``B`` where each row's prompt ends: its first target token, or for a row without one
    (an empty response) the column after its last real token."""
    t = target_mask_BT.bool()
    return torch.where(t.any(-1), t.long().argmax(-1), last_index(attention_mask_BT) + 1)


def _prompt_groups(ids_BT: torch.Tensor, valid_BT: torch.Tensor, prompt_end_B: torch.Tensor) -> list[list[int]]:
    """Rows grouped by identical prompts: the same prompt end column and the same real tokens before
    it. Groups in order of first appearance."""
    # one copy from a GPU, not one sync per row
    ids_BT, valid_BT, prompt_end_B = ids_BT.cpu(), valid_BT.cpu(), prompt_end_B.cpu()
    groups: dict[tuple, list[int]] = {}
    for b in range(ids_BT.shape[0]):
        e = int(prompt_end_B[b])
        key = (e, tuple(ids_BT[b, :e][valid_BT[b, :e]].tolist()))
        groups.setdefault(key, []).append(b)
    return list(groups.values())


class SegmentPlan:
    """Attention plan of one packed row ``1×N`` in which groups of sequences share a prompt:
    ``[prompt_1 | response_1,1 | ... | response_1,G | prompt_2 | ...]``. Attention rows
    (segments): each prompt attends to itself (causally); each response attends to its group's
    prompt and causally to itself, never to the other responses. Equal to running each
    ``prompt + response`` separately; the prompt's linears and MLPs run once per group.

    Fields (S segments, Q / K their longest query / key lists, N the packed tokens; index N names
    a zero pad slot): q_idx_SQ, k_idx_SK (packed token indices), q_pos_SQ, k_pos_SK (positions),
    q_valid_SQ, k_valid_SK (bool), out_slot_N (each packed token's slot ``s·Q + q`` as a query).
    Built by `shared_prompt_hidden_states`, read by the training attention
    (`turborlhf.models.attention`, keyword ``turborlhf_segments``)."""

    def __init__(self, queries: list[torch.Tensor], keys: list[torch.Tensor], pos_N: torch.Tensor) -> None:
        N, dev = pos_N.shape[0], pos_N.device

        def pad(lists: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            L = max(len(x) for x in lists)
            idx = torch.full((len(lists), L), N, dtype=torch.long, device=dev)
            for s, x in enumerate(lists):
                idx[s, :len(x)] = x
            return idx, idx < N

        self.q_idx_SQ, self.q_valid_SQ = pad(queries)
        self.k_idx_SK, self.k_valid_SK = pad(keys)
        pos_ext = torch.cat([pos_N, pos_N.new_zeros(1)])
        self.q_pos_SQ, self.k_pos_SK = pos_ext[self.q_idx_SQ], pos_ext[self.k_idx_SK]
        slots = torch.arange(self.q_idx_SQ.numel(), device=dev)[self.q_valid_SQ.reshape(-1)]
        self.out_slot_N = torch.empty(N, dtype=torch.long, device=dev)
        self.out_slot_N[self.q_idx_SQ.reshape(-1)[self.q_valid_SQ.reshape(-1)]] = slots
        assert int(self.q_valid_SQ.sum()) == N, "every packed token is a query of exactly one segment"

    def mask(self, window: Optional[int] = None) -> torch.Tensor:
        """Boolean ``S×1×Q×K`` (True = may attend): a valid key at a position not after the
        query's (within `window` positions for a sliding-window layer, transformers'
        ``sliding_window_overlay``). Pad query slots see every valid key (finite outputs, unread)."""
        qp, kp = self.q_pos_SQ[:, :, None], self.k_pos_SK[:, None, :]
        real = self.q_valid_SQ[:, :, None]
        m = self.k_valid_SK[:, None, :] & ((kp <= qp) | ~real)
        if window:
            m = m & ((kp > qp - int(window)) | ~real)
        return m[:, None]


def shared_prompt_hidden_states(model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                                prompt_end_B: torch.Tensor) -> Optional[torch.Tensor]:
    """`hidden_states` ``B×T×H`` with each distinct prompt computed once: rows whose real tokens
    before column `prompt_end_B` are identical share them (`SegmentPlan`), and the hidden states of
    a shared prompt are copied back to each of its rows (so their gradients add up, as for
    separate rows). For GRPO with G samples of a prompt of p tokens and responses of r, the layer
    linears run on p + G·r tokens instead of G·(p + r): SGLang's and vLLM's prefix caching, applied
    to the training forward.

    Returns None, for the caller to run `hidden_states`, where sharing does not apply: no two rows
    share a prompt, a 4-D mask, or a model without turborlhf's training attention (GPU
    attention kernels take other varlen arguments)."""
    backbone = backbone_of(model)
    if attention_mask_BT.dim() != 2 or not packs_sequences(backbone):
        return None
    valid_BT = attention_mask_BT.bool()
    groups = _prompt_groups(input_ids_BT, valid_BT, prompt_end_B)
    if len(groups) == input_ids_BT.shape[0]:
        return None
    B, T = input_ids_BT.shape
    dev = input_ids_BT.device
    pos_BT = (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)
    cols = torch.arange(T, device=dev)
    src_BT = torch.full((B, T), -1, dtype=torch.long, device=dev)    # packed index of each real token
    flat: list[torch.Tensor] = []                                       # (b·T + t) of each packed token, in order
    queries, keys = [], []
    n = 0
    for rows in groups:
        e = int(prompt_end_B[rows[0]])
        p_cols = cols[:e][valid_BT[rows[0], :e]]
        p_idx = torch.arange(n, n + p_cols.numel(), device=dev)
        n += p_cols.numel()
        flat.append(rows[0] * T + p_cols)
        if p_cols.numel():
            queries.append(p_idx)
            keys.append(p_idx)
        for b in rows:
            src_BT[b, cols[:e][valid_BT[b, :e]]] = p_idx
            r_cols = cols[e:][valid_BT[b, e:]]
            r_idx = torch.arange(n, n + r_cols.numel(), device=dev)
            n += r_cols.numel()
            flat.append(b * T + r_cols)
            src_BT[b, r_cols] = r_idx
            if r_cols.numel():
                queries.append(r_idx)
                keys.append(torch.cat([p_idx, r_idx]))
    flat_N = torch.cat(flat)
    pos_N = pos_BT.reshape(-1)[flat_N]
    plan = SegmentPlan(queries, keys, pos_N)
    out = backbone(input_ids=input_ids_BT.reshape(-1)[flat_N][None], position_ids=pos_N[None],
                   attention_mask=torch.ones(1, n, dtype=torch.long, device=dev), use_cache=False,
                   turborlhf_segments=plan)
    h_NH = out.last_hidden_state[0]
    h_ext = torch.cat([h_NH, h_NH.new_zeros(1, h_NH.shape[-1])])        # row n: zeros at padding
    return h_ext[src_BT.masked_fill(src_BT < 0, n)]


# ----------------------------------------------------------------------------------------------
# Encoded records ({input_ids, loss_mask}) → summed response log-probs (DPO, KTO, references)
# ----------------------------------------------------------------------------------------------

def summed_logps(model, pad_id: int, seqs: Sequence[dict], dtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward pass over right-padded `seqs` (records with ``input_ids``/``loss_mask``).

    Returns ``(logp_B, logp_BT, mask_BT)``: summed response log-probs (fp32, differentiable when
    grad is enabled), the per-token log-probs and the 0/1 response mask (B rows, T padded).
    """
    ids_BT, attn_BT = pad_batch([s["input_ids"] for s in seqs], pad_id)
    mask_BT = pad_masks([s["loss_mask"] for s in seqs])
    with autocast(dtype, model):
        logp_BT, _ = response_logprobs(model, ids_BT, attn_BT, mask_BT)
    return logp_BT.sum(-1), logp_BT, mask_BT


@torch.no_grad()
def sequence_logps(model, pad_id: int, seqs: Sequence[dict], dtype: str, batch_size: int) -> torch.Tensor:
    """Summed response log-probs ``N`` of `seqs` without grad, in length-sorted batches (order kept).

    The attention kernels are those of the training forward (`kernels_of_training`): these are the
    reference log-probs that DPO and KTO set against the policy's forward with grad (and the
    policy's side of their evaluations and of KTO's z0). Under bf16, SDPA rounded differently from
    that forward's matmul path, by 0.36 nats per sequence on average on SmolLM2-135M, so the
    implicit rewards of the untrained policy were that noise instead of 0.
    """
    from turborlhf.models.attention import kernels_of_training

    was_training = model.training
    model.eval()
    out = torch.zeros(len(seqs))
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["input_ids"]))
    with kernels_of_training():
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            out[idx] = summed_logps(model, pad_id, [seqs[i] for i in idx], dtype)[0].float()
    model.train(was_training)
    return out


def last_index(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Index of the last attended token of each row (``B``); works for any padding side."""
    T = attention_mask_BT.shape[-1]
    pos = torch.arange(T, device=attention_mask_BT.device)
    return (attention_mask_BT.long() * pos).argmax(-1)


def pooling_pad_id(model: nn.Module) -> Optional[int]:
    """The ``pad_token_id`` of a (peft-wrapped) model's text config: the id transformers'
    sequence-classification pooling skips (`score_index`). `turborlhf.models.load` sets it to the
    tokenizer's pad id."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "pad_token_id", None)


def score_index(input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, pad_id: Optional[int]) -> torch.Tensor:
    """Index ``B`` of the token a reward model's head reads: the rightmost attended token whose id
    is not `pad_id`, which is the token transformers' ``*ForSequenceClassification`` pools
    ("rightmost token != config.pad_token_id", ``GenericForSequenceClassification.forward``).

    With a pad token distinct from EOS this is the last attended token, the EOS. With pad == EOS
    (Llama-3-style tokenizers without a spare token, kept by `turborlhf.models.load.load_tokenizer`)
    trailing EOS tokens are skipped and the last response token is read, as transformers reads it.
    `pad_id` None, or a row whose attended tokens are all `pad_id`: the last attended token.
    """
    last = last_index(attention_mask_BT)
    if pad_id is None:
        return last
    keep = attention_mask_BT.bool() & (input_ids_BT != pad_id)
    return torch.where(keep.any(-1), last_index(keep), last)


@_on_model_device
def last_token_scores(model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Reward-model scores ``B`` (fp32): the scalar head at the last attended token (the EOS), or
    at the last non-pad token when the pad id is the EOS id (`score_index`): the score
    ``AutoModelForSequenceClassification`` gives the same right-padded batch."""
    hidden = hidden_states(model, input_ids_BT, attention_mask_BT)
    idx = score_index(input_ids_BT, attention_mask_BT, pooling_pad_id(model))
    h_BH = hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]
    return apply_score_head(model, h_BH)


@_on_model_device
def token_values(model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Critic values ``B×T`` (fp32): the scalar head at every position.

    ``values_BT[b, t]`` is the value of the state after token t; the value of the state in which
    response token t is chosen is therefore ``values_BT[b, t-1]`` (callers shift).
    """
    hidden = hidden_states(model, input_ids_BT, attention_mask_BT)
    return apply_score_head(model, hidden)


def apply_score_head(model: nn.Module, hidden_XH: torch.Tensor) -> torch.Tensor:
    """The scalar head ``score`` on hidden states ``X×H`` → ``X`` fp32, computed in fp32 with
    autocast off (a plain head with bf16 weights, as a frozen reward model loaded in bf16 has, is
    cast up; a peft-wrapped head computes in its weights' dtype, fp32 master weights in training).

    Under bf16 autocast the head's output would be rounded to bf16: 8 significant bits, steps of
    2⁻⁶ ≈ 0.016 for scores in [2, 4). Close chosen/rejected scores then tie exactly (a tie counts
    as wrong in pair accuracy) and per-token values lose their low bits. A 1-output linear costs
    nothing in fp32. peft's ``modules_to_save`` wrapper forwards to the active copy.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.score
    w_dtype = next(head.parameters()).dtype
    with torch.autocast(hidden_XH.device.type, enabled=False):
        if w_dtype != torch.float32 and isinstance(head, nn.Linear):
            bias = None if head.bias is None else head.bias.float()
            return nn.functional.linear(hidden_XH.float(), head.weight.float(), bias).squeeze(-1)
        return head(hidden_XH.to(w_dtype)).squeeze(-1).float()


# ----------------------------------------------------------------------------------------------
# Shared-prefix packing for pairs (RM, DPO): the prompt is computed once for both responses
# ----------------------------------------------------------------------------------------------

class SharedPrefixBatch:
    """Row i = ``[prefix_i | a_i | b_i | pad]``; `a` and `b` both attend to the prefix (and causally
    to themselves) but never to each other, and both continue the prefix's positions. One forward
    pass then gives exactly the hidden states of the two separate sequences ``prefix+a`` and
    ``prefix+b`` while computing the prefix once (~40% fewer tokens on HH pairs).

    Fields: ids_BL, pos_BL, mask_B1LL (bool, True = may attend), a_last_B / b_last_B (index of
    the last token of each continuation), and per-row segment starts for log-prob targets.
    """

    def score_positions(self, pad_id: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed indices ``(a_B, b_B)`` of the token `score_index` reads in each separate
        sequence ``prefix+a`` / ``prefix+b``: the last token not equal to `pad_id` (it may lie in
        the shared prefix), else the last token."""
        if pad_id is None:
            return self.a_last_B, self.b_last_B
        a_out, b_out = self.a_last_B.clone(), self.b_last_B.clone()
        for i, (p, a, b) in enumerate(zip(self.prefix_len, self.a_len, self.b_len)):
            row = self.ids_BL[i]
            for out, idx in ((a_out, torch.arange(p + a)),
                             (b_out, torch.cat([torch.arange(p), torch.arange(p + a, p + a + b)]))):
                real = idx[row[idx] != pad_id]
                if real.numel():
                    out[i] = real[-1]
        return a_out, b_out

    def __init__(self, ids, pos, mask, prefix_len, a_len, b_len):
        self.ids_BL, self.pos_BL, self.mask_B1LL = ids, pos, mask
        self.prefix_len, self.a_len, self.b_len = prefix_len, a_len, b_len
        self.a_last_B = torch.tensor([p + a - 1 for p, a in zip(prefix_len, a_len)])
        self.b_last_B = torch.tensor([p + a + b - 1 for p, a, b in zip(prefix_len, a_len, b_len)])


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    """Tokens that `pack_shared_prefix` computes once for the pair ``(a, b)``: their longest
    common prefix, kept at least one token short of each."""
    return max(min(_common_prefix_len(a, b), len(a) - 1, len(b) - 1), 0)


def packed_pair_len(a: list[int], b: list[int]) -> int:
    """Length of the packed row ``[prefix | a's rest | b's rest]`` of `pack_shared_prefix`."""
    return len(a) + len(b) - shared_prefix_len(a, b)


def pack_shared_prefix(seqs_a: list[list[int]], seqs_b: list[list[int]], pad_id: int) -> SharedPrefixBatch:
    """Pack pairs of full sequences that share a prefix (their longest common token prefix, kept
    at least one token short of each so both continuations are non-empty)."""
    rows, P, A, Bl = [], [], [], []
    for a, b in zip(seqs_a, seqs_b):
        p = shared_prefix_len(a, b)
        rows.append(a[:p] + a[p:] + b[p:])
        P.append(p)
        A.append(len(a) - p)
        Bl.append(len(b) - p)
    L = max(len(r) for r in rows)
    n = len(rows)
    ids = torch.full((n, L), pad_id, dtype=torch.long)
    pos = torch.zeros((n, L), dtype=torch.long)
    mask = torch.zeros((n, 1, L, L), dtype=torch.bool)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    for i, (r, p, a, b) in enumerate(zip(rows, P, A, Bl)):
        ids[i, :len(r)] = torch.tensor(r)
        pos[i, :p + a] = torch.arange(p + a)
        pos[i, p + a:p + a + b] = torch.arange(p, p + b)
        m = mask[i, 0]
        m[:p + a, :p + a] = causal[:p + a, :p + a]                       # prefix + a: causal
        m[p + a:p + a + b, :p] = True                                    # b sees the prefix
        m[p + a:p + a + b, p + a:p + a + b] = causal[:b, :b]             # b: causal within itself
        if len(r) < L:                                                   # padding: see itself only
            idx = torch.arange(len(r), L)
            m[idx, idx] = True
    return SharedPrefixBatch(ids, pos, mask, P, A, Bl)


def shared_prefix_scores(model: nn.Module, batch: SharedPrefixBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward-model scores ``(a_B, b_B)`` (fp32) of packed pairs: the scalar head at the position
    `last_token_scores` reads in each sequence (`SharedPrefixBatch.score_positions`). Equal to
    `last_token_scores` on the two sequences separately. Computed on the model's device; the
    scores come back to the batch's."""
    dev = compute_device(model)
    hidden = hidden_states(model, batch.ids_BL.to(dev), batch.mask_B1LL.to(dev), batch.pos_BL.to(dev))
    rows = torch.arange(hidden.shape[0], device=dev)
    a_idx, b_idx = batch.score_positions(pooling_pad_id(model))
    a_B = apply_score_head(model, hidden[rows, a_idx.to(dev)])
    b_B = apply_score_head(model, hidden[rows, b_idx.to(dev)])
    return a_B.to(batch.ids_BL.device), b_B.to(batch.ids_BL.device)
