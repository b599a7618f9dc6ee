"""Text -> model inputs: prompt/response encoding with loss masks, padding, length grouping.

Notation: B sequences in a batch, T padded length.

Truncation policy of ``encode_prompt_response`` (prompt P tokens, response R tokens incl. EOS,
budget L = ``max_len``, m = ``min_response_tokens``, default L // 2):

1. If P + R <= L nothing is cut.
2. Otherwise the budget is shared: the response is guaranteed up to m tokens and the prompt up to
   L - m; a part shorter than its share gives the spare room to the other. In formulas, the
   response keeps ``r = min(R, max(m, L - P))`` and the prompt ``p = min(P, L - r)``. So a long
   prompt is cut first, and only as much as needed, while a long response keeps at least m.
3. The prompt loses tokens from the *left* (its end, with the latest turn and the assistant
   header, matters most).
4. The response loses tokens from the *right*; a cut response ends without EOS, so the model is
   never taught to stop where the text was merely truncated.

This is the policy of TRL's (pre-1.0) DPO ``tokenize_row`` (prompt to ``max_prompt_length`` =
L - m first, then the completion) without its waste: TRL cuts the prompt to L - m even when
less would do.

Prompt and response are tokenized separately with ``add_special_tokens=False`` so the boundary
(``prompt_len``) is exact; rendered prompts already carry their template's special tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt_response(
    tokenizer,
    prompt: str,
    response: str,
    max_len: int,
    add_eos: bool = True,
    min_response_tokens: int | None = None,
) -> dict:
    """Encode ``prompt + response (+ EOS)`` truncated to ``max_len`` (policy in module docstring).

    Returns ``{"input_ids": list[int] (L <= max_len), "loss_mask": list[int] (L; 1 on response
    tokens incl. EOS), "prompt_len": int, "prompt_truncated": bool, "response_truncated": bool}``.
    Raises ``ValueError`` if ``max_len < 1``, or ``add_eos`` and the tokenizer has no EOS token.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    p_ids = _ids(tokenizer, prompt)
    r_ids = _ids(tokenizer, response)
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("add_eos=True but the tokenizer has no eos_token_id")
        r_ids.append(tokenizer.eos_token_id)
    min_r = max_len // 2 if min_response_tokens is None else min(max(min_response_tokens, 0), max_len)
    r_keep = min(len(r_ids), max(min_r, max_len - len(p_ids)))
    p_keep = min(len(p_ids), max_len - r_keep)
    p_cut = p_ids[len(p_ids) - p_keep :]
    r_cut = r_ids[:r_keep]
    return {
        "input_ids": p_cut + r_cut,
        "loss_mask": [0] * len(p_cut) + [1] * len(r_cut),
        "prompt_len": len(p_cut),
        "prompt_truncated": p_keep < len(p_ids),
        "response_truncated": r_keep < len(r_ids),
    }


def encode_prompt(tokenizer, prompt: str, max_prompt_len: int) -> list[int]:
    """Token ids of ``prompt`` (no added special tokens), keeping its last ``max_prompt_len``."""
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    ids = _ids(tokenizer, prompt)
    return ids[-max_prompt_len:]


def _pad(seqs: Sequence[Sequence[int]], value: int, side: str, pad_to_multiple_of: int | None):
    import torch

    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    if len(seqs) == 0:
        raise ValueError("cannot pad an empty batch")
    T = max(len(s) for s in seqs)
    if pad_to_multiple_of:
        T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
    out_BT = torch.full((len(seqs), T), value, dtype=torch.long)
    mask_BT = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not s:
            continue
        sl = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
        out_BT[i, sl] = torch.as_tensor(list(s), dtype=torch.long)
        mask_BT[i, sl] = 1
    return out_BT, mask_BT


def pad_batch(
    seqs: Sequence[Sequence[int]],
    pad_id: int,
    side: str = "right",
    pad_to_multiple_of: int | None = None,
):
    """Pad token-id lists -> ``(ids_BT LongTensor, attention_mask_BT LongTensor of 0/1)``.

    ``side="left"`` is for generation (prompts end at the same column). Raises ``ValueError`` for
    an empty batch or an unknown side.
    """
    return _pad(seqs, pad_id, side, pad_to_multiple_of)


def pad_masks(
    masks: Sequence[Sequence[int]], side: str = "right", pad_to_multiple_of: int | None = None
):
    """Pad per-token 0/1 masks (e.g. loss masks) with 0 -> LongTensor B x T, aligned like ``pad_batch``."""
    return _pad(masks, 0, side, pad_to_multiple_of)[0]


def length_grouped_batches(
    lengths: Sequence[int],
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    megabatch_mult: int = 50,
    drop_last: bool = False,
) -> list[list[int]]:
    """Group indices into batches of similar length to cut padding.

    Indices are shuffled (if ``shuffle``), cut into mega-batches of ``megabatch_mult * batch_size``,
    each sorted by length (longest first) and chunked into batches; the batch order is then
    shuffled. Deterministic given ``seed``. Every index appears once (the last batch may be short
    unless ``drop_last``). Same idea as TRL/HF ``LengthGroupedSampler``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rng = random.Random(seed)
    idx = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(idx)
    mega = max(1, megabatch_mult) * batch_size
    batches: list[list[int]] = []
    for start in range(0, len(idx), mega):
        chunk = sorted(idx[start : start + mega], key=lambda i: -lengths[i])  # stable
        batches.extend(chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size))
    if drop_last:
        batches = [b for b in batches if len(b) == batch_size]
    if shuffle:
        rng.shuffle(batches)
    return batches
