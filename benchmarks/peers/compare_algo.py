#!/usr/bin/env python
"""Compare `turborlhf.algo` numerically with the peers' own implementations (issue 3).

Every comparison feeds the same seeded random tensors (several shapes, right-padded masks with
finite junk in the padding, advantages of both signs, fp64 and fp32 where the values stay O(1-100))
to one of our functions and to the peer's code, and records the largest absolute difference.
Where our default differs from the peer by design, the row also records the difference with
our *default* options, and the table points at the doc that explains it.

Each peer runs in its own child process with only its folder (then our ``src``) on
``PYTHONPATH``, so two versions of one package never meet. The peer's code is called as it is:
module functions directly, ``nn.Module`` losses as they are, and trainer methods unbound with a
small stand-in ``self`` (a ``SimpleNamespace`` carrying the attributes the method reads) and a
stand-in model that returns given per-token log-probs. Nothing of the peers is copied here.
OpenRLHF files are imported by path under empty stand-ins for its package ``__init__`` files,
with ``deepspeed``, ``ray`` and ``openrlhf.trainer.ray.launcher`` stubbed (imported at module
level but not used by the functions compared); its ``@torch.compile``'d ``compute_entropy`` is
called through ``__wrapped__`` (the same Python code, run eagerly).

Install the peers (each into its own folder ``<cache>/peers/<pkg>-<ver>-py<XY>/site-packages``,
cache = ``$TURBORLHF_CACHE`` or ``~/.cache/turborlhf``; never into the project's environment) with
``--install`` (or ``make peers``; the tests install them too, see tests/algo/test_vs_peers.py).
It calls `compare_core.install_peer`, i.e. `turborlhf.bench.peers.ensure_package`: TRL 1.16.0 and
1.12.0 (1.12 is the last with PPO, trl.experimental.ppo) with the packages the environment lacks,
as `turborlhf bench` installs them; OpenRLHF 0.11.2 and 0.9.0 (0.9.0 still has KTOLoss; 0.9.10,
0.10.0 and 0.11.x do not: KTO was removed in 2026-03) as their own files only, ``pip install
--no-deps``: deepspeed, vLLM, flash-attn, Ray, bitsandbytes are not installed (see above). PyPI
only, ~20 s and ~20 MB for the four.

Usage (1 thread, small tensors, < 1 min; no model is loaded)::

    PYTHONPATH=src python benchmarks/peers/compare_algo.py [--install] [--peer trl-1.16.0 ...] [--json]

Layout: this file is the driver (one child process per peer, the table, the JSON);
``compare_core.py`` holds the registries, seeded inputs, accumulators and `load_peer`;
``compare_openrlhf.py`` and ``compare_trl.py`` hold the cases, one ``@case`` function each.

A peer whose folder is missing is reported as "not installed". Results and the explanation of
every intended difference: docs/algorithms/README.md. The same comparisons run as tests in
tests/algo/test_vs_peers.py.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the sibling modules, also when loaded by path

import compare_openrlhf  # noqa: E402,F401  (registers its cases)
import compare_trl  # noqa: E402,F401  (registers its cases)
from compare_core import (CASES, DIFFER_MIN, NOT_COMPARABLE, PEERS, REPO, RESULT_TAG, TOL, Diff,  # noqa: E402
                          _g, install_peer, load_peer, peer_path)

__all__ = ["CASES", "PEERS", "Diff", "peer_path", "install_peer", "run_peer", "status", "markdown_table", "main"]


# ------------------------------------------------------------------------------ worker / driver


def status(row: dict) -> str:
    if row.get("error"):
        return "ERROR"
    if row["max_diff"] is None:
        return "not installed"
    if not row["max_diff"] <= TOL:
        return "MISMATCH"
    if row["doc"]:
        if row["default_diff"] is not None and row["default_diff"] > DIFFER_MIN:
            return f"intended difference (see {row['doc']})"
        return "MISMATCH (the default was expected to differ)"
    return "match"


def worker(peer: str, seeds: int) -> dict:
    import torch

    torch.set_num_threads(1)
    folder = peer_path(peer)
    P = load_peer(peer, folder)
    rows = []
    for c in [c for c in CASES if c.peer == peer]:
        d, dd = Diff(), Diff()
        err = None
        t0 = time.perf_counter()
        try:
            for dt in c.dtypes:
                for seed in range(seeds):
                    c.fn(P, dt, _g(1000 * seed + 17), d, dd)
        except Exception:   # one broken comparison must not hide the others
            err = traceback.format_exc(limit=6)
        row = {k: v for k, v in asdict(c).items() if k != "fn"}
        row.update(max_diff=d.max, n=d.n, default_diff=dd.max if dd.n else None, error=err,
                   seconds=round(time.perf_counter() - t0, 2))
        row["status"] = status(row)
        rows.append(row)
    import transformers

    return {"peer": peer, "version": P.version, "folder": str(folder), "torch": torch.__version__,
            "transformers": transformers.__version__, "rows": rows}


def run_peer(peer: str, seeds: int = 3, timeout: float = 1200) -> dict:
    """Run one peer's comparisons in a child process (its folder first on PYTHONPATH, then our src)."""
    folder = peer_path(peer)
    base = {"peer": peer, "version": PEERS[peer][1], "folder": str(folder)}
    if not folder.is_dir():
        rows = [{**{k: v for k, v in asdict(c).items() if k != "fn"}, "max_diff": None, "n": 0, "default_diff": None,
                 "error": None, "status": "not installed"} for c in CASES if c.peer == peer]
        return {**base, "installed": False, "rows": rows}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO / "src")]), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "TURBORLHF_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", peer, "--seeds", str(seeds)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO))
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return {**json.loads(line[len(RESULT_TAG):]), "installed": True}
    tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-15:])
    raise RuntimeError(f"comparison worker for {peer} failed (exit {res.returncode}):\n{tail}")


def _fmt(x) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.1e}"


def markdown_table(results: list[dict]) -> str:
    lines = ["| ours | peer | peer code | our options (reproducing the peer) | dtypes | max abs diff "
             "| default: abs diff | result |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        for r in res["rows"]:
            peer = f"{res['peer'].split('-')[0]} {res.get('version', '')}"
            default = _fmt(r["default_diff"]) + (f" ({r['default_note']})" if r["doc"] else "")
            cells = [f"`{r['function']}`", peer, r["peer_code"], r["options"], ", ".join(r["dtypes"]),
                     _fmt(r["max_diff"]), default, r["status"]]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", action="append", choices=sorted(PEERS), help="only these peers (repeatable)")
    ap.add_argument("--seeds", type=int, default=3, help="random draws per case and dtype (default 3)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--install", action="store_true",
                    help="first install the peers whose folder is missing (PyPI; see the module docstring)")
    ap.add_argument("--worker", choices=sorted(PEERS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(RESULT_TAG + json.dumps(worker(args.worker, args.seeds)), flush=True)
        return 0
    from turborlhf.bench.peers import PeerUnavailable

    results, install_failed = [], False
    for peer in args.peer or list(PEERS):
        if args.install:
            try:
                install_peer(peer)
            except PeerUnavailable as e:   # reported; the peer's rows say "not installed"
                print(f"[compare] {peer} could not be installed: {e}", file=sys.stderr, flush=True)
                install_failed = True
        print(f"[compare] {peer} ...", file=sys.stderr, flush=True)
        results.append(run_peer(peer, args.seeds))
    print(f"turborlhf.algo vs peers, {time.strftime('%Y-%m-%d')}; tolerance {TOL:g} (max |ours - peer| over "
          f"{args.seeds} seeds x shapes x dtypes); an intended difference must exceed {DIFFER_MIN:g} with our default")
    for res in results:
        where = res["folder"] if res["installed"] else f"not installed ({res['folder']})"
        extra = f", torch {res['torch']}, transformers {res['transformers']}" if res["installed"] else ""
        print(f"- {res['peer']}: {where}{extra}")
    print()
    print(markdown_table(results))
    print("\nNot compared:")
    for peer, what, why in NOT_COMPARABLE:
        print(f"- {peer}: {what} -- {why}")
    errors = [r for res in results for r in res["rows"] if r.get("error")]
    for r in errors:
        print(f"\nERROR in {r['key']}:\n{r['error']}", file=sys.stderr)
    bad = [r for res in results for r in res["rows"] if r["status"].startswith(("MISMATCH", "ERROR"))]
    if args.json:
        print(json.dumps({"date": time.strftime("%Y-%m-%d"), "tolerance": TOL, "differ_min": DIFFER_MIN,
                          "results": results, "not_comparable": NOT_COMPARABLE}))
    return 1 if bad or install_failed else 0


if __name__ == "__main__":
    sys.exit(main())
