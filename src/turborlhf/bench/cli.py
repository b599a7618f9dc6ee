"""`turborlhf bench <ppo|dpo|rm|grpo|generate> --vs trl [--json]`: our command and the peer's on the
same settings, in one run, alternating (ours, peer, peer, ours, ...) as separate child processes,
`--reps` times; each child runs `--warmup` untimed steps then `--steps` timed ones.

Prints the Markdown table and, with ``--json``, the result object as the LAST stdout line
(`turborlhf.bench.report` lists its keys); progress goes to stderr. Everything a run writes goes
under ``--out`` (default ``runs/bench/<command>``): ``data/`` (the inputs both sides read),
``configs/`` (our resolved configs), ``logs/`` (each child's stdout/stderr), ``result.json``.

The peer is installed on first use into ``~/.cache/turborlhf/peers/`` (`turborlhf.bench.peers`);
if it cannot be installed or fails, its fields are null and ``peer_error`` says why. The exit
code is 0 when our side produced numbers, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import yaml

from turborlhf.bench import report as R
from turborlhf.bench.data import fits_untruncated, write_bench_data, write_fresh_reward_model
from turborlhf.bench.measure import GIB, ChildResult, run_child
from turborlhf.bench.peers import PeerUnavailable, ensure_package
from turborlhf.bench.workloads import (WORKLOADS, RunContext, SideRun, Workload, data_needed, describe, our_command,
                                       our_config, parse_bench_result, parse_metrics_jsonl, parse_reference_pass,
                                       peer_args, repo_root, samples_per_step)

__all__ = ["main", "build_parser"]

POLL_S = 0.5   # RSS sampling interval: walking the process table costs the harness ~1% of a core at this rate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="turborlhf bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Side-by-side speed and peak memory of turborlhf and a peer on this machine.",
        epilog="Run it alone on the machine (it times things); e.g. a quick check of a few minutes:\n"
               "  turborlhf bench rm --vs trl --warmup 1 --steps 2 --reps 1 --json\n"
               "Settings shared by both sides: configs/bench/<command>.yaml; peer scripts: benchmarks/peers/.")
    p.add_argument("command", choices=list(WORKLOADS), help="what to compare")
    p.add_argument("--vs", default="trl", choices=["trl", "hf", "none"],
                   help="the peer: TRL for ppo/dpo/rm/grpo, HF generate for generate (trl and hf both mean it "
                        "there); none = our side only")
    p.add_argument("--json", action="store_true", help="print the result object as the last stdout line")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps (generate: calls per batch size) per child; 2 because on both sides the "
                        "first two training steps still grow the heap and allocate optimizer states")
    p.add_argument("--steps", type=int, default=3, help="timed steps (generate: calls per batch size) per child")
    p.add_argument("--reps", type=int, default=2, help="children per side, alternating ours/peer")
    p.add_argument("--threads", type=int, default=0, help="torch threads of every child (0 = $TURBORLHF_THREADS, else 2)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="HF directory or zoo name (both sides)")
    p.add_argument("--hh-data", default=None, help="raw HH-RLHF .jsonl(.gz) (default: the repo's data/hh-rlhf sample)")
    p.add_argument("--out", default=None, help="run directory (default runs/bench/<command>)")
    p.add_argument("--batch-sizes", default="1,8,32", help="generate: batch sizes")
    p.add_argument("--seed", type=int, default=0, help="seed of repetition 1 (repetition r uses seed + r - 1)")
    p.add_argument("--no-force-length", action="store_true",
                   help="ppo/grpo: let EOS end responses early (default: exactly max_new_tokens on both sides)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="ppo/grpo: response tokens per sample (default: the bench config's rollout.max_new_tokens); "
                        "generate: new tokens per call (default 64)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="both sides recompute activations (TRL's default); default off on both, as turborlhf's")
    p.add_argument("--peer-dir", default=None, help="use this folder (put first on the peer's PYTHONPATH) "
                                                    "instead of installing the peer")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="both sides' precision; auto = this host's best (bf16 only where the CPU computes it "
                        "natively, else fp32: README, Hardware)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a child is killed")
    p.add_argument("--keep-runs", action="store_true", help="keep our runs' output directories (models, checkpoints)")
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _child_env(threads: int, pythonpath: list[str]) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TURBORLHF_THREADS"):
        env[k] = str(threads)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               WANDB_DISABLED="true")
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    return env


class Side:
    """One side's accumulated results over the repetitions."""

    def __init__(self, name: str, threads: int):
        self.name, self.threads = name, threads
        self.runs: list[SideRun] = []
        self.children: list[ChildResult] = []
        self.child_info: list[dict] = []
        self.error: Optional[str] = None

    def fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
        _log(f"[bench] {self.name}: {why}")

    @property
    def peak_rss_gib(self) -> Optional[float]:
        ok = [c.peak_rss_bytes for c in self.children if c.ok]
        return max(ok) / GIB if ok else None


def _run_side(side: Side, tag: str, cmd: list[str], env: dict, logs: Path, timeout: float, cwd: Path) -> Optional[ChildResult]:
    _log(f"[bench] {tag}: {' '.join(cmd[:4])} ... (log {logs / (tag + '.out')})")
    res = run_child(cmd, logs / f"{tag}.out", logs / f"{tag}.err", env=env, cwd=cwd, timeout_s=timeout, poll_s=POLL_S,
                    on_line=lambda line: line.startswith("[") and _log(f"    {tag} {line[:160]}"))
    _log(f"[bench] {tag}: exit {res.returncode} in {res.wall_s:.0f} s, peak RSS {res.peak_rss_gib:.2f} GiB, "
         f"CPU share {res.cpu_share(side.threads):.2f}, load {res.loadavg_start:.1f} → {res.loadavg_end:.1f}"
         + (" (TIMED OUT)" if res.timed_out else ""))
    side.child_info.append({"tag": tag, "started": round(time.time() - res.wall_s, 1), "exit": res.returncode,
                            "wall_s": round(res.wall_s, 1), "peak_rss_gib": round(res.peak_rss_gib, 3), "cpu_share": round(res.cpu_share(side.threads), 3),
                            "loadavg_start": round(res.loadavg_start, 2), "loadavg_end": round(res.loadavg_end, 2)})
    if not res.ok:
        why = "timed out" if res.timed_out else f"exit code {res.returncode}"
        side.fail(f"{tag} failed ({why}); last stderr lines:\n{res.stderr_tail()}")
        return None
    side.children.append(res)
    return res


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")   # run_child then kills the running child's process group


def main(argv: Optional[list[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _main(a)
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return _main(a)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(a: argparse.Namespace) -> int:
    w: Workload = WORKLOADS[a.command]
    repo = repo_root()
    for sub in ("benchmarks/peers", "configs/bench"):
        if not (repo / sub).is_dir():
            print(f"error: {repo / sub} not found: `turborlhf bench` runs from a source checkout "
                  "(git clone; pip install -e .)", file=sys.stderr)
            return 2
    if a.warmup < 0 or a.steps < 1 or a.reps < 1:
        print("error: need --warmup >= 0, --steps >= 1, --reps >= 1", file=sys.stderr)
        return 2
    threads = a.threads or int(os.environ.get("TURBORLHF_THREADS", "0") or 0) or 2
    out = Path(a.out or f"runs/bench/{a.command}").resolve()
    logs, cfg_dir = out / "logs", out / "configs"
    logs.mkdir(parents=True, exist_ok=True)
    cfg_dir.mkdir(parents=True, exist_ok=True)
    hh = Path(a.hh_data) if a.hh_data else repo / "data" / "hh-rlhf" / "harmless-base-1800.jsonl.gz"

    from turborlhf.models.zoo import resolve_model_path

    model_dir = resolve_model_path(a.model)
    try:
        batch_sizes = tuple(int(x) for x in a.batch_sizes.split(","))
        if min(batch_sizes) < 1 or a.threads < 0:
            raise ValueError
    except ValueError:
        print(f"error: --batch-sizes must be comma-separated integers ≥ 1 (got {a.batch_sizes!r}) and "
              f"--threads ≥ 0 (got {a.threads})", file=sys.stderr)
        return 2
    from turborlhf.engine.hardware import choose_precision

    # both sides run on the CPU, GPU host or not (the peer scripts pass TRL `use_cpu`, and our
    # configs pin the CPU): the precision is the CPU's, and the timings, RSS and roofline are its
    precision = choose_precision(a.dtype, "cpu")
    _log(f"[bench] precision of both sides: {precision.dtype} ({precision.reason})")
    ctx = RunContext(repo=repo, model_dir=model_dir, data={}, threads=threads, warmup=a.warmup, steps=a.steps,
                     force_length=not a.no_force_length, gradient_checkpointing=a.gradient_checkpointing,
                     batch_sizes=batch_sizes, dtype=precision.dtype, response_tokens=a.new_tokens,
                     # our rollout engine as users get it: with --dtype auto it may compute in fp32 on bf16
                     # weights where that measures faster (`rollout.dtype: auto`); never below the precision
                     rollout_dtype="auto" if a.dtype == "auto" else precision.dtype)
    if a.new_tokens is not None:
        if a.new_tokens < 1:
            raise SystemExit("error: --new-tokens must be at least 1")
        if w.command == "generate":
            ctx.new_tokens = a.new_tokens
    base_cfg = yaml.safe_load((repo / w.config).read_text()) if w.config else None
    n_pairs, n_prompts = data_needed(w, base_cfg, ctx)
    max_len = ((base_cfg or {}).get("data") or {}).get("max_len")
    fits = None
    if n_pairs and max_len:                 # pairs neither side truncates nor drops (`fits_untruncated`)
        from turborlhf.models.load import load_tokenizer

        fits = fits_untruncated(load_tokenizer(str(model_dir)), int(max_len))
    ctx.data = write_bench_data(hh, out / "data", n_pairs, n_prompts, fits)
    if base_cfg and "reward_model" in base_cfg:
        ctx.reward_model_dir = str(write_fresh_reward_model(model_dir, out / "data" / "reward_model"))

    ours, peer = Side("turborlhf", threads), Side(w.peer_name, threads)
    src_dir = str(Path(__file__).resolve().parents[2])
    ours_env = _child_env(threads, [src_dir])
    peer_env, peer_info = None, {}
    if a.vs == "none":
        peer.error = "not requested (--vs none)"
    elif w.trl_version is None:
        peer_env = _child_env(threads, [src_dir])       # HF generate: transformers from our environment
    elif a.peer_dir:
        peer_env, peer_info = _child_env(threads, [str(Path(a.peer_dir).resolve())]), {"folder": a.peer_dir}
    else:
        try:
            inst = ensure_package("trl", w.trl_version, log=_log)
            peer_env = _child_env(threads, [str(inst.path)])
            peer_info = {"folder": str(inst.path), "installed": inst.installed, "shadowed": inst.shadowed}
        except PeerUnavailable as e:
            peer.error = f"{w.peer_name} could not be installed: {e}"
            _log(f"[bench] {peer.error}")

    hw_runs: list[dict] = []
    load_start = os.getloadavg()
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        _log(f"[bench] warning: load average {load_start[0]:.1f} on {os.cpu_count()} CPUs before the first child: "
             "other processes are running, so timings will be slower and noisier (see each child's CPU share)")
    t_start = time.time()
    for rep in range(a.reps):
        seed = a.seed + rep
        if w.command == "generate":
            _hw_peak(repo, ctx, ours_env, logs, rep, a.timeout, hw_runs)
        order = ("ours", "peer") if rep % 2 == 0 else ("peer", "ours")
        for which in order:
            side = ours if which == "ours" else peer
            if side.error is not None:
                continue
            tag = f"{which}-{rep + 1}"
            run_dir = out / "runs" / tag
            shutil.rmtree(run_dir, ignore_errors=True)   # a kept earlier run's DPO reference cache skipped a pass
            if which == "ours":
                cfg_path = None
                if w.trainer:
                    cfg = our_config(w, ctx, run_dir, seed)
                    cfg_path = cfg_dir / f"{tag}.yaml"
                    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
                cmd, env = our_command(w, ctx, cfg_path, seed), ours_env
            else:
                cfg = our_config(w, ctx, run_dir, seed) if w.trainer else None
                cmd = [sys.executable, str(repo / w.peer_script), *peer_args(w, cfg, ctx, run_dir, seed)]
                env = peer_env
            res = _run_side(side, tag, cmd, env, logs, a.timeout, out)
            if res is not None:
                _parse_child(w, side, which, res, run_dir, ctx)
            if not a.keep_runs:
                shutil.rmtree(run_dir, ignore_errors=True)

    result = _result(w, ctx, a, ours, peer, hw_runs, peer_info, load_start, t_start)
    result["precision"] = {"ours": ctx.dtype, "peer": ctx.dtype, "reason": precision.reason,
                           "ours_rollout": _first_extra(ours, "rollout_dtype"),
                           "ours_weights": _first_extra(ours, "weight_dtype"),
                           "ours_optimizer_state": _first_extra(ours, "state_dtype")}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(R.format_table(result), flush=True)
    if a.json:
        print(json.dumps(result), flush=True)
    return 0 if ours.error is None and ours.runs else 1


def _hw_peak(repo: Path, ctx: RunContext, env: dict, logs: Path, rep: int, timeout: float, hw_runs: list) -> None:
    tag = f"hw-{rep + 1}"
    # the bf16 peak only where the run is in bf16: emulated bf16 would take many minutes to measure
    dtypes = "bf16,fp32" if ctx.dtype == "bf16" else "fp32"
    res = run_child([sys.executable, str(repo / "benchmarks" / "hw_peak.py"), "--threads", str(ctx.threads),
                     "--dtypes", dtypes],
                    logs / f"{tag}.out", logs / f"{tag}.err", env=env, timeout_s=timeout)
    try:
        if not res.ok:
            raise ValueError(f"exit {res.returncode}: {res.stderr_tail(5)}")
        hw_runs.append(parse_bench_result(res.stdout()))
        h = hw_runs[-1]
        _log(f"[bench] {tag}: {h.get('bf16_gflops') or float('nan'):.0f} GFLOP/s bf16, "
             f"{h.get('fp32_gflops') or float('nan'):.0f} fp32, "
             f"{h['read_gb_s']:.1f} GB/s read")
    except ValueError as e:
        _log(f"[bench] {tag}: no hardware figures ({e}); the roofline will be missing")


def _first_extra(side: Side, key: str) -> Optional[str]:
    """`key` of the side's first run that records it (our engine's rollout and weight dtypes,
    optimizer state), or None."""
    return next((run.extra[key] for run in side.runs if run.extra.get(key)), None)


def _parse_child(w: Workload, side: Side, which: str, res: ChildResult, run_dir: Path, ctx: RunContext) -> None:
    try:
        if which == "ours" and w.trainer:
            run = parse_metrics_jsonl((run_dir / "metrics.jsonl").read_text())
            hw = run_dir / "hardware.json"         # the rollout engine's dtype, as `rollout.dtype: auto` chose it
            if hw.exists():
                choices = json.loads(hw.read_text()).get("choices", {})
                for key, extra in (("rollout.dtype", "rollout_dtype"), ("rollout.weight_dtype", "weight_dtype"),
                                   ("optim.state_dtype", "state_dtype")):
                    if (choices.get(key) or {}).get("value"):
                        run.extra[extra] = choices[key]["value"]
            ref = parse_reference_pass(res.stdout()) if w.command == "dpo" else None
            if ref is not None:
                run.extra["reference_pass"] = {"sequences": ref[0], "seconds": ref[1]}
        else:
            obj = parse_bench_result(res.stdout())
            run = SideRun([float(x) for x in obj.pop("step_times", [])], obj)
            if which == "ours" and w.command == "generate" and obj.get("dtype"):
                run.extra["rollout_dtype"] = obj["dtype"]
    except (OSError, ValueError) as e:
        side.fail(f"could not read the timings of {res.stdout_path.name}: {e}")
        return
    if w.command != "generate" and len(run.step_times) < ctx.total_steps:
        side.fail(f"{res.stdout_path.name}: {len(run.step_times)} steps reported, {ctx.total_steps} expected")
        return
    side.runs.append(run)


def _mean_dicts(ds: list[dict]) -> dict:
    keys = sorted({k for d in ds for k in d})
    return {k: R.summarize([d[k] for d in ds if isinstance(d.get(k), (int, float))])["mean"]
            for k in keys if any(isinstance(d.get(k), (int, float)) for d in ds)}


def _side_steps(side: Side, warmup: int) -> tuple[list[float], dict]:
    steps, phases, lens = [], [], []
    for run in side.runs:
        steps += run.step_times[warmup:]
        phases += (run.extra.get("phases") or [])[warmup:]
        lens += [x for x in (run.extra.get("response_length") or [])[warmup:] if x is not None]
    extra = {}
    if phases:
        extra["phases_s_per_step"] = _mean_dicts(phases)
    if lens:
        extra["response_length_mean"] = sum(lens) / len(lens)
    versions = [r.extra.get("versions") for r in side.runs if r.extra.get("versions")]
    if versions:
        extra["versions"] = versions[0]
    return steps, extra


def _result(w: Workload, ctx: RunContext, a, ours: Side, peer: Side, hw_runs: list, peer_info: dict,
            load_start, t_start: float) -> dict:
    from turborlhf import __version__
    from turborlhf.engine.hardware import host_summary

    r: dict = {"command": w.command, "peer": w.peer_name, "description": describe(w, ctx), "reps": a.reps,
               "warmup": ctx.warmup, "steps": ctx.steps, "threads": ctx.threads, "model": ctx.model_dir,
               "date": time.strftime("%Y-%m-%d %H:%M"), "wall_s": round(time.time() - t_start, 1),
               "force_length": ctx.force_length, "gradient_checkpointing": ctx.gradient_checkpointing,
               "response_tokens": ctx.response_tokens, "turborlhf_version": __version__, "peer_install": peer_info,
               "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                           **host_summary()},
               "ours_peak_rss_gib": ours.peak_rss_gib, "peer_peak_rss_gib": peer.peak_rss_gib,
               "rss_ratio": R.ratio(ours.peak_rss_gib, peer.peak_rss_gib),
               "targets": dict(w.targets), "target_met": {}, "sample_unit": w.sample_unit}
    if w.command == "generate":
        _generate_result(r, ctx, ours, peer, hw_runs)
    else:
        cfg = yaml.safe_load((ctx.repo / w.config).read_text())
        n = samples_per_step(w, cfg)
        o_steps, o_extra = _side_steps(ours, ctx.warmup) if ours.error is None else ([], {})
        p_steps, p_extra = _side_steps(peer, ctx.warmup) if peer.error is None else ([], {})
        o_stats, p_stats = R.summarize(o_steps), R.summarize(p_steps)
        o_s = o_stats["median"] if o_stats else None
        refs = [run.extra["reference_pass"] for run in ours.runs if "reference_pass" in run.extra]
        if refs and o_s is not None:   # DPO: the one-off reference pass, amortised per step
            per_step = [x["seconds"] / (x["sequences"] / 2) * n for x in refs]
            r["ours_train_s_per_step"] = o_s
            r["ours_reference_s_per_step"] = sum(per_step) / len(per_step)
            o_s = o_s + r["ours_reference_s_per_step"]
        p_s = p_stats["median"] if p_stats else None
        r.update({"samples_per_step": n, "ours_s_per_step": o_s, "peer_s_per_step": p_s,
                  "speedup": R.ratio(p_s, o_s),
                  "ours_samples_per_s": R.ratio(float(n), o_s), "peer_samples_per_s": R.ratio(float(n), p_s),
                  "ours_steps": o_stats, "peer_steps": p_stats, "ours_step_times": o_steps,
                  "peer_step_times": p_steps, "ours_extra": o_extra, "peer_extra": p_extra})
        for name, t in w.targets.items():
            r["target_met"][name] = R.check_target(r.get(name), t)
    r["ours_error"], r["peer_error"] = ours.error, peer.error
    r["children"] = sorted(ours.child_info + peer.child_info, key=lambda c: c["started"])
    return r


def _generate_result(r: dict, ctx: RunContext, ours: Side, peer: Side, hw_runs: list) -> None:
    r["batch_sizes"] = list(ctx.batch_sizes)

    def per_bs(side: Side, key: str) -> dict:
        out = {}
        for b in ctx.batch_sizes:
            xs = [x for run in side.runs for x in (run.extra.get(key) or {}).get(str(b), [])]
            s = R.summarize(xs) if side.error is None else None
            out[str(b)] = s["median"] if s else None
        return out

    r["tokens_per_s"], r["peer_tokens_per_s"] = per_bs(ours, "tokens_per_s"), per_bs(peer, "tokens_per_s")
    r["ours_s_per_step"], r["peer_s_per_step"] = per_bs(ours, "s_per_call"), per_bs(peer, "s_per_call")
    r["speedup"] = {k: R.ratio(r["tokens_per_s"][k], r["peer_tokens_per_s"][k]) for k in r["tokens_per_s"]}
    n_params = next((run.extra.get("n_params") for run in ours.runs if run.extra.get("n_params")), None)
    r["hardware"] = None
    r["roofline_tokens_per_s"] = {str(b): None for b in ctx.batch_sizes}
    if hw_runs and n_params:
        key = "bf16_gflops" if ctx.dtype == "bf16" else "fp32_gflops"      # the peak of the precision run
        gflops = max(h.get(key) or h.get("bf16_gflops") or 0.0 for h in hw_runs)
        bw = max(h["read_gb_s"] for h in hw_runs)
        # bytes per weight a decode step reads: our engine's storage (bf16 weights with fp32
        # arithmetic where it chose so: the bound both sides are measured against is then the lower)
        wdt = next((run.extra.get("weight_dtype") for run in ours.runs if run.extra.get("weight_dtype")), ctx.dtype)
        flops_tok, wbytes = 2.0 * n_params, (2.0 if "bf16" in (ctx.dtype, wdt) else 4.0) * n_params
        bf16 = [h["bf16_gflops"] for h in hw_runs if h.get("bf16_gflops")]
        r["hardware"] = {"bf16_gflops": max(bf16) if bf16 else None, "matmul_gflops": gflops,
                         "dtype": ctx.dtype, "weight_dtype": wdt, "read_gb_s": bw, "n_params": n_params,
                         "gflop_per_token": flops_tok / 1e9, "weight_mb": wbytes / 1e6}
        if all(h.get("fp32_gflops") for h in hw_runs):
            r["hardware"]["fp32_gflops"] = max(h["fp32_gflops"] for h in hw_runs)
        r["roofline_tokens_per_s"] = {str(b): R.roofline_tokens_per_s(b, gflops, bw, flops_tok, wbytes)
                                      for b in ctx.batch_sizes}
    r["roofline_fraction"] = {k: R.ratio(r["tokens_per_s"][k], r["roofline_tokens_per_s"][k]) for k in r["tokens_per_s"]}
    r["peer_roofline_fraction"] = {k: R.ratio(r["peer_tokens_per_s"][k], r["roofline_tokens_per_s"][k])
                                   for k in r["tokens_per_s"]}
    engine = next((run.extra.get("engine") for run in ours.runs if run.extra.get("engine")), None)
    r["ours_extra"] = {"engine": engine, "weight_dtype": next(
        (run.extra.get("weight_dtype") for run in ours.runs if run.extra.get("weight_dtype")), None)}
    for name, t in r["targets"].items():
        k = name.split("@")[1]
        r["target_met"][name] = R.check_target(r["tokens_per_s"].get(k), t)
