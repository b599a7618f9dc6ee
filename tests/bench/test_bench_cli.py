"""`turborlhf bench` end to end on the tiny random model, our side only or with a broken peer: the
plumbing (configs, child processes, metrics parsing, JSON as the last line, clear peer errors).
Times are not checked: speed is measured by real runs (docs/benchmarks.md), never asserted here."""
import json
import subprocess
import sys

from turborlhf.bench.cli import main


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out = capsys.readouterr().out.strip().splitlines()
    return rc, out, json.loads(out[-1])


def test_bench_rm_ours_only_prints_table_then_json(tiny_model, tmp_path, capsys):
    rc, out, r = _run(capsys, "rm", "--vs", "none", "--model", tiny_model, "--warmup", "1", "--steps", "2",
                      "--reps", "1", "--threads", "1", "--out", tmp_path / "b", "--json")
    assert rc == 0
    assert any(line.startswith("| s/step (median) |") for line in out)
    for key in ("ours_s_per_step", "peer_s_per_step", "speedup", "ours_peak_rss_gib", "peer_peak_rss_gib"):
        assert key in r
    assert r["ours_s_per_step"] > 0 and len(r["ours_step_times"]) == 2 and 0.1 < r["ours_peak_rss_gib"] < 6
    assert r["peer_s_per_step"] is None and r["speedup"] is None and r["peer_peak_rss_gib"] is None
    assert r["peer_error"] == "not requested (--vs none)" and r["ours_error"] is None
    assert (tmp_path / "b" / "result.json").exists() and (tmp_path / "b" / "configs" / "ours-1.yaml").exists()
    assert not (tmp_path / "b" / "runs" / "ours-1").exists()        # model files removed unless --keep-runs


def test_bench_ppo_ours_only_runs_with_a_fresh_head_reward_model(tiny_model, tmp_path, capsys):
    """Our PPO side needs a reward model directory (`turborlhf ppo` refuses a causal LM as one): the
    harness writes the base model with a fresh scalar head, as the TRL script builds in-process."""
    from turborlhf.rewards.model import check_reward_model

    rc, out, r = _run(capsys, "ppo", "--vs", "none", "--model", tiny_model, "--warmup", "1", "--steps", "1",
                      "--reps", "1", "--threads", "1", "--new-tokens", "8", "--out", tmp_path / "b", "--json")
    assert rc == 0 and r["ours_error"] is None and r["ours_s_per_step"] > 0, r["ours_error"]
    rm_dir = tmp_path / "b" / "data" / "reward_model"
    check_reward_model(str(rm_dir))                                   # raises for a causal LM
    assert f"reward_model: {rm_dir}" in (tmp_path / "b" / "configs" / "ours-1.yaml").read_text()


def test_a_broken_peer_gives_null_fields_and_a_reason(tiny_model, tmp_path, capsys):
    # a peer folder whose trl cannot be imported, whatever this interpreter has installed
    broken = tmp_path / "broken-peer"
    (broken / "trl").mkdir(parents=True)
    (broken / "trl" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'trl.broken'\")\n")
    rc, out, r = _run(capsys, "dpo", "--vs", "trl", "--peer-dir", broken, "--model", tiny_model, "--warmup", "0",
                      "--steps", "1", "--reps", "1", "--threads", "1", "--out", tmp_path / "b", "--json")
    assert rc == 0 and r["ours_s_per_step"] > 0
    assert r["peer_s_per_step"] is None and r["speedup"] is None and r["peer_peak_rss_gib"] is None
    assert "peer-1 failed (exit code 1)" in r["peer_error"] and "ModuleNotFoundError" in r["peer_error"]
    assert any("has no numbers" in line for line in out)


def test_bench_help_stays_light():
    code = ("import sys, contextlib, io\n"
            "from turborlhf.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: main(['bench', '--help'])\n"
            "    except SystemExit: pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'trl') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_kept_run_does_not_lend_its_dpo_reference_to_the_next_bench(tiny_model, tmp_path, capsys):
    """With --keep-runs the next `bench dpo` into the same --out loaded the kept run's reference
    cache: no reference pass, so our s/step lost its amortised reference cost."""
    args = ("dpo", "--vs", "none", "--model", tiny_model, "--warmup", "0", "--steps", "1", "--reps", "1",
            "--threads", "1", "--keep-runs", "--out", tmp_path / "b", "--json")
    for _ in range(2):
        rc, _, r = _run(capsys, *args)
        assert rc == 0 and r["ours_reference_s_per_step"] is not None, r
