"""The benchmark's inputs, written once per run and read by both sides (standard library only).

From the HH-RLHF harmless-base sample (``data/hh-rlhf/harmless-base-1800.jsonl.gz``), in file
order, as shared/peers/hh_data.py selected them:

- ``pairs.jsonl``: ``{"prompt", "chosen", "rejected"}`` as plain text: the prompt is the common
  prefix of the two dialogues up to and including the last ``"\\n\\nAssistant:"``; lines whose
  rejected dialogue does not start with that prefix are skipped. `turborlhf dpo`/`rm` use a string
  prompt verbatim and TRL gets the same strings, so both tokenise the same text.
- ``prompts.jsonl``: ``{"prompt": [{"role": "user", "content": <first human turn>}]}``, distinct
  first turns only; both sides render them with the model's chat template.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Callable, Optional

__all__ = ["iter_hh_pairs", "load_hh_pairs", "fits_untruncated", "first_user_turn", "write_bench_data",
           "write_fresh_reward_model"]

ASSISTANT = "\n\nAssistant:"
HUMAN = "\n\nHuman: "


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if str(path).endswith(".gz") else open(path, encoding="utf-8")


def iter_hh_pairs(path: str | Path):
    """Yield the usable raw HH lines of `path` in file order as ``{"prompt", "chosen", "rejected"}``.

    Raises ValueError (naming the line) for a line that is not JSON or lacks ``chosen``/``rejected``.
    """
    with _open(Path(path)) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
                c, r = ex["chosen"], ex["rejected"]
                k = c.rfind(ASSISTANT)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{lineno}: not an HH line with 'chosen' and 'rejected': {e}") from None
            if k < 0:
                continue
            k += len(ASSISTANT)
            prompt = c[:k]
            if not isinstance(r, str) or not r.startswith(prompt) or not c[k:].strip() or not r[k:].strip():
                continue
            yield {"prompt": prompt, "chosen": c[k:], "rejected": r[k:]}


def load_hh_pairs(path: str | Path, n: int, fits: Optional[Callable[[dict], bool]] = None) -> list[dict]:
    """The first `n` usable pairs of `path` (see `iter_hh_pairs`) for which `fits` (if given) holds.

    Raises ValueError for a malformed line (naming it) or if the file has fewer than `n` such pairs.
    """
    rows: list[dict] = []
    for r in iter_hh_pairs(path) if n > 0 else ():
        if fits is not None and not fits(r):
            continue
        rows.append(r)
        if len(rows) >= n:
            break
    if len(rows) < n:
        raise ValueError(f"{path}: only {len(rows)} usable pairs, {n} needed")
    return rows


def fits_untruncated(tokenizer, max_len: int, margin: int = 4) -> Callable[[dict], bool]:
    """A `load_hh_pairs` filter: both ``prompt + chosen`` and ``prompt + rejected`` within `max_len`
    tokens (less `margin` for special tokens). The peers treat longer pairs differently (TRL's
    RewardTrainer drops them, `turborlhf rm` cuts the prompt from the left), so the benchmark's
    pairs are ones neither side shortens: both train on the same tokens."""
    def fits(r: dict) -> bool:
        return all(len(tokenizer(r["prompt"] + r[k], add_special_tokens=False)["input_ids"]) + margin <= max_len
                   for k in ("chosen", "rejected"))
    return fits


def first_user_turn(prompt: str) -> str:
    """The first human turn of an HH prompt (``"\\n\\nHuman: X\\n\\nAssistant: ..."`` → ``"X"``).

    Raises ValueError if the text has no ``"\\n\\nHuman: "`` turn.
    """
    if HUMAN not in prompt:
        raise ValueError(f"not an HH prompt (no {HUMAN!r}): {prompt[:60]!r}")
    return prompt.split(HUMAN, 1)[1].split(ASSISTANT, 1)[0].strip()


def write_bench_data(hh_path: str | Path, out_dir: str | Path, n_pairs: int, n_prompts: int,
                     fits: Optional[Callable[[dict], bool]] = None) -> dict[str, Path]:
    """Write ``pairs.jsonl`` (`n_pairs`, those `fits` accepts: `fits_untruncated`) and
    ``prompts.jsonl`` (`n_prompts` distinct first turns).

    Returns ``{"pairs": path, "prompts": path}``. Raises ValueError if the source has too few.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = load_hh_pairs(hh_path, n_pairs, fits) if n_pairs else []
    prompts: list[str] = []
    seen: set[str] = set()
    for r in iter_hh_pairs(hh_path) if n_prompts > 0 else ():
        turn = first_user_turn(r["prompt"])
        if turn and turn not in seen:
            seen.add(turn)
            prompts.append(turn)
            if len(prompts) >= n_prompts:
                break
    if len(prompts) < n_prompts:
        raise ValueError(f"{hh_path}: only {len(prompts)} distinct first turns, {n_prompts} needed")
    paths = {"pairs": out / "pairs.jsonl", "prompts": out / "prompts.jsonl"}
    paths["pairs"].write_text("".join(json.dumps(r) + "\n" for r in pairs), encoding="utf-8")
    paths["prompts"].write_text("".join(json.dumps({"prompt": [{"role": "user", "content": t}]}) + "\n"
                                        for t in prompts), encoding="utf-8")
    return paths


def write_fresh_reward_model(model_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Save `model_dir` with a freshly initialised scalar head (``*ForSequenceClassification``,
    ``num_labels=1``, torch seed `seed`) and its tokenizer into `out_dir`; returns it. Kept for the
    next run while `model_dir` (its files' sizes and times) and `seed` are the same, rebuilt when
    they differ (a reward model of an earlier ``--model`` would score with another trunk).

    The PPO benchmark's reward model: TRL's script builds the same kind of model from the base
    checkpoint in-process, and `turborlhf ppo` refuses a causal-LM directory as a reward model
    (its scores would come from a random head; `turborlhf.rewards.model.check_reward_model`), so
    our side reads the head from a directory. Both sides score with an untrained head, which costs
    what a trained one costs."""
    import torch

    from turborlhf.models.load import load_scalar_model, load_tokenizer

    import shutil

    out = Path(out_dir)
    src = Path(model_dir).resolve()
    source = {"model": str(src), "seed": seed,
              "files": sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in src.iterdir() if f.is_file())}
    if (out / "config.json").exists() and _read_json(out / SOURCE_FILE) == source:
        return out
    shutil.rmtree(out, ignore_errors=True)      # built from another model (an earlier --model) or unfinished
    tok = load_tokenizer(str(model_dir))
    torch.manual_seed(seed)
    model = load_scalar_model(str(model_dir), tok)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / SOURCE_FILE).write_text(json.dumps(source))
    tmp.rename(out)
    return out


SOURCE_FILE = "bench_source.json"      # which base model (and its files) the head was put on


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
