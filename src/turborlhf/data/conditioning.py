"""Reward-conditioned prompts (`turborlhf conditional-sft`, Hu et al. 2023, arXiv 2308.12050; the
tag idea of SteerLM, Dong et al. 2023): where a score tag ``<rm_score>=k`` goes in a rendered
prompt, and the mapping a conditional-SFT run saves beside its policy (``conditional_sft.json``).

Training (`turborlhf.trainers.conditional_sft`) writes the mapping; evaluation
(`turborlhf.evaluate.eval_policy`) reads it back with `load_tag_info` and conditions prompts with
`condition_prompt`, so both place the tag the same way.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

__all__ = ["TAG_FILE", "PLACEMENTS", "chat_anchors", "condition_prompt", "load_tag_info"]

TAG_FILE = "conditional_sft.json"
_SLOT = "<<TAG_SLOT_7f3a>>"


def chat_anchors(tokenizer) -> dict:
    """Template strings around message contents, found by rendering probe conversations through
    the tokenizer's chat template, so `condition_prompt` can edit rendered prompt strings:

    - ``turn_end``: what follows the last user message's content in a rendered prompt (end of
      turn + assistant header; ChatML ``<|im_end|>\\n<|im_start|>assistant\\n``);
    - ``system_header``: what precedes a system message's content (ChatML ``<|im_start|>system\\n``);
    - ``system_block``: a whole system message with the tag slot, to prepend when a prompt has
      none (None when the template adds a prefix such as BOS or a default system message).

    A template that rejects a probe leaves the anchor None (placement then falls back to text).
    """
    from turborlhf.data.chat import render_prompt

    def render(msgs):
        try:
            return render_prompt(tokenizer, msgs)
        except Exception:  # templates may reject a role (e.g. no system support)
            return None

    anchors: dict = {"turn_end": None, "system_header": None, "system_block": None}
    user = render([{"role": "user", "content": _SLOT}])
    if user and _SLOT in user:
        anchors["turn_end"] = user[user.rindex(_SLOT) + len(_SLOT):]
    with_sys = render([{"role": "system", "content": _SLOT}, {"role": "user", "content": "u"}])
    no_sys = render([{"role": "user", "content": "u"}])
    if with_sys and _SLOT in with_sys:
        anchors["system_header"] = with_sys[:with_sys.index(_SLOT)]
        if no_sys and with_sys.endswith(no_sys) and len(with_sys) > len(no_sys):
            anchors["system_block"] = with_sys[:len(with_sys) - len(no_sys)]
    return anchors


def _at_last_user(prompt: str, tag: str, sep: str, anchors: dict) -> str:
    end = anchors.get("turn_end")
    if end and prompt.endswith(end):
        return prompt[:len(prompt) - len(end)] + sep + tag + end
    return prompt + sep + tag


def _at_system(prompt: str, tag: str, sep: str, anchors: dict) -> str:
    head, block = anchors.get("system_header"), anchors.get("system_block")
    if head and prompt.startswith(head):
        return head + tag + sep + prompt[len(head):]
    if block:
        return block.replace(_SLOT, tag) + prompt
    return _at_prefix(prompt, tag, sep, anchors)


def _at_prefix(prompt: str, tag: str, sep: str, anchors: dict) -> str:
    return tag + sep + prompt


PLACEMENTS = {"last_user": _at_last_user, "system": _at_system, "prefix": _at_prefix}


def condition_prompt(prompt_text: str, tag_info: dict, k: Optional[int] = None) -> str:
    """Insert the score tag of bin `k` (default: ``tag_info["best_bin"]``) into a rendered prompt.

    With the default format ``<rm_score>={k}``, separator " " and a ChatML prompt
    ``…<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n``, the placements give:

    - ``last_user``: ``…<|im_start|>user\\nHi <rm_score>=4<|im_end|>\\n<|im_start|>assistant\\n``
      (a prompt not ending with the template's turn end gets ``" <rm_score>=4"`` appended, as
      OpenRLHF's ``"{input} <rm_score>: {reward} "``); survives left truncation of long dialogues;
    - ``system``: ``<|im_start|>system\\n<rm_score>=4 You are…`` (a prompt without a system message
      gets one holding only the tag, if the template allows; else the tag is prefixed);
    - ``prefix``: ``<rm_score>=4 `` + prompt_text.

    tag_info: the dict saved as ``conditional_sft.json`` (keys format, position, separator,
    anchors, best_bin). Raises ValueError for an unknown position or a bin outside 0 … n_bins-1.
    """
    k = tag_info["best_bin"] if k is None else int(k)
    if not 0 <= k < tag_info["n_bins"]:
        raise ValueError(f"bin {k} outside 0 … {tag_info['n_bins'] - 1}")
    pos = tag_info["position"]
    if pos not in PLACEMENTS:
        raise ValueError(f"unknown tag position {pos!r}; choose one of {sorted(PLACEMENTS)}")
    tag = tag_info["format"].replace("{k}", str(k))
    return PLACEMENTS[pos](prompt_text, tag, tag_info["separator"], tag_info["anchors"])


def load_tag_info(policy_dir: str | Path) -> dict:
    """Read ``<policy_dir>/conditional_sft.json``. Raises FileNotFoundError if it is missing."""
    path = Path(policy_dir) / TAG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {policy_dir} was not trained by `turborlhf conditional-sft`")
    return json.loads(path.read_text())
