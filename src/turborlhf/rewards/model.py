"""Scoring with a reward model: preference pairs (accuracy) and prompt/response texts.

A reward model is an `AutoModelForSequenceClassification(num_labels=1)`; the score of a sequence
is the head at its last attended token (the EOS), or at the last token before the trailing EOS
when the pad id is the EOS id: the token transformers' own pooling reads, so a saved reward model
scores the same in plain transformers (`turborlhf.models.forward.last_token_scores`, `score_index`).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from turborlhf.data.tokenize import (batch_tokenized, encode_pair_list, encode_prompt_response, pad_batch,
                                     report_truncation)
from turborlhf.engine.train import autocast
from turborlhf.errors import UserError
from turborlhf.models.forward import last_token_scores, pack_shared_prefix, packed_pair_len, shared_prefix_scores
from turborlhf.models.probe import shares_prefixes

__all__ = ["encode_pairs", "pair_row_len", "pair_scores", "score_token_ids", "score_texts", "load_reward_model",
           "check_reward_model", "NotARewardModelError", "warn_if_other_format"]

logger = logging.getLogger(__name__)


class NotARewardModelError(UserError):
    """A model given for scoring has no trained score head (e.g. a causal-LM directory)."""


def check_reward_model(name_or_path: str) -> None:
    """Raise `NotARewardModelError` unless `name_or_path` (directory, hub id or zoo name) holds a
    sequence-classification model, i.e. a trained score head, according to its ``config.json``
    ``architectures``. Loading a causal LM as a scalar model gives a randomly initialised head,
    which is right for a critic or a reward model about to be trained (`load_trainable`) and wrong
    for scoring: its scores are noise. Reads only the config, no weights."""
    from transformers import AutoConfig

    from turborlhf.models.zoo import resolve_model_path

    archs = AutoConfig.from_pretrained(resolve_model_path(name_or_path)).architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise NotARewardModelError(
            f"{name_or_path}: not a reward model ({', '.join(archs) or 'no architecture'} has no trained score head; "
            "its scores would come from a random head): give a directory written by `turborlhf rm`")


def warn_if_other_format(rm_tokenizer, policy_tokenizer, name: str) -> None:
    """Warn when a reward model of another vocabulary (which reads the decoded texts) ends its
    prompts with another chat template's generation header than the policy's: it then scores the
    policy's rendering of each prompt, not the format it was trained on (OpenRLHF's convention, as
    here; TRL re-renders conversational prompts with the reward model's template), which may lower
    or skew its scores."""
    from turborlhf.data.chat import turn_end

    rm_header, policy_header = turn_end(rm_tokenizer)[1], turn_end(policy_tokenizer)[1]
    if rm_header and rm_header != policy_header:
        logger.warning(f"[reward] {name}: its chat template ends prompts with {rm_header!r}, the policy's with "
                       f"{policy_header!r}: it scores the policy's rendering of each prompt (the decoded text), not "
                       "the format it was trained on")


def load_reward_model(name_or_path: str, tokenizer=None, dtype: torch.dtype = torch.float32, device="cpu",
                      device_field: str = "device"):
    """`turborlhf.models.load.load_scalar_model` for scoring (on `device`), after `check_reward_model`.
    The checkpoint's own ``pad_token_id`` stays in its config, since the head was trained pooling
    by it (`turborlhf.models.forward.score_index`): a reward model trained with pad = EOS (TRL's
    usual set-up) reads the token before the trailing EOS, as transformers scores it; the
    tokenizer's pad id (`load_tokenizer` may switch it to unk) would make it read the EOS.
    Raises `turborlhf.engine.hardware.HardwareError` for a device this host lacks, naming
    `device_field` (the setting `device` came from, e.g. ``model.device``)."""
    from transformers import AutoConfig

    from turborlhf.models.load import load_scalar_model
    from turborlhf.models.zoo import resolve_model_path

    check_reward_model(name_or_path)
    saved = AutoConfig.from_pretrained(resolve_model_path(name_or_path))
    saved = saved.get_text_config() if hasattr(saved, "get_text_config") else saved
    model = load_scalar_model(name_or_path, tokenizer, dtype=dtype, device=device, device_field=device_field)
    if getattr(saved, "pad_token_id", None) is not None:
        model.config.pad_token_id = saved.pad_token_id
    return model


def encode_pairs(tokenizer, pairs: Sequence[dict], max_len: int, tag: Optional[str] = None) -> list[dict]:
    """Each pair → ``{"chosen": ids, "rejected": ids, "margin": float}`` (EOS appended), both
    sides truncated to ``max_len`` with one shared prompt (`turborlhf.data.tokenize.encode_pair`,
    as DPO): where a long response leaves less room for the prompt, the other side's prompt is
    cut to the same tokens, so the two scores compare the responses in the same context, and
    the packed forward (`pair_scores`) still computes that prompt once. With `tag`, the sides cut
    at `max_len` are counted in a warning (`report_truncation`)."""
    out, sides = [], []
    for p, e in zip(pairs, encode_pair_list(tokenizer, pairs, max_len)):
        out.append({"chosen": e["chosen"]["input_ids"], "rejected": e["rejected"]["input_ids"],
                    "margin": float(p.get("margin") or 0.0)})
        sides += [e["chosen"], e["rejected"]]
    if tag is not None:
        report_truncation(tag, sides, max_len)
    return out


def pair_row_len(model, pair: dict, shared_prefix: bool = True) -> int:
    """Length of the row `pair_scores` builds for an encoded pair: its packed row (prompt once)
    where it packs pairs, else its longer sequence (both are padded to the batch's longest)."""
    if shared_prefix and shares_prefixes(model):
        return packed_pair_len(pair["chosen"], pair["rejected"])
    return max(len(pair["chosen"]), len(pair["rejected"]))


def pair_scores(model, tokenizer, encoded: Sequence[dict], dtype: str = "auto",
                shared_prefix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``(chosen_B, rejected_B)`` of encoded pairs in one forward pass (grad enabled if
    the caller enables it).

    With `shared_prefix` (default) each pair is one packed row ``[prompt | chosen | rejected]``
    whose attention mask keeps the two responses apart (`pack_shared_prefix`), so the prompt is
    computed once; the scores equal those of separate sequences. Otherwise chosen and rejected
    go through the model as 2B padded rows.
    """
    B = len(encoded)
    with autocast(dtype, model):
        if shared_prefix and shares_prefixes(model):        # not for models found inexact at load (ALiBi)
            batch = pack_shared_prefix([e["chosen"] for e in encoded], [e["rejected"] for e in encoded],
                                       tokenizer.pad_token_id)
            return shared_prefix_scores(model, batch)
        ids, attn = pad_batch([e["chosen"] for e in encoded] + [e["rejected"] for e in encoded], tokenizer.pad_token_id)
        scores = last_token_scores(model, ids, attn)
    return scores[:B], scores[B:]


@torch.no_grad()
def score_token_ids(model, pad_id: int, seqs: Sequence[Sequence[int]], dtype: str = "auto",
                    batch_size: int = 16) -> torch.Tensor:
    """Scores ``B`` of full token sequences, batched by similar length (order preserved)."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = torch.empty(len(seqs))
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        ids, attn = pad_batch([list(seqs[i]) for i in idx], pad_id)
        with autocast(dtype, model):
            out[idx] = last_token_scores(model, ids, attn).float()
    model.train(was_training)
    return out


def score_texts(model, tokenizer, prompts: Sequence[str], responses: Sequence[str], max_len: int = 1024,
                dtype: str = "auto", batch_size: int = 16, add_eos: Optional[Sequence[bool]] = None,
                min_response_tokens: Optional[int] = None) -> torch.Tensor:
    """Scores of (prompt, response) texts; EOS appended to each response, or only where
    `add_eos[i]` (a response cut at a token budget is then scored as cut, as `eval-policy` and
    `ppo` score it). A sequence over `max_len` is cut as `encode_prompt_response` cuts it (the
    response keeps at least `min_response_tokens`, default half of `max_len`; the prompt loses
    its start)."""
    eos = [True] * len(prompts) if add_eos is None else list(add_eos)
    with batch_tokenized(tokenizer, [*prompts, *responses]):
        seqs = [encode_prompt_response(tokenizer, p, r, max_len, add_eos=e, min_response_tokens=min_response_tokens)
                ["input_ids"] for p, r, e in zip(prompts, responses, eos)]
    return score_token_ids(model, tokenizer.pad_token_id, seqs, dtype, batch_size)
