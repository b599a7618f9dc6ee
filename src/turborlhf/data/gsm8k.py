"""GSM8K -> prompt files for RL with verifiable rewards, and the one prompt format shared by
training (``turborlhf ppo``) and evaluation (``turborlhf eval-math``).

Source format (Cobbe et al. 2021, arXiv:2110.14168; ``data/gsm8k/``): one JSON object per line,
``{"question": str, "answer": str}``, the answer a worked solution whose last line is
``#### <number>`` (sometimes with thousands separators: ``#### 1,080``). The same columns in a
``.parquet``, ``.arrow``, ``.csv`` or ``.json`` file (the hub's ``openai/gsm8k`` ships Parquet) or
a saved dataset directory are read too (`turborlhf.data.sources.open_rows`, numbered by row).

Output: ``<name>_prompts.jsonl`` (``<name>`` = the input file name without its data suffix), one
line per problem::

    {"prompt": [{"role": "user", "content": question + "\\n\\n" + GSM8K_INSTRUCTION}],
     "answer": "1080",            # the final number, separators removed
     "solution": "... #### 1,080", "question": "..."}

The prompt is a message list, so the trainer renders it with the policy's own chat template
(`turborlhf.data.loaders`); ``answer`` (and the rest) reach reward functions as columns, e.g.
``gsm8k_accuracy`` (`turborlhf.rewards.verifiers`).

Also ``<name>_sft.jsonl``, the same prompts with the reference solution as the response, for a
cold-start SFT before RL (DeepSeek-AI 2025, arXiv:2501.12948, section 2.3.1)::

    {"prompt": [...same...], "response": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n...\n#### 72"}

The solution keeps its calculator annotations (``<<48/2=24>>``: the expression, ``=``, its
value), so a policy trained on it calls the calculator (`turborlhf.rollout.tools.Calculator`,
``rollout.tool: calculator``) where the reference solutions did; its last line is
``#### <number>`` without separators: the format `gsm8k_format` rewards. Plus
``<name>_report.json``.

Problems (a line gets one, nothing dropped silently): ``bad_json``, ``missing_key`` (not an
object, or ``question``/``answer`` absent or not strings), ``empty_question``,
``no_final_answer`` (no ``#### <number>`` in the answer). They are skipped and reported with
1-based line numbers; ``strict=True`` makes any of them a `DataError` (nothing written).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from turborlhf.data.chat import Message
from turborlhf.data.errors import DataError, Problem, format_problems, group_problems
from turborlhf.data.jsonl import JsonLineError, read_jsonl, write_jsonl, write_text_atomic
from turborlhf.data.sources import DATASETS_SUFFIXES, open_rows

__all__ = ["GSM8K_INSTRUCTION", "PROBLEM_KINDS", "gsm8k_messages", "convert_gsm8k", "sft_response", "prepare_gsm8k",
           "split_name", "write_report", "summarize"]

GSM8K_INSTRUCTION = ("Solve the problem step by step. Then write the final answer as a number on the last line, "
                     "in the form \"#### <number>\".")
PROBLEM_KINDS = ("bad_json", "missing_key", "empty_question", "no_final_answer")
_FINAL_RE = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def gsm8k_messages(question: str) -> list[Message]:
    """The prompt of one problem: a single user message, the question then `GSM8K_INSTRUCTION`."""
    return [{"role": "user", "content": f"{question.strip()}\n\n{GSM8K_INSTRUCTION}"}]


def convert_gsm8k(obj: Any, line: int = 0) -> dict | Problem:
    """One GSM8K record -> its prompt row (module docstring), or the `Problem` that stops it."""
    if isinstance(obj, JsonLineError):
        return Problem(line, "bad_json", obj.message)
    if not isinstance(obj, dict) or not isinstance(obj.get("question"), str) or not isinstance(obj.get("answer"), str):
        return Problem(line, "missing_key", "need string fields 'question' and 'answer'")
    question, solution = obj["question"], obj["answer"]
    if not question.strip():
        return Problem(line, "empty_question", "question is empty")
    m = _FINAL_RE.search(solution.strip())
    if m is None:
        return Problem(line, "no_final_answer", "answer does not end with '#### <number>'")
    return {"prompt": gsm8k_messages(question), "answer": m.group(1).replace(",", ""), "solution": solution,
            "question": question}


def sft_response(solution: str, answer: str) -> str:
    """A GSM8K reference solution as a training response: calculator annotations kept, the last
    line ``#### <answer>`` (`answer` as `convert_gsm8k` gives it: no separators)."""
    work = _FINAL_RE.sub("", solution.strip()).rstrip()
    return f"{work}\n#### {answer}" if work else f"#### {answer}"


def split_name(path: str | Path) -> str:
    """``data/gsm8k/test-1000.jsonl.gz`` -> ``test-1000`` (``train.parquet`` -> ``train``)."""
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json", *DATASETS_SUFFIXES):
        name = name[: -len(suffix)] if name.endswith(suffix) else name
    return name


def write_report(out: Path, name: str, report: dict) -> None:
    write_text_atomic(out / f"{name}_report.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n")


def prepare_gsm8k(input_path: str | Path, output_dir: str | Path, strict: bool = False) -> dict:
    """Convert a GSM8K ``.jsonl[.gz]`` file (or ``.parquet``, ``.arrow``, ``.csv``, ``.json``, a
    saved dataset directory) into ``<name>_prompts.jsonl`` and ``<name>_report.json`` in
    `output_dir`; return the report (lines read, rows written, problems by kind with lines).

    Raises:
        FileNotFoundError: no input file. DataError: ``strict`` and a bad line, or no usable line;
        a file its suffix says is Parquet (Arrow, CSV) that datasets cannot read.
    """
    rows, problems, n_read = [], [], 0
    unit, records = open_rows(input_path) if Path(input_path).exists() else ("line", read_jsonl(input_path))
    for line, obj in records:
        n_read += 1
        res = convert_gsm8k(obj, line)
        (problems if isinstance(res, Problem) else rows).append(res)
    if problems and (strict or not rows):
        raise DataError(f"{input_path}: {len(problems)} bad {unit}(s): {format_problems(problems, unit=unit)}")
    if not rows:
        raise DataError(f"{input_path}: no records")
    out, name = Path(output_dir), split_name(input_path)
    written = write_jsonl(out / f"{name}_prompts.jsonl", rows)
    write_jsonl(out / f"{name}_sft.jsonl",
                [{"prompt": r["prompt"], "response": sft_response(r["solution"], r["answer"])} for r in rows])
    grouped = group_problems(problems)
    report = {"dataset": "gsm8k", "source": str(input_path), "output_dir": str(out), "lines_read": n_read,
              "prompts_written": written, "problems_total": len(problems),
              "problems": {k: {"count": len(grouped.get(k, [])), "lines": grouped.get(k, [])} for k in PROBLEM_KINDS},
              "problem_details": [{"line": p.line, "kind": p.kind, "detail": p.detail} for p in problems],
              "files": [f"{name}_prompts.jsonl", f"{name}_sft.jsonl", f"{name}_report.json"]}
    assert n_read == written + len(problems)  # nothing silently dropped
    write_report(out, name, report)
    return report


def summarize(report: dict) -> str:
    """A short human summary of a `prepare_gsm8k` (or reasoning-gym) report."""
    lines = [f"read {report['lines_read']} lines from {report['source']}",
             f"prompts written: {report['prompts_written']}"]
    bad = {k: v for k, v in report["problems"].items() if v["count"]}
    if bad:
        lines.append(f"skipped {report['problems_total']} bad line(s):")
        for kind, v in bad.items():
            shown = ", ".join(map(str, v["lines"][:20])) + (" ..." if v["count"] > 20 else "")
            lines.append(f"  {kind}: {v['count']} (lines {shown})")
    else:
        lines.append("no bad lines")
    lines.append(f"wrote {', '.join(report['files'])} to {report['output_dir']}")
    return "\n".join(lines)
