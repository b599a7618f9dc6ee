"""Readers the trainers use: JSONL (or .jsonl.gz) -> lists of rendered text records.

Every loader detects the format per line, so files may mix formats. Strings given as ``prompt``
are used verbatim (they must already be rendered with the chat template, as ``prepare_hh``
writes them); message lists are rendered with the tokenizer's chat template and the generation
prompt. Responses are plain text without an end-of-turn token (trainers append EOS).

Bad lines are collected as ``Problem(line, kind, detail)`` with 1-based line numbers. With
``strict=True`` any bad line raises ``DataError`` listing kinds and lines; otherwise they are
skipped and one ``DataWarning`` reports how many and where. The returned ``Records`` is a plain
list with a ``.problems`` attribute. A file with no usable record raises ``DataError``.

Accepted line formats
---------------------
pairs (``load_pairs``):
  ``{"prompt": str|messages, "chosen": str|[assistant msg], "rejected": ..., "margin"?: number}``;
  ``{"chosen": messages, "rejected": messages}`` (shared prefix = prompt, last = response);
  raw HH ``{"chosen": dialogue, "rejected": dialogue}``.
prompts (``load_prompts``; ``load_prompt_records`` keeps the other keys as columns):
  ``{"prompt": str|messages}``, ``{"text": str}``,
  ``{"messages"|"chosen": messages}`` (a final assistant message is dropped), raw HH (prompt of
  chosen; an empty chosen response is fine here).
SFT (``load_sft``): ``{"prompt", "response"|"completion"}``, ``{"messages": messages}``
  (last message is the assistant's response), any pair format (chosen), raw HH (chosen).
KTO (``load_kto``): ``{"prompt", "completion", "label": bool|0|1}``, or any pair format
  (-> two rows: chosen desirable, rejected undesirable).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from turborlhf.data.chat import is_messages, render_prompt, require_chat_template, response_text
from turborlhf.data.errors import DataError, Problem, format_problems
from turborlhf.data.hh_rlhf import convert_pair, prompt_messages_of, split_prompt_response
from turborlhf.data.jsonl import JsonLineError, read_jsonl


class DataWarning(UserWarning):
    """Bad lines were skipped while loading (non-strict mode)."""


class Records(list):
    """A list of loaded records; ``.problems`` lists the skipped bad lines."""

    problems: list[Problem]


class _Bad(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def _load(path: str | os.PathLike, parse: Callable[[dict], list], strict: bool) -> Records:
    records, problems = Records(), []
    for line, obj in read_jsonl(path):
        if isinstance(obj, JsonLineError):
            problems.append(Problem(line, "bad_json", obj.message))
            continue
        try:
            if not isinstance(obj, dict):
                raise _Bad("missing_key", f"expected a JSON object, got {type(obj).__name__}")
            records.extend(parse(obj))
        except _Bad as e:
            problems.append(Problem(line, e.kind, e.detail))
    records.problems = problems
    if problems and (strict or not records):
        why = "" if strict else " and no usable record"
        raise DataError(f"{path}: {len(problems)} bad line(s){why}: {format_problems(problems)}")
    if not records:
        raise DataError(f"{path}: no records")
    if problems:
        warnings.warn(
            f"{path}: skipped {len(problems)} bad line(s): {format_problems(problems, max_lines=10)}",
            DataWarning,
            stacklevel=3,
        )
    return records


# ------------------------------------------------------------------------------- field parsers


def _prompt(x: Any, tokenizer) -> str:
    """A prompt field: rendered string (verbatim) or message list (rendered)."""
    if isinstance(x, str):
        if not x.strip():
            raise _Bad("empty_prompt", "prompt is empty")
        return x
    if is_messages(x):
        return render_prompt(tokenizer, x)
    raise _Bad("bad_value", f"prompt must be a string or a list of messages, got {type(x).__name__}")


def _response(obj: dict, key: str) -> str:
    if key not in obj:
        raise _Bad("missing_key", f"key {key!r} is missing")
    text = response_text(obj[key])
    if text is None:
        raise _Bad("bad_value", f"{key!r} must be a string or one assistant message")
    if not text.strip():
        raise _Bad("empty_response", f"{key} response is empty")
    return text


def _hh_prompt_response(dialogue: str, tokenizer, need_response: bool = True) -> tuple[str, str]:
    """Raw HH dialogue -> (rendered prompt, stripped final response)."""
    sp = split_prompt_response(dialogue)
    if isinstance(sp, str):
        raise _Bad(sp, "no final assistant turn")
    messages = prompt_messages_of(sp[0])
    if not messages:
        raise _Bad("empty_prompt", "no turn before the final assistant response")
    if need_response and not sp[1].strip():
        raise _Bad("empty_response", "response is empty")
    return render_prompt(tokenizer, messages), sp[1].strip()


def _conversation(messages: list[dict], tokenizer) -> tuple[str, str]:
    """Message list ending in an assistant message -> (rendered prompt, response)."""
    if messages[-1]["role"] != "assistant":
        raise _Bad("no_assistant_turn", "last message is not the assistant's")
    if len(messages) < 2:
        raise _Bad("empty_prompt", "no message before the assistant response")
    if not messages[-1]["content"].strip():
        raise _Bad("empty_response", "response is empty")
    return render_prompt(tokenizer, messages[:-1]), messages[-1]["content"]


def _pair(obj: dict, tokenizer) -> tuple[str, str, str]:
    """Any pair format -> (rendered prompt, chosen, rejected)."""
    chosen, rejected = obj.get("chosen"), obj.get("rejected")
    if "prompt" in obj:
        return _prompt(obj["prompt"], tokenizer), _response(obj, "chosen"), _response(obj, "rejected")
    if is_messages(chosen) and is_messages(rejected):
        if chosen[:-1] != rejected[:-1]:
            raise _Bad("prompt_mismatch", "chosen and rejected conversations differ before the end")
        prompt, c = _conversation(chosen, tokenizer)
        return prompt, c, _conversation(rejected, tokenizer)[1]
    if isinstance(chosen, str) and isinstance(rejected, str):
        res = convert_pair(obj)
        if isinstance(res, Problem):
            raise _Bad(res.kind, res.detail)
        return render_prompt(tokenizer, res.prompt_messages), res.chosen, res.rejected
    raise _Bad("missing_key", "need 'prompt'+'chosen'+'rejected', or 'chosen'+'rejected'")


def _margin(obj: dict) -> float | None:
    m = obj.get("margin")
    if m is None:
        return None
    if isinstance(m, bool) or not isinstance(m, (int, float)):
        raise _Bad("bad_value", f"margin must be a number, got {m!r}")
    return float(m)


# ------------------------------------------------------------------------------------ loaders


def load_pairs(path: str | os.PathLike, tokenizer, strict: bool = False) -> Records:
    """Preference pairs -> ``[{"prompt": str, "chosen": str, "rejected": str, "margin": float|None}]``.

    ``prompt`` is rendered (ends with the assistant header); responses have no EOS. Raises
    ``DataError`` (strict and any bad line, or no usable record), ``FileNotFoundError``.
    """
    require_chat_template(tokenizer)

    def parse(obj: dict) -> list[dict]:
        prompt, chosen, rejected = _pair(obj, tokenizer)
        return [{"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": _margin(obj)}]

    return _load(path, parse, strict)


def load_prompt_records(path: str | os.PathLike, tokenizer, strict: bool = False) -> Records:
    """Prompts with their other fields -> ``[{"prompt": rendered str, "columns": {key: value}}]``,
    de-duplicated by prompt keeping the first occurrence (and its columns).

    ``columns`` holds every key of the line except the one the prompt came from (``prompt``,
    ``text``, ``messages`` or ``chosen``): e.g. ``answer`` for verifiable rewards, which PPO passes
    to reward functions by name (`turborlhf.rewards.functions`).
    """
    require_chat_template(tokenizer)
    seen: set[str] = set()

    def parse(obj: dict) -> list[dict]:
        if "prompt" in obj:
            key, prompt = "prompt", _prompt(obj["prompt"], tokenizer)
        elif "text" in obj:
            if not isinstance(obj["text"], str):
                raise _Bad("bad_value", "'text' must be a string")
            key, prompt = "text", _prompt(obj["text"], tokenizer)
        elif is_messages(obj.get("messages")) or is_messages(obj.get("chosen")):
            key = "messages" if is_messages(obj.get("messages")) else "chosen"
            msgs = obj[key]
            msgs = msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs
            if not msgs:
                raise _Bad("empty_prompt", "no message before the assistant response")
            prompt = render_prompt(tokenizer, msgs)
        elif isinstance(obj.get("chosen"), str):
            key, prompt = "chosen", _hh_prompt_response(obj["chosen"], tokenizer, need_response=False)[0]
        else:
            raise _Bad("missing_key", "need 'prompt', 'text', 'messages' or 'chosen'")
        if prompt in seen:
            return []
        seen.add(prompt)
        return [{"prompt": prompt, "columns": {k: v for k, v in obj.items() if k != key}}]

    return _load(path, parse, strict)


def load_prompts(path: str | os.PathLike, tokenizer, strict: bool = False) -> Records:
    """Prompts -> rendered prompt strings, de-duplicated keeping first occurrence order
    (`load_prompt_records` without the columns)."""
    recs = load_prompt_records(path, tokenizer, strict)
    out = Records(r["prompt"] for r in recs)
    out.problems = recs.problems
    return out


def load_sft(path: str | os.PathLike, tokenizer, strict: bool = False) -> Records:
    """SFT examples -> ``[{"prompt": rendered str, "response": str}]`` (response without EOS)."""
    require_chat_template(tokenizer)

    def parse(obj: dict) -> list[dict]:
        if "prompt" in obj and ("response" in obj or "completion" in obj):
            key = "response" if "response" in obj else "completion"
            prompt, response = _prompt(obj["prompt"], tokenizer), _response(obj, key)
        elif is_messages(obj.get("messages")):
            prompt, response = _conversation(obj["messages"], tokenizer)
        elif "prompt" in obj and "chosen" in obj:
            prompt, response = _prompt(obj["prompt"], tokenizer), _response(obj, "chosen")
        elif is_messages(obj.get("chosen")):
            prompt, response = _conversation(obj["chosen"], tokenizer)
        elif isinstance(obj.get("chosen"), str):
            prompt, response = _hh_prompt_response(obj["chosen"], tokenizer)
        else:
            raise _Bad("missing_key", "need 'prompt'+'response'/'completion', 'messages' or 'chosen'")
        return [{"prompt": prompt, "response": response}]

    return _load(path, parse, strict)


def load_kto(path: str | os.PathLike, tokenizer, strict: bool = False) -> Records:
    """Unpaired KTO data -> ``[{"prompt": rendered str, "completion": str, "label": bool}]``.

    Pair-format lines give two rows (chosen ``True``, rejected ``False``).
    """
    require_chat_template(tokenizer)

    def parse(obj: dict) -> list[dict]:
        if "completion" in obj:
            if "prompt" not in obj or "label" not in obj:
                raise _Bad("missing_key", "KTO lines need 'prompt', 'completion' and 'label'")
            label = obj["label"]
            if not isinstance(label, bool) and label not in (0, 1):
                raise _Bad("bad_value", f"label must be true/false, got {label!r}")
            return [
                {
                    "prompt": _prompt(obj["prompt"], tokenizer),
                    "completion": _response(obj, "completion"),
                    "label": bool(label),
                }
            ]
        prompt, chosen, rejected = _pair(obj, tokenizer)
        return [
            {"prompt": prompt, "completion": chosen, "label": True},
            {"prompt": prompt, "completion": rejected, "label": False},
        ]

    return _load(path, parse, strict)
