"""Built-in verifiable rewards (RLVR): rule-based checks of a response against the reference
answer that the prompts file carries as a column.

Each verifier is a reward function in TRL's convention (`turborlhf.rewards.functions`)::

    fn(prompts: list[str], completions: list[str], *, answer: list[str], **columns) -> list[float]

``answer[i]`` is the reference of ``completions[i]`` (columns are repeated for each sample of a
prompt). Name one in a config without a file path, by its short name or its import path::

    rewards:
      - {kind: function, path: gsm8k_accuracy, name: accuracy}
      - {kind: function, path: "turborlhf.rewards.verifiers:gsm8k_format", name: format}

| name | 1.0 when | source |
| --- | --- | --- |
| ``gsm8k_accuracy`` | the final number (the last ``#### <number>``, else, with no ``####`` answer line, the last number of the response) equals ``answer`` | lm-evaluation-harness gsm8k "flexible-extract" |
| ``gsm8k_strict_accuracy`` | the last ``#### <number>`` equals ``answer`` (no fallback) | lm-evaluation-harness gsm8k "strict-match" |
| ``gsm8k_format`` | the response's last non-empty line is ``#### <number>``, its only ``####`` | GSM8K's own solutions (Cobbe et al. 2021) |
| ``gsm8k_soft_format`` | partial credit towards ``gsm8k_format``: 0.5 for a ``#### <number>`` line, +0.25 if it is the only ``####``, +0.25 if it is the last line | shaped like open-r1's ``tag_count_reward`` |
| ``math_accuracy`` | `math-verify` finds the response's answer mathematically equal to ``answer`` (LaTeX or plain; ``\\boxed{}`` preferred, else the last expression) | Hugging Face Math-Verify, as TRL/open-r1 ``accuracy_reward`` |
| ``think_answer_format`` | the response is ``<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>`` | open-r1 ``format_reward`` (DeepSeek-R1-Zero template) |
| ``answer_tag_format`` | the response ends with its only ``<answer>...</answer>``, not empty (reasoning before it is free) | the answer format of reasoning-gym's default system prompt |
| ``reasoning_gym_score`` | the task's own ``score_answer`` on the ``<answer>...</answer>`` text (partial credit in [0, 1] for some tasks) | reasoning-gym (Stojanovski et al. 2025) |

Numbers compare exactly as decimals after removing ``$``, thousands separators and a trailing
period: ``1,080`` = ``1080`` = ``1080.00``; ``-3.5`` ≠ ``3.5``; ``-2, 3`` is no number. A markdown heading
(``#### 2. Step two``) is no answer line. ``math_accuracy`` needs the
``math`` extra (``pip install 'turborlhf[math]'``), ``reasoning_gym_score`` the ``reasoning-gym``
extra; both are imported on first call.
"""
from __future__ import annotations

import functools
import json
import re
import threading
import warnings
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Optional, Sequence

__all__ = ["BUILTIN_REWARDS", "extract_hash_answer", "extract_last_number", "numbers_equal", "gsm8k_accuracy",
           "gsm8k_strict_accuracy", "gsm8k_format", "gsm8k_soft_format", "math_accuracy", "think_answer_format",
           "answer_tag_format", "reasoning_gym_score"]

# a number as people write it: optional sign and $, thousands separators or plain digits, decimals
# ("- 18", a list item or "20 - 5", is 18 or 5: a sign is only a sign right before the digits or a $).
# A whole number only: not the start or the end of "3/4", "10^3", "12:30", "1e3", "12,3456", "3.14.15";
# a colon that follows a word is no part of a time ("Answer:58", "Answer:-5" are 58 and -5)
_NUM = (r"(?<![\d.,/^])(?<!\d:)(?<!\d[eE])(?<!\d[eE][-+])"
        r"(?:(?:-?\$\s?-?|-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\$?\.\d+)"
        r"(?![\d/^]|:\d|[.,]\d|[eE][-+]?\d)")
# a markdown heading, not an answer line: "#### 2. Step two", "#### 1) Compute", "#### 3: Total"
_HEADING_AFTER_NUMBER = r"[.):][^\S\n]*[^\W\d_]"
# each run of spaces matched by one pattern only: "####" before a long run of spaces or newlines
# stays linear (two adjacent \s* took seconds per 4,000 spaces, whole minutes per response)
_HASH_RE = re.compile(rf"####\s*(?:\*+\s*)?({_NUM})(?!{_HEADING_AFTER_NUMBER})")
# "####" before something written like a number ("#### 1/2", "#### 3:30", "#### 2.5.1"), headings aside:
# where the last of these is no whole number, the response's final answer is not one
_HASH_NUMBERLIKE_RE = re.compile(rf"####\s*(?:\*+\s*)?(?=-?\$?\s?-?\.?\d)(?!-?\$?\s?-?\d+{_HEADING_AFTER_NUMBER})")
_NUM_RE = re.compile(_NUM)
_FORMAT_LINE_RE = re.compile(rf"^\s*####\s*(?:\*+\s*)?(?:{_NUM})\s*(?:\*+\s*)?(?:\.\s*)?$")
# LaTeX whose numbers are no answer by themselves: \frac{1}{2} is not 2, \sqrt{2} not 2
_LATEX_PARTS_RE = re.compile(r"\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}|\\sqrt\s*(?:\[[^\]]*\])?\s*\{[^{}]*\}")
_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-"})      # typeset minus signs (−, –) read as "-"


_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
# a sign and a dollar sign before the digits, spaces between them: "-$ 5", "$-5", "- 5"
_LEAD_RE = re.compile(r"([-+]?)\s*\$?\s*([-+]?)\s*")


def _to_decimal(text: Optional[str]) -> Optional[Decimal]:
    """``"$1,080."`` → Decimal(1080); None when `text` is not a number. Commas only as thousands
    separators and spaces only after a leading sign or ``$``: ``"-2, 3"`` and ``"12,34"`` are no
    number (a list is not -23, nor a decimal comma 1234)."""
    if text is None:
        return None
    s = str(text).translate(_MINUS).strip().rstrip(".")
    lead = _LEAD_RE.match(s)
    s = lead.group(1) + lead.group(2) + s[lead.end():]
    if s.startswith("--"):
        s = s[2:]
    if "," in s:
        if not _THOUSANDS_RE.fullmatch(s):
            return None
        s = s.replace(",", "")
    if not s or any(ch.isspace() or ch == "$" for ch in s):
        return None
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    return d if d.is_finite() else None


def extract_hash_answer(text: str) -> Optional[str]:
    """The number after the last ``####`` of `text` (GSM8K's answer line), as written (a typeset
    minus ``−`` as ``-``); None if there is none, or if the last ``####`` written before a number is
    followed by no whole number (``#### 3/4``, after an earlier ``#### 5`` too). A markdown heading
    (``#### 2. Step two``) is no answer line. ``"... #### 1,080"`` → ``"1,080"``."""
    return _hash_answer(text)[0]


def _hash_answer(text: str) -> tuple[Optional[str], bool]:
    """(`extract_hash_answer`, whether `text` ends its numbers with a ``####`` answer line at all:
    True for ``#### 3/4`` too, whose answer is no whole number, so no other number may stand in)."""
    text = text.translate(_MINUS)
    last = None
    for last in _HASH_RE.finditer(text):
        pass
    committed = None
    for committed in _HASH_NUMBERLIKE_RE.finditer(text):
        pass
    if committed is not None and (last is None or committed.start() > last.start()):
        return None, True
    return (last.group(1).strip(), True) if last is not None else (None, False)


def extract_last_number(text: str) -> Optional[str]:
    """The last whole number written in `text` (``"$1,200.50"``, ``"-3"``; not a part of ``3/4``,
    ``1e3``, ``\\frac{1}{2}`` or ``\\sqrt{2}``), or None."""
    found = _NUM_RE.findall(_LATEX_PARTS_RE.sub(" ", text.translate(_MINUS)))
    return found[-1].strip() if found else None


def numbers_equal(a: Optional[str], b: Optional[str]) -> bool:
    """Exact decimal equality of two written numbers (``"1,080"`` == ``"1080.0"``); False when
    either is not a number."""
    da, db = _to_decimal(a), _to_decimal(b)
    return da is not None and db is not None and da == db


def _reference(answer: Any) -> Optional[str]:
    """A reference given as a number, ``"72"`` or a whole GSM8K solution ending ``#### 72``."""
    if answer is None:
        return None
    text = str(answer)
    return extract_hash_answer(text) or text.strip()


def _reference_number(name: str, answer: Any) -> Optional[str]:
    """`_reference`, with a warning when it holds no number (None, "seventy-two", "72 apples"):
    every response to it scores 0, so its GRPO group has no signal (and dynamic sampling drops it)."""
    ref = _reference(answer)
    if _to_decimal(ref) is None:
        warnings.warn(f"{name}: cannot read a number from the reference answer {answer!r}; every response to it "
                      "scores 0", stacklevel=3)
    return ref


def _require(name: str, answer: Optional[Sequence], n: int) -> Sequence:
    if answer is None:
        raise ValueError(f"{name} needs an 'answer' column in the prompts file "
                         "(turborlhf prepare-data gsm8k writes one)")
    if len(answer) != n:
        raise ValueError(f"{name}: {len(answer)} answers for {n} completions")
    return answer


def gsm8k_accuracy(prompts: list[str], completions: list[str], answer: Optional[Sequence] = None,
                   **columns) -> list[float]:
    """1.0 where the response's final number equals the reference: the last ``#### <number>``,
    else, where no ``####`` precedes something written as a number, the last number anywhere
    (lm-evaluation-harness's "flexible-extract"); else 0.0. (``5 apples... #### 1/2`` answered
    1/2: it scores 0 against 5.)

    Args:
        prompts, completions: B texts each. answer: B references (number or full solution).
    Raises:
        ValueError: no ``answer`` column, or not one per completion.
    """
    answer = _require("gsm8k_accuracy", answer, len(completions))
    out = []
    for c, a in zip(completions, answer):
        pred, answered = _hash_answer(c)
        if not answered:
            pred = extract_last_number(c)
        out.append(float(numbers_equal(pred, _reference_number("gsm8k_accuracy", a))))
    return out


def gsm8k_strict_accuracy(prompts: list[str], completions: list[str], answer: Optional[Sequence] = None,
                          **columns) -> list[float]:
    """1.0 where the last ``#### <number>`` of the response equals the reference (no fallback:
    lm-evaluation-harness's "strict-match"); else 0.0. Raises as `gsm8k_accuracy`."""
    answer = _require("gsm8k_strict_accuracy", answer, len(completions))
    return [float(numbers_equal(extract_hash_answer(c), _reference_number("gsm8k_strict_accuracy", a)))
            for c, a in zip(completions, answer)]


def gsm8k_format(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1.0 where the response's last non-empty line is ``#### <number>`` (optionally bold or
    followed by a period) and is its only ``####``, as every GSM8K reference solution ends; else
    0.0. (A response that repeats ``#### 3`` until it is cut off is not formatted.)"""
    out = []
    for c in completions:
        lines = [ln for ln in c.strip().splitlines() if ln.strip()]
        out.append(float(bool(lines) and c.count("####") == 1 and _FORMAT_LINE_RE.match(lines[-1]) is not None))
    return out


def gsm8k_soft_format(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """Partial credit towards `gsm8k_format`, a denser signal while the policy rarely meets it:
    0.5 if some line is ``#### <number>``, plus 0.25 if the response has no other ``####``, plus
    0.25 if that line is the last non-empty one (1.0 exactly when `gsm8k_format` is 1). Shaped
    like open-r1's ``tag_count_reward``."""
    out = []
    for c in completions:
        lines = [ln for ln in c.strip().splitlines() if ln.strip()]
        hits = [i for i, ln in enumerate(lines) if _FORMAT_LINE_RE.match(ln)]
        if not hits:
            out.append(0.0)
            continue
        out.append(0.5 + 0.25 * (c.count("####") == 1) + 0.25 * (hits[-1] == len(lines) - 1))
    return out


def _think_answer(text: str) -> bool:
    """Whether `text` is ``<think>\\n…\\n</think>\\n<answer>\\n…\\n</answer>``: open-r1's regex
    ``^<think>\\n.*?\\n</think>\\n<answer>\\n.*?\\n</answer>$`` (DOTALL), checked in linear time
    (the regex backtracks quadratically over a response that repeats its tags)."""
    head, middle, tail = "<think>\n", "\n</think>\n<answer>\n", "\n</answer>"
    if not (text.startswith(head) and text.endswith(tail)):
        return False
    at = text.find(middle, len(head))          # the first split leaves the most room for the answer
    return at != -1 and at + len(middle) <= len(text) - len(tail)


def think_answer_format(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1.0 where the whole response is ``<think>\\n…\\n</think>\\n<answer>\\n…\\n</answer>`` (open-r1's
    ``format_reward``, the DeepSeek-R1-Zero template); else 0.0."""
    return [float(_think_answer(c.strip())) for c in completions]


def answer_tag_format(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1.0 where the response ends with ``<answer>…</answer>`` holding some text, and has no other
    ``<answer>`` tag (the format reasoning-gym's default system prompt asks for, which
    `reasoning_gym_score` reads); else 0.0. What comes before the tag is not checked."""
    return [float(c.count("<answer>") == 1 and c.rstrip().endswith("</answer>") and bool(_extract_answer_tag(c)))
            for c in completions]


_CALC_NOTE_RE = re.compile(r"<<[^<>]*>>")        # GSM8K's calculator notes "<<12*5=60>>": not an answer


def _math_reference(answer: Any) -> str:
    """A reference as math-verify should read it: a GSM8K solution's ``####`` number, a plain
    number as a decimal (``1e3`` → ``1000``), LaTeX without delimiters inside ``$…$``."""
    ref = str(answer) if answer is not None else ""
    hashed = extract_hash_answer(ref)
    ref = hashed if hashed is not None else ref
    number = _to_decimal(ref)
    if number is not None:
        return f"${number:f}$"
    if not re.search(r"(?<!\\)\$", ref) and not any(d in ref for d in ("\\boxed", "\\(", "\\[")):   # \$: a dollar
        ref = f"${ref}$"
    return ref


def _has_value(parsed: Any) -> bool:
    """Whether math-verify's parse result holds a math object (it falls back to the raw string)."""
    return not isinstance(parsed, str)


@functools.lru_cache(maxsize=1)
def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("math_accuracy needs math-verify: pip install 'turborlhf[math]'") from e
    return math_verify


def math_accuracy(prompts: list[str], completions: list[str], answer: Optional[Sequence] = None,
                  **columns) -> list[float]:
    """1.0 where `math-verify` finds the response's final answer mathematically equivalent to the
    reference (``1/2`` = ``\\frac{1}{2}`` = ``0.5``, ``\\sqrt{8}`` = ``2\\sqrt{2}``, sets, equations
    ``x = 3`` vs ``3``); else 0.0. The reference may be LaTeX (with or without ``$``), a plain
    number or a GSM8K solution (its ``####`` number is used). A reference math-verify cannot parse
    scores 0.0 with one warning.

    Source: Hugging Face Math-Verify (`parse` + `verify`, default extraction), as TRL's and
    open-r1's ``accuracy_reward``. Its parsing timeout uses SIGALRM, so outside the main thread
    it runs without a timeout.

    Raises:
        ValueError: no ``answer`` column; ImportError: math-verify not installed.
    """
    mv = _math_verify()
    answer = _require("math_accuracy", answer, len(completions))
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    out = []
    for c, a in zip(completions, answer):
        gold = mv.parse(_math_reference(a), parsing_timeout=timeout)
        if not any(_has_value(g) for g in gold):
            warnings.warn(f"math_accuracy: math-verify cannot parse the reference {a!r}; scored 0", stacklevel=2)
            out.append(0.0)
            continue
        hashed = _to_decimal(extract_hash_answer(c))       # a GSM8K-style response: its "#### n" line is its answer
        pred = mv.parse(f"${hashed:f}$" if hashed is not None else _CALC_NOTE_RE.sub("", c), parsing_timeout=timeout)
        out.append(float(bool(pred) and mv.verify(gold, pred, timeout_seconds=timeout)))
    return out


# ----------------------------------------------------------------------------------------------
# reasoning-gym: procedurally generated tasks, each with its own scorer
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _rg_scorer(task: str) -> Callable[[Optional[str], dict], float]:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError("reasoning_gym_score needs reasoning-gym: pip install 'turborlhf[reasoning-gym]'") from e
    return reasoning_gym.get_score_answer_fn(task)


# tasks whose scorer compares the parsed answer with tuples of the metadata (ARC grids)
_RG_TUPLES = {"arc_agi": ("input", "output"), "rearc": ("input", "output")}


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _extract_answer_tag(text: str) -> Optional[str]:
    """The stripped text of the last ``<answer>…</answer>`` of `text` as ``re.findall(r"<answer>(.*?)
    </answer>")`` pairs them (left to right, each tag with the first close after it), in linear time
    (the regex is quadratic in a response that repeats ``<answer>``); None if there is none."""
    last, pos = None, 0
    while (start := text.find("<answer>", pos)) != -1:
        end = text.find("</answer>", start + len("<answer>"))
        if end == -1:
            break
        last, pos = text[start + len("<answer>"):end], end + len("</answer>")
    return last.strip() if last is not None else None


def reasoning_gym_score(prompts: list[str], completions: list[str], answer: Optional[Sequence] = None,
                        metadata: Optional[Sequence] = None, question: Optional[Sequence] = None,
                        **columns) -> list[float]:
    """The reasoning-gym task's ``score_answer(answer_text, entry)`` for the text inside the last
    ``<answer>…</answer>`` of each response (None when there is none: the task scores it 0).

    Columns (written by ``turborlhf prepare-data reasoning-gym``): ``answer`` (the entry's answer),
    ``metadata`` (the entry's metadata, a dict or its JSON text, whose ``source_dataset`` names
    the task), ``question`` (optional). Scores are in [0, 1]; some tasks give partial credit.

    Raises:
        ValueError: a missing ``answer``/``metadata`` column, a metadata that is no JSON object, or one without
            ``source_dataset``.
    """
    answer = _require("reasoning_gym_score", answer, len(completions))
    if metadata is None:
        raise ValueError("reasoning_gym_score needs a 'metadata' column (turborlhf prepare-data reasoning-gym "
                         "writes one)")
    out = []
    for i, (c, a, meta) in enumerate(zip(completions, answer, metadata)):
        meta = _metadata(meta, i)
        task = meta.get("source_dataset")
        if not task:
            raise ValueError(f"reasoning_gym_score: metadata of row {i} has no 'source_dataset'")
        for k in _RG_TUPLES.get(task, ()):           # JSON made the task's tuples lists
            if k in meta:
                meta[k] = _tuples(meta[k])
        entry = {"question": question[i] if question is not None else "", "answer": a, "metadata": meta}
        out.append(float(_rg_scorer(task)(_extract_answer_tag(c), entry)))
    return out


def _metadata(meta: Any, i: int) -> dict:
    """Row `i`'s reasoning-gym metadata as a dict (from a dict, a mapping or its JSON text)."""
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError as e:
            raise ValueError(f"reasoning_gym_score: metadata of row {i} is not JSON ({e})") from None
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        try:
            meta = dict(meta)
        except (TypeError, ValueError):
            raise ValueError(f"reasoning_gym_score: metadata of row {i} is a {type(meta).__name__}, not an object "
                             "with a 'source_dataset'") from None
    return dict(meta)


# short names usable as `rewards: [{kind: function, path: NAME}]`
BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {
    "gsm8k_accuracy": gsm8k_accuracy,
    "gsm8k_strict_accuracy": gsm8k_strict_accuracy,
    "gsm8k_format": gsm8k_format,
    "gsm8k_soft_format": gsm8k_soft_format,
    "math_accuracy": math_accuracy,
    "think_answer_format": think_answer_format,
    "answer_tag_format": answer_tag_format,
    "reasoning_gym_score": reasoning_gym_score,
}
