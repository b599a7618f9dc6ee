"""Every training command survives SIGTERM/SIGINT: the current step finishes, a resumable checkpoint
is saved (with the default ``save_every=0`` too), the exit code is 128 + the signal, and
``--resume`` finishes the run with the weights of an uninterrupted one.

The signal is real (``os.kill`` of the training process by itself, from a patched
`MetricsLogger.log`, right after step `STOP_AT` is logged), so the test does not depend on timing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, max_weight_diff, metrics, run_cli, weights

STOP_AT = 1

_CHILD = """
import functools, importlib, os, signal, sys
owner = importlib.import_module("{module}")
for name in "{attr}".split(".")[:-1]:
    owner = getattr(owner, name)
leaf = "{attr}".split(".")[-1]
orig, calls = getattr(owner, leaf), [0]
@functools.wraps(orig)
def hooked(*a, **k):
    out = orig(*a, **k)
    calls[0] += 1
    if {when}:
        os.kill(os.getpid(), signal.{sig})
    return out
setattr(owner, leaf, hooked)
from turborlhf.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _signalled_run(args: list[str], sig: str = "SIGTERM", stop: int = STOP_AT,
                   hook: tuple[str, str, str] = ("turborlhf.metrics", "MetricsLogger.log", "a[1] == {stop}")
                   ) -> subprocess.CompletedProcess:
    """Run the CLI in a child that sends itself `sig` when `hook` (module, attribute, condition on
    the call's ``a``/``calls``) is met: by default right after step `stop` is logged."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), TURBORLHF_THREADS="1", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    module, attr, when = hook
    code = _CHILD.format(module=module, attr=attr, when=when.format(stop=stop), sig=sig)
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)


def _commands(name: str, tiny_model: Path, tiny_rm: Path, data: Path) -> list[str]:
    tiny = REPO / "configs/tiny"
    common = ["log.tensorboard=false", "log.progress=false", "train.save_every=0"]
    return {
        "sft": ["sft", "--config", tiny / "sft.yaml", f"model.name_or_path={tiny_model}",
                f"data.train_file={data / 'train_pairs.jsonl'}", "data.max_samples=32", "train.max_steps=3",
                *common],
        "rm": ["rm", "--config", tiny / "rm.yaml", f"model.name_or_path={tiny_model}",
               f"data.train_file={data / 'train_pairs.jsonl'}", "data.max_samples=32", "train.max_steps=3", *common],
        "dpo": ["dpo", "--config", tiny / "dpo.yaml", f"model.name_or_path={tiny_model}",
                f"data.train_file={data / 'train_pairs.jsonl'}", "data.max_samples=32", "train.max_steps=3",
                *common],
        "kto": ["kto", "--config", tiny / "kto.yaml", f"model.name_or_path={tiny_model}",
                f"data.train_file={data / 'train_kto.jsonl'}", "data.max_samples=32", "train.max_steps=3", *common],
        "conditional-sft": ["conditional-sft", "--config", tiny / "conditional_sft.yaml",
                            f"model.name_or_path={tiny_model}", f"reward_model={tiny_rm}",
                            f"data.train_file={data / 'train_pairs.jsonl'}", *common],
        "rejection-sampling": ["rejection-sampling", "--config", tiny / "rejection_sampling.yaml",
                               f"model.name_or_path={tiny_model}", f"reward_model={tiny_rm}",
                               f"data.prompts_file={data / 'train_prompts.jsonl'}", "data.max_samples=16",
                               "algo.rounds=2", *common],
        "ppo": ["ppo", "--config", tiny / "ppo.yaml", f"actor.name_or_path={tiny_model}", f"reward_model={tiny_rm}",
                f"data.prompts_file={data / 'train_prompts.jsonl'}", "data.max_samples=32", "train.max_steps=3",
                *common],
    }[name]


def _with_output(args: list[str], out: Path) -> list[str]:
    return [*args, f"output_dir={out}"]


@pytest.mark.parametrize("name", ["sft", "rm", "dpo", "kto", "conditional-sft", "rejection-sampling", "ppo"])
def test_sigterm_saves_checkpoint_and_resume_matches_uninterrupted(name, tiny_model, tiny_rm, tiny_data, tmp_path):
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    args = _commands(name, tiny_model, tiny_rm, tiny_data)
    out = tmp_path / "stopped"
    res = _signalled_run(_with_output(args, out))
    text = res.stdout + res.stderr
    assert res.returncode == 143, text[-3000:]                              # 128 + SIGTERM
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and f"kept checkpoint {ckpt}" in text, text[-3000:]
    state = load_trainer_state(ckpt)
    assert state.get("step", state.get("round")) == STOP_AT                 # the step in flight finished, no more
    assert not (out / "model.safetensors").exists()                         # no export of an unfinished run

    run_cli(*_with_output(args, out), "--resume")
    run_cli(*_with_output(args, tmp_path / "uninterrupted"))
    assert max_weight_diff(weights(out), weights(tmp_path / "uninterrupted")) < 1e-5
    steps = [r["step"] for r in metrics(out)]
    assert steps == [r["step"] for r in metrics(tmp_path / "uninterrupted")]  # each step logged once


def test_sigint_exits_130_with_checkpoint(tiny_model, tiny_rm, tiny_data, tmp_path):
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    out = tmp_path / "sft"
    res = _signalled_run(_with_output(_commands("sft", tiny_model, tiny_rm, tiny_data), out), "SIGINT")
    assert res.returncode == 130, (res.stdout + res.stderr)[-3000:]
    assert "SIGINT at step 1/3" in res.stderr and load_trainer_state(latest_checkpoint(out))["step"] == 1


def test_signal_in_the_last_step_keeps_it(tiny_model, tiny_rm, tiny_data, tmp_path):
    """A signal during the last step saves it too (the final evaluation and export follow on --resume)."""
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    base = _commands("sft", tiny_model, tiny_rm, tiny_data)
    args = _with_output(base, tmp_path / "sft")
    res = _signalled_run(args, stop=3)
    assert res.returncode == 143 and "SIGTERM at step 3/3" in res.stderr, (res.stdout + res.stderr)[-3000:]
    assert load_trainer_state(latest_checkpoint(tmp_path / "sft"))["step"] == 3
    run_cli(*args, "--resume")
    run_cli(*_with_output(base, tmp_path / "ref"))
    assert max_weight_diff(weights(tmp_path / "sft"), weights(tmp_path / "ref")) < 1e-5


def test_rejection_sampling_stops_inside_a_round_sft_and_resumes_it(tiny_model, tiny_rm, tiny_data, tmp_path):
    """A round (generation, scoring, SFT epochs) takes minutes on a real model: a signal during its
    SFT stops after the current optimizer step, and --resume continues that SFT, not the round."""
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    base = _commands("rejection-sampling", tiny_model, tiny_rm, tiny_data)
    args = _with_output(base, tmp_path / "rs")
    res = _signalled_run(args, hook=("turborlhf.trainers.rejection_sampling", "clip_and_step", "calls[0] == 1"))
    text = res.stdout + res.stderr
    assert res.returncode == 143 and "SIGTERM in round 1/2 after SFT step 1" in text, text[-3000:]
    state = load_trainer_state(latest_checkpoint(tmp_path / "rs"))
    assert state["round"] == 0 and state["sft"]["round"] == 1 and state["sft"]["sft"]["step"] == 1
    run_cli(*args, "--resume")
    run_cli(*_with_output(base, tmp_path / "ref"))
    assert max_weight_diff(weights(tmp_path / "rs"), weights(tmp_path / "ref")) < 1e-5
    rows, ref = metrics(tmp_path / "rs"), metrics(tmp_path / "ref")
    assert [r["step"] for r in rows] == [1, 2]
    for r, q in zip(rows, ref):
        assert r["train/loss"] == pytest.approx(q["train/loss"], rel=1e-5)


def test_resume_without_checkpoint_says_so(tiny_model, tiny_rm, tiny_data, tmp_path, capsys):
    out = tmp_path / "fresh"
    run_cli(*_with_output(_commands("sft", tiny_model, tiny_rm, tiny_data), out), "--resume")
    err = capsys.readouterr().err
    assert f"[sft] --resume: no checkpoint in {out / 'checkpoints'}; starting from step 0" in err
    assert len([r for r in metrics(out) if "train/loss" in r]) == 3


def test_resume_refuses_changed_config_and_keeps_config_yaml(tiny_model, tiny_rm, tiny_data, tmp_path, capsys):
    """Extending a cosine run on --resume made its learning rate jump back up, silently; and the
    refused/failed resume overwrote the run's config.yaml."""
    import yaml

    from turborlhf.cli import main

    out = tmp_path / "sft"
    args = _with_output(_commands("sft", tiny_model, tiny_rm, tiny_data), out) + ["optim.schedule=cosine"]
    run_cli(*args)
    saved = (out / "config.yaml").read_text()
    capsys.readouterr()
    assert main([*map(str, args), "train.max_steps=6", "optim.lr=2e-3", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume from") and len(err.splitlines()) == 1
    assert "train.max_steps: 3 -> 6" in err and "optim.lr: 0.001 -> 0.002" in err and "--resume-changed" in err
    assert (out / "config.yaml").read_text() == saved                       # untouched by the refused resume
    # exempt fields (log.*, threads, save interval) may differ
    run_cli(*args, "log.progress=true", "train.threads=1", "train.save_every=1", "--resume")
    saved = (out / "config.yaml").read_text()
    # a run saved before a field existed resumes when the field is at its default ("auto" fields are
    # this host's choice), but not when it is set to something else
    tree = yaml.safe_load(saved)
    del tree["model"]["device"], tree["optim"]["weight_decay"]
    (out / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    run_cli(*args, "--resume")
    (out / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    assert main([*map(str, args), "optim.weight_decay=0.5", "--resume"]) == 2
    assert "optim.weight_decay: '<unset>' -> 0.5" in capsys.readouterr().err
    (out / "config.yaml").write_text(saved)
    # --resume-changed goes on with the new config, says what changed, keeps the old config beside it
    run_cli(*args, "train.max_steps=4", "--resume-changed")
    err = capsys.readouterr().err
    assert "train.max_steps: 3 -> 4" in err
    assert "its batching changed" not in err       # the steps done are the same ones
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["max_steps"] == 4
    assert (out / "config.before-resume.yaml").read_text() == saved
    assert [r["step"] for r in metrics(out) if "train/loss" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize("name, hook", [("sft", ("turborlhf.trainers.common", "evaluate_nll", "calls[0] == 1")),
                                        ("dpo", ("turborlhf.trainers.dpo", "evaluate", "calls[0] == 1"))])
def test_a_signal_in_the_final_evaluation_finds_the_last_checkpoint(name, hook, tiny_model, tiny_rm, tiny_data,
                                                                     tmp_path):
    """The final evaluation ran after the step loop, where the default handlers are back, and the
    last checkpoint was written after it: with ``save_every=0`` a SIGTERM there lost the whole run.
    Now the checkpoint comes first, and --resume finishes the run as an uninterrupted one."""
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    base = [*_commands(name, tiny_model, tiny_rm, tiny_data), f"data.test_file={tiny_data / 'test_pairs.jsonl'}",
            "data.max_test_samples=4"]
    args = _with_output(base, tmp_path / "run")
    res = _signalled_run(args, hook=hook)
    assert res.returncode != 0, (res.stdout + res.stderr)[-3000:]           # killed in the evaluation
    assert load_trainer_state(latest_checkpoint(tmp_path / "run"))["step"] == 3
    run_cli(*args, "--resume")
    run_cli(*_with_output(base, tmp_path / "ref"))
    assert max_weight_diff(weights(tmp_path / "run"), weights(tmp_path / "ref")) < 1e-5


@pytest.mark.parametrize("name", ["sft", "ppo"])
def test_a_signal_while_the_last_checkpoint_is_written_keeps_it(name, tiny_model, tiny_rm, tiny_data, tmp_path):
    """The last step's checkpoint was written after the step loop, with the default handlers back:
    a SIGTERM while it was being written (here right after its trainer state, before it is moved in
    place) killed the run, and with ``save_every=0`` nothing was kept. It is written inside the loop
    now: the run stops with the checkpoint complete, and --resume finishes it."""
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    args = _with_output(_commands(name, tiny_model, tiny_rm, tiny_data), tmp_path / "run")
    last_state = "str(a[1]).endswith('trainer_state.pt') and 'step-000003' in str(a[1])"   # once, mid-write
    res = _signalled_run(args, hook=("torch", "save", last_state))
    assert res.returncode == 143 and "after the last step 3" in res.stderr, (res.stdout + res.stderr)[-3000:]
    assert load_trainer_state(latest_checkpoint(tmp_path / "run"))["step"] == 3
    run_cli(*args, "--resume")
    assert (tmp_path / "run" / "model.safetensors").exists()
