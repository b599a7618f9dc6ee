"""Tools called inside a rollout: the engine stops sampling for one row, the tool writes tokens into
the response, and sampling goes on after them (tool-integrated reasoning).

The one tool here is GSM8K's calculator (Cobbe et al. 2021, "Training Verifiers to Solve Math Word
Problems", arXiv:2110.14168, §B "Calculator annotations"): the reference solutions write every
arithmetic step as ``48/2 = <<48/2=24>>24``. When a response ends with ``<<expression=``, the
calculator computes the expression and the engine appends the result and ``>>``; the model then
copies the result into its prose. The model learns where to call it from the annotated solutions
(`turborlhf.data.gsm8k.sft_response` with ``calculator=True``).

Tokens a tool wrote are not the policy's actions: engines report them in
`RolloutOutput.tool_mask`, and trainers leave them out of the loss and of the log-prob checks, as
verl's and SkyRL's tool agent loops do with tool responses.

Contract (`Tool`): `trigger_ids` are the token ids after which the engine calls the tool (so the
tool runs only on a few steps); the call gets the row's response token ids so far and returns the
token ids to append, or None. Tools must be cheap and deterministic; they run in the decode loop.
"""
from __future__ import annotations

import ast
import math
import operator
import re
import warnings
from typing import Optional, Protocol, Sequence, runtime_checkable

__all__ = ["Tool", "ToolCalls", "Calculator", "continuation_ids", "evaluate_arithmetic", "format_number", "make_tool",
           "TOOLS"]


@runtime_checkable
class Tool(Protocol):
    """What an engine needs from a rollout tool (module docstring)."""

    trigger_ids: frozenset[int]

    def __call__(self, response_ids: Sequence[int]) -> Optional[list[int]]:
        ...


class ToolCalls:
    """The engines' shared bookkeeping of one batch decoded with a `tool`: after a trigger token
    the model sampled, the tool's tokens are queued for that row (`after`); the engine then writes
    them one per step (`next_token`) in place of sampled ones and flags them as tool tokens.
    Rows are the caller's indices (a request index, or a row of a `generate` call)."""

    def __init__(self, tool: Tool):
        self.tool = tool
        self._queued: dict[int, list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self._queued)

    def next_token(self, row: int) -> Optional[int]:
        """The next token queued for `row` (removed from the queue), or None."""
        queue = self._queued.get(row)
        if not queue:
            return None
        tok = queue.pop(0)
        if not queue:
            del self._queued[row]
        return tok

    def after(self, row: int, response_ids: Sequence[int]) -> None:
        """Call the tool if the last of `response_ids` (the row's response so far) is a trigger
        token and nothing is queued for `row`; queue what it returns. The caller passes only tokens
        the model sampled: a token a tool wrote never calls a tool."""
        if row not in self._queued and response_ids and response_ids[-1] in self.tool.trigger_ids:
            add = self.tool(response_ids)
            if add:
                self._queued[row] = list(add)


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow, ast.FloorDiv: operator.floordiv}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_ABS = 1e15                     # larger results are not arithmetic a word problem needs
_MAX_LEN = 80                       # longer expressions are not GSM8K steps


def evaluate_arithmetic(expression: str) -> Optional[float]:
    """The value of a plain arithmetic expression (numbers, + - * / // **, x or × for *, ÷ for /,
    parentheses; thousands separators, ``$`` and ``%`` signs ignored), or None when it is not one,
    divides by zero, or leaves [-1e15, 1e15]. Parsed with `ast` and a whitelist of operators:
    nothing is executed. Exponents are capped at 10 (``2**10**10`` is refused, not computed)."""
    s = expression.strip().replace(",", "").replace("$", "").replace("×", "*").replace("÷", "/")
    s = re.sub(r"(?<=[\d)\s])x(?=[\s\d(])", "*", s)
    s = s.replace("%", "")
    if not s or len(s) > _MAX_LEN or not re.fullmatch(r"[\d.+\-*/()\s]+", s):
        return None
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError:
        return None

    def ev(node) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > 10:
                raise ValueError("exponent too large")
            return _BINOPS[type(node.op)](a, b)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")

    try:
        v = ev(tree)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None
    if isinstance(v, complex) or not math.isfinite(v) or abs(v) > _MAX_ABS:
        return None
    return v


def format_number(v: float) -> str:
    """GSM8K's style: integers without a decimal point, others rounded to 4 decimals, trailing
    zeros dropped (``24``, ``0.2``, ``3.3333``)."""
    if abs(v - round(v)) < 1e-9:
        return str(int(round(v)))
    return f"{v:.4f}".rstrip("0").rstrip(".")


class Calculator:
    """GSM8K's calculator (module docstring) for one tokenizer.

    When the decoded response ends with ``<<EXPR=`` (no ``>>`` after the last ``<<``) and EXPR is
    arithmetic (`evaluate_arithmetic`), returns the token ids of ``VALUE>>``; otherwise None (the
    model goes on sampling, e.g. after a prose ``=``).
    The ids are the text's as a continuation of ``=`` (`continuation_ids`), checked in context:
    appended to the response they decode to exactly ``VALUE>>`` after it, with byte-level BPE
    (GPT-2, Qwen) and SentencePiece (Llama, Mistral) tokenizers alike. Where no ids do (a decoder
    that puts spaces between tokens, as WordPiece's), the continuation ids are written all the same,
    with a `RuntimeWarning` once.
    tokenizer: a `transformers` tokenizer (decode, encode without special tokens, vocabulary).
    Trigger tokens: every vocabulary entry whose text ends with ``=``.
    """

    name = "calculator"
    _LOOKBACK = 48                   # tokens decoded to find the open "<<" (an expression is short)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.trigger_ids = frozenset(i for tok, i in vocab.items()
                                     if tokenizer.convert_tokens_to_string([tok]).endswith("="))
        if not self.trigger_ids:
            raise ValueError("calculator: the tokenizer has no token ending with '='")
        self.calls = 0
        self._warned = False

    def __call__(self, response_ids: Sequence[int]) -> Optional[list[int]]:
        window = list(response_ids[-self._LOOKBACK:])
        text = self.tokenizer.decode(window, skip_special_tokens=True)
        if not text.endswith("="):
            return None
        open_at = text.rfind("<<")
        if open_at < 0 or ">>" in text[open_at:]:
            return None
        v = evaluate_arithmetic(text[open_at + 2: -1])
        if v is None:
            return None
        result = format_number(v) + ">>"
        ids, exact = continuation_ids(self.tokenizer, window, result)
        if not exact and not self._warned:
            wrote = self.tokenizer.decode(window + ids, skip_special_tokens=True)[len(text):]
            warnings.warn(f"calculator: no tokens of this tokenizer append exactly {result!r} after {text[-20:]!r}; "
                          f"writing ones that decode as {wrote!r}", RuntimeWarning, stacklevel=2)
            self._warned = True
        self.calls += 1
        return ids


_ANCHORS = ("=", "\n")       # texts a tool's output is encoded after, then cut off (`continuation_ids`)


def continuation_ids(tokenizer, context_ids: Sequence[int], text: str) -> tuple[list[int], bool]:
    """Token ids to append to `context_ids` for `text`, and whether they decode to exactly `text`
    after the context's own decode (special tokens skipped); when no candidate does, the first.

    A SentencePiece tokenizer (Llama, Mistral; Metaspace ``▁`` word starts) encodes a fragment as
    the start of a text, so as a word: ``24>>`` becomes ``▁24>>``, which after ``<<48/2=`` decodes
    as ``<<48/2= 24>>``. Its decode of the fragment alone strips that space again, so only a decode
    in context shows it. The candidates, first exact one wins: `text` encoded after an anchor
    (``=``, the calculator's trigger, then a newline) with the anchor's own tokens cut off (the
    text as a continuation, the tokens an annotated solution has there), then `text` encoded alone
    (byte-level BPE: the same ids). Raises ValueError when `text` encodes to no token."""
    def enc(s: str) -> list[int]:
        return list(tokenizer.encode(s, add_special_tokens=False))

    context_ids = list(context_ids)
    before = tokenizer.decode(context_ids, skip_special_tokens=True)
    candidates = []
    for anchor in _ANCHORS:
        head, both = enc(anchor), enc(anchor + text)
        if both[:len(head)] == head and len(both) > len(head):
            candidates.append(both[len(head):])
    candidates.append(enc(text))
    if not candidates[-1]:
        raise ValueError(f"continuation_ids: {text!r} encodes to no token")
    for ids in candidates:
        if tokenizer.decode(context_ids + ids, skip_special_tokens=True) == before + text:
            return ids, True
    return candidates[0], False


TOOLS = ("calculator",)


def make_tool(name: Optional[str], tokenizer) -> Optional[Tool]:
    """The tool called `name` (one of `TOOLS`) for `tokenizer`, or None for None/'none'.
    Raises ValueError naming the choices for an unknown name."""
    if name in (None, "", "none"):
        return None
    if name == "calculator":
        return Calculator(tokenizer)
    raise ValueError(f"unknown rollout tool {name!r}; choose one of {('none',) + TOOLS}")
