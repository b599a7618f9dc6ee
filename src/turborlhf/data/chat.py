"""Chat messages: validation and rendering through the tokenizer's chat template.

A *message list* is ``[{"role": "user"|"assistant"|"system"|..., "content": str}, ...]``.
A *rendered prompt* is the template applied with ``add_generation_prompt=True`` (it ends with the
assistant header, e.g. ``"<|im_start|>assistant\\n"`` for ChatML); the response text that follows
it carries no end-of-turn token: trainers append it themselves (`turn_end`: the template's own
end-of-turn token after a rendered prompt, as TRL's conversational data gets it, else EOS), and
rollouts stop at either (`stop_ids`).
"""

from __future__ import annotations

import math
from typing import Any

Message = dict[str, str]


def is_messages(x: Any) -> bool:
    """True if ``x`` is a non-empty list of ``{"role": str, "content": str}`` dicts."""
    return (
        isinstance(x, list)
        and len(x) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in x
        )
    )


def message_list_problem(x: Any) -> str | None:
    """What is wrong with a list of message-like dicts (``messages[1]: content must be a string, got
    list``), or None: fine, or not message-shaped at all (the parsers say what they expected).
    Tool calls are refused: the content-only rendering (`clean_messages`) would drop them and
    train an empty assistant turn in their place."""
    if not (isinstance(x, list) and x and all(isinstance(m, dict) for m in x)
            and any("role" in m or "content" in m for m in x)):
        return None
    for i, m in enumerate(x):
        if not isinstance(m.get("role"), str):
            return f"[{i}]: role must be a string, got {type(m.get('role')).__name__}"
        if m.get("tool_calls"):
            return f"[{i}]: an assistant message with tool_calls, which turborlhf does not render or train on"
        if not isinstance(m.get("content"), str):
            kind = type(m.get("content")).__name__
            hint = " (content parts are not read: give the text)" if isinstance(m.get("content"), list) else ""
            return f"[{i}]: content must be a string, got {kind}{hint}"
    return None


def clean_messages(messages: list[dict]) -> list[Message]:
    """Copy keeping only ``role`` and ``content`` (extra keys would confuse some templates)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def render_prompt(tokenizer, messages: list[Message]) -> str:
    """Render ``messages`` with the chat template plus the generation prompt (assistant header).
    A list ending in an assistant message (a prefill) is continued instead: no end of turn after
    it and no new header (``continue_final_message``, as TRL renders such prompts)."""
    if messages and messages[-1]["role"] == "assistant":
        return tokenizer.apply_chat_template(clean_messages(messages), add_generation_prompt=False,
                                             continue_final_message=True, tokenize=False)
    return tokenizer.apply_chat_template(
        clean_messages(messages), add_generation_prompt=True, tokenize=False
    )


def render_conversation(tokenizer, messages: list[Message]) -> str:
    """Render a whole conversation (last message usually the assistant's), no generation prompt."""
    return tokenizer.apply_chat_template(
        clean_messages(messages), add_generation_prompt=False, tokenize=False
    )


def response_text(x: Any) -> str | None:
    """A response given as a string or as one assistant message -> its text, else ``None``.

    Accepts ``"text"`` and ``[{"role": "assistant", "content": "text"}]`` (TRL's conversational
    explicit-prompt style), and a plain finite number as its text (``42`` -> ``"42"``; a whole
    float as an integer, ``72.0`` -> ``"72"``: a CSV column of numeric answers arrives typed as
    numbers, as floats once one of them has a decimal point).
    """
    if isinstance(x, str):
        return x
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return str(int(x)) if float(x).is_integer() else str(x)
    if is_messages(x) and len(x) == 1 and x[0]["role"] == "assistant":
        return x[0]["content"]
    return None


# Named templates for ``data.chat_template`` (tokenizers without one: base models).
CHAT_TEMPLATES: dict[str, str] = {
    # ChatML, as SmolLM2/Qwen write it: <|im_start|>role\ncontent<|im_end|>\n
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
        "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{% endif %}"
    ),
    # the messages' contents, separated by a blank line; no role names or special tokens
    "plain": (
        "{% for message in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}{{ message['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '\\n\\n' }}{% endif %}"
    ),
}


def resolve_chat_template(spec: str) -> str:
    """``data.chat_template`` -> a Jinja template: a name of ``CHAT_TEMPLATES`` or a Jinja string
    (anything containing ``{{`` or ``{%``). Raises ``ValueError`` for an unknown name."""
    if spec in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[spec]
    if "{{" in spec or "{%" in spec:
        return spec
    raise ValueError(f"data.chat_template: {spec!r} is neither a named template ({', '.join(CHAT_TEMPLATES)}) "
                     "nor a Jinja template")


def set_chat_template(tokenizer, spec: str | None) -> None:
    """Give ``tokenizer`` the template ``spec`` (see ``resolve_chat_template``); ``None`` keeps its own.

    The template is then saved with the tokenizer (``save_pretrained``), so the trained model's
    directory renders chats the same way in later stages and in ``turborlhf chat``.
    """
    if spec:
        tokenizer.chat_template = resolve_chat_template(spec)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def require_chat_template(tokenizer) -> None:
    """Raise ``ValueError`` if ``tokenizer`` has no chat template (rendering would fail later)."""
    if not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no chat template; use an instruct/chat tokenizer or set "
            "data.chat_template (chatml, plain or a Jinja string)"
        )


_SENTINEL = "TURBORLHF_RESPONSE_SENTINEL"
_TURN_END: dict[tuple, tuple] = {}


def turn_end(tokenizer) -> tuple[int | None, str | None]:
    """``(end_of_turn_id, generation_header)`` of the tokenizer's chat template.

    end_of_turn_id: the special token the template writes right after an assistant message
    (``<end_of_turn>`` for Gemma, ``<|im_end|>`` for ChatML on a base model whose EOS is
    ``<|endoftext|>``), or None where it is EOS itself (SmolLM2-Instruct, Llama-3.1-Instruct),
    writes no special token there (``plain``), or there is no template. generation_header: what
    ``add_generation_prompt`` appends (``"<|im_start|>assistant\\n"``); a prompt ending with it was
    rendered by the template. Cached per template and tokenizer."""
    if not has_chat_template(tokenizer):
        return None, None
    key = (tokenizer.chat_template, getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "bos_token", None),
           getattr(tokenizer, "name_or_path", ""))
    if key not in _TURN_END:
        _TURN_END[key] = _find_turn_end(tokenizer)
    return _TURN_END[key]


def _find_turn_end(tokenizer) -> tuple[int | None, str | None]:
    user = [{"role": "user", "content": "x"}]
    try:
        prompt, bare = render_prompt(tokenizer, user), render_conversation(tokenizer, user)
        whole = render_conversation(tokenizer, user + [{"role": "assistant", "content": _SENTINEL}])
        at = whole.rfind(_SENTINEL)
        tail = tokenizer(whole[at + len(_SENTINEL):], add_special_tokens=False)["input_ids"] if at >= 0 else []
        eot = tail[0] if tail and tail[0] in set(tokenizer.all_special_ids) else None
    except Exception:            # a template that refuses this conversation (roles it requires)
        return None, None
    header = prompt[len(bare):] if prompt.startswith(bare) and len(prompt) > len(bare) else None
    return (None if eot == tokenizer.eos_token_id else eot), header


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The tokens a rollout of this tokenizer's model stops at: EOS, the chat template's end-of-turn
    token where it is another special token (`turn_end`), and the end tokens the model directory's
    ``generation_config.json`` lists (Llama 3.1 Instruct and Qwen2.5 Instruct list several; HF
    ``generate`` stops at each)."""
    import json
    from pathlib import Path

    eot, _ = turn_end(tokenizer)
    extra: list = []
    config = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "generation_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            eos = None
        extra = [eos] if isinstance(eos, int) else [t for t in eos or [] if isinstance(t, int)]
    return tuple(dict.fromkeys(t for t in (tokenizer.eos_token_id, eot, *extra) if t is not None))
