"""engine.lifecycle without a model: which config changes --resume refuses, and the step iterator's
checkpoints and signal handling."""
from __future__ import annotations

import os
import signal

import pytest

from turborlhf.engine.lifecycle import RunInterrupted, checkpointed_steps, config_changes


def test_config_changes_names_fields_and_skips_exempt_ones():
    old = {"optim": {"lr": 1e-3, "schedule": "cosine"}, "train": {"max_steps": 6, "threads": 2, "save_every": 0},
           "log": {"progress": True}, "output_dir": "runs/a", "distributed": {"backend": "local"}}
    new = {"optim": {"lr": 1e-3, "schedule": "cosine"}, "train": {"max_steps": 12, "threads": 1, "save_every": 5},
           "log": {"progress": False}, "output_dir": "/abs/runs/a", "distributed": {"backend": "ray"},
           "reference": "x"}
    assert config_changes(old, new) == {"train.max_steps": (6, 12), "reference": ("<unset>", "x")}
    assert config_changes(old, old) == {}
    # distributed.* is placement, except the rollout work item size, which sets the sampling seeds
    assert config_changes({"distributed": {"rollout_chunk": 0}}, {"distributed": {"rollout_chunk": 4}}) == {
        "distributed.rollout_chunk": (0, 4)}


def test_checkpointed_steps_saves_periodically_and_after_the_last_step():
    """The last step's checkpoint is written inside the loop, under its signal handlers (it was the
    caller's, after them: a SIGTERM while writing it lost the run)."""
    saved = []
    steps = list(checkpointed_steps(0, 5, lambda d: saved.append(d) or f"ckpt-{d}", 2, "t"))
    assert steps == [0, 1, 2, 3, 4] and saved == [2, 4, 5]
    saved.clear()
    assert list(checkpointed_steps(3, 5, lambda d: saved.append(d), 0, "t")) == [3, 4] and saved == [5]
    saved.clear()
    assert list(checkpointed_steps(5, 5, lambda d: saved.append(d), 1, "t")) == [] and saved == []  # resumed at end


def test_a_signal_while_the_last_checkpoint_is_written_stops_after_it():
    def save(done):
        if done == 3:
            os.kill(os.getpid(), signal.SIGTERM)          # arrives mid-write: the write still completes
        return f"ckpt-{done}"
    with pytest.raises(RunInterrupted, match=r"SIGTERM after the last step 3: kept checkpoint ckpt-3"):
        list(checkpointed_steps(0, 3, save, 0, "t"))


def test_a_signal_while_a_periodic_checkpoint_is_written_stops_after_it():
    """A signal that arrived while a save_every checkpoint was being written ran one more whole
    step (a PPO step takes minutes; a preempted job's grace period may not) and saved again."""
    saved, ran = [], []

    def save(done):
        saved.append(done)
        if done == 2:
            os.kill(os.getpid(), signal.SIGTERM)          # arrives mid-write: the write still completes
        return f"ckpt-{done}"
    with pytest.raises(RunInterrupted, match=r"SIGTERM at step 2/10: kept checkpoint ckpt-2") as e:
        for step in checkpointed_steps(0, 10, save, 2, "t"):
            ran.append(step)
    assert ran == [0, 1] and saved == [2] and e.value.exit_code == 143


def test_signal_finishes_the_step_saves_and_raises_then_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    saved, ran = [], []
    with pytest.raises(RunInterrupted, match=r"SIGTERM at step 2/10: kept checkpoint ckpt-2") as e:
        for step in checkpointed_steps(0, 10, lambda d: saved.append(d) or f"ckpt-{d}", 0, "t"):
            ran.append(step)
            if step == 1:
                os.kill(os.getpid(), signal.SIGTERM)      # arrives mid-step: the step still completes
                ran.append("after kill")
    assert ran == [0, 1, "after kill"] and saved == [2] and e.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_run_on_a_used_output_dir_is_refused(tmp_path):
    """Nothing stopped a second run on the output_dir of a running one: it deleted the first run's
    checkpoints and both wrote one metrics.jsonl. The directory is locked for the run's process now;
    the same process may take it again (a Python session that trains, then resumes)."""
    import subprocess
    import sys

    from turborlhf.engine.lifecycle import lock_output_dir
    from turborlhf.errors import UserError

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from turborlhf.engine.lifecycle import lock_output_dir; "
                               f"lock_output_dir(Path({str(out)!r})); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=rf"output_dir {out} is in use by a running turborlhf run "
                                            rf"\(pid {holder.pid}\)"):
            lock_output_dir(out)
    finally:
        holder.kill()
        holder.wait()
    lock_output_dir(out)            # the holder is gone: free
    lock_output_dir(out)            # and this process may take it again
    from turborlhf.engine.lifecycle import unlock_output_dir
    unlock_output_dir(out)          # released (a Python session's trainer, once its run ended)
    other = subprocess.run([sys.executable, "-c", "from pathlib import Path; from turborlhf.engine.lifecycle import "
                            f"lock_output_dir; lock_output_dir(Path({str(out)!r}))"], capture_output=True, text=True)
    assert other.returncode == 0, other.stderr


def test_each_changed_resume_keeps_the_config_before_it(tmp_path):
    """A second --resume-changed overwrote config.before-resume.yaml: the run's original config was
    lost. The first stays; each later one keeps its predecessor as config.before-resume.N.yaml."""
    import yaml

    from turborlhf.config import SFTConfig, config_to_dict
    from turborlhf.engine.lifecycle import _check_resume_config, allow_config_change

    def cfg(max_steps):
        return SFTConfig(train={"max_steps": max_steps})

    def steps(name):
        return yaml.safe_load((tmp_path / name).read_text())["train"]["max_steps"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg(3)), sort_keys=False))
    with allow_config_change():
        for n in (4, 5, 6):
            _check_resume_config(cfg(n), tmp_path, tmp_path / "checkpoints" / "step-000001", "t")
            (tmp_path / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg(n)), sort_keys=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.before-resume.2.yaml", "config.before-resume.3.yaml", "config.before-resume.yaml", "config.yaml"]
    assert [steps("config.before-resume.yaml"), steps("config.before-resume.2.yaml"),
            steps("config.before-resume.3.yaml"), steps("config.yaml")] == [3, 4, 5, 6]


def test_a_resume_never_continues_an_earlier_runs_checkpoint(tiny_model, tmp_path, capsys):
    """A fresh run that starts from an earlier run's checkpoint in its own output_dir keeps that
    run's checkpoints. Killed before its own first save, its --resume continued the earlier run's
    checkpoint with the new config: config.yaml was already the new run's, so nothing differed.
    --resume takes the run's own checkpoints only; with none yet it starts from step 0, naming
    the earlier run's it leaves."""
    import shutil

    from turborlhf.commands.export import ExportError, resolve_model_dir
    from turborlhf.config import SFTConfig
    from turborlhf.engine.checkpoint import latest_checkpoint, save_checkpoint
    from turborlhf.engine.lifecycle import start_run, unlock_output_dir

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    out = tmp_path / "run"

    def cfg(model, lr):
        return SFTConfig(model={"name_or_path": str(model)}, data={"train_file": str(data)}, output_dir=str(out),
                         optim={"lr": lr})

    def model_dir(d):
        shutil.copytree(tiny_model, d)

    def start(model, lr, resume):
        try:
            return start_run(cfg(model, lr), resume, "t")[1]
        finally:
            unlock_output_dir(out)          # each start is a process of its own
    start(tiny_model, 1e-3, False)                                  # run A: 4 steps
    save_checkpoint(out, 4, {"policy": model_dir}, None, {"step": 4})
    earlier = out / "checkpoints" / "step-000004"
    assert start(tiny_model, 1e-3, True) == earlier                 # A's own --resume
    start(earlier / "policy", 5e-4, False)                          # run B from A's checkpoint, killed
    capsys.readouterr()
    assert start(earlier / "policy", 5e-4, True) is None
    err = capsys.readouterr().err
    assert "starting from step 0" in err and "step-000004" in err and "earlier run" in err
    assert latest_checkpoint(out) is None and earlier.is_dir()      # kept: B reads it
    with pytest.raises(ExportError, match=r"no complete checkpoint of its run \(step-000004: an earlier run's"):
        resolve_model_dir(out)                                      # `turborlhf export` of the run: the same
    save_checkpoint(out, 2, {"policy": model_dir}, None, {"step": 2})
    assert start(earlier / "policy", 5e-4, True) == out / "checkpoints" / "step-000002"
