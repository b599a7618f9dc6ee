"""`turborlhf plan` against the measured peak RSS of real runs (the table in docs/memory.md).

Each run is a training command in a child process that prints its peak RSS (``ru_maxrss``) at
the end; the plan is computed for the same config and overrides (``--from-data``: the run's own
heaviest micro-batch). Loads the real model; run one at a time with nothing else running (each
is a few minutes at 2 threads):

    OMP_NUM_THREADS=2 TURBORLHF_THREADS=2 \\
        python benchmarks/plan_vs_measured.py --run sft --data runs/hh_data --sft runs/demo/sft \\
        --rm runs/demo/rm --out runs/plan_vs_measured

`--run` names: sft rm dpo ppo (stock data) and sft_long rm_long dpo_long ppo_long (only pairs of
≥ 400 tokens / prompts of ≥ 260 tokens, written by `--make-long`, so every sequence is cut to
max_len: the worst case the default plan assumes). Results are appended to <out>/results.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CFG = REPO / "configs" / "hh_smollm2"
COMMON = ["train.max_steps=3", "log.tensorboard=false"]


def runs(data: Path, sft: str, rm: str) -> dict[str, tuple[str, list[str]]]:
    pairs, long_pairs = data / "train_pairs.jsonl", data / "long_pairs.jsonl"
    prompts, long_prompts = data / "train_prompts.jsonl", data / "long_prompts.jsonl"
    out = {}
    for suffix, p, q in (("", pairs, prompts), ("_long", long_pairs, long_prompts)):
        # every run on the CPU: the measurement is the host's peak RSS, on a GPU host too
        out["sft" + suffix] = ("sft", [f"--config={CFG / 'sft.yaml'}", f"data.train_file={p}", "data.test_file=null",
                                       "model.device=cpu"])
        out["rm" + suffix] = ("rm", [f"--config={CFG / 'rm.yaml'}", f"model.name_or_path={sft}", f"data.train_file={p}",
                                     "data.test_file=null", "train.eval_every=0", "model.device=cpu"])
        out["dpo" + suffix] = ("dpo", [f"--config={CFG / 'dpo.yaml'}", f"data.train_file={p}", "data.test_file=null",
                                       "data.max_samples=24", "train.save_every=0", "model.device=cpu"])
        out["ppo" + suffix] = ("ppo", [f"--config={CFG / 'ppo.yaml'}", f"actor.name_or_path={sft}", f"reference={sft}",
                                       f"reward_model={rm}", f"data.prompts_file={q}", "distributed.device=cpu"]
                               + (["rollout.min_new_tokens=48"] if suffix else []))
    return out


def make_long(data: Path) -> None:
    """long_pairs.jsonl (both responses with their prompt ≥ 400 SmolLM2 tokens) and
    long_prompts.jsonl (prompts ≥ 260 tokens) from the prepared HH files."""
    sys.path.insert(0, str(REPO / "src"))
    from turborlhf.data.loaders import load_pairs, load_prompts
    from turborlhf.data.tokenize import encode_prompt, encode_prompt_response
    from turborlhf.models.load import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    n = lambda p, r: len(encode_prompt_response(tok, p, r, 10 ** 6)["input_ids"])
    pairs = [p for p in load_pairs(data / "train_pairs.jsonl", tok)
             if min(n(p["prompt"], p["chosen"]), n(p["prompt"], p["rejected"])) >= 400]
    with open(data / "long_pairs.jsonl", "w") as f:
        for p in pairs:
            f.write(json.dumps({k: p[k] for k in ("prompt", "chosen", "rejected")}) + "\n")
    prompts = [p for p in load_prompts(data / "train_prompts.jsonl", tok) if len(encode_prompt(tok, p, 10 ** 6)) >= 260]
    with open(data / "long_prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"{len(pairs)} long pairs, {len(prompts)} long prompts", flush=True)


def measure(command: str, args: list[str], out_dir: Path) -> dict:
    code = ("import resource, sys; from turborlhf.cli import main; rc = main(sys.argv[1:]); "
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", code, command, *args, *COMMON, f"output_dir={out_dir}"],
                       capture_output=True, text=True, env=env, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    peak = int(next(l for l in p.stdout.splitlines() if l.startswith("PEAK")).split()[1])
    return {"measured": peak, "seconds": round(time.time() - t0, 1)}


def plan(command: str, args: list[str]) -> dict:
    sys.path.insert(0, str(REPO / "src"))
    from turborlhf import config as C
    from turborlhf.cli import TRAIN_COMMANDS, _split_overrides
    from turborlhf.plan import plan_config

    cfg_path = next(a.split("=", 1)[1] for a in args if a.startswith("--config="))
    over = _split_overrides([a for a in args if not a.startswith("--config=")] + COMMON)
    cls = getattr(C, TRAIN_COMMANDS[command][2])
    out = {}
    for from_data in (False, True):
        dev = plan_config(command, C.load_config(cls, cfg_path, over), from_data=from_data)[0].devices[0]
        out["plan_from_data" if from_data else "plan_max_len"] = dev.peak
        out["phase_from_data" if from_data else "phase_max_len"] = dev.peak_phase
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", nargs="+", default=[], help="runs to measure (sft, rm_long, ...)")
    p.add_argument("--data", type=Path, required=True, help="prepared HH directory (turborlhf prepare-data)")
    p.add_argument("--sft", default="runs/demo/sft", help="an SFT model directory (RM and PPO start from it)")
    p.add_argument("--rm", default="runs/demo/rm", help="a reward model directory (PPO)")
    p.add_argument("--out", type=Path, default=Path("runs/plan_vs_measured"))
    p.add_argument("--make-long", action="store_true", help="write the long-sequence data files first")
    a = p.parse_args()
    if a.make_long:
        make_long(a.data)
    table = runs(a.data, a.sft, a.rm)
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.run:
        command, args = table[name]
        row = {"run": name, **plan(command, args), **measure(command, args, a.out / name)}
        row["ratio_from_data"] = round(row["plan_from_data"] / row["measured"], 3)
        row["ratio_max_len"] = round(row["plan_max_len"] / row["measured"], 3)
        print(json.dumps(row), flush=True)
        with open(a.out / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
