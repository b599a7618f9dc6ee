"""PPO/GRPO through Ray with two CPU workers per role (a local cluster started by the command)
give the metrics and weights of the local backend with the same seed; a killed worker stops the
run with an error naming it and leaves a resumable checkpoint; SIGTERM leaves one too."""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, max_weight_diff, metrics, run_cli, weights

pytest.importorskip("ray")

TWO_PER_ROLE = ["distributed.backend=ray", "distributed.timeout_s=180"] + [
    f"distributed.{r}.devices_per_node=2" for r in ("actor", "critic", "reward", "reference", "rollout")]


def _args(yaml: str, tiny_model, tiny_rm, tiny_data, out, *extra) -> list[str]:
    return ["ppo", "--config", str(REPO / "configs/tiny" / yaml), f"actor.name_or_path={tiny_model}",
            f"reward_model={tiny_rm}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}", "data.max_samples=32",
            f"output_dir={out}", "log.tensorboard=false", "log.progress=false", "rollout.batch_size=2", *extra]


def _same_metrics(a_dir: Path, b_dir: Path) -> None:
    a, b = metrics(a_dir), metrics(b_dir)
    assert len(a) == len(b) > 0
    for ra, rb in zip(a, b):
        keys = [k for k in ra if not k.startswith("timing/") and k != "rollout/tokens_per_s"]
        assert keys and all(k in rb for k in keys)
        for k in keys:
            assert math.isclose(ra[k], rb[k], rel_tol=1e-4, abs_tol=1e-5), (ra.get("step"), k, ra[k], rb[k])
    assert max_weight_diff(weights(a_dir), weights(b_dir)) < 1e-5


@pytest.mark.slow
def test_ppo_ray_two_workers_per_role_matches_local(tiny_model, tiny_rm, tiny_data, tmp_path):
    run_cli(*_args("ppo.yaml", tiny_model, tiny_rm, tiny_data, tmp_path / "local", "train.max_steps=2"))
    run_cli(*_args("ppo.yaml", tiny_model, tiny_rm, tiny_data, tmp_path / "ray", "train.max_steps=2", *TWO_PER_ROLE))
    _same_metrics(tmp_path / "local", tmp_path / "ray")
    rows = metrics(tmp_path / "ray")
    # both engines took work from the queue; the critic trained on its two DP ranks
    assert all(r["rollout/engine0_items"] + r["rollout/engine1_items"] == 2 for r in rows)
    assert all(r["critic/loss"] > 0 for r in rows)


def _fp32_kernel_linears() -> bool:
    import torch

    from turborlhf.rollout import kernels

    k = kernels.load(warn=False)
    return k is not None and torch.float32 in k.linear_dtypes


@pytest.mark.parametrize("weight_dtype", ["same", "bf16"])
def test_ppo_ray_fsdp_matches_local(tiny_model, tiny_rm, tiny_data, tmp_path, weight_dtype):
    """Actor and critic sharded with FSDP2 over 2 CPU workers (gloo): the weight-sync check (the
    trainer's side a sharded forward on every rank, or with the engine's bf16 weights a gathered
    copy rounded alike), every rank's forwards and backwards in step, and the checkpoint gathered
    on rank 0; the same metrics and weights as one local worker. One mini-batch: 4 rows over 2
    workers of micro-batches of 2 (`PPOConfig._check_fsdp_batches`)."""
    if weight_dtype == "bf16" and not _fp32_kernel_linears():
        pytest.skip("bf16 engine weights need the fp32 kernel linears (x86-64 with AVX2 and FMA)")
    one_mini = ["train.max_steps=2", "algo.num_mini_batches=1", f"rollout.weight_dtype={weight_dtype}"]
    run_cli(*_args("ppo.yaml", tiny_model, tiny_rm, tiny_data, tmp_path / "local", *one_mini))
    run_cli(*_args("ppo.yaml", tiny_model, tiny_rm, tiny_data, tmp_path / "ray", *one_mini, *TWO_PER_ROLE,
                   "distributed.dp_strategy=fsdp"))
    _same_metrics(tmp_path / "local", tmp_path / "ray")
    assert all(r["critic/loss"] > 0 for r in metrics(tmp_path / "ray"))


def test_fsdp_refuses_a_short_step_that_cannot_split_over_its_workers(tiny_model, tiny_rm, tiny_data, tmp_path,
                                                                        capsys):
    """5 prompts with prompts_per_step 8 make one short step of 5 rows, whose second mini-batch (2 rows,
    one micro-batch) leaves one of the two FSDP workers without work: the workers' collectives no
    longer matched (a gloo abort). A config error naming the fields now, before any worker starts."""
    from turborlhf.cli import main

    fsdp = ["distributed.backend=ray", "distributed.dp_strategy=fsdp", "distributed.actor.devices_per_node=2",
            "algo.advantage_estimator=reinforce_pp", "algo.kl_coef=0", "algo.prompts_per_step=8",
            "algo.num_mini_batches=2", "train.micro_batch_size=2"]
    args = _args("ppo.yaml", tiny_model, tiny_rm, tiny_data, tmp_path / "run", *fsdp)
    assert main([*args, "data.max_samples=5"]) == 2
    err = capsys.readouterr().err
    assert "data.prompts_file: 5 prompts" in err and "algo.prompts_per_step 8" in err and "micro-batch" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_grpo_ray_colocated_matches_local(tiny_model, tiny_rm, tiny_data, tmp_path):
    """All roles colocated on 2 workers (actor DP=2 + reference/reward offload + sleeping engines),
    CPU slots on any host (two GPU workers would need two GPUs)."""
    run_cli(*_args("grpo.yaml", tiny_model, tiny_rm, tiny_data, tmp_path / "local", "actor.device=cpu"))
    run_cli(*_args("grpo.yaml", tiny_model, tiny_rm, tiny_data, tmp_path / "ray", "actor.device=cpu", *TWO_PER_ROLE,
                   "distributed.colocate_all_models=true", "distributed.ref_reward_offload=true",
                   "distributed.rollout_sleep=true"))
    _same_metrics(tmp_path / "local", tmp_path / "ray")
    assert all(r["rollout/engine0_items"] + r["rollout/engine1_items"] == 2 for r in metrics(tmp_path / "ray"))


def _popen(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), TURBORLHF_THREADS="1", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "turborlhf", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def _wait_for(pred, proc: subprocess.Popen, log: Path, timeout: float = 240.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(f"run ended early (rc {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"timed out waiting:\n{log.read_text()[-3000:]}")


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"run did not stop within {timeout} s:\n{log.read_text()[-3000:]}")


def test_killed_worker_stops_run_with_named_error_and_resumable_checkpoint(tiny_model, tiny_rm, tiny_data, tmp_path):
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    out, log = tmp_path / "killed", tmp_path / "killed.log"
    steps = ["train.max_steps=60", "train.save_every=1", "train.keep_checkpoints=2"]
    proc = _popen(_args("grpo.yaml", tiny_model, tiny_rm, tiny_data, out, *steps, *TWO_PER_ROLE,
                        "distributed.colocate_all_models=true"), log)
    pids = _wait_for(lambda: re.findall(r"2 worker\(s\), pids \[(\d+), (\d+)\]", log.read_text()), proc, log)
    _wait_for(lambda: (out / "checkpoints" / "step-000002").exists(), proc, log)
    os.kill(int(pids[0][1]), signal.SIGKILL)                      # rank 1 of every colocated role
    rc = _finish(proc, log)
    text = log.read_text()
    assert rc == 1, text[-3000:]
    err = re.search(r"error: (\w+) worker rank 1 \(pid (\d+).*died during (\w+)", text)
    assert err and err.group(2) == pids[0][1], text[-3000:]
    assert "last complete checkpoint" in text
    # the newest checkpoint is complete and resumes (here on the local backend: checkpoints hold full state)
    ckpt = latest_checkpoint(out)
    step = load_trainer_state(ckpt)["step"]
    assert 2 <= step < 60
    resumed = ["train.max_steps=%d" % (step + 1), "train.save_every=1"]
    run_cli(*_args("grpo.yaml", tiny_model, tiny_rm, tiny_data, out, *resumed), "--resume-changed")
    run_cli(*_args("grpo.yaml", tiny_model, tiny_rm, tiny_data, tmp_path / "ref", *resumed))
    assert max_weight_diff(weights(out), weights(tmp_path / "ref")) < 1e-5
    assert not list((out / "checkpoints").glob(".*tmp*"))      # no half-written checkpoint left behind


def test_ray_resume_restores_the_workers_random_state(tiny_model, tiny_rm, tiny_data, tmp_path):
    """LoRA dropout draws from the actor worker's own process under Ray, whose random state the
    driver's checkpoint does not hold: a resumed run reseeded it and diverged from step 3 (max
    weight difference 0.046); each rank's state is in its worker checkpoint now."""
    from tests.e2e.helpers import rewind_to

    out = tmp_path / "ray"
    args = _args("grpo.yaml", tiny_model, tiny_rm, tiny_data, out, "distributed.backend=ray",
                 "distributed.timeout_s=180", "actor.lora.rank=4", "actor.lora.dropout=0.3", "train.max_steps=3",
                 "train.save_every=1", "train.keep_checkpoints=3", "actor.device=cpu")
    run_cli(*args)
    final = weights(out)
    rewind_to(out, 2)
    run_cli(*args, "--resume")
    assert max_weight_diff(final, weights(out)) < 1e-6


def test_sigterm_keeps_resumable_checkpoint(tiny_model, tiny_rm, tiny_data, tmp_path):
    out, log = tmp_path / "term", tmp_path / "term.log"
    args = _args("ppo.yaml", tiny_model, tiny_rm, tiny_data, out, "train.max_steps=200", "train.save_every=0",
                 "log.progress=true")
    proc = _popen(args, log)
    _wait_for(lambda: re.search(r"\[ppo\] 2/200", log.read_text()), proc, log)
    os.killpg(proc.pid, signal.SIGTERM)
    rc = _finish(proc, log)
    text = log.read_text()
    assert rc == 143 and "continue with --resume" in text, text[-2000:]             # 128 + SIGTERM
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    step = load_trainer_state(latest_checkpoint(out))["step"]
    assert 2 <= step < 200
    run_cli(*_args("ppo.yaml", tiny_model, tiny_rm, tiny_data, out, f"train.max_steps={step + 1}"),
            "--resume-changed")
    run_cli(*_args("ppo.yaml", tiny_model, tiny_rm, tiny_data, tmp_path / "ref", f"train.max_steps={step + 1}"))
    assert max_weight_diff(weights(out), weights(tmp_path / "ref")) < 1e-5


def test_an_api_trainer_left_open_on_ray_keeps_its_steps_at_exit(tiny_model, tmp_path):
    """The exit path of a trainer left open (`turborlhf.api`) saves as close() does; on Ray it ran
    after Ray's own exit handler had shut the workers down ("Can't find actor"), and the steps were lost."""
    out = tmp_path / "o"
    args = {"rollout": {"max_new_tokens": 8, "batch_size": 16}, "algo": {"prompts_per_step": 2},
            "train": {"max_steps": 3, "micro_batch_size": 4}, "actor": {"dtype": "fp32", "device": "cpu"},
            "log": {"tensorboard": False, "progress": False}, "output_dir": str(out),
            "distributed": {"backend": "ray", "timeout_s": 180}}
    rows = [{"prompt": f"What is {i} plus {i}?"} for i in range(8)]
    script = tmp_path / "script.py"
    script.write_text("import turborlhf as T\n"
                      "def short(completions, **kwargs):\n    return [-len(c) / 100.0 for c in completions]\n"
                      f"t = T.GRPOTrainer(model={str(tiny_model)!r}, reward_funcs=short, train_dataset={rows!r}, "
                      f"args={args!r})\nt.step()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [c.name for c in (out / "checkpoints").glob("step-*")] == ["step-000001"], r.stderr[-3000:]
    assert "kept a checkpoint" in r.stderr
