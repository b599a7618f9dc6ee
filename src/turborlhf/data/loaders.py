"""Readers the trainers use: a data file, dataset directory or hub id -> lists of rendered text records.

Sources (``data/sources.py``): JSON lines (``.jsonl``/``.jsonl.gz``, numbered by line), JSON
arrays, Parquet, Arrow and CSV files, ``save_to_disk`` directories and hub ids through 🤗 datasets
(numbered by row). Every loader detects the format per record, so files may mix formats.

Strings given as ``prompt`` are used verbatim (TRL's "standard" format: plain text for a base
model, or a prompt already rendered with the chat template, as ``prepare_hh`` writes them);
message lists are rendered with the tokenizer's chat template and the generation prompt (TRL's
"conversational" format). A tokenizer without a chat template is only refused when a record
needs one (``chat_template=`` gives it one, see ``data/chat.py``). Responses are plain text
without an end-of-turn token (trainers append EOS).

``keys`` maps the canonical keys to the data's own, as OpenRLHF's ``--input_key`` /
``--output_key``: ``{"prompt": "question", "response": "answer"}`` reads ``{question, answer}``
records. Canonical keys: ``prompt``, ``chosen``, ``rejected``, ``response`` (SFT response; the
KTO ``completion``). Error messages name the data's own keys.

Bad records are collected as ``Problem(line, kind, detail)`` with 1-based line (JSON lines) or
row numbers. With ``strict=True`` any bad record raises ``DataError`` listing kinds, lines and
the key at fault; otherwise they are skipped and one ``DataWarning`` reports how many and where.
The returned ``Records`` is a plain list with a ``.problems`` attribute. A source with no usable
record raises ``DataError``; so does a record of messages when the tokenizer has no chat template.

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
  (last message is the assistant's response; with ``multiturn`` every assistant message is
  trained), any pair format (chosen), raw HH (chosen).
KTO (``load_kto``): ``{"prompt", "completion", "label": bool|0|1}``, or any pair format
  (-> two rows: chosen desirable, rejected undesirable).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from turborlhf.data.chat import (has_chat_template, is_messages, message_list_problem, render_conversation,
                                 render_prompt, response_text, set_chat_template, turn_end)
from turborlhf.data.errors import DataError, Problem, format_problems
from turborlhf.data.hh_rlhf import SAME_RESPONSE, convert_pair, prompt_messages_of, split_prompt_response
from turborlhf.data.jsonl import JsonLineError
from turborlhf.data.sources import open_rows
from turborlhf.data.tokenize import response_end_id

CANONICAL_KEYS = ("prompt", "chosen", "rejected", "response")


class DataWarning(UserWarning):
    """Bad lines were skipped while loading (non-strict mode), or the prompts look rendered for
    another model (`_warn_foreign_template`)."""


# what common chat templates append for the assistant's turn (ChatML, Llama 3, Gemma, Phi-3/Zephyr,
# Mistral): a text prompt ending with one of these was rendered by that template
_GENERATION_HEADERS = ("<|im_start|>assistant\n", "<|start_header_id|>assistant<|end_header_id|>\n\n",
                       "<start_of_turn>model\n", "<|assistant|>\n", "[/INST]")


class Records(list):
    """A list of loaded records; ``.problems`` lists the skipped bad lines."""

    problems: list[Problem]


class _Bad(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class _NoTemplate(Exception):
    """A record needs the chat template and the tokenizer has none: a setup error, not bad data."""


def _key_map(keys: Mapping[str, str] | None, response_as: str) -> dict[str, str]:
    """``{data key: canonical key}`` for the keys that differ (``response`` -> ``response_as``)."""
    out = {}
    for canon, key in (keys or {}).items():
        if canon not in CANONICAL_KEYS:
            raise ValueError(f"unknown data key {canon!r}; known: {', '.join(CANONICAL_KEYS)}")
        target = response_as if canon == "response" else canon
        if key and key not in (canon, target):  # the canonical name itself: nothing to rename
            out[key] = target
    return out


def _renamed(obj: dict, rename: dict[str, str]) -> dict:
    """``obj`` with the data's keys under their canonical names (a canonical key the data also
    uses for something else is dropped, as the mapping says which one to read)."""
    if not rename:
        return obj
    out = {k: v for k, v in obj.items() if k not in rename and k not in rename.values()}
    out.update({canon: obj[key] for key, canon in rename.items() if key in obj})
    return out


def _own_names(detail: str, rename: dict[str, str]) -> str:
    """A problem's detail with canonical key names put back to the data's own."""
    for key, canon in rename.items():
        detail = detail.replace(repr(canon), repr(key))
    return detail


def _load(path: str | os.PathLike, parse: Callable[[dict], list], strict: bool, tokenizer,
          keys: Mapping[str, str] | None = None, chat_template: str | None = None,
          response_as: str = "response", key_hint: bool = True) -> Records:
    set_chat_template(tokenizer, chat_template)
    rename = _key_map(keys, response_as)
    unit, rows = open_rows(path)
    records, problems = Records(), []
    unseen, first_keys = set(rename), None       # a data key named for a field that no record has
    for line, obj in rows:
        if isinstance(obj, JsonLineError):
            problems.append(Problem(line, "bad_json", obj.message))
            continue
        try:
            if not isinstance(obj, dict):
                raise _Bad("missing_key", f"expected a JSON object, got {type(obj).__name__}")
            if unseen:
                unseen -= obj.keys()
                first_keys = first_keys or sorted(obj)
            obj = _renamed(obj, rename)
            for key in ("messages", "prompt", "chosen", "rejected", "completion", "response"):
                if (why := message_list_problem(obj.get(key))) is not None:
                    raise _Bad("bad_value", f"{key}{why}")
            records.extend(parse(obj))
        except _Bad as e:
            detail = _own_names(e.detail, rename)
            if e.kind == "missing_key" and isinstance(obj, dict) and key_hint:    # where keys can be renamed
                detail += (f"; the record has keys {sorted(obj)[:8]} (name yours with data.prompt_key, "
                           "data.chosen_key, data.rejected_key, data.response_key)")
            problems.append(Problem(line, e.kind, detail))
        except _NoTemplate as e:
            raise DataError(f"{path}: {unit} {line}: {_own_names(str(e), rename)}") from None
    records.problems = problems
    if unseen and first_keys is not None:   # a mistyped key: the loader read another column instead, silently
        key = sorted(unseen)[0]
        canon = next(c for c, k in (keys or {}).items() if k == key)
        raise DataError(f"{path}: no record has the key {key!r} given for the {canon} (data.{canon}_key, "
                        f"--{canon}-key); the records have {first_keys[:8]}")
    bad = f"bad {unit}(s)"
    if problems and (strict or not records):
        why = "" if strict else " and no usable record"
        raise DataError(f"{path}: {len(problems)} {bad}{why}: {format_problems(problems, unit=unit)}")
    if not records:
        raise DataError(f"{path}: no records")
    if problems:
        warnings.warn(
            f"{path}: skipped {len(problems)} {bad}: {format_problems(problems, max_lines=10, unit=unit)}",
            DataWarning,
            stacklevel=3,
        )
    _warn_foreign_template(path, records, tokenizer)
    return records


def _warn_foreign_template(path, records: list, tokenizer) -> None:
    """Warn when text prompts end with another chat template's generation header than the
    tokenizer's (files `turborlhf prepare-data` rendered with another ``--tokenizer``, or a peer's
    data): used verbatim, they are that model's format, not this one's. Prompts given as message
    lists are rendered with the tokenizer and never warn."""
    own = turn_end(tokenizer)[1]
    if not own:                  # no template (a base model): no format of its own to compare with
        return
    prompts = [r.get("prompt") for r in records if isinstance(r, dict)]
    foreign = [p for p in prompts if isinstance(p, str) and not p.endswith(own)
               and any(p.endswith(h) for h in _GENERATION_HEADERS)]
    if foreign:
        header = next(h for h in _GENERATION_HEADERS if foreign[0].endswith(h))
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        warnings.warn(f"{path}: {len(foreign)} of {len(prompts)} prompts were rendered by another chat template "
                      f"(they end with {header!r}, {name!r} ends prompts with {own!r}): the model reads them "
                      "verbatim; render them with this model's tokenizer (prepare-data --tokenizer) or give them as "
                      "message lists", DataWarning, stacklevel=3)


def _render(tokenizer, messages: list, what: str) -> str:
    """``render_prompt``, or ``_NoTemplate`` naming the field when the tokenizer has no template."""
    if not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise _NoTemplate(f"{what} needs a chat template and tokenizer {name!r} has none: set data.chat_template "
                          "(chatml, plain or a Jinja string), or give prompts as plain text")
    return _templated(render_prompt, tokenizer, messages)


def _templated(render, tokenizer, messages: list):
    """`render` (`render_prompt`, `render_conversation`), a record the chat template itself refuses
    (Gemma's without a system role, Llama-2's roles that do not alternate) reported as a bad record."""
    try:
        return render(tokenizer, messages)
    except Exception as e:          # jinja2's TemplateError (raise_exception in the template), and the like
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise _Bad("template_error", f"the chat template refused it: {type(e).__name__}: {first}") from None


# ------------------------------------------------------------------------------- field parsers


def _prompt(x: Any, tokenizer) -> str:
    """A prompt field: rendered string (verbatim) or message list (rendered)."""
    if isinstance(x, str):
        if not x.strip():
            raise _Bad("empty_prompt", "prompt is empty")
        return x
    if is_messages(x):
        return _render(tokenizer, x, "'prompt' (a message list)")
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
    return _render(tokenizer, messages, "a raw HH dialogue"), sp[1].strip()


def _conversation(messages: list[dict], tokenizer) -> tuple[str, str]:
    """Message list ending in an assistant message -> (rendered prompt, response)."""
    if messages[-1]["role"] != "assistant":
        raise _Bad("no_assistant_turn", "last message is not the assistant's")
    if len(messages) < 2:
        raise _Bad("empty_prompt", "no message before the assistant response")
    if not messages[-1]["content"].strip():
        raise _Bad("empty_response", "response is empty")
    return _render(tokenizer, messages[:-1], "a conversation (message list)"), messages[-1]["content"]


def _assistant_turns(messages: list[dict], tokenizer) -> list[tuple[str, str]]:
    """Message list ending in an assistant message -> ``[(context, response)]``, one per assistant
    turn after the first message: ``context`` is the text the chat template renders between the
    previous response's end and this response, the first one the whole rendered prompt. An
    earlier response ends with the end-of-turn token the template writes right after it (none for
    ``plain``: the prompts of later turns have none there either), the last one has none (the
    trainer closes it, as a single-turn response); concatenated, the pairs are the rendered
    conversation. Raises ``_Bad("multiturn_template")`` where the template renders earlier turns
    differently once later ones follow (one that drops earlier reasoning, say)."""
    prompt, last = _conversation(messages, tokenizer)
    turns, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue
        if not m["content"].strip():       # the last turn: `_conversation`'s own check
            raise _Bad("empty_response", f"message {i + 1} (an assistant turn) is empty")
        ctx = prompt if i == len(messages) - 1 else _render(tokenizer, messages[:i], "a conversation (message list)")
        whole = _templated(render_conversation, tokenizer, messages[:i + 1])
        if not ctx.startswith(done) or not whole.startswith(ctx + m["content"]):
            raise _Bad("multiturn_template", f"the chat template renders the turns before message {i + 1} differently "
                                             "once later ones follow; data.multiturn needs one that only appends")
        end = tokenizer.decode([response_end_id(tokenizer, ctx)])
        written = end if whole[len(ctx) + len(m["content"]):].startswith(end) else ""
        # one end token where the content writes it too, as `encode_prompt_response` closes a response
        closed = m["content"] if i == len(messages) - 1 or m["content"].endswith(end) else m["content"] + written
        turns.append((ctx[len(done):], closed))
        done = ctx + m["content"] + written
    return turns


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
        return _render(tokenizer, res.prompt_messages, "a raw HH dialogue"), res.chosen, res.rejected
    raise _Bad("missing_key", "need 'prompt'+'chosen'+'rejected', or 'chosen'+'rejected'")


def _margin(obj: dict) -> float | None:
    m = obj.get("margin")
    if m is None:
        return None
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
        raise _Bad("bad_value", f"margin must be a finite number, got {m!r}")   # JSON's NaN: a NaN loss
    return float(m)


# ------------------------------------------------------------------------------------ loaders


def load_pairs(path: str | os.PathLike, tokenizer, strict: bool = False, *, keys: Mapping[str, str] | None = None,
               chat_template: str | None = None) -> Records:
    """Preference pairs -> ``[{"prompt": str, "chosen": str, "rejected": str, "margin": float|None}]``.

    ``prompt`` is rendered (ends with the assistant header); responses have no EOS. ``path``: any
    source of ``data/sources.py``; ``keys``: the data's own key names (module docstring);
    ``chat_template``: a named or Jinja template set on ``tokenizer`` first (``data.chat_template``).
    Raises ``DataError`` (strict and any bad record, no usable record, a record that needs a chat
    template the tokenizer lacks, an unreadable source), ``FileNotFoundError``.
    """

    def parse(obj: dict) -> list[dict]:
        prompt, chosen, rejected = _pair(obj, tokenizer)
        if chosen.strip() == rejected.strip():
            raise _Bad("same_response", SAME_RESPONSE)
        return [{"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": _margin(obj)}]

    return _load(path, parse, strict, tokenizer, keys, chat_template)


def load_prompt_records(path: str | os.PathLike, tokenizer, strict: bool = False, *,
                        keys: Mapping[str, str] | None = None, chat_template: str | None = None) -> Records:
    """Prompts with their other fields -> ``[{"prompt": rendered str, "columns": {key: value}}]``,
    de-duplicated by prompt keeping the first occurrence (and its columns).

    ``columns`` holds every key of the record except the one the prompt came from (``prompt``,
    ``text``, ``messages`` or ``chosen``, after `keys` mapping): e.g. ``answer`` for verifiable
    rewards, which PPO passes to reward functions by name (`turborlhf.rewards.functions`).
    """
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
            prompt = _render(tokenizer, msgs, "a conversation (message list)")
        elif isinstance(obj.get("chosen"), str):
            key, prompt = "chosen", _hh_prompt_response(obj["chosen"], tokenizer, need_response=False)[0]
        else:
            raise _Bad("missing_key", "need 'prompt', 'text', 'messages' or 'chosen'")
        if prompt in seen:
            return []
        seen.add(prompt)
        return [{"prompt": prompt, "columns": {k: v for k, v in obj.items() if k != key}}]

    return _load(path, parse, strict, tokenizer, keys, chat_template)


def load_prompts(path: str | os.PathLike, tokenizer, strict: bool = False, *, keys: Mapping[str, str] | None = None,
                 chat_template: str | None = None) -> Records:
    """Prompts -> rendered prompt strings, de-duplicated keeping first occurrence order
    (`load_prompt_records` without the columns)."""
    recs = load_prompt_records(path, tokenizer, strict, keys=keys, chat_template=chat_template)
    out = Records(r["prompt"] for r in recs)
    out.problems = recs.problems
    return out


def load_sft(path: str | os.PathLike, tokenizer, strict: bool = False, *, keys: Mapping[str, str] | None = None,
             chat_template: str | None = None, multiturn: bool = False) -> Records:
    """SFT examples -> ``[{"prompt": rendered str, "response": str}]`` (response without EOS).

    ``multiturn``: a ``messages`` conversation with several assistant turns also gets
    ``"turns": [(context, response), ...]`` (`_assistant_turns`: the earlier responses with the
    end-of-turn token their template writes after them), so that every assistant turn is
    trained (OpenRLHF's ``--multiturn``, TRL's ``assistant_only_loss``); otherwise only its last
    turn is, the earlier ones being context. ``prompt``/``response`` stay the last turn's.
    """

    def parse(obj: dict) -> list[dict]:
        if "prompt" in obj and ("response" in obj or "completion" in obj):
            key = "response" if "response" in obj else "completion"
            prompt, response = _prompt(obj["prompt"], tokenizer), _response(obj, key)
        elif is_messages(obj.get("messages")):
            prompt, response = _conversation(obj["messages"], tokenizer)
            turns = _assistant_turns(obj["messages"], tokenizer) if multiturn else []
            if len(turns) > 1:
                return [{"prompt": prompt, "response": response, "turns": turns}]
        elif "prompt" in obj and "chosen" in obj:
            prompt, response = _prompt(obj["prompt"], tokenizer), _response(obj, "chosen")
        elif is_messages(obj.get("chosen")):
            prompt, response = _conversation(obj["chosen"], tokenizer)
        elif isinstance(obj.get("chosen"), str):
            prompt, response = _hh_prompt_response(obj["chosen"], tokenizer)
        else:
            raise _Bad("missing_key", "need 'prompt'+'response'/'completion', 'messages' or 'chosen'")
        return [{"prompt": prompt, "response": response}]

    return _load(path, parse, strict, tokenizer, keys, chat_template)


def load_kto(path: str | os.PathLike, tokenizer, strict: bool = False, *, keys: Mapping[str, str] | None = None,
             chat_template: str | None = None) -> Records:
    """Unpaired KTO data -> ``[{"prompt": rendered str, "completion": str, "label": bool}]``.

    Pair-format lines give two rows (chosen ``True``, rejected ``False``).
    """

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

    return _load(path, parse, strict, tokenizer, keys, chat_template, response_as="completion")
