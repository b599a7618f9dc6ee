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
(``prompt_len``) is exact; rendered prompts already carry their template's special tokens. A
tokenizer that adds BOS to what it encodes (Llama, Gemma, Mistral; not SmolLM2 or Qwen) gets its
BOS at the start of every prompt that lacks one, kept through the prompt's left truncation, as
TRL's trainers give it (plain-text prompts and the ``plain`` template render none).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Sequence

# within `batch_tokenized`: id(tokenizer) → {text: ids} from one batched call, plus its `_bos` under _BOS_KEY
_BATCHED: dict[int, dict] = {}
_BOS_KEY = object()


@contextlib.contextmanager
def batch_tokenized(tokenizer, texts: Iterable[str]):
    """Within the block, this module's encoders read the ids of `texts` (``add_special_tokens=False``)
    from one batched call of `tokenizer` instead of one call per text, and `tokenizer`'s BOS from
    one probe: the ids are the same (a tokenizer encodes a batch text by text, a fast one in
    parallel), the encoding of a data set is not. The 1610 pairs of the demo's HH-RLHF sample
    (4830 texts with the SFT responses): 1.96 → 0.8 s of tokenizer calls on 2 cores; a data set
    of 160k pairs spends minutes there. Texts not in `texts` are encoded one by one as outside the
    block. Blocks nest (the inner one's texts are read there, the outer's again after it)."""
    key = id(tokenizer)
    uniq = list(dict.fromkeys(t for t in texts if isinstance(t, str)))
    ids = [x for s in range(0, len(uniq), 8192)      # in chunks: no attention masks for the whole set at once
           for x in tokenizer(uniq[s:s + 8192], add_special_tokens=False, return_attention_mask=False)["input_ids"]]
    outer = _BATCHED.get(key)
    cache = dict(zip(uniq, ids))
    cache[_BOS_KEY] = _probe_bos(tokenizer)
    _BATCHED[key] = cache
    try:
        yield
    finally:
        if outer is None:
            _BATCHED.pop(key, None)
        else:
            _BATCHED[key] = outer


def _ids(tokenizer, text: str) -> list[int]:
    cached = _BATCHED.get(id(tokenizer), {}).get(text)
    return list(cached if cached is not None else tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer) -> int | None:
    """The BOS id where `tokenizer` puts one before what it encodes by default, else None."""
    cache = _BATCHED.get(id(tokenizer))
    return cache[_BOS_KEY] if cache is not None else _probe_bos(tokenizer)


def _probe_bos(tokenizer) -> int | None:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return bos if ids and ids[0] == bos and _ids(tokenizer, "a")[:1] != [bos] else None


def _prompt_ids(tokenizer, text: str) -> tuple[list[int], int | None]:
    """Prompt ids with the tokenizer's BOS first where it adds one (`_bos`), and that BOS (None:
    no BOS to keep through truncation)."""
    ids, bos = _ids(tokenizer, text), _bos(tokenizer)
    if bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    return ids, bos


def _keep_last(ids: list[int], k: int, bos: int | None) -> list[int]:
    """The last `k` of prompt `ids`, its BOS kept first when it has one and is cut."""
    if k >= len(ids):
        return ids
    if bos is not None and k >= 2 and ids[:1] == [bos]:
        return [bos] + ids[len(ids) - k + 1:]
    return ids[len(ids) - k:]


def encode_prompt_response(
    tokenizer,
    prompt: str,
    response: str,
    max_len: int,
    add_eos: bool = True,
    min_response_tokens: int | None = None,
) -> dict:
    """Encode ``prompt + response (+ EOS)`` truncated to ``max_len`` (policy in module docstring).
    The closing token is `response_end_id`'s: EOS, or the chat template's end-of-turn token after
    a prompt the template rendered.

    Returns ``{"input_ids": list[int] (L <= max_len), "loss_mask": list[int] (L; 1 on response
    tokens incl. EOS), "prompt_len": int, "prompt_truncated": bool, "response_truncated": bool}``.
    Raises ``ValueError`` if ``max_len < 1``, or ``add_eos`` and the tokenizer has no EOS token.
    """
    p_ids, bos = _prompt_ids(tokenizer, prompt)
    r_ids = _closed(tokenizer, _ids(tokenizer, response), prompt) if add_eos else _ids(tokenizer, response)
    return _fit(p_ids, [0] * len(p_ids), r_ids, bos, max_len, min_response_tokens)


def encode_conversation(tokenizer, turns: Sequence[tuple[str, str]], max_len: int, add_eos: bool = True,
                        min_response_tokens: int | None = None) -> dict:
    """Encode a multi-turn conversation, every assistant response trained: ``turns`` is
    ``[(context, response), ...]`` as `turborlhf.data.loaders.load_sft` gives them with
    ``multiturn`` (each context the template's text since the previous response's end, each
    earlier response ending with the end-of-turn token the template writes after it, if any).
    The earlier responses are encoded as given, so the sequence is the rendered conversation, as
    the prompts of its later turns render it (TRL trains the template's rendering); the last one is
    closed by `response_end_id` when ``add_eos``, as a single-turn response. The loss mask is 1 on
    every response token and closing token, 0 on the contexts (OpenRLHF's ``--multiturn``, TRL's
    ``assistant_only_loss``).

    Truncation is `encode_prompt_response`'s with everything before the last response as the
    prompt: the last response keeps at least ``min_response_tokens`` (default ``max_len // 2``),
    the earliest tokens go first (the BOS stays). Returns `encode_prompt_response`'s dict
    (``prompt_len``: tokens before the last response). Raises ``ValueError`` for no turns or
    ``max_len < 1``.
    """
    if not turns:
        raise ValueError("a conversation needs at least one (context, response) turn")
    p_ids, p_mask = [], []
    for ctx, resp in turns[:-1]:
        c_ids, r_ids = _ids(tokenizer, ctx), _ids(tokenizer, resp)
        p_ids += c_ids + r_ids
        p_mask += [0] * len(c_ids) + [1] * len(r_ids)
    ctx, resp = turns[-1]
    c_ids = _ids(tokenizer, ctx)
    p_ids, p_mask = p_ids + c_ids, p_mask + [0] * len(c_ids)
    bos = _bos(tokenizer)
    if bos is not None and p_ids[:1] != [bos]:
        p_ids, p_mask = [bos] + p_ids, [0] + p_mask
    r_ids = _closed(tokenizer, _ids(tokenizer, resp), ctx) if add_eos else _ids(tokenizer, resp)
    return _fit(p_ids, p_mask, r_ids, bos, max_len, min_response_tokens)


def _fit(p_ids: list[int], p_mask: list[int], r_ids: list[int], bos: int | None, max_len: int,
         min_response_tokens: int | None) -> dict:
    """The truncation policy of the module docstring applied to prompt ids (with their loss mask)
    and response ids (all trained)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    min_r = max_len // 2 if min_response_tokens is None else min(max(min_response_tokens, 0), max_len)
    r_keep = min(len(r_ids), max(min_r, max_len - len(p_ids)))
    p_keep = min(len(p_ids), max_len - r_keep)
    # the positions kept (position 0 stands for the BOS where the prompt starts with it)
    kept = _keep_last(list(range(len(p_ids))), p_keep, 0 if bos is not None and p_ids[:1] == [bos] else None)
    p_cut, m_cut = [p_ids[i] for i in kept], [p_mask[i] for i in kept]
    r_cut = r_ids[:r_keep]
    mask = m_cut + [1] * len(r_cut)
    if mask:                     # nothing predicts the first token: it is never scored, nor counted
        mask[0] = 0
    return {
        "input_ids": p_cut + r_cut,
        "loss_mask": mask,
        "prompt_len": len(p_cut),
        "prompt_truncated": p_keep < len(p_ids),
        "response_truncated": r_keep < len(r_ids),
    }


def _closed(tokenizer, r_ids: list[int], prompt: str) -> list[int]:
    """`r_ids` closed by `response_end_id`, unless the response text already ended with it (data
    that writes the EOS or end-of-turn token itself: a second one would be trained, and in a
    preference pair would mark a side), as OpenRLHF and TRL append it only when missing."""
    end = response_end_id(tokenizer, prompt)
    return r_ids if r_ids[-1:] == [end] else r_ids + [end]


def response_end_id(tokenizer, prompt: str) -> int:
    """The token that closes a response to `prompt`: the chat template's end-of-turn token where
    `prompt` was rendered by that template and the template ends turns with a special token other
    than EOS (`turborlhf.data.chat.turn_end`), else EOS. Raises ValueError without an EOS."""
    from turborlhf.data.chat import turn_end

    eot, header = turn_end(tokenizer)
    if eot is not None and header and prompt.endswith(header):
        return eot
    if tokenizer.eos_token_id is None:
        raise ValueError("add_eos=True but the tokenizer has no eos_token_id")
    return tokenizer.eos_token_id


def _cut_prompt(enc: dict, k: int, bos: int | None = None) -> dict:
    """Drop `k` prompt tokens of an `encode_prompt_response` record from the left (after its
    BOS, which stays, when `bos` is given and leads)."""
    if k <= 0:
        return enc
    ids, mask = enc["input_ids"], enc["loss_mask"]
    lead = 1 if bos is not None and ids[:1] == [bos] and enc["prompt_len"] - k >= 1 else 0
    mask = mask[:lead] + mask[lead + k:]
    if mask:
        mask[0] = 0
    return {**enc, "input_ids": ids[:lead] + ids[lead + k:], "loss_mask": mask,
            "prompt_len": enc["prompt_len"] - k, "prompt_truncated": True}


def encode_pair(tokenizer, prompt: str, chosen: str, rejected: str, max_len: int) -> dict:
    """``{"chosen": enc, "rejected": enc}`` (see `encode_prompt_response`) with one shared prompt.

    Each side is truncated by the shared policy (prompt from the left, response from the right,
    EOS appended); the longer kept prompt is then cut to the shorter one, so both sequences
    condition on identical prompt tokens.
    """
    c = encode_prompt_response(tokenizer, prompt, chosen, max_len)
    r = encode_prompt_response(tokenizer, prompt, rejected, max_len)
    p, bos = min(c["prompt_len"], r["prompt_len"]), _bos(tokenizer)
    return {"chosen": _cut_prompt(c, c["prompt_len"] - p, bos), "rejected": _cut_prompt(r, r["prompt_len"] - p, bos)}


def encode_prompt(tokenizer, prompt: str, max_prompt_len: int) -> list[int]:
    """Token ids of ``prompt`` (the tokenizer's BOS first where it adds one, no other added
    special tokens), keeping its last ``max_prompt_len`` (and the BOS)."""
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    ids, bos = _prompt_ids(tokenizer, prompt)
    return _keep_last(ids, max_prompt_len, bos)


def encode_prompts(tokenizer, prompts: Sequence[str], max_prompt_len: int) -> list[list[int]]:
    """`encode_prompt` of each of `prompts`, in one batched tokenizer call (`batch_tokenized`)."""
    with batch_tokenized(tokenizer, prompts):
        return [encode_prompt(tokenizer, p, max_prompt_len) for p in prompts]


def encode_pair_list(tokenizer, pairs: Sequence[dict], max_len: int) -> list[dict]:
    """`encode_pair` of each ``{prompt, chosen, rejected}`` of `pairs`, in batched tokenizer calls
    (`batch_tokenized`)."""
    with batch_tokenized(tokenizer, [t for p in pairs for t in (p["prompt"], p["chosen"], p["rejected"])]):
        return [encode_pair(tokenizer, p["prompt"], p["chosen"], p["rejected"], max_len) for p in pairs]


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


def assemble_prompt_response(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """PPO's batch layout ``[left-padded prompt | right-padded response]`` (OpenRLHF's and verl's):
    prompts end at column P, so response token j of every row sits at column P + j.

    Returns ``(ids_BS, attn_BS, P, mask_BR)``: LongTensor ids and 0/1 attention mask over S = P + R
    columns (P = longest prompt, R = longest response, at least 1), the float 0/1 mask of the
    response tokens. Raises ``ValueError`` for an empty batch or unequal numbers of prompts and responses.
    """
    import torch

    if not prompts or len(prompts) != len(responses):
        raise ValueError(f"need one response per prompt and at least one row; got {len(prompts)} prompts, "
                         f"{len(responses)} responses")
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    B = len(prompts)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    mask = torch.zeros((B, R), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P] = torch.as_tensor(list(p))
        attn[i, P - len(p):P] = 1
        if r:
            ids[i, P:P + len(r)] = torch.as_tensor(list(r))
            attn[i, P:P + len(r)] = 1
            mask[i, :len(r)] = 1
    return ids, attn, P, mask


def report_truncation(tag: str, encoded: Sequence[dict], max_len: int, what: str = "data.max_len") -> None:
    """Warn, once for a data set, how many of the `encoded` sequences (`encode_prompt_response`
    records) had their response cut at `max_len` (trained without their end token; a reward model
    compares a cut side with a whole one) and how many lost the start of their prompt."""
    import logging

    cut = sum(bool(e.get("response_truncated")) for e in encoded)
    left = sum(bool(e.get("prompt_truncated")) for e in encoded)
    if cut or left:
        logging.getLogger(__name__).warning(
            f"[{tag}] {cut} of {len(encoded)} responses were cut at {what}={max_len} (no end token) and "
            f"{left} prompts lost their start; raise {what} to keep them whole")


def encode_examples(tokenizer, rows: Sequence[dict], max_len: int) -> list[dict]:
    """`encode_prompt_response` of every ``{prompt, response}`` row (SFT data, best-of-n winners,
    tagged conditional-SFT examples) with budget `max_len`; `encode_conversation` of a row with
    ``turns`` (multi-turn SFT). A row with ``finished: False`` (a
    sampled response cut at max_new_tokens) gets no appended EOS: the policy must not learn to
    stop where the text was merely truncated."""
    texts = [t for r in rows for t in ([x for turn in r["turns"] for x in turn] if r.get("turns")
                                       else [r["prompt"], r["response"]])]
    with batch_tokenized(tokenizer, texts):
        return [encode_conversation(tokenizer, r["turns"], max_len, add_eos=r.get("finished", True))
                if r.get("turns") else
                encode_prompt_response(tokenizer, r["prompt"], r["response"], max_len, add_eos=r.get("finished", True))
                for r in rows]


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
