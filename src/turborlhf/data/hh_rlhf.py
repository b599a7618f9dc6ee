"""Anthropic HH-RLHF -> turborlhf data files (pairs, comparisons, prompts, KTO) with a report.

Source format (Bai et al. 2022, arXiv:2204.05862; github.com/anthropics/hh-rlhf): one JSON
object per line, ``{"chosen": dialogue, "rejected": dialogue}``, each dialogue
``"\\n\\nHuman: ...\\n\\nAssistant: ...\\n\\nHuman: ...\\n\\nAssistant: ..."``. The prompt is the
text up to and including the last ``"\\n\\nAssistant:"``; the response is what follows it. The
same columns in a ``.parquet``, ``.arrow``, ``.csv`` or ``.json`` file (the hub's
``Anthropic/hh-rlhf`` ships Parquet) or a saved dataset directory are read too
(`turborlhf.data.sources.open_rows`, numbered by row), as is a hub id.

How turns are split (decided from the real data, ``data/hh-rlhf/harmless-base-1800.jsonl.gz``):

- A turn starts only at a *marker*: ``"Human:"`` or ``"Assistant:"`` at the very start of the
  text or right after a blank line (``"\\n\\n"``). In the sample, 70 dialogues contain
  ``"Human:"`` *inside* an assistant turn, always without a blank line before it: the model
  role-playing the user (``"\\n\\nAssistant: Human: So she doesn't like rap..."``) or run-on text
  (``"...drag kings.  Human: Then how do..."``). Those stay part of the assistant's content,
  exactly as the dataset's own convention (and every peer converter that splits on
  ``"\\n\\nAssistant:"``) treats them. A ``"\\n\\nHuman:"`` inside a response cannot be told apart
  from a real turn; none occur after the last assistant marker in the sample.
- Consecutive turns of the same role (8 dialogues, e.g. two ``Assistant:`` turns in a row on
  lines 668, 764, 1320) are merged into one message joined by ``"\\n\\n"`` - the text between
  them - so templates that require alternating roles still render.
- Text before the first marker (never seen in the sample) becomes a user message.
- Message contents and responses are ``strip()``-ed (the response's leading space goes).

Problems (a line gets exactly one, checked in this order; nothing is dropped silently):
``bad_json``, ``missing_key`` (chosen/rejected absent or not strings, or not an object),
``no_assistant_turn`` (no ``Assistant:`` marker, or a ``Human:`` turn after the last one),
``prompt_mismatch`` (rejected does not share chosen's prompt), ``empty_prompt`` (no turn before
the response), ``empty_response`` (chosen or rejected response empty after strip),
``same_response`` (chosen and rejected the same text: no preference; the reward and DPO losses
are constant on it, and it counts as a tie in accuracies).

Train/test split: ``sha256`` of the canonical prompt (its message list as JSON) mapped to [0, 1);
below ``test_fraction`` -> test. The same prompt always lands in the same split, whatever the line
order, and no prompt is in both splits.

Command line (via ``turborlhf prepare-data``) or Python::

    from turborlhf.data import prepare_hh
    report = prepare_hh("data/hh-rlhf/harmless-base-1800.jsonl.gz", "out/hh", tokenizer)
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turborlhf.data.chat import Message, render_conversation, render_prompt, require_chat_template
from turborlhf.data.errors import DataError, DataFileError, Problem, format_problems, group_problems
from turborlhf.data.jsonl import JsonLineError, write_jsonl, write_text_atomic
from turborlhf.data.sources import DATASETS_SUFFIXES, open_rows

PROBLEM_KINDS = (
    "bad_json",
    "missing_key",
    "no_assistant_turn",
    "prompt_mismatch",
    "empty_prompt",
    "empty_response",
    "same_response",
)
SPLITS = ("train", "test")
SAME_RESPONSE = "chosen and rejected are the same response: no preference to learn"

# A turn marker: "Human:"/"Assistant:" at the start of the text or after a blank line.
_TURN_RE = re.compile(r"(?:\A|\n\n)(Human|Assistant):")
_ROLE = {"Human": "user", "Assistant": "assistant"}


@dataclass(frozen=True)
class Pair:
    """One converted preference pair.

    ``prompt_messages``: the dialogue before the final assistant turn (list of role/content dicts).
    ``chosen`` / ``rejected``: the final assistant responses, stripped, without end-of-turn token.
    """

    prompt_messages: list[Message]
    chosen: str
    rejected: str

    @property
    def prompt_key(self) -> str:
        """Canonical prompt string used for splitting and de-duplication."""
        return json.dumps(self.prompt_messages, ensure_ascii=False, sort_keys=True)


def parse_dialogue(text: str) -> list[Message]:
    """Split an HH dialogue into ``[{"role": "user"|"assistant", "content": str}, ...]``.

    Turns start only at ``"Human:"``/``"Assistant:"`` at the start of ``text`` or after ``"\\n\\n"``;
    a ``"Human:"`` elsewhere stays inside the current turn. Consecutive same-role turns are merged
    with ``"\\n\\n"``; contents are stripped; leading text before any marker is a user message.
    """
    messages: list[Message] = []
    matches = list(_TURN_RE.finditer(text))
    head = text[: matches[0].start()] if matches else text
    if head.strip():
        messages.append({"role": "user", "content": head.strip()})
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        role, content = _ROLE[m.group(1)], text[m.end() : end].strip()
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{content}".strip()
        else:
            messages.append({"role": role, "content": content})
    return messages


def split_prompt_response(text: str) -> tuple[str, str] | str:
    """Split a dialogue at its last assistant marker -> ``(prompt_text, response_text)``.

    ``prompt_text`` includes the marker (``"...\\n\\nAssistant:"``); ``response_text`` is the raw
    remainder (not stripped). Returns the problem kind ``"no_assistant_turn"`` if there is no
    assistant marker or a human turn follows the last one.
    """
    last = None
    for m in _TURN_RE.finditer(text):
        last = m
    if last is None or last.group(1) != "Assistant":
        return "no_assistant_turn"
    return text[: last.end()], text[last.end() :]


def prompt_messages_of(prompt_text: str) -> list[Message]:
    """Messages of a prompt text ending in the final ``"Assistant:"`` marker (marker dropped)."""
    m = None
    for m in _TURN_RE.finditer(prompt_text):
        pass
    return parse_dialogue(prompt_text[: m.start()] if m else prompt_text)


def convert_pair(obj: Any, line: int = 0) -> Pair | Problem:
    """Convert one HH record ``{"chosen": str, "rejected": str}`` -> ``Pair``, or a ``Problem``.

    ``obj`` may be a ``JsonLineError`` (from ``read_jsonl``) -> ``bad_json``. ``line`` is the 1-based
    source line stored in the problem. See the module docstring for the problem kinds and order.
    """
    if isinstance(obj, JsonLineError):
        return Problem(line, "bad_json", obj.message)
    if not isinstance(obj, dict):
        return Problem(line, "missing_key", f"expected a JSON object, got {type(obj).__name__}")
    for key in ("chosen", "rejected"):
        if key not in obj:
            return Problem(line, "missing_key", f"key {key!r} is missing")
        if not isinstance(obj[key], str):
            return Problem(line, "missing_key", f"{key!r} is {type(obj[key]).__name__}, not a string")
    chosen_split = split_prompt_response(obj["chosen"])
    rejected_split = split_prompt_response(obj["rejected"])
    for key, sp in (("chosen", chosen_split), ("rejected", rejected_split)):
        if isinstance(sp, str):
            return Problem(line, sp, f"{key!r} has no final assistant turn")
    prompt_text, chosen_raw = chosen_split
    rejected_prompt, rejected_raw = rejected_split
    if rejected_prompt != prompt_text:
        n = len(_common_prefix(prompt_text, rejected_prompt))
        return Problem(line, "prompt_mismatch", f"chosen and rejected prompts differ from char {n}")
    messages = prompt_messages_of(prompt_text)
    if not messages:
        return Problem(line, "empty_prompt", "no turn before the final assistant response")
    chosen, rejected = chosen_raw.strip(), rejected_raw.strip()
    empty = [k for k, v in (("chosen", chosen), ("rejected", rejected)) if not v]
    if empty:
        return Problem(line, "empty_response", " and ".join(empty) + " response empty")
    if chosen == rejected:
        return Problem(line, "same_response", SAME_RESPONSE)
    return Pair(messages, chosen, rejected)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def split_of(prompt_key: str, test_fraction: float) -> str:
    """``"test"`` if ``sha256(prompt_key)`` mapped to [0, 1) is below ``test_fraction``, else ``"train"``."""
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
    u = int.from_bytes(hashlib.sha256(prompt_key.encode("utf-8")).digest()[:8], "big") / 2.0**64
    return "test" if u < test_fraction else "train"


# ---------------------------------------------------------------- sources: local file or hub id

_HUB_RE = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<dir>[\w./-]+?))?(?::(?P<split>[\w+\[\]%:.-]+))?$"
)


def parse_hub_spec(spec: str) -> tuple[str, str | None, str] | None:
    """``"org/name[/data_dir][:split]"`` -> ``(hub_id, data_dir, split)`` (split defaults to
    ``"train"``), or ``None`` if ``spec`` does not look like a hub id (e.g. ends in ``.jsonl``)."""
    if spec.endswith((".jsonl", ".json", ".gz", *DATASETS_SUFFIXES)):
        return None
    m = _HUB_RE.match(spec)
    if not m:
        return None
    return m.group("repo"), m.group("dir"), m.group("split") or "train"


def load_hh_from_hub(hub_id: str, split: str = "train", data_dir: str | None = None) -> Iterator[dict]:
    """Yield HH records ``{"chosen", "rejected"}`` from the Hugging Face hub via ``datasets``.

    ``hub_id`` e.g. ``"Anthropic/hh-rlhf"``; ``data_dir`` selects a subset such as
    ``"harmless-base"``; ``split`` is any ``datasets`` split expression (``"train"``,
    ``"test"``, ``"train+test"``). Raises ``ImportError`` if ``datasets`` is not installed,
    ``DataError`` (one line) when the hub id cannot be loaded (offline, unknown, no such split).
    """
    try:
        import datasets  # lazy: optional dependency
    except ImportError as e:
        raise ImportError(
            f"loading {hub_id!r} from the hub needs the 'datasets' package (pip install datasets); "
            "or download the .jsonl.gz file and pass its path"
        ) from e
    try:
        ds = datasets.load_dataset(hub_id, data_dir=data_dir, split=split)
    except Exception as e:        # offline, unknown id, bad split: datasets' own reason, one line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"{hub_id}: no such file, and loading it as a Hugging Face hub dataset failed "
                        f"({type(e).__name__}: {reason}); or download the .jsonl.gz file and pass its path") from None
    for row in ds:
        yield dict(row)


def _records(source: str | Path) -> tuple[str, Iterator[tuple[int, Any]]]:
    """``(unit, (1-based line or row number, record) items)`` from a local file or directory
    (`open_rows`: JSON lines by line; Parquet, Arrow, CSV, a JSON array, a saved dataset by row) or
    a hub spec (by row). Raises `DataFileError` for neither, `DataError` for an unreadable file."""
    if Path(source).exists():
        return open_rows(source)
    hub = parse_hub_spec(str(source))
    if hub is None:
        raise DataFileError(f"{source}: no such file (and not a hub id like 'Anthropic/hh-rlhf')")
    hub_id, data_dir, split = hub
    return "row", enumerate(load_hh_from_hub(hub_id, split=split, data_dir=data_dir), start=1)


# ---------------------------------------------------------------- prepare


def convert_records(records: Iterable[tuple[int, Any]]) -> tuple[list[tuple[int, Pair]], list[Problem], int]:
    """Convert ``(line, record)`` items -> ``(pairs with their lines, problems, records read)``."""
    pairs, problems, n = [], [], 0
    for line, obj in records:
        n += 1
        res = convert_pair(obj, line)
        if isinstance(res, Problem):
            problems.append(res)
        else:
            pairs.append((line, res))
    return pairs, problems, n


def _split_rows(tokenizer, pairs: list[Pair]) -> dict[str, list[dict]]:
    """Render one split's pairs into the rows of each output file kind."""
    out: dict[str, list[dict]] = {"pairs": [], "comparisons": [], "prompts": [], "kto": []}
    seen: set[str] = set()
    for p in pairs:
        prompt = render_prompt(tokenizer, p.prompt_messages)
        out["pairs"].append(
            {"prompt": prompt, "chosen": p.chosen, "rejected": p.rejected, "prompt_messages": p.prompt_messages}
        )
        for response in (p.chosen, p.rejected):  # NeMo-Aligner: chosen line, then rejected line
            full = p.prompt_messages + [{"role": "assistant", "content": response}]
            out["comparisons"].append({"text": render_conversation(tokenizer, full)})
        if prompt not in seen:
            seen.add(prompt)
            out["prompts"].append({"text": prompt, "prompt": prompt})
        out["kto"].append({"prompt": prompt, "completion": p.chosen, "label": True})
        out["kto"].append({"prompt": prompt, "completion": p.rejected, "label": False})
    return out


def prepare_hh(
    input_path: str | Path,
    output_dir: str | Path,
    tokenizer,
    test_fraction: float = 0.1,
    strict: bool = False,
) -> dict:
    """Convert HH-RLHF (local ``.jsonl[.gz]``, ``.parquet``, ... file or hub id) into training files;
    return the report.

    Writes to ``output_dir`` for each split in (train, test):
    ``{split}_pairs.jsonl`` ``{"prompt", "chosen", "rejected", "prompt_messages"}``;
    ``{split}_comparisons.jsonl`` ``{"text"}`` x2 per pair, chosen then rejected (NeMo-Aligner);
    ``{split}_prompts.jsonl`` ``{"text", "prompt"}`` per unique prompt;
    ``{split}_kto.jsonl`` ``{"prompt", "completion", "label"}`` (chosen True, rejected False);
    and ``report.json``. Prompts are rendered with ``tokenizer``'s chat template and the generation
    prompt; responses carry no end-of-turn token.

    Bad lines (rows of a Parquet, Arrow, CSV or JSON-array file, a saved dataset or a hub id) are
    skipped and listed in the report by kind with 1-based line (row) numbers; with ``strict=True``
    any bad line raises ``DataError`` (nothing is written). Raises ``FileNotFoundError`` for a
    missing local file, ``DataError`` for a file its suffix says is Parquet (Arrow, CSV) that
    datasets cannot read, ``ValueError`` for a tokenizer without a chat template or a
    ``test_fraction`` outside [0, 1].
    """
    require_chat_template(tokenizer)
    split_of("", test_fraction)  # validate early
    unit, records = _records(input_path)
    pairs, problems, n_read = convert_records(records)
    if strict and problems:
        raise DataError(f"{input_path}: {len(problems)} bad {unit}(s): {format_problems(problems, unit=unit)}")
    if not pairs:
        why = (f": {len(problems)} bad {unit}(s): {format_problems(problems, max_lines=10, unit=unit)}"
               if problems else "")
        raise DataError(f"{input_path}: no valid pair in {n_read} record(s){why}")

    by_split: dict[str, list[Pair]] = {s: [] for s in SPLITS}
    for _, pair in pairs:
        by_split[split_of(pair.prompt_key, test_fraction)].append(pair)

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    files = []
    for split in SPLITS:
        for kind, rows in _split_rows(tokenizer, by_split[split]).items():
            name = f"{split}_{kind}.jsonl"
            counts.setdefault(kind, {})[split] = write_jsonl(out / name, rows)
            files.append(name)

    grouped = group_problems(problems)
    report = {
        "dataset": "hh-rlhf",
        "source": str(input_path),
        "output_dir": str(out),
        "test_fraction": test_fraction,
        "lines_read": n_read,
        "pairs_written": counts["pairs"],
        "prompts_written": counts["prompts"],
        "comparison_lines_written": counts["comparisons"],
        "kto_rows_written": counts["kto"],
        "problems_total": len(problems),
        "problems": {k: {"count": len(grouped.get(k, [])), "lines": grouped.get(k, [])} for k in PROBLEM_KINDS},
        "problem_details": [{"line": p.line, "kind": p.kind, "detail": p.detail} for p in problems],
        "files": files + ["report.json"],
    }
    assert n_read == len(pairs) + len(problems)  # nothing silently dropped
    write_text_atomic(out / "report.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return report


def summarize_report(report: dict) -> str:
    """A short human summary of a ``prepare_hh`` report."""
    pw = report["pairs_written"]
    lines = [
        f"read {report['lines_read']} lines from {report['source']}",
        f"pairs: train {pw['train']}, test {pw['test']}; unique prompts: "
        f"train {report['prompts_written']['train']}, test {report['prompts_written']['test']}",
    ]
    bad = {k: v for k, v in report["problems"].items() if v["count"]}
    if bad:
        lines.append(f"skipped {report['problems_total']} bad line(s):")
        for kind, v in bad.items():
            shown = ", ".join(map(str, v["lines"][:20])) + (" ..." if v["count"] > 20 else "")
            lines.append(f"  {kind}: {v['count']} (lines {shown})")
    else:
        lines.append("no bad lines")
    lines.append(f"wrote {len(report['files'])} files to {report['output_dir']}")
    return "\n".join(lines)


def run_prepare_data(args) -> dict:
    """CLI entry: ``args`` has ``dataset`` ("hh-rlhf"), ``input``, ``output_dir``,
    ``test_fraction``, ``strict`` and ``tokenizer`` (directory/hub name, or a loaded tokenizer).

    Prints a short summary and returns the report. Raises ``ValueError`` for an unknown dataset.
    """
    dataset = str(getattr(args, "dataset", "hh-rlhf") or "hh-rlhf").lower().replace("_", "-")
    if dataset not in ("hh-rlhf", "anthropic/hh-rlhf"):
        raise ValueError(f"unknown dataset {args.dataset!r}; supported: 'hh-rlhf'")
    if not getattr(args, "input", None):
        raise ValueError("prepare-data needs an input file or hub id (e.g. Anthropic/hh-rlhf)")
    tokenizer = args.tokenizer
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    test_fraction = getattr(args, "test_fraction", None)
    report = prepare_hh(
        args.input,
        args.output_dir,
        tokenizer,
        test_fraction=0.1 if test_fraction is None else float(test_fraction),
        strict=bool(getattr(args, "strict", False)),
    )
    print(summarize_report(report))
    return report
