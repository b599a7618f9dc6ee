import json
import subprocess
import sys
import time

from tests.e2e.helpers import REPO, run_cli


def test_tiny_pipeline_and_eval_commands(tiny_model, tmp_path):
    run_dir = tmp_path / "pipe"
    run_cli("pipeline", "--config", REPO / "configs/tiny/pipeline.yaml", f"model={tiny_model}", f"run_dir={run_dir}",
            f"prepare.input={REPO / 'data/hh-rlhf/harmless-base-1800.jsonl.gz'}")
    s = json.loads((run_dir / "summary.json").read_text())
    for k in ("rm_test_accuracy", "sft_policy", "ppo_policy", "ppo_minus_sft_reward_in_sft_std", "stage_seconds",
              "samples"):
        assert k in s, k
    assert (run_dir / "ppo_curves.png").stat().st_size > 1000
    for stage in ("sft", "rm", "ppo"):
        assert (run_dir / stage / "config.json").exists() and (run_dir / stage / "model.safetensors").exists()
    assert s["ppo_policy"]["kl_to_reference"] == s["ppo_policy"]["kl_to_reference"]  # finite, not nan
    rm_eval = json.loads((run_dir / "rm" / "eval.json").read_text())    # the RM stage's scores, not a second pass
    assert (s["rm_test_accuracy"], s["rm_test_pairs"], s["rm_test_length"]) == (rm_eval["accuracy"], rm_eval["n"],
                                                                              rm_eval["length"])

    # the evaluation commands print one JSON object (last line) on stdout
    exe = [sys.executable, "-m", "turborlhf"]
    out = subprocess.run(exe + ["eval-rm", "--model", run_dir / "rm", "--data",
                                REPO / "data/hh-rlhf/harmless-base-1800.jsonl.gz", "--limit", "20", "--json"],
                         check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["n"] == 20 and 0 <= res["accuracy"] <= 1
    L = res["length"]  # the strata re-add to the overall accuracy
    n_s = L["n_chosen_shorter"]
    assert 0 < n_s < 20 and L["shorter_wins"] == n_s / 20
    assert abs(L["accuracy_chosen_shorter"] * n_s + L["accuracy_chosen_not_shorter"] * (20 - n_s)
               - res["accuracy"] * 20) < 1e-6
    assert s["rm_test_length"]["shorter_wins"] is not None
    out = subprocess.run(exe + ["eval-policy", "--policy", run_dir / "ppo", "--reward-model", run_dir / "rm",
                                "--prompts", run_dir / "data" / "test_prompts.jsonl", "--n", "4",
                                "--max-new-tokens", "6", "--json"], check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    for k in ("reward_mean", "reward_std", "n", "response_length_mean"):
        assert k in res
    assert res["n"] == 4

    # --resume skips finished stages, while their config is the one they finished with
    args = ["pipeline", "--config", REPO / "configs/tiny/pipeline.yaml", f"model={tiny_model}", f"run_dir={run_dir}",
            f"prepare.input={REPO / 'data/hh-rlhf/harmless-base-1800.jsonl.gz'}"]
    run_cli(*args, "--resume")
    from turborlhf.cli import main

    assert main([str(a) for a in args] + ["--resume", "sft.optim.lr=0.5"]) == 2        # was skipped, exit 0
    for change in ("prepare.test_fraction=0.3", "eval.n_prompts=3"):     # skipped: old data, old summary
        assert main([str(a) for a in args] + ["--resume", change]) == 2
    # --resume-changed trains the stage again, and every stage after it (they built on its old model)
    before = {s: (run_dir / s / ".done").stat().st_mtime_ns for s in ("prepare", "sft", "rm", "ppo", "eval")
              if (run_dir / s / ".done").exists()}
    assert main([str(a) for a in args] + ["--resume-changed", "sft.optim.lr=0.5"]) == 0
    after = {s: (run_dir / s / ".done").stat().st_mtime_ns for s in before}
    assert [s for s in before if after[s] != before[s]] == ["sft", "rm", "ppo", "eval"], (before, after)
    assert "rm_test_accuracy" in json.loads((run_dir / "summary.json").read_text())
    assert main([str(a) for a in args] + ["sft.output_dir=elsewhere"]) == 2           # the stages read run_dir/sft
    assert main([str(a) for a in args] + ["eval.rollout.top_k=1"]) == 2               # never passed on
    # a fresh run of the first stage alone shows no evaluation of the models it replaces
    run_cli(*args, "stages=[prepare]")
    assert "rm_test_accuracy" not in json.loads((run_dir / "summary.json").read_text())
    # ...and a later --resume trains every stage on the new split (they were skipped as done: SFT,
    # RM and PPO of the old split, evaluated on prompts they had partly trained on)
    dirs = {"prepare": "data", "sft": "sft", "rm": "rm", "ppo": "ppo", "eval": "eval"}
    before = {s: (run_dir / d / ".done").stat().st_mtime_ns for s, d in dirs.items()}
    run_cli(*args, "--resume")
    after = {s: (run_dir / d / ".done").stat().st_mtime_ns for s, d in dirs.items()}
    assert [s for s in before if after[s] != before[s]] == ["sft", "rm", "ppo", "eval"], (before, after)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "rm_test_accuracy" in summary and set(summary["stage_seconds"]) == set(before)
    # the stages a run wires together cannot be pointed elsewhere by a stage section
    for wired in ("ppo.reward_model=x", "ppo.reference=x", "ppo.data.prompts_file=x", "rm.model.name_or_path=x"):
        assert main([str(a) for a in args] + [wired]) == 2, wired
    # a run of the later stages alone starts from the SFT model an earlier run finished here
    from turborlhf.config import PipelineConfig, load_config
    from turborlhf.pipeline import stage_configs

    later = load_config(PipelineConfig, REPO / "configs/tiny/pipeline.yaml",
                        [f"model={tiny_model}", f"run_dir={run_dir}", "stages=[ppo,eval]"])
    ppo = stage_configs(later, str(tiny_model))["ppo"]
    assert ppo.actor.name_or_path == ppo.reference == str(run_dir / "sft")

    # the RM stage's scores stay valid for a copy of the run directory (same test pairs by content),
    # not for other pairs; an eval.json without the digest is matched by its path
    import shutil

    from turborlhf.report import rm_eval_covers
    copy = tmp_path / "moved"
    shutil.copytree(run_dir / "data", copy / "data")
    assert rm_eval_covers(rm_eval, str(copy / "data" / "test_pairs.jsonl"))
    assert not rm_eval_covers(rm_eval, str(copy / "data" / "train_pairs.jsonl"))
    assert not rm_eval_covers({k: v for k, v in rm_eval.items() if k != "length"}, rm_eval["data"])
    old = {k: v for k, v in rm_eval.items() if k != "data_sha256"}
    assert rm_eval_covers(old, rm_eval["data"]) and not rm_eval_covers(old, str(copy / "data" / "test_pairs.jsonl"))


def test_eval_policy_pair_equals_two_evals_with_the_prompt_scored_once(tiny_model, tiny_rm, tiny_data, tmp_path,
                                                                        monkeypatch):
    """The pipeline's evaluation (`eval_policy_pair`): the same results as `eval_policy` on each
    policy (the trained one with its KL to the base), while the reward model scores each prompt's
    two answers in one packed row whose prompt it computes once."""
    import pytest

    import turborlhf.rewards.model as rmod
    from turborlhf.evaluate import eval_policy, eval_policy_pair
    from turborlhf.models.tiny import save_tiny_causal_lm

    trained = save_tiny_causal_lm(tmp_path / "trained", seed=1)     # another model: a KL far from 0
    prompts = str(tiny_data / "test_prompts.jsonl")
    kw = dict(n=6, max_new_tokens=6, seed=3, dtype="fp32")
    base = eval_policy(str(tiny_model), str(tiny_rm), prompts, **kw)
    pol = eval_policy(str(trained), str(tiny_rm), prompts, reference_dir=str(tiny_model), **kw)

    packed = []
    spf = rmod.shared_prefix_scores
    monkeypatch.setattr(rmod, "shared_prefix_scores", lambda m, b: packed.append(b) or spf(m, b))
    monkeypatch.setattr(rmod, "score_token_ids", None)              # no separate pass per policy
    outs = (tmp_path / "base.jsonl", tmp_path / "trained.jsonl")
    pb, pp = eval_policy_pair(str(tiny_model), str(trained), str(tiny_rm), prompts, **kw,
                              samples_out=tuple(map(str, outs)))
    for want, got in ((base, pb), (pol, pp)):
        for k, v in want.items():
            if "seconds" in k:
                continue
            assert got[k] == (pytest.approx(v, abs=1e-4) if isinstance(v, float) else v), k
    assert abs(pp["kl_to_reference"]) > 0.1 and "kl_to_reference" not in pb
    # every prompt once: its two answers continue it in one row
    assert sum(len(b.prefix_len) for b in packed) == 6
    assert all(p > 0 for b in packed for p in b.prefix_len)
    rows = [[json.loads(l) for l in o.read_text().splitlines()] for o in outs]
    assert [r["prompt"] for r in rows[0]] == [r["prompt"] for r in rows[1]] and len(rows[0]) == 6
    scores = [sum(r["score"] for r in rs) / 6 for rs in rows]
    assert scores == [pytest.approx(pb["reward_mean"], abs=1e-5), pytest.approx(pp["reward_mean"], abs=1e-5)]


def _pipeline_cli(tiny_model, run_dir, *extra) -> list[str]:
    return [sys.executable, "-m", "turborlhf", "pipeline", "--config", str(REPO / "configs/tiny/pipeline.yaml"),
            f"model={tiny_model}", f"run_dir={run_dir}",
            f"prepare.input={REPO / 'data/hh-rlhf/harmless-base-1800.jsonl.gz'}", *map(str, extra)]


def _env() -> dict:
    import os
    return dict(os.environ, PYTHONPATH=str(REPO / "src"), TURBORLHF_THREADS="1", OMP_NUM_THREADS="1",
                HF_HUB_OFFLINE="1")


def test_pipeline_stage_runs_in_its_own_process_and_stops_on_sigterm(tiny_model, tmp_path):
    """A training stage is a child process of the pipeline; SIGTERM sent to the pipeline reaches it
    once (forwarded: the child has a process group of its own), so the stage finishes its step,
    saves a checkpoint and the pipeline exits with 143; ``--resume`` then finishes the run."""
    import signal

    import psutil

    run_dir = tmp_path / "pipe"
    cmd = _pipeline_cli(tiny_model, run_dir, "stages=[prepare,sft]", "sft.train.max_steps=400",
                        "sft.train.save_every=0", "sft.log.progress=true")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
    lines, stage_pids = [], set()
    for line in p.stdout:
        lines.append(line)
        if line.startswith("[sft] 2/"):        # the stage's training loop is running
            stage_pids = {c.pid for c in psutil.Process(p.pid).children() if "python" in c.name().lower()}
            p.send_signal(signal.SIGTERM)
            break
    rest = p.communicate(timeout=300)[0]
    out = "".join(lines) + rest
    assert stage_pids and p.pid not in stage_pids, out[-3000:]
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped:" in out and "Traceback" not in out, out[-3000:]
    ckpts = list((run_dir / "sft" / "checkpoints").glob("step-*"))
    assert ckpts and not (run_dir / "sft" / ".done").exists(), out[-3000:]
    done = subprocess.run(_pipeline_cli(tiny_model, run_dir, "stages=[prepare,sft]", "sft.train.max_steps=400",
                                        "sft.train.save_every=0", "sft.log.progress=false", "--resume"),
                          capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run_dir / "sft" / ".done").exists() and "resum" in (done.stdout + done.stderr).lower()


def test_pipeline_stage_error_is_one_line(tiny_model, tmp_path):
    """An input error inside a stage's process comes back to the pipeline as the same error: one
    line and exit code 2, no traceback. The stage's `.done` from an earlier run is gone: a later
    ``--resume`` must run the stage again, not skip it."""
    run_dir = tmp_path / "pipe"
    for stage in ("sft", "data"):
        (run_dir / stage).mkdir(parents=True)
        (run_dir / stage / ".done").write_text("{}")
    r = subprocess.run(_pipeline_cli(tiny_model, run_dir, "stages=[sft]"), capture_output=True, text=True,
                       env=_env(), cwd=REPO, timeout=300)        # "prepared" before, but no data files
    assert r.returncode == 2, r.stderr[-3000:]
    err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(err) == 1 and "train_pairs.jsonl" in err[0] and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (run_dir / "sft" / ".done").exists()
    # a stage whose input no earlier stage writes is refused before the first stage runs (the
    # evaluation failed for want of a PPO model once SFT and RM had trained)
    from turborlhf.cli import main

    fresh = tmp_path / "fresh"
    assert main([str(a) for a in _pipeline_cli(tiny_model, fresh, "stages=[prepare,sft,rm,eval]")[3:]]) == 2
    assert not fresh.exists()


def test_pipeline_reports_a_killed_stage_in_one_line(tiny_model, tmp_path):
    """A stage's process killed outright (SIGKILL, as the kernel's OOM killer does) cannot report:
    the pipeline says which stage ended how, in one line, and exits with 1."""
    import signal

    import psutil

    cmd = _pipeline_cli(tiny_model, tmp_path / "pipe", "stages=[prepare,sft]", "sft.train.max_steps=400",
                        "sft.log.progress=true")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
    for line in p.stdout:
        if line.startswith("[sft] 2/"):
            for c in psutil.Process(p.pid).children():
                if "spawn_main" in " ".join(c.cmdline()):
                    c.send_signal(signal.SIGKILL)
            break
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 1, out[-3000:]
    err = [l for l in out.splitlines() if l.startswith("error:")]
    assert len(err) == 1 and "sft stage's process ended with code -9" in err[0] and "Traceback" not in out, out[-3000:]


def test_pipeline_stopped_while_a_stage_starts_is_a_stop_not_a_crash(tiny_model, tmp_path):
    """SIGTERM forwarded to a stage still starting up (before its handlers) killed it at once, and the
    pipeline called that a crash, perhaps by the OOM killer (exit 1): a stop (exit 143) now."""
    import signal

    cmd = _pipeline_cli(tiny_model, tmp_path / "pipe", "stages=[prepare,sft]", "sft.train.max_steps=400")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
    for line in p.stdout:
        if "===== sft =====" in line:          # the stage's process is being spawned: torch not imported yet
            time.sleep(0.3)
            p.send_signal(signal.SIGTERM)
            break
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped:" in out and "OOM" not in out and "Traceback" not in out, out[-3000:]
