"""reasoning-gym tasks -> prompt files with the columns their verifier needs.

reasoning-gym (Stojanovski et al. 2025, PyPI ``reasoning-gym``) generates problems procedurally
(``create_dataset(task, size, seed)``), each entry ``{question, answer, metadata}``, and every task
scores an answer with ``score_answer(answer, entry)``. This writes ``<task>_prompts.jsonl``::

    {"prompt": [{"role": "system", "content": <reasoning-gym's default system prompt>},
                {"role": "user", "content": question}],
     "answer": str, "metadata": {..., "source_dataset": task}, "question": str}

``<task>_sft.jsonl`` (the same prompts with ``"response": "<answer>" + answer + "</answer>"``,
for a short cold-start SFT that teaches the answer format: the untrained SmolLM2-135M never wrote
the tag in 192 samples; entries without a reference answer, whose scorer checks an answer against
the metadata, are left out and counted as ``sft_without_answer``; their ``answer`` is null) and ``<task>_report.json``; the ``reasoning_gym_score`` reward
(`turborlhf.rewards.verifiers`) reads ``answer``/``metadata``/``question`` and scores the ``<answer>…</answer>`` of a response.
The same (task, n, seed) always writes the same problems. Metadata goes through JSON (tuples
become lists); an entry whose metadata is not JSON-serialisable raises ``ValueError``.

Needs the ``reasoning-gym`` extra: ``pip install 'turborlhf[reasoning-gym]'``.
"""
from __future__ import annotations

import json
from pathlib import Path

from turborlhf.data.gsm8k import PROBLEM_KINDS, write_report
from turborlhf.data.jsonl import write_jsonl

__all__ = ["prepare_reasoning_gym"]


def prepare_reasoning_gym(task: str, n: int, seed: int, output_dir: str | Path) -> dict:
    """Write `n` problems of reasoning-gym task `task` (seeded) to `output_dir`; return the report.

    Raises:
        ImportError: reasoning-gym is not installed. ValueError: unknown task (the message lists
            them), ``n < 1``, or metadata that JSON cannot hold.
    """
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError as e:
        raise ImportError("prepare-data reasoning-gym needs reasoning-gym: "
                          "pip install 'turborlhf[reasoning-gym]'") from e
    if task not in DATASETS:
        raise ValueError(f"unknown reasoning-gym task {task!r}; known: {', '.join(sorted(DATASETS))}")
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    rows = []
    for i, entry in enumerate(reasoning_gym.create_dataset(task, size=n, seed=seed)):
        try:
            meta = json.loads(json.dumps(entry["metadata"]))
        except TypeError as e:
            raise ValueError(f"reasoning-gym task {task!r}: entry {i} has metadata JSON cannot hold: {e}") from e
        meta.setdefault("source_dataset", task)
        rows.append({"prompt": [{"role": "system", "content": SYSTEM_PROMPTS["default"]},
                                {"role": "user", "content": entry["question"]}],
                     "answer": None if entry["answer"] is None else str(entry["answer"]), "metadata": meta,
                     "question": entry["question"]})
    out = Path(output_dir)
    written = write_jsonl(out / f"{task}_prompts.jsonl", rows)
    # tasks whose entries have no reference answer (graph_color, rush_hour...: the scorer checks
    # an answer against the metadata) give no SFT target, rather than "<answer>None</answer>"
    sft = write_jsonl(out / f"{task}_sft.jsonl", [{"prompt": r["prompt"], "response": f"<answer>{r['answer']}</answer>"}
                                                  for r in rows if r["answer"] is not None])
    report = {"dataset": "reasoning-gym", "source": f"reasoning_gym.create_dataset({task!r}, size={n}, seed={seed})",
              "output_dir": str(out), "task": task, "seed": seed, "lines_read": n, "prompts_written": written,
              "sft_written": sft, "sft_without_answer": written - sft,
              "problems_total": 0, "problems": {k: {"count": 0, "lines": []} for k in PROBLEM_KINDS},
              "files": [f"{task}_prompts.jsonl", f"{task}_sft.jsonl", f"{task}_report.json"]}
    write_report(out, task, report)
    return report
