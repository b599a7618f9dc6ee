"""Chat messages: validation and rendering through the tokenizer's chat template.

A *message list* is ``[{"role": "user"|"assistant"|"system"|..., "content": str}, ...]``.
A *rendered prompt* is the template applied with ``add_generation_prompt=True`` (it ends with the
assistant header, e.g. ``"<|im_start|>assistant\\n"`` for ChatML); the response text that follows
it carries no end-of-turn token (trainers append EOS themselves).
"""

from __future__ import annotations

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


def clean_messages(messages: list[dict]) -> list[Message]:
    """Copy keeping only ``role`` and ``content`` (extra keys would confuse some templates)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def render_prompt(tokenizer, messages: list[Message]) -> str:
    """Render ``messages`` with the chat template plus the generation prompt (assistant header)."""
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
    explicit-prompt style).
    """
    if isinstance(x, str):
        return x
    if is_messages(x) and len(x) == 1 and x[0]["role"] == "assistant":
        return x[0]["content"]
    return None


def require_chat_template(tokenizer) -> None:
    """Raise ``ValueError`` if ``tokenizer`` has no chat template (rendering would fail later)."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no chat template; use an instruct/chat tokenizer or set "
            "tokenizer.chat_template"
        )
