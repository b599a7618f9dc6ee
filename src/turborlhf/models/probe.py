"""A load-time check that turborlhf's own forward paths compute the model transformers built.

The training forward packs a batch's sequences into one row (`turborlhf.models.forward`,
`packs_sequences`) and the reward-model trainer scores a pair as one row ``[prompt | chosen |
rejected]`` under a 4-D mask (`shared_prefix_scores`). Both hold only for a decoder whose every
layer mixes tokens through the attention it is given, positioned by ``position_ids``: a layer that
drops the attention arguments (StableLM, Nemotron), a recurrent (Mamba, linear-attention) layer of
a hybrid model, or ALiBi by column index (MPT, Bloom) mixes the rows. And log-probs come from the
LM head's output with the model class's own transform (`final_logit_transform`), which must know
that class.

`check_training_forward` runs each path on two short random rows (a few forward passes of 7
tokens, CPU models) against the plain per-row forward and:

- packing differs or fails: the model goes back to ``sdpa`` (padded batches, transformers' own
  masking), with one warning naming the model type;
- the shared-prefix pair differs or fails: `shares_prefixes` is False for the model, and reward
  pairs go as separate padded rows;
- the log-probs differ from the model's own logits: ValueError naming the model type (a logit
  scale or cap turborlhf does not reproduce would train another distribution than the model
  samples from).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["check_training_forward", "shares_prefixes"]

_WARNED: set[tuple[str, str]] = set()      # (model type, what): each warning once per process
_ROWS, _SHORT = 7, 4          # the probe's two rows: 7 tokens, and 4 tokens right-padded to 7
_TOL = 1e-3                   # fp32 kernel differences are ~1e-6 of the values; the defects ~1e-1


def _differs(a: torch.Tensor, b: torch.Tensor) -> Optional[float]:
    """The largest difference of `a` and `b` relative to their size, where it is above the
    tolerance of their dtype (`_TOL`; 5e-2 in bf16/fp16, whose packed and separate rows were
    bit-equal on SmolLM2)."""
    tol = _TOL if a.dtype == torch.float32 else 5e-2
    diff = float((a.float() - b.float()).abs().max()) / (1.0 + float(b.float().abs().max()))
    return diff if not diff <= tol else None        # NaN differs too


def _probe_ids(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)            # a generator of its own: the run's RNG is untouched
    ids = torch.randint(0, vocab, (2, _ROWS), generator=g)
    mask = torch.ones_like(ids)
    mask[1, _SHORT:] = 0
    return ids, mask


def _packing_problem(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Optional[str]:
    from turborlhf.models.forward import hidden_states

    try:
        packed = hidden_states(model, ids, mask)
    except Exception as e:                          # e.g. a linear-attention kernel refusing packed rows
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
    for i, n in ((0, _ROWS), (1, _SHORT)):
        alone = hidden_states(model, ids[i:i + 1, :n], mask[i:i + 1, :n])[0]     # unpadded: not packed
        if (d := _differs(packed[i, :n], alone)) is not None:
            return f"its packed rows differ from separate ones by {d:.3g}"
    return None


def _shared_prefix_problem(model: nn.Module, ids: torch.Tensor) -> Optional[str]:
    from turborlhf.models.forward import hidden_states, pack_shared_prefix

    a, b = ids[0].tolist(), ids[0, :3].tolist() + ids[1, 3:].tolist()
    try:
        batch = pack_shared_prefix([a], [b], 0)
        packed = hidden_states(model, batch.ids_BL, batch.mask_B1LL, batch.pos_BL)
        a_idx, b_idx = batch.score_positions(None)
        got = torch.stack([packed[0, int(a_idx[0])], packed[0, int(b_idx[0])]])
    except Exception as e:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
    want = torch.stack([hidden_states(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0, -1]
                        for s in (a, b)])
    d = _differs(got, want)
    return None if d is None else f"its shared-prefix pair differs from separate rows by {d:.3g}"


def _logprob_problem(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Optional[str]:
    from turborlhf.models.forward import response_logprobs

    ours, _ = response_logprobs(model, ids, mask, mask)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    theirs = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    valid = mask[:, 1:].bool()
    d = _differs(ours[:, 1:][valid], theirs[valid])
    return None if d is None else f"its log-probs differ from the model's own logits by {d:.3g} (relative)"


def shares_prefixes(model: nn.Module) -> bool:
    """Whether reward pairs of `model` may be scored as one shared-prefix row (`check_training_forward`
    found it exact, or did not run)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "_turborlhf_shares_prefixes", True)


def check_training_forward(model: nn.Module, scalar: bool) -> None:
    """Check a freshly loaded model (module docstring); `scalar`: a reward model or critic (its
    shared-prefix pairs are checked, not its log-probs). Only models on the CPU are probed (GPU
    models do not pack), the log-probs of fp32 ones only (bf16 rounding would blur that
    comparison, and refusing is not a fallback).

    Raises:
        ValueError: a causal LM whose log-probs differ from its own logits.
    """
    from turborlhf.models.attention import ATTN_IMPLEMENTATION

    p = next(model.parameters(), None)
    if p is None or not p.is_floating_point() or p.device.type != "cpu":
        return
    kind = getattr(model.config, "model_type", type(model).__name__)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids, mask = _probe_ids(model)
            if getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
                if (why := _packing_problem(model, ids, mask)) is not None:
                    model.set_attn_implementation("sdpa")
                    _warn_once(kind, "packing", f"packed training batches are not exact for this model ({why}); "
                                                "using padded batches (slower on the CPU)")
            if scalar and (why := _shared_prefix_problem(model, ids)) is not None:
                model._turborlhf_shares_prefixes = False
                _warn_once(kind, "pairs", f"reward pairs are scored as separate rows ({why})")
            if not scalar and p.dtype == torch.float32 and (why := _logprob_problem(model, ids, mask)) is not None:
                raise ValueError(f"model type {kind!r}: {why}; its class transforms its logits in a way turborlhf "
                                 "does not reproduce: not supported for training")
    finally:
        model.train(was_training)


def _warn_once(kind: str, what: str, message: str) -> None:
    if (kind, what) not in _WARNED:
        _WARNED.add((kind, what))
        logger.warning(f"[model] {kind}: {message}")
