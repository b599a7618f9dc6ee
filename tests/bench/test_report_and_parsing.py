"""Pure parts of the bench harness: parsing children's output, statistics, targets, roofline,
the result table, and pip reports."""
import json

import pytest

from turborlhf.bench import report as R
from turborlhf.bench.peers import parse_pip_report, peer_dir
from turborlhf.bench.workloads import parse_bench_result, parse_metrics_jsonl, parse_reference_pass


def test_metrics_jsonl_step_times_in_step_order_with_phases():
    text = "\n".join(json.dumps(r) for r in [
        {"step": 2, "timing/step": 2.5, "timing/generate": 1.0, "rollout/response_length": 64.0},
        {"step": 1, "timing/step": 3.5, "timing/generate": 2.0, "rollout/response_length": 60.0},
        {"step": 2, "eval/accuracy": 0.6},          # final eval row: no timing, ignored
    ]) + "\n\n"
    run = parse_metrics_jsonl(text)
    assert run.step_times == [3.5, 2.5]
    assert run.extra["phases"] == [{"generate": 2.0}, {"generate": 1.0}]
    assert run.extra["response_length"] == [60.0, 64.0]


def test_metrics_jsonl_errors_name_the_line():
    with pytest.raises(ValueError, match="line 2"):
        parse_metrics_jsonl('{"step": 1, "timing/step": 1}\n{oops\n')
    with pytest.raises(ValueError, match="no 'timing/step' rows"):
        parse_metrics_jsonl('{"step": 1, "train/loss": 1}\n')


def test_bench_result_is_the_last_tagged_line():
    out = 'noise\nBENCH_RESULT {"step_times": [1]}\nmore\nBENCH_RESULT {"step_times": [2, 3]}\ntrailing\n'
    assert parse_bench_result(out) == {"step_times": [2, 3]}
    with pytest.raises(ValueError, match="no BENCH_RESULT"):
        parse_bench_result("nothing here\n")
    with pytest.raises(ValueError, match="not a JSON object"):
        parse_bench_result("BENCH_RESULT [1, 2]\n")


def test_reference_pass_line():
    out = "[dpo] batch sizes:\n[dpo] reference log-probs of 24 sequences in 7.5s → /x/ref_logps.pt\n"
    assert parse_reference_pass(out) == (24, 7.5)
    assert parse_reference_pass("[dpo] reference log-probs loaded from /x\n") is None


def test_summary_ratio_and_targets():
    s = R.summarize([3.0, 1.0, 2.0, 10.0])
    assert s["n"] == 4 and s["mean"] == 4.0 and s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 10.0
    assert R.summarize([]) is None
    assert R.ratio(6.0, 2.0) == 3.0 and R.ratio(None, 2.0) is None and R.ratio(1.0, 0.0) is None
    assert R.check_target(3.0, (">=", 3.0)) is True and R.check_target(2.9, (">=", 3.0)) is False
    assert R.check_target(0.6, ("<=", 0.6)) is True and R.check_target(0.7, ("<=", 0.6)) is False
    assert R.check_target(None, (">=", 1.0)) is None
    with pytest.raises(ValueError):
        R.check_target(1.0, ("==", 1.0))


def test_roofline_memory_bound_at_batch_1_compute_bound_at_32():
    # SmolLM2-135M on the reference machine: 877 GFLOP/s bf16, 86 GB/s read, 134.5M parameters
    n = 134_515_008
    b1 = R.roofline_tokens_per_s(1, 877.0, 86.0, 2.0 * n, 2.0 * n)
    b32 = R.roofline_tokens_per_s(32, 877.0, 86.0, 2.0 * n, 2.0 * n)
    assert b1 == pytest.approx(86e9 / (2.0 * n))            # ~320 tok/s: reading 269 MB per token
    assert b32 == pytest.approx(877e9 / (2.0 * n))          # ~3260 tok/s: 0.27 GFLOP per token
    assert 300 < b1 < 340 and 3200 < b32 < 3300
    with pytest.raises(ValueError):
        R.roofline_tokens_per_s(0, 1.0, 1.0, 1.0, 1.0)


def _training_result(**kw):
    r = {"command": "ppo", "peer": "TRL 1.12.0 PPOTrainer", "description": "PPO step", "reps": 2, "warmup": 1,
         "steps": 3, "threads": 2, "date": "2026-01-01 00:00", "sample_unit": "samples",
         "ours_s_per_step": 4.0, "peer_s_per_step": 16.0, "speedup": 4.0, "ours_samples_per_s": 2.0,
         "peer_samples_per_s": 0.5, "ours_peak_rss_gib": 3.0, "peer_peak_rss_gib": 10.0, "rss_ratio": 0.3,
         "ours_steps": R.summarize([4.0, 4.0]), "peer_steps": R.summarize([15.0, 17.0]),
         "targets": {"speedup": (">=", 3.0), "rss_ratio": ("<=", 0.6)},
         "target_met": {"speedup": True, "rss_ratio": True}, "ours_error": None, "peer_error": None}
    r.update(kw)
    return r


def test_training_table_shows_ratio_targets_and_errors():
    t = R.format_table(_training_result())
    assert "| s/step (median) | 4.00 | 16.00 | 4.00× | ≥ 3× | yes |" in t
    assert "| peak RSS GiB | 3.00 | 10.00 | ours/peer 0.30 | ≤ 0.6 | yes |" in t
    assert "| samples/s | 2.000 | 0.500 |" in t
    t = R.format_table(_training_result(peer_s_per_step=None, speedup=None, peer_peak_rss_gib=None,
                                        rss_ratio=None, peer_steps=None, target_met={},
                                        peer_error="could not be installed: no network"))
    assert "| s/step (median) | 4.00 | — | — |" in t
    assert "TRL 1.12.0 PPOTrainer has no numbers: could not be installed: no network" in t


def test_header_names_our_rollout_arithmetic_where_it_differs():
    head = R.format_table(_training_result(precision={"ours": "bf16", "ours_rollout": "bf16"})).splitlines()[0]
    assert "2 threads, bf16 on both sides, 2026" in head
    head = R.format_table(_training_result(precision={"ours": "bf16", "ours_rollout": "fp32"})).splitlines()[0]
    assert "bf16 on both sides (ours: rollout engine fp32 arithmetic on bf16 weights), 2026" in head


def test_header_names_our_bf16_weights_and_moments_under_fp32():
    """"fp32 on both sides" was printed while our engine held bf16 weights and our AdamW bf16
    moments (`rollout.weight_dtype` / `optim.state_dtype: auto`), which TRL and HF do not."""
    head = R.format_table(_training_result(precision={"ours": "fp32", "ours_rollout": "fp32", "ours_weights": "bf16",
                                                      "ours_optimizer_state": "bf16"})).splitlines()[0]
    assert "fp32 on both sides (ours: rollout engine fp32 arithmetic on bf16 weights; AdamW moments in bf16)" in head
    head = R.format_table(_training_result(precision={"ours": "fp32", "ours_rollout": "fp32", "ours_weights": "fp32",
                                                      "ours_optimizer_state": "fp32"})).splitlines()[0]
    assert "fp32 on both sides, 2026" in head


def test_generate_table_per_batch_size():
    r = {"command": "generate", "peer": "HF generate", "description": "gen", "reps": 1, "warmup": 1, "steps": 3,
         "threads": 2, "date": "d", "batch_sizes": [1, 32], "tokens_per_s": {"1": 90.0, "32": 1200.0},
         "peer_tokens_per_s": {"1": 45.0, "32": 400.0}, "speedup": {"1": 2.0, "32": 3.0},
         "roofline_tokens_per_s": {"1": 320.0, "32": 3260.0}, "roofline_fraction": {"1": 0.28, "32": 0.368},
         "peer_roofline_fraction": {"1": 0.14, "32": 0.123},
         "targets": {"tokens_per_s@32": (">=", 1000.0), "tokens_per_s@1": (">=", 100.0)},
         "target_met": {"tokens_per_s@32": True, "tokens_per_s@1": False}, "ours_peak_rss_gib": 1.0,
         "peer_peak_rss_gib": 1.2, "hardware": None, "ours_error": None, "peer_error": None}
    t = R.format_table(r)
    assert "| 1 | 90.0 | 45.0 | 2.00× | 320 | 0.280 | 0.140 | ≥ 100 tok/s: NO |" in t
    assert "| 32 | 1200.0 | 400.0 | 3.00× | 3260 | 0.368 | 0.123 | ≥ 1000 tok/s: yes |" in t


def test_pip_report_parsing():
    rep = {"version": "1", "install": [{"metadata": {"name": "trl", "version": "1.12.0"}, "requested": True},
                                       {"metadata": {"name": "datasets", "version": "5.2.0"}}]}
    assert parse_pip_report(rep) == [("trl", "1.12.0"), ("datasets", "5.2.0")]
    assert parse_pip_report({"install": []}) == []
    with pytest.raises(ValueError, match="no 'install' list"):
        parse_pip_report({"version": "1"})
    with pytest.raises(ValueError, match="entry 0"):
        parse_pip_report({"install": [{"metadata": {"name": "x"}}]})


def test_peer_folder_ends_in_site_packages(tmp_path):
    # dill (used by datasets to hash tables) pickles modules outside a "site-packages" path by value
    p = peer_dir("trl", "1.12.0", tmp_path)
    assert p.name == "site-packages" and p.parent.name.startswith("trl-1.12.0-py3")


def test_our_rollout_dtype_is_read_from_the_run(tmp_path):
    """The dtype `rollout.dtype: auto` chose is taken from the run's hardware.json into the result."""
    from turborlhf.bench.cli import Side, _first_extra, _parse_child
    from turborlhf.bench.measure import ChildResult
    from turborlhf.bench.workloads import WORKLOADS, RunContext

    rows = [{"step": i, "timing/step": 1.0} for i in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "hardware.json").write_text(json.dumps({"choices": {"rollout.dtype": {"value": "fp32"}}}))
    ctx = RunContext(repo=tmp_path, model_dir="m", data={}, threads=2, warmup=1, steps=1)
    res = ChildResult(["x"], 0, 1.0, 0, 0, 0, tmp_path / "out", tmp_path / "err")
    side = Side("ours", 2)
    _parse_child(WORKLOADS["ppo"], side, "ours", res, tmp_path, ctx)
    assert side.error is None and _first_extra(side, "rollout_dtype") == "fp32"
    (tmp_path / "hardware.json").unlink()
    side = Side("ours", 2)
    _parse_child(WORKLOADS["ppo"], side, "ours", res, tmp_path, ctx)
    assert side.error is None and _first_extra(side, "rollout_dtype") is None
