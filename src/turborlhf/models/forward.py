"""Forward passes shared by all trainers, written so no work is wasted:

- log-probs are computed only at the positions that need them (response tokens), through the LM
  head in chunks, so the fp32 ``B×T×V`` logits tensor is never materialised;
- reward scores read only the last attended position (one head application per sequence);
- position ids come from the attention mask (``cumsum - 1``), so right-padded batches and PPO's
  left-padded-prompt / right-padded-response layout both get the positions the engine used.

Notation: B sequences, T tokens (prompt + response, right-padded), H hidden size, V vocabulary,
N selected positions. ``logp_BT[b, t] = log p(ids[b, t] | ids[b, <t])``; entries where the mask
is 0 are 0.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from turborlhf.algo.losses import entropy_from_logits
from turborlhf.models.load import backbone_of

__all__ = ["hidden_states", "response_logprobs", "last_token_scores", "token_values", "last_index"]


def hidden_states(model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Final-layer hidden states ``B×T×H`` of the decoder stack (no LM head, no cache)."""
    position_ids = (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)
    out = backbone_of(model)(input_ids=input_ids_BT, attention_mask=attention_mask_BT, position_ids=position_ids,
                             use_cache=False)
    return out.last_hidden_state


def response_logprobs(model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                      target_mask_BT: torch.Tensor, with_entropy: bool = False,
                      entropy_grad: bool = False, chunk_tokens: int = 1024) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs (and entropies) of the tokens where ``target_mask_BT`` is 1.

    Args:
        model: causal LM (HF, optionally peft-wrapped).
        input_ids_BT, attention_mask_BT: right-padded token ids and mask.
        target_mask_BT: 1 on the tokens to score (response tokens incl. EOS). Position 0 is
            never scored (it has no context).
        with_entropy: also return the entropy of the predictive distribution at those positions.
        entropy_grad: keep the entropy in the autograd graph (for an entropy bonus); otherwise
            it is computed without grad (a metric only).
        chunk_tokens: positions per LM-head chunk; peak extra memory ~ chunk_tokens·V·4 bytes.

    Returns:
        ``(logp_BT, entropy_BT or None)`` in fp32, zero where the target mask is 0.
    """
    hidden = hidden_states(model, input_ids_BT, attention_mask_BT)          # B×T×H
    sel = target_mask_BT[:, 1:].bool()                                       # B×(T-1)
    h_NH = hidden[:, :-1][sel]                                               # N×H
    labels_N = input_ids_BT[:, 1:][sel]                                      # N
    head = model.get_output_embeddings()
    logps, ents = [], []
    for s in range(0, h_NH.shape[0], chunk_tokens):
        logits = head(h_NH[s:s + chunk_tokens]).float()                      # n×V
        lse = torch.logsumexp(logits, dim=-1)
        logps.append(logits.gather(-1, labels_N[s:s + chunk_tokens, None]).squeeze(-1) - lse)
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ents.append(entropy_from_logits(logits if entropy_grad else logits.detach()))
    B, T = input_ids_BT.shape
    logp_BT = hidden.new_zeros((B, T), dtype=torch.float32)
    ent_BT = hidden.new_zeros((B, T), dtype=torch.float32) if with_entropy else None
    if logps:
        logp_BT[:, 1:][sel] = torch.cat(logps)
        if with_entropy:
            ent_BT[:, 1:][sel] = torch.cat(ents)
    return logp_BT, ent_BT


def last_index(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Index of the last attended token of each row (``B``); works for any padding side."""
    T = attention_mask_BT.shape[-1]
    pos = torch.arange(T, device=attention_mask_BT.device)
    return (attention_mask_BT.long() * pos).argmax(-1)


def last_token_scores(model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Reward-model scores ``B`` (fp32): the scalar head at the last attended token (the EOS)."""
    hidden = hidden_states(model, input_ids_BT, attention_mask_BT)
    idx = last_index(attention_mask_BT)
    h_BH = hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]
    return _score_head(model)(h_BH).squeeze(-1).float()


def token_values(model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Critic values ``B×T`` (fp32): the scalar head at every position.

    ``values_BT[b, t]`` is the value of the state after token t; the value of the state in which
    response token t is chosen is therefore ``values_BT[b, t-1]`` (callers shift).
    """
    hidden = hidden_states(model, input_ids_BT, attention_mask_BT)
    return _score_head(model)(hidden).squeeze(-1).float()


def _score_head(model: nn.Module) -> nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.score
    # peft's modules_to_save wrapper forwards to the active copy
    return head
