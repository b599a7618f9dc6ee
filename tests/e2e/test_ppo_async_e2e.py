"""Asynchronous rollouts (``rollout.max_staleness``, `turborlhf.trainers.ppo.async_rollout`) on the tiny GRPO
config: 0 is the synchronous trainer exactly; 1 trains on rollouts of the weights before the last
update (staleness metric, IS correction fields, different weights); a run stopped after a step
with a pending rollout and resumed equals the uninterrupted one and does not regenerate it; a
stuck rollout stops the run with `RolloutTimeoutError`; bad configs name the field; Ray."""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from tests.e2e.helpers import REPO, max_weight_diff, metrics, rewind_to, run_cli, weights
from turborlhf.cli import main
from turborlhf.config import ConfigError, PPOConfig, load_config

GRPO_YAML = REPO / "configs/tiny/grpo.yaml"
# the correction max_staleness > 0 requires (decoupled PPO: engine log-probs = behaviour policy)
TIS = ["algo.rollout_is=tis", "algo.rollout_is_threshold=2.0"]


def _args(tiny_model, tiny_rm, tiny_data, out, *extra) -> list[str]:
    return ["ppo", "--config", str(GRPO_YAML), f"actor.name_or_path={tiny_model}", f"reward_model={tiny_rm}",
            f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}", "data.max_samples=32", f"output_dir={out}",
            "log.tensorboard=false", "log.progress=false", "train.threads=1", *extra]


def _run(tiny_model, tiny_rm, tiny_data, out, *extra) -> list[dict]:
    run_cli(*_args(tiny_model, tiny_rm, tiny_data, out, *extra))
    return [r for r in metrics(out) if "rollout/reward_mean" in r]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for ra, rb in zip(a, b):
        keys = [k for k in ra if not k.startswith("timing/") and k != "rollout/tokens_per_s"]
        assert set(keys) == {k for k in rb if not k.startswith("timing/") and k != "rollout/tokens_per_s"}
        for k in keys:
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (["rollout.max_staleness=1"], "algo.rollout_is"),                                   # no IS correction
    (["rollout.max_staleness=1", *TIS, "distributed.rollout_sleep=true"], "distributed.rollout_sleep"),
    (["rollout.max_staleness=-1", *TIS], "rollout.max_staleness"),
])
def test_bad_async_configs_name_the_field(overrides, field, tmp_path):
    args = _args("m", "rm", tmp_path, tmp_path / "x", *overrides)[3:]
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(PPOConfig, GRPO_YAML, args)


def test_max_staleness_is_a_ppo_field_only():
    from turborlhf.config import RolloutCfg

    assert PPOConfig.model_fields["rollout"].default_factory().max_staleness == 0
    assert "max_staleness" not in RolloutCfg.model_fields        # rejection sampling etc. do not take it


# ----------------------------------------------------------------------------------------------
# max_staleness 0 = the synchronous trainer; 1 = one-step-off-policy
# ----------------------------------------------------------------------------------------------

def test_staleness_0_is_the_sync_trainer_and_1_is_one_step_off(tiny_model, tiny_rm, tiny_data, tmp_path):
    steps = ["train.max_steps=3", *TIS]
    sync = _run(tiny_model, tiny_rm, tiny_data, tmp_path / "sync", *steps)
    zero = _run(tiny_model, tiny_rm, tiny_data, tmp_path / "zero", *steps, "rollout.max_staleness=0")
    _same(sync, zero)
    assert max_weight_diff(weights(tmp_path / "sync"), weights(tmp_path / "zero")) == 0.0
    assert "rollout/staleness" not in zero[0]

    off = _run(tiny_model, tiny_rm, tiny_data, tmp_path / "async", *steps, "rollout.max_staleness=1")
    assert [r["rollout/staleness"] for r in off] == [0.0, 1.0, 1.0]
    for r in off:
        for k in ("timing/rollout_wait", "rollout/is_weight_mean", "rollout/is_clipfrac", "rollout/mismatch_kl",
                  "sync/logprob_mean_diff", "policy/loss"):
            assert math.isfinite(r[k]), (k, r)
        assert r["sync/logprob_mean_diff"] <= 0.05                   # every push still verified
        assert r["timing/rollout_wait"] >= 0
    # step 1 is the sync trainer's (same weights, same seeds); step 2 trains on θ_0's samples, not θ_1's
    assert off[0]["rollout/reward_mean"] == sync[0]["rollout/reward_mean"]
    assert off[0]["rollout/mismatch_kl"] < 1e-6                      # fp32 engine = trainer: no staleness yet
    assert off[1]["rollout/mismatch_kl"] > 100 * max(sync[1]["rollout/mismatch_kl"], 1e-12)   # stale samples
    # the IS weight π_old/μ: 1 on fresh samples, not 1 on stale ones (it corrects them)
    assert abs(off[0]["rollout/is_weight_mean"] - 1) < 1e-6 < abs(off[1]["rollout/is_weight_mean"] - 1)
    assert max_weight_diff(weights(tmp_path / "sync"), weights(tmp_path / "async")) > 1e-7


# ----------------------------------------------------------------------------------------------
# Resume: the pending rollout is saved with the checkpoint and trained on, not regenerated
# ----------------------------------------------------------------------------------------------

def test_resume_keeps_the_pending_rollouts(tiny_model, tiny_rm, tiny_data, tmp_path, monkeypatch):
    from turborlhf.engine.checkpoint import load_trainer_state
    from turborlhf.trainers.ppo import roles

    out = tmp_path / "run"
    extra = ["train.max_steps=4", "train.save_every=1", "train.keep_checkpoints=4", "rollout.max_staleness=1", *TIS]
    full = _run(tiny_model, tiny_rm, tiny_data, out, *extra)
    final = weights(out)
    saved = load_trainer_state(out / "checkpoints" / "step-000002")["async_rollouts"]
    assert [b["step"] for b in saved["batches"]] == [2] and saved["batches"][0]["version"] == 1
    assert len(saved["batches"][0]["rollouts"]["responses"]) == 8 and saved["batches"][0]["rollouts"]["logprobs"]

    # crash after step 2, resume: the rollouts of step 3 come from the checkpoint (θ_1's), not from θ_2
    rewind_to(out, 2)
    calls = []
    real = roles.RolloutWorker.generate
    monkeypatch.setattr(roles.RolloutWorker, "generate",
                        lambda self, prompts, params: calls.append(params.seed) or real(self, prompts, params))
    resumed = _run(tiny_model, tiny_rm, tiny_data, out, *extra, "--resume")
    assert max_weight_diff(final, weights(out)) == 0.0
    _same(full[2:], resumed[-2:])
    assert len(calls) == 1           # only step 4's batch is generated (step 3's came from the checkpoint)

    # the same resume without the saved rollouts (regenerated with θ_2) would train differently
    rewind_to(out, 2)
    ckpt = out / "checkpoints" / "step-000002"
    st = load_trainer_state(ckpt)
    st["async_rollouts"]["batches"] = []
    torch.save(st, ckpt / "trainer_state.pt")
    _run(tiny_model, tiny_rm, tiny_data, out, *extra, "--resume")
    assert max_weight_diff(final, weights(out)) > 1e-7

    # --resume-changed with another group size: the saved batch (4 samples a prompt) is generated
    # again, not regrouped by 2 (baselines over pairs, silently) nor reshaped by 3 (a crash)
    out = tmp_path / "changed"
    _run(tiny_model, tiny_rm, tiny_data, out, *extra)
    for g in (2, 3):
        rewind_to(out, 2)
        calls.clear()
        _run(tiny_model, tiny_rm, tiny_data, out, *extra, f"algo.n_samples_per_prompt={g}", "--resume-changed")
        assert len(calls) == 2


def test_sigterm_mid_run_then_resume_equals_uninterrupted(tiny_model, tiny_rm, tiny_data, tmp_path, monkeypatch):
    """A signal during a step, with the next step's rollouts generated in the background by the
    end of it, saves them with the checkpoint; the resumed run ends with the uninterrupted run's
    weights. (A generation still running then is not waited for: the test below.)"""
    import os
    import signal
    from concurrent.futures import wait as futures_wait

    from turborlhf.trainers.ppo.async_rollout import RolloutPipeline

    extra = ["train.max_steps=3", "rollout.max_staleness=1", *TIS]
    _run(tiny_model, tiny_rm, tiny_data, tmp_path / "ref", *extra)
    from turborlhf.trainers.ppo import driver

    real = driver.ppo_update
    real_launch = RolloutPipeline._launch
    launched, n = [], []

    def launch(self, step):
        real_launch(self, step)
        launched.append(self.pending[1])

    def update_then_signal(*a, **k):           # SIGTERM while step 1 trains (step 2's rollouts pending)
        n.append(1)
        if len(n) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        out = real(*a, **k)
        if len(n) == 1:
            futures_wait(launched, timeout=120)     # step 2's rollouts are ready by the end of step 1
        return out

    monkeypatch.setattr(RolloutPipeline, "_launch", launch)

    out = tmp_path / "term"
    driver.ppo_update = update_then_signal
    try:
        assert main(_args(tiny_model, tiny_rm, tiny_data, out, *extra)) == 143     # 128 + SIGTERM
    finally:
        driver.ppo_update = real
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    st = load_trainer_state(latest_checkpoint(out))
    assert st["step"] == 1 and [b["step"] for b in st["async_rollouts"]["batches"]] == [1]
    _run(tiny_model, tiny_rm, tiny_data, out, *extra, "--resume")
    assert max_weight_diff(weights(tmp_path / "ref"), weights(out)) == 0.0


def test_sigterm_does_not_wait_for_a_generation_still_running(tiny_model, tiny_rm, tiny_data, tmp_path,
                                                              monkeypatch):
    """SIGTERM while step 1 trains and step 2's rollouts are still being generated: the run waited
    for them (up to distributed.timeout_s) before saving, past a scheduler's grace period
    (Kubernetes: 30 s, then SIGKILL). Now the generation is abandoned: step 1 is saved without that
    batch (not pushed: the engine is busy; the generation is cancelled), exit 143, and --resume
    generates it again."""
    import os
    import signal

    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state
    from turborlhf.trainers.ppo import driver, roles

    real_generate, real_update = roles.RolloutWorker.generate, driver.ppo_update
    release, returned, n, signalled, hung = threading.Event(), [], [], [], []

    def second_hangs(self, prompts, params):        # step 2's batch (in the background) hangs until released
        n.append(1)
        if len(n) == 2:
            hung.append(threading.current_thread())
            t0 = time.monotonic()
            while not release.wait(0.05) and time.monotonic() - t0 < 45:
                pass
            returned.append(time.monotonic())
        return real_generate(self, prompts, params)

    def update_then_signal(*a, **k):                # SIGTERM while step 1 trains
        if not signalled:
            signalled.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
        return real_update(*a, **k)

    monkeypatch.setattr(roles.RolloutWorker, "generate", second_hangs)
    monkeypatch.setattr(driver, "ppo_update", update_then_signal)
    out = tmp_path / "run"
    extra = ["train.max_steps=3", "train.save_every=50", "rollout.max_staleness=1", *TIS]
    try:
        assert main(_args(tiny_model, tiny_rm, tiny_data, out, *extra, "distributed.timeout_s=300")) == 143
        stopped = time.monotonic()
        assert not returned, "the save waited for the generation still running"
    finally:
        release.set()
    assert stopped - signalled[0] < 30
    assert not hung[0].is_alive(), "the abandoned generation was not cancelled"
    st = load_trainer_state(latest_checkpoint(out))
    assert st["step"] == 1 and st["async_rollouts"]["batches"] == []      # the abandoned batch is not saved
    monkeypatch.setattr(roles.RolloutWorker, "generate", real_generate)
    monkeypatch.setattr(driver, "ppo_update", real_update)
    rows = _run(tiny_model, tiny_rm, tiny_data, out, *extra, "--resume")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["rollout/staleness"] == 0.0     # generated again


_BUSY_CHILD = """
import os, signal, sys, time
from turborlhf.trainers.ppo import driver, roles
real_generate, real_update, n = roles.RolloutWorker.generate, driver.ppo_update, [0]
def busy(self, prompts, params):          # step 2's batch keeps the engine computing for a minute
    n[0] += 1
    t0 = time.monotonic()
    while n[0] == 2 and time.monotonic() - t0 < 60:
        real_generate(self, prompts, params)
    return real_generate(self, prompts, params)
def update(*a, **k):                      # with SIGTERM: sent while step 1 trains
    if {signal} and n[0] <= 2 and not getattr(update, "sent", False):
        update.sent = True
        os.kill(os.getpid(), signal.SIGTERM)
    return real_update(*a, **k)
roles.RolloutWorker.generate, driver.ppo_update = busy, update
from turborlhf.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("how, code, message", [
    ("signal", 143, "stopped: SIGTERM at step 1/3: kept checkpoint"),
    ("timeout", 1, "error: the rollouts of step 2 (generated in the background"),
])
def test_the_exit_code_survives_a_generation_left_inside_torch(how, code, message, tiny_model, tiny_rm, tiny_data,
                                                               tmp_path):
    """A real process whose run stops (SIGTERM, or the generation's timeout) while the background
    generation computes inside torch: the interpreter exited with that thread in a torch operation
    and aborted now and then ("terminate called without an active exception", exit code 134). Now
    the run cancels the generation and exits at once with its own code."""
    import os
    import subprocess
    import sys

    from turborlhf.engine.checkpoint import latest_checkpoint

    out = tmp_path / "run"
    args = _args(tiny_model, tiny_rm, tiny_data, out, "train.max_steps=3", "rollout.max_staleness=1", *TIS,
                 f"distributed.timeout_s={300 if how == 'signal' else 3}")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), TURBORLHF_THREADS="1", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    t0 = time.monotonic()
    child = subprocess.run([sys.executable, "-c", _BUSY_CHILD.format(signal=how == "signal"), *args],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert child.returncode == code, child.stderr[-2000:]
    assert message in child.stderr and "terminate called" not in child.stderr
    assert time.monotonic() - t0 < 55               # the generation would have run for 60 s
    assert latest_checkpoint(out).name == "step-000001"


# ----------------------------------------------------------------------------------------------
# A stuck rollout: a named error after distributed.timeout_s, not a hang
# ----------------------------------------------------------------------------------------------

def test_stuck_rollout_raises_the_named_timeout(tiny_model, tiny_rm, tiny_data, tmp_path, monkeypatch, capsys):
    from turborlhf.distributed.group import WorkerError, WorkerTimeoutError
    from turborlhf.trainers.ppo import roles
    from turborlhf.trainers.ppo import train
    from turborlhf.trainers.ppo.async_rollout import RolloutTimeoutError

    real = roles.RolloutWorker.generate
    release = threading.Event()
    n = []

    def stuck_after_first(self, prompts, params):      # step 1's batch is fine; step 2's hangs (until released)
        n.append(1)
        if len(n) > 1:
            release.wait(60)
        return real(self, prompts, params)

    monkeypatch.setattr(roles.RolloutWorker, "generate", stuck_after_first)
    args = _args(tiny_model, tiny_rm, tiny_data, tmp_path / "stuck", "rollout.max_staleness=1", *TIS,
                 "distributed.timeout_s=2")
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError, match=r"rollouts of step 2 .* not ready within 2 s "
                                              r"\(distributed\.timeout_s\)") as err:
            train(load_config(PPOConfig, GRPO_YAML, args[3:]))
    finally:
        release.set()
    assert time.monotonic() - t0 < 50
    assert isinstance(err.value.__cause__, RolloutTimeoutError) and isinstance(err.value.__cause__, WorkerTimeoutError)
    assert err.value.role == "rollout"
    # the CLI: one line naming it, exit code 1
    n.clear()
    release.clear()
    try:
        assert main(_args(tiny_model, tiny_rm, tiny_data, tmp_path / "stuck1", "rollout.max_staleness=1", *TIS,
                          "distributed.timeout_s=2")) == 1
    finally:
        release.set()
    assert "error: the rollouts of step 2" in capsys.readouterr().err


def test_a_timed_out_generation_keeps_the_checkpoint_of_the_step_trained_meanwhile(tiny_model, tiny_rm, tiny_data,
                                                                                   tmp_path, monkeypatch, capsys):
    """Step 2's rollouts, generated while step 1 trains, hang past distributed.timeout_s. The
    timeout was raised at the wait before step 1's push, so step 1's update and checkpoint were lost
    (every step since the last checkpoint). Now step 1 is saved whatever train.save_every is (not
    pushed: the engine may still be busy), the run stops with the timeout's one-line error and the
    checkpoint's name, and --resume generates step 2's batch again."""
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state
    from turborlhf.trainers.ppo import roles

    real = roles.RolloutWorker.generate
    release = threading.Event()
    n = []

    def second_hangs(self, prompts, params):        # step 1's batch is fine; step 2's hangs (until released)
        n.append(1)
        t0 = time.monotonic()
        while len(n) == 2 and not release.wait(0.05) and time.monotonic() - t0 < 60:
            pass
        return real(self, prompts, params)

    monkeypatch.setattr(roles.RolloutWorker, "generate", second_hangs)
    out = tmp_path / "run"
    extra = ["train.max_steps=3", "train.save_every=50", "rollout.max_staleness=1", *TIS]
    try:
        assert main(_args(tiny_model, tiny_rm, tiny_data, out, *extra, "distributed.timeout_s=2")) == 1
    finally:
        release.set()
    err = capsys.readouterr().err
    assert ("error: the rollouts of step 2 (generated in the background, rollout.max_staleness=1) were not ready "
            "within 2 s (distributed.timeout_s)\n") in err
    ckpt = latest_checkpoint(out)
    assert ckpt is not None, "the step trained while the generation hung was not saved"
    assert f"last complete checkpoint: {ckpt}" in err
    st = load_trainer_state(ckpt)
    assert st["step"] == 1 and st["async_rollouts"]["batches"] == []
    monkeypatch.setattr(roles.RolloutWorker, "generate", real)
    rows = _run(tiny_model, tiny_rm, tiny_data, out, *extra, "--resume")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["rollout/staleness"] == 0.0     # generated again


@pytest.mark.parametrize("save_every", [1, 50])
def test_a_failed_generation_keeps_the_checkpoint_of_the_step_trained_meanwhile(tiny_model, tiny_rm, tiny_data,
                                                                                tmp_path, monkeypatch, save_every):
    """Step 2's rollouts, generated while step 1 trains, fail. The pipeline raised the error at the
    wait before step 1's push, so step 1's update and checkpoint were lost (with train.save_every:
    50, every step since the last one). Now step 1 is pushed and saved whatever train.save_every
    is, the run stops, and --resume generates step 2's batch again."""
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state
    from turborlhf.trainers.ppo import roles

    real = roles.RolloutWorker.generate
    n = []

    def second_fails(self, prompts, params):        # step 1's batch is fine; step 2's (in the background) fails
        n.append(1)
        if len(n) == 2:
            raise RuntimeError("engine out of memory")
        return real(self, prompts, params)

    monkeypatch.setattr(roles.RolloutWorker, "generate", second_fails)
    out = tmp_path / "run"
    extra = ["train.max_steps=3", f"train.save_every={save_every}", "rollout.max_staleness=1", *TIS]
    assert main(_args(tiny_model, tiny_rm, tiny_data, out, *extra)) == 1
    assert latest_checkpoint(out) is not None, "the step trained while the generation failed was not saved"
    st = load_trainer_state(latest_checkpoint(out))
    assert st["step"] == 1 and st["async_rollouts"]["batches"] == []
    monkeypatch.setattr(roles.RolloutWorker, "generate", real)
    rows = _run(tiny_model, tiny_rm, tiny_data, out, *extra, "--resume")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["rollout/staleness"] == 0.0     # generated again


def test_wait_keeps_a_generation_error_or_timeout_for_after_the_checkpoint():
    """`wait` never raises for the generation: a failed one's error (the engines are idle: the push
    and the checkpoint go ahead), a generation's own WorkerTimeoutError and the pipeline's timeout
    (an engine may still be busy: no push, `can_push` False) are kept in ``failed``, which the
    driver raises once the step is checkpointed (`state` works: the batch is not in it)."""
    import time as _time
    from concurrent.futures import Future
    from types import SimpleNamespace as NS

    from turborlhf.distributed.group import WorkerError, WorkerTimeoutError
    from turborlhf.trainers.ppo.async_rollout import RolloutPipeline, RolloutTimeoutError

    def pipeline(timeout_s=5.0):
        cfg = NS(rollout=NS(max_staleness=1), algo=NS(critic_warmup_steps=0), distributed=NS(timeout_s=timeout_s))
        return RolloutPipeline(cfg, NS(backend="ray"), None, [[1]], [[0], [0]], None, start=0)

    def pending(pipe, exc=None):
        fut = Future()
        if exc is not None:
            fut.set_exception(exc)
        pipe.pending = (1, fut)

    pipe = pipeline()
    pending(pipe, WorkerError("rollout failed in generate: boom", "rollout", 0, "generate"))
    pipe.wait()                                           # the push and the checkpoint may follow
    assert pipe.pending is None and pipe.can_push() and pipe.state()["batches"] == []
    assert isinstance(pipe.failed, WorkerError)
    with pytest.raises(WorkerError, match="boom"):
        pipe.take(1)

    pipe = pipeline()
    pending(pipe, WorkerTimeoutError("rollout worker rank 0 did not finish a generate item", "rollout", 0, "generate"))
    pipe.wait()
    assert isinstance(pipe.failed, WorkerTimeoutError) and not pipe.can_push() and pipe.state()["batches"] == []

    pipe = pipeline(timeout_s=0.3)
    pending(pipe)                                         # never finishes
    t0 = _time.monotonic()
    pipe.wait()
    assert 0.3 <= _time.monotonic() - t0 < 5
    assert isinstance(pipe.failed, RolloutTimeoutError) and not pipe.can_push() and pipe.state()["batches"] == []
    assert str(pipe.failed) == ("the rollouts of step 2 (generated in the background, rollout.max_staleness=1) were "
                                "not ready within 0.3 s (distributed.timeout_s)")


def test_wait_on_a_stop_signal_keeps_a_ready_batch_and_abandons_a_running_one(monkeypatch):
    """With a stop signal received (`stop_requested`), `wait` returns at once: a batch already
    generated is kept (it goes into the checkpoint), one still running is abandoned (no error, no
    push: `can_push` False; not in `state`, so --resume generates it again)."""
    import time as _time
    from concurrent.futures import Future
    from types import SimpleNamespace as NS

    from turborlhf.trainers.ppo import async_rollout
    from turborlhf.trainers.ppo.async_rollout import RolloutBatch, RolloutPipeline

    monkeypatch.setattr(async_rollout, "stop_requested", lambda: 15)
    cfg = NS(rollout=NS(max_staleness=1), algo=NS(critic_warmup_steps=0), distributed=NS(timeout_s=60.0))

    pipe = RolloutPipeline(cfg, NS(backend="ray"), None, [[1]], [[0], [0]], None, start=0)
    ready = Future()
    ready.set_result(RolloutBatch(1, None, 0, 0.1))
    pipe.pending = (1, ready)
    pipe.wait()
    assert pipe.pending is None and list(pipe.ready) == [1] and pipe.can_push() and pipe.failed is None

    pipe = RolloutPipeline(cfg, NS(backend="ray"), None, [[1]], [[0], [0]], None, start=0)
    pipe.pending = (1, Future())                          # never finishes
    t0 = _time.monotonic()
    pipe.wait()
    assert _time.monotonic() - t0 < 5
    assert pipe.pending is None and pipe.failed is None and not pipe.can_push()
    assert pipe.state()["batches"] == []


def test_close_cancels_a_generation_still_running():
    """`close` raises `GenerationCancelled` in a generation's thread that is still running (pending,
    or abandoned by a timed-out `wait`) and waits for it: the roles are not shut down under it and
    the process does not exit with it inside torch (an abort)."""
    from types import SimpleNamespace as NS

    from turborlhf.trainers.ppo.async_rollout import GenerationCancelled, RolloutPipeline

    cfg = NS(rollout=NS(max_staleness=1), algo=NS(critic_warmup_steps=0), distributed=NS(timeout_s=0.2))
    pipe = RolloutPipeline(cfg, NS(backend="ray"), None, [[1]], [[0], [0], [0]], None, start=0)

    def forever(step, version):             # a generation that never ends by itself
        while True:
            time.sleep(0.01)

    pipe._generate = forever
    pipe._launch(1)
    fut = pipe.pending[1]
    pipe.wait()                             # times out: abandoned, still running
    assert not pipe.can_push() and [t.is_alive() for t, _ in pipe._threads] == [True]
    t0 = time.monotonic()
    pipe.close()
    assert time.monotonic() - t0 < 5 and pipe._threads == []
    assert isinstance(fut.exception(timeout=1), GenerationCancelled)


# ----------------------------------------------------------------------------------------------
# Dynamic sampling in the background thread (reward scoring there), k = 2
# ----------------------------------------------------------------------------------------------

def test_dynamic_sampling_and_two_steps_off(tiny_model, tiny_rm, tiny_data, tmp_path):
    rule = tmp_path / "rule.py"
    rule.write_text("def score(prompts, responses):\n"
                    "    return [0.0 if len(p) % 2 == 0 else float(sum(map(ord, r)) % 7) "
                    "for p, r in zip(prompts, responses)]\n")
    extra = ["reward_model=null", f"rewards=[{{kind: function, path: {rule}:score}}]", "algo.dynamic_sampling=true",
             "algo.kl_coef=0", "train.max_steps=4", *TIS]
    sync = _run(tiny_model, tiny_rm, tiny_data, tmp_path / "sync", *extra)
    two = _run(tiny_model, tiny_rm, tiny_data, tmp_path / "two", *extra, "rollout.max_staleness=2")
    assert [r["rollout/staleness"] for r in two] == [0.0, 1.0, 2.0, 2.0]
    assert all(r["rollout/groups_filled"] == 0 and r["rollout/sampling_rounds"] >= 1 for r in two)
    # steps 1 and 2 sample with θ_0 in both runs (same seeds): same rollouts; the sync run's step 2 is on-policy
    assert two[0]["rollout/reward_mean"] == sync[0]["rollout/reward_mean"]
    assert two[1]["rollout/mismatch_kl"] > 100 * max(sync[1]["rollout/mismatch_kl"], 1e-12)
    assert max_weight_diff(weights(tmp_path / "sync"), weights(tmp_path / "two")) > 1e-7


# ----------------------------------------------------------------------------------------------
# Ray: separate rollout workers generate while the actor trains; same numbers as the local backend
# ----------------------------------------------------------------------------------------------

def test_ray_async_matches_local_async(tiny_model, tiny_rm, tiny_data, tmp_path):
    pytest.importorskip("ray")
    extra = ["train.max_steps=3", "rollout.max_staleness=1", *TIS, "rollout.batch_size=4",
             "actor.device=cpu"]                      # two rollout workers: CPU slots, on a GPU host too
    local = _run(tiny_model, tiny_rm, tiny_data, tmp_path / "local", *extra)
    ray_rows = _run(tiny_model, tiny_rm, tiny_data, tmp_path / "ray", *extra, "distributed.backend=ray",
                    "distributed.timeout_s=180", "distributed.rollout.devices_per_node=2")
    assert [r["rollout/staleness"] for r in ray_rows] == [0.0, 1.0, 1.0]
    assert all(r["rollout/engine0_items"] + r["rollout/engine1_items"] == 2 for r in ray_rows)   # both engines
    for a, b in zip(local, ray_rows):
        for k in ("rollout/reward_mean", "rollout/mismatch_kl", "rollout/is_weight_mean", "policy/loss"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (a["step"], k, a[k], b[k])
    assert max_weight_diff(weights(tmp_path / "local"), weights(tmp_path / "ray")) < 1e-5


def test_ppo_with_critic_and_warmup_counts_actor_updates(tiny_model, tiny_rm, tiny_data, tmp_path):
    """GAE PPO (critic) with a critic warm-up step: the actor does not move at step 1, so the batch of
    step 2 (sampled during step 1) is not stale; step 3's is one actor update behind."""
    run_cli("ppo", "--config", REPO / "configs/tiny/ppo.yaml", f"actor.name_or_path={tiny_model}",
            f"reward_model={tiny_rm}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}", "data.max_samples=32",
            f"output_dir={tmp_path / 'ppo'}", "log.tensorboard=false", "train.threads=1", "algo.critic_warmup_steps=1",
            "rollout.max_staleness=1", *TIS)
    rows = [r for r in metrics(tmp_path / "ppo") if "rollout/reward_mean" in r]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 0.0, 1.0]
    assert "policy/loss" not in rows[0] and all(math.isfinite(r["critic/loss"]) for r in rows)
    assert rows[1]["rollout/mismatch_kl"] < 1e-6 < rows[2]["rollout/mismatch_kl"]


def test_a_bad_push_is_still_caught(tiny_model, tiny_rm, tiny_data, tmp_path, monkeypatch, capsys):
    """The canary check after each push works as in the synchronous trainer: an engine that drops a
    tensor update stops the run with WeightSyncError naming the rollout worker."""
    from turborlhf.trainers.ppo import roles

    real = roles.RolloutWorker.load_weights

    def stale_embedding(self, state):
        real(self, {k: (v + 0.5 if "embed_tokens" in k else v) for k, v in state.items()})

    monkeypatch.setattr(roles.RolloutWorker, "load_weights", stale_embedding)
    assert main(_args(tiny_model, tiny_rm, tiny_data, tmp_path / "bad", "rollout.max_staleness=1", *TIS)) == 1
    assert "rollout failed in check_sync: WeightSyncError" in capsys.readouterr().err


def test_local_roles_are_entered_by_one_thread_at_a_time():
    """`_Serialized`: the background generation thread and the trainer never run inside the same
    local role object at once (without the lock the two calls below overlap)."""
    from turborlhf.distributed.group import LocalGroup
    from turborlhf.trainers.ppo.async_rollout import _Serialized

    class Slow:
        inside, overlapped = 0, False

        def score(self):
            Slow.inside += 1
            Slow.overlapped |= Slow.inside > 1
            time.sleep(0.2)
            Slow.inside -= 1
            return 1

    def two_threads(group):
        Slow.inside, Slow.overlapped = 0, False
        t = threading.Thread(target=group.run, args=("score",))
        t.start()
        group.submit("score").get()
        t.join()
        return Slow.overlapped

    assert two_threads(LocalGroup("reward", Slow()))                 # the hazard is real
    assert not two_threads(_Serialized(LocalGroup("reward", Slow())))


def test_resume_with_another_staleness_names_what_it_drops(tiny_model, tiny_rm, tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    extra = ["train.max_steps=3", "train.save_every=1", "train.keep_checkpoints=3", *TIS]
    _run(tiny_model, tiny_rm, tiny_data, out, *extra, "rollout.max_staleness=1")
    rewind_to(out, 1)
    capsys.readouterr()
    run_cli(*_args(tiny_model, tiny_rm, tiny_data, out, *extra, "rollout.max_staleness=0"), "--resume-changed")
    assert ("--resume: rollout.max_staleness=0: dropping the saved rollouts of step(s) 2; they are generated again"
            in capsys.readouterr().out)
    rewind_to(out, 1)
    run_cli(*_args(tiny_model, tiny_rm, tiny_data, out, *extra, "rollout.max_staleness=1"), "--resume-changed")
    assert "--resume: training on the saved rollouts of step(s) 2 (not generated again)" in capsys.readouterr().out
