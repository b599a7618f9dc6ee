"""Statistics, the result object printed with ``--json`` and the Markdown table.

Result keys (training commands): ``ours_s_per_step``, ``peer_s_per_step`` (median seconds per
optimizer step over the measured steps of all repetitions: on a shared machine other processes
only ever slow a step down, and the median ignores the odd such step; the mean is in
``ours_steps``/``peer_steps``), ``speedup`` (peer / ours: > 1 means
we are faster), ``ours_samples_per_s``, ``peer_samples_per_s``, ``ours_peak_rss_gib``,
``peer_peak_rss_gib`` (largest peak over the repetitions, whole process tree), ``rss_ratio``
(ours / peer), ``targets`` and ``target_met``, the raw step times, per-side extras, and
``peer_error`` / ``ours_error`` (None, or why that side has no numbers: then its fields are None).

``generate`` adds ``tokens_per_s``, ``peer_tokens_per_s``, ``roofline_tokens_per_s``,
``roofline_fraction`` and ``peer_roofline_fraction``, each keyed by batch size ("1", "8", "32"),
and makes ``ours_s_per_step``, ``peer_s_per_step`` and ``speedup`` objects keyed the same way
(seconds per whole generate call).
"""
from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

__all__ = ["summarize", "ratio", "check_target", "roofline_tokens_per_s", "format_table", "fmt"]


def summarize(xs: Sequence[float]) -> Optional[dict]:
    """``{"n", "mean", "median", "min", "max", "stdev"}`` of `xs`, or None when empty."""
    xs = [float(x) for x in xs]
    if not xs:
        return None
    return {"n": len(xs), "mean": statistics.fmean(xs), "median": statistics.median(xs), "min": min(xs),
            "max": max(xs), "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """num / den, or None if either is missing or den is not positive."""
    if num is None or den is None or not den > 0:
        return None
    return num / den


def check_target(value: Optional[float], target: tuple[str, float]) -> Optional[bool]:
    """Whether `value` meets ``(">=" | "<=", bound)``; None when the value is missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    op, bound = target
    if op == ">=":
        return value >= bound
    if op == "<=":
        return value <= bound
    raise ValueError(f"unknown target comparison {op!r}")


def roofline_tokens_per_s(batch: int, gflops: float, read_gb_s: float, flops_per_token: float,
                          weight_bytes: float) -> float:
    """Upper bound on decode tokens/s at `batch` rows: ``min(compute, memory)`` with
    compute = gflops·1e9 / flops_per_token and memory = batch · read_gb_s·1e9 / weight_bytes (each
    decode step reads every weight once for the whole batch). Attention FLOPs and KV-cache reads
    are left out, so the bound is optimistic. Raises ValueError for a non-positive argument."""
    if min(batch, gflops, read_gb_s, flops_per_token, weight_bytes) <= 0:
        raise ValueError("roofline inputs must be positive")
    return min(gflops * 1e9 / flops_per_token, batch * read_gb_s * 1e9 / weight_bytes)


def fmt(v, nd: int = 2, suffix: str = "") -> str:
    """A number for the table ('—' when missing)."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{nd}f}{suffix}"
    return f"{v}{suffix}"


def _target_text(t: Optional[tuple[str, float]], unit: str = "") -> str:
    if not t:
        return ""
    return f"{'≥' if t[0] == '>=' else '≤'} {t[1]:g}{unit}"


def format_table(r: dict) -> str:
    """Markdown table of a result object (see the module docstring), with a header line."""
    m = r.get("machine") or {}
    pr = r.get("precision") or {}
    prec = pr.get("ours", "bf16")
    rollout, weights, state = pr.get("ours_rollout"), pr.get("ours_weights"), pr.get("ours_optimizer_state")
    ours = []                              # where our side stores or computes below/above the shared precision
    if rollout and rollout != prec:        # `rollout.dtype: auto` took fp32 arithmetic on the same bf16 weights
        ours.append(f"rollout engine {rollout} arithmetic on {weights or prec} weights")
    elif weights and weights != prec:      # `rollout.weight_dtype: auto`: bf16 weights under fp32 arithmetic
        ours.append(f"rollout engine {prec} arithmetic on {weights} weights")
    if state and state != prec:
        ours.append(f"AdamW moments in {state}")
    prec += " on both sides" + (f" (ours: {'; '.join(ours)})" if ours else "")
    head = (f"turborlhf bench {r['command']} vs {r['peer']}: {r['description']}; {r['reps']} rep(s) x "
            f"({r['warmup']} warm-up + {r['steps']} measured), {r['threads']} threads, {prec}, "
            f"{r['date']}")
    lines = [head, ""]
    if m.get("cpu"):
        lines[1:1] = [f"host: {m['cpu']}, {m.get('cores')} cores, {'/'.join(m.get('isa') or []) or 'no AVX2'}"
                      + (f" (limited by {', '.join(f'{k}={v}' for k, v in m['limits'].items())})" if m.get("limits") else ""),
                      ""]
    if r["command"] == "generate":
        lines += ["| batch | ours tok/s | HF generate tok/s | speedup | roofline tok/s | ours / roofline "
                  "| HF / roofline | target |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for b in r["batch_sizes"]:
            k = str(b)
            t = r["targets"].get(f"tokens_per_s@{k}")
            met = r["target_met"].get(f"tokens_per_s@{k}")
            lines.append(f"| {k} | {fmt(_get(r, 'tokens_per_s', k), 1)} | {fmt(_get(r, 'peer_tokens_per_s', k), 1)} "
                         f"| {fmt(_get(r, 'speedup', k), 2, '×')} | {fmt(_get(r, 'roofline_tokens_per_s', k), 0)} "
                         f"| {fmt(_get(r, 'roofline_fraction', k), 3)} | {fmt(_get(r, 'peer_roofline_fraction', k), 3)} "
                         f"| {(_target_text(t, ' tok/s') + ': ' + fmt(met)) if t else ''} |")
        lines += ["", f"peak RSS GiB: ours {fmt(r['ours_peak_rss_gib'])}, HF generate {fmt(r['peer_peak_rss_gib'])}"]
        hw = r.get("hardware") or {}
        if hw:
            dt = hw.get("dtype", "bf16")
            lines.append(f"roofline inputs: {dt} matmul {fmt(hw.get('matmul_gflops', hw.get('bf16_gflops')), 0)} GFLOP/s, "
                         f"memory read {fmt(hw.get('read_gb_s'), 1)} GB/s, {fmt(hw.get('gflop_per_token'), 3)} GFLOP and "
                         f"{fmt(hw.get('weight_mb'), 0)} MB of {hw.get('weight_dtype') or dt} weights per generated token")
    else:
        unit = r["sample_unit"]
        t_speed, t_rss = r["targets"].get("speedup"), r["targets"].get("rss_ratio")
        lines += ["| metric | turborlhf | peer | peer / ours | target | met |", "| --- | --- | --- | --- | --- | --- |",
                  f"| s/step (median) | {fmt(r['ours_s_per_step'])} | {fmt(r['peer_s_per_step'])} "
                  f"| {fmt(r['speedup'], 2, '×')} | {_target_text(t_speed, '×')} "
                  f"| {fmt(r['target_met'].get('speedup')) if t_speed else ''} |",
                  f"| {unit}/s | {fmt(r['ours_samples_per_s'], 3)} | {fmt(r['peer_samples_per_s'], 3)} | | | |",
                  f"| s/step mean (min-max) | {_spread(r.get('ours_steps'))} | {_spread(r.get('peer_steps'))} "
                  "| | | |",
                  f"| peak RSS GiB | {fmt(r['ours_peak_rss_gib'])} | {fmt(r['peer_peak_rss_gib'])} "
                  f"| ours/peer {fmt(r['rss_ratio'])} | {_target_text(t_rss)} "
                  f"| {fmt(r['target_met'].get('rss_ratio')) if t_rss else ''} |"]
        if r.get("ours_reference_s_per_step") is not None:
            lines.append(f"\nours s/step = training step {fmt(r['ours_train_s_per_step'])} + one-off reference "
                         f"pass amortised per step {fmt(r['ours_reference_s_per_step'])} (TRL runs the reference "
                         "model in every step)")
    if r.get("children"):
        lines += ["", "| child | wall s | peak RSS GiB | CPU share | load (1 min) start → end |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {c['tag']} | {c['wall_s']:.0f} | {c['peak_rss_gib']:.2f} | {c['cpu_share']:.2f} "
                  f"| {c['loadavg_start']:.1f} → {c['loadavg_end']:.1f} |" for c in r["children"]]
        lines.append("(CPU share = CPU time / (wall × threads): a child whose share is well below its "
                     "siblings' lost its cores to other processes.)")
    for side in ("ours", "peer"):
        if r.get(f"{side}_error"):
            lines.append(f"\n{'turborlhf' if side == 'ours' else r['peer']} has no numbers: {r[f'{side}_error']}")
    return "\n".join(lines)


def _get(r: dict, key: str, k: str):
    v = r.get(key)
    return v.get(k) if isinstance(v, dict) else None


def _spread(s: Optional[dict]) -> str:
    if not s:
        return "—"
    return f"{s['mean']:.2f} ({s['min']:.2f}-{s['max']:.2f}, n={s['n']})"
