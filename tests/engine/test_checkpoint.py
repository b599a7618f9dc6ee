"""Checkpoints survive crashes. The crashes here are real: a child process is killed with SIGKILL
in the middle of a save (no `except`/`finally` of ours runs), and the run directory must still
hold the previous checkpoint, loadable, with --resume working; what the kill left behind is
removed on resume or by the next complete save."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import turborlhf.engine.checkpoint as C
from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint

REPO = Path(__file__).resolve().parents[2]

# the child: one complete checkpoint (step 1), then a save of step 2 that stops at `phase` and
# waits to be killed. The pauses wrap the real functions; they only mark where the kill lands.
_CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import turborlhf.engine.checkpoint as C

    out, phase = Path(sys.argv[1]), sys.argv[2]

    def pause():
        print("KILL ME", flush=True)
        time.sleep(600)

    def writer(text, stop=False):
        def write(d):
            d.mkdir(parents=True)
            (d / "weights.txt").write_text(text)
            if stop:
                pause()
        return write

    C.save_checkpoint(out, 1, {"actor": writer("one")}, None, {"step": 1})
    if phase == "latest":           # the checkpoint is in place, `latest` half written
        real_fsync = os.fsync
        def fsync(fd):
            real_fsync(fd)
            if ".latest." in os.readlink(f"/proc/self/fd/{fd}"):
                pause()
        os.fsync = fsync
    if phase == "delete":           # step 2 complete and `latest`, step 1 half deleted (keep=1)
        real_rmtree = C.shutil.rmtree
        def rmtree(path, *a, **kw):
            (Path(path) / "trainer_state.pt").unlink()
            pause()
        C.shutil.rmtree = rmtree
    if phase == "resave":           # step 1 saved again: killed with the old copy renamed aside
        real_replace = C.os.replace
        def replace(src, dst):
            real_replace(src, dst)
            if ".old-" in str(dst):
                pause()
        C.os.replace = replace
        C.save_checkpoint(out, 1, {"actor": writer("one again")}, None, {"step": 1})
    C.save_checkpoint(out, 2, {"actor": writer("two", stop=phase == "write")}, None, {"step": 2})
    print("SAVED", flush=True)
""")


def _env():
    return {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}", "TURBORLHF_THREADS": "1",
            "OMP_NUM_THREADS": "1"}


def _kill_when_told(cmd: list[str], timeout: float = 300) -> None:
    """Run `cmd`, wait for its 'KILL ME' line, SIGKILL it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        for line in proc.stdout:
            if line.strip() == "KILL ME":
                os.kill(proc.pid, signal.SIGKILL)
                break
        else:
            raise AssertionError(f"the child ended without reaching the kill point:\n{proc.stderr.read()[-3000:]}")
        assert proc.wait(timeout=timeout) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _contents(ckpt: Path) -> tuple[int, str]:
    return load_trainer_state(ckpt)["step"], (ckpt / "actor" / "weights.txt").read_text()


def _writer(text):
    def write(d):
        d.mkdir(parents=True)
        (d / "weights.txt").write_text(text)
    return write


def _age(path: Path, seconds: float) -> None:
    st = path.stat()
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


# killed while `latest` is written, step 2 is in place but the save did not finish: `latest` (step 1) rules;
# resave: the only checkpoint was renamed aside for its replacement, which never arrived: it is put back
@pytest.mark.parametrize("phase, survivor", [("write", (1, "one")), ("latest", (1, "one")), ("delete", (2, "two")),
                                            ("resave", (1, "one"))])
def test_sigkill_mid_save_keeps_a_complete_checkpoint_and_the_leftovers_go(tmp_path, phase, survivor):
    _kill_when_told([sys.executable, "-c", _CHILD, str(tmp_path), phase])
    root = tmp_path / "checkpoints"
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    assert leftovers, "the kill left nothing behind: the test did not kill mid-save"
    for p in root.glob(".latest.*"):
        _age(p, 120)                    # a crash's temp file, not a live writer's
    ckpt = latest_checkpoint(tmp_path)  # what --resume does first
    assert _contents(ckpt) == survivor
    assert not [p for p in root.iterdir() if ".old-" in p.name or ".del-" in p.name or p.name.startswith(".latest.")]
    assert all((p / "trainer_state.pt").exists() for p in root.glob("step-*"))
    save_checkpoint(tmp_path, 3, {"actor": _writer("three")}, None, {"step": 3})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000003"]
    assert _contents(latest_checkpoint(tmp_path)) == (3, "three")


def test_resume_leaves_a_young_latest_temp_file_alone(tmp_path):
    """`latest_checkpoint` may run beside a live save (an evaluation reading a training run):
    it removes only `.latest.*` files old enough to be a crash's."""
    save_checkpoint(tmp_path, 1, {"actor": _writer("one")}, None, {"step": 1})
    young = tmp_path / "checkpoints" / ".latest.abc123"
    young.write_text("step-0000")
    assert _contents(latest_checkpoint(tmp_path)) == (1, "one") and young.exists()
    _age(young, 120)
    latest_checkpoint(tmp_path)
    assert not young.exists()


def test_a_step_dir_left_mid_deletion_is_skipped_and_removed(tmp_path):
    """A ``step-N`` that lost files to an in-place deletion cut short (what earlier versions
    left) is never picked, and is removed on resume."""
    root = tmp_path / "checkpoints"
    save_checkpoint(tmp_path, 2, {"actor": _writer("two")}, None, {"step": 2})
    half = root / "step-000001" / "actor"
    half.mkdir(parents=True)
    (half / "weights.txt").write_text("half")
    (root / "notes").mkdir()                                   # not ours: left alone
    assert _contents(latest_checkpoint(tmp_path)) == (2, "two")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "notes", "step-000002"]


def test_files_and_directories_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(C.os, "fsync", record)
    save_checkpoint(tmp_path, 1, {"actor": _writer("one")}, None, {"step": 1})
    staged = [s for s in synced if "/.step-000001.tmp-" in s]
    names = {Path(s).name for s in staged}
    assert {"weights.txt", "trainer_state.pt", "actor"} <= names         # files, then their directory
    root = str(tmp_path / "checkpoints")
    assert synced.index(root) > max(synced.index(s) for s in staged)   # the rename made durable
    assert synced.count(root) >= 2                                      # ... and the rename of `latest`


def test_keep_prunes_oldest(tmp_path):
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, {"actor": _writer(str(step))}, None, {"step": step, "t": torch.ones(2)}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-000003", "step-000004"]
    assert load_trainer_state(latest_checkpoint(tmp_path))["step"] == 4


def test_checkpoints_and_written_files_get_the_umask_permissions(tmp_path):
    """tempfile makes 0600 files and 0700 directories: config.yaml, `latest` and every checkpoint
    (and `export --output`'s directory) were unreadable to anyone but their owner."""
    old = os.umask(0o022)
    try:
        ckpt = save_checkpoint(tmp_path, 1, {"actor": _writer("1")}, None, {"step": 1})
        C.atomic_write_text(tmp_path / "config.yaml", "a: 1\n")
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777      # noqa: E731
    assert mode(ckpt) == 0o755 and mode(tmp_path / "checkpoints" / "latest") == 0o644
    assert mode(tmp_path / "config.yaml") == 0o644 and mode(ckpt / "trainer_state.pt") == 0o644


def test_a_failed_atomic_write_leaves_no_temp_file(tmp_path, monkeypatch):
    """A write that fails (the disk fills during fsync) re-raises and removes its hidden
    ``.<name>.*`` temp file; the previous file stays as it was."""
    import errno

    C.atomic_write_text(tmp_path / "config.yaml", "a: 1\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(C.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        C.atomic_write_text(tmp_path / "config.yaml", "a: 2\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    assert (tmp_path / "config.yaml").read_text() == "a: 1\n"


def test_a_full_disk_is_named_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    """torch's writer says only "unexpected pos" when the disk fills: an ENOSPC OSError naming the
    checkpoint now (one line on the command line); the staging directory goes, the last one stays."""
    import errno
    from collections import namedtuple

    save_checkpoint(tmp_path, 1, {"actor": _writer("1")}, None, {"step": 1})
    monkeypatch.setattr(C.torch, "save", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 4096))
    with pytest.raises(OSError, match="No space left on device") as e:
        save_checkpoint(tmp_path, 2, {"actor": _writer("2")}, None, {"step": 2})
    assert e.value.errno == errno.ENOSPC and e.value.filename.endswith("step-000002")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == ["step-000001"]
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: usage(10 << 30, 1 << 30, 9 << 30))
    with pytest.raises(RuntimeError, match="unexpected pos"):      # with room to spare: torch's own error
        save_checkpoint(tmp_path, 2, {"actor": _writer("2")}, None, {"step": 2})


def test_keep_counts_by_step_number_and_never_prunes_the_checkpoint_just_written(tmp_path):
    """A checkpoint of a higher step than the one being written (an earlier run's, in the same
    directory) was kept instead of the new one, by name order; a 7-digit step sorted before a
    6-digit one."""
    save_checkpoint(tmp_path, 8, {"actor": _writer("old run")}, None, {"step": 8})
    save_checkpoint(tmp_path, 4, {"actor": _writer("new run")}, None, {"step": 4})
    assert [p.name for p in (tmp_path / "checkpoints").glob("step-*")] == ["step-000004"]
    assert _contents(latest_checkpoint(tmp_path)) == (4, "new run")
    for step in (999_999, 1_000_000, 1_000_001):
        save_checkpoint(tmp_path / "long", step, {"actor": _writer(str(step))}, None, {"step": step}, keep=2)
    assert sorted(p.name for p in (tmp_path / "long" / "checkpoints").glob("step-*")) == ["step-1000000",
                                                                                        "step-1000001"]
    (tmp_path / "long" / "checkpoints" / "latest").unlink()                 # the fallback orders by step too
    assert latest_checkpoint(tmp_path / "long").name == "step-1000001"


def test_keep_counts_only_the_runs_own_checkpoints(tmp_path):
    """A fresh run that starts from an earlier run's checkpoint in its own directory keeps it (a new
    run identity, `new_run_id`); that checkpoint took one of the new run's `keep` slots, so with
    ``keep=2`` the new run had a single checkpoint of its own."""
    C.new_run_id(tmp_path)
    save_checkpoint(tmp_path, 4, {"actor": _writer("earlier run")}, None, {"step": 4})
    C.new_run_id(tmp_path)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"actor": _writer(str(step))}, None, {"step": step}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-000002", "step-000003", "step-000004"]
    assert _contents(latest_checkpoint(tmp_path)) == (3, "3")
    assert [p.name for p in C.earlier_run_checkpoints(tmp_path)] == ["step-000004"]


def test_a_fresh_run_in_a_used_directory_drops_the_earlier_checkpoints(tiny_model, tiny_data, tmp_path, capfd):
    """Run A (4 steps) then run B (2 steps, no --resume) in one directory: B's checkpoint used to
    be rotated away in favour of A's step 4, and B's --resume continued A."""
    from tests.e2e.helpers import max_weight_diff, run_cli, weights

    def args(steps):
        return ["sft", "--config", str(REPO / "configs/tiny/sft.yaml"), f"model.name_or_path={tiny_model}",
                f"data.train_file={tiny_data / 'train_pairs.jsonl'}", "data.max_samples=16",
                f"output_dir={tmp_path / 'run'}", "train.save_every=2", f"train.max_steps={steps}",
                "log.tensorboard=false", "log.progress=false"]

    run_cli(*args(4))
    capfd.readouterr()
    run_cli(*args(2))
    assert "removed 1 checkpoint(s) of an earlier run" in capfd.readouterr().err
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.name == "step-000002" and [p.name for p in ckpt.parent.glob("step-*")] == ["step-000002"]
    assert max_weight_diff(weights(ckpt / "policy"), weights(tmp_path / "run")) < 1e-6


# a real SFT run killed while it writes the checkpoint of step 3 (model files written, no
# trainer_state.pt yet); --resume must continue from step 2 and end where an unbroken run ends
_SFT_CHILD = textwrap.dedent("""
    import sys, time
    import turborlhf.engine.checkpoint as C
    from turborlhf.cli import main

    real = C._write_hf
    def write_hf(model, tok, out, *a, **kw):
        real(model, tok, out, *a, **kw)
        if ".step-000003.tmp-" in str(out):
            print("KILL ME", flush=True)
            time.sleep(600)
    C._write_hf = write_hf
    main(sys.argv[1:])
""")


def test_sft_killed_mid_checkpoint_resumes_to_the_same_weights(tiny_model, tiny_data, tmp_path):
    from tests.e2e.helpers import max_weight_diff, metrics, run_cli, weights

    def args(out):
        return ["sft", "--config", str(REPO / "configs/tiny/sft.yaml"), f"model.name_or_path={tiny_model}",
                f"data.train_file={tiny_data / 'train_pairs.jsonl'}", "data.max_samples=16", f"output_dir={out}",
                "train.save_every=1", "log.tensorboard=false", "log.progress=false"]

    killed, whole = tmp_path / "killed", tmp_path / "whole"
    _kill_when_told([sys.executable, "-c", _SFT_CHILD, *args(killed)])
    assert [p.name for p in (killed / "checkpoints").glob(".step-000003.tmp-*")]   # the kill's leftover
    ckpt = latest_checkpoint(killed)
    assert ckpt.name == "step-000002" and load_trainer_state(ckpt)["step"] == 2
    assert all(torch.isfinite(t).all() for t in weights(ckpt / "policy").values())
    run_cli(*args(killed), "--resume")
    run_cli(*args(whole))
    assert max_weight_diff(weights(killed), weights(whole)) < 1e-6
    assert [r["step"] for r in metrics(killed) if "train/loss" in r] == [1, 2, 3, 4]
    assert not [p for p in (killed / "checkpoints").iterdir() if p.name.startswith(".")]


def test_the_plan_digest_covers_the_steps_done_only():
    """A checkpoint compares the steps it has done: a plan extended or cut after them (a changed
    `train.max_steps`) matches, other examples or another batching of those steps do not, and a
    checkpoint that recorded the whole plan's digest is still compared as before."""
    from turborlhf.engine.lifecycle import ConfigChanged

    examples = [{"ids": [i, i + 1]} for i in range(8)]
    plan = [[0, 1], [2, 3], [4, 5], [6, 7]]
    digest = C.PlanDigest(plan, examples)
    assert C.PlanDigest(plan[:3], examples).done(2) == digest.done(2) != digest.done(3)
    edited_later = examples[:6] + [{"ids": [0]}, examples[7]]
    assert C.PlanDigest(plan, edited_later).done(3) == digest.done(3)
    assert C.PlanDigest(plan, edited_later).done(4) != digest.done(4)
    assert C.PlanDigest([[1, 0]] + plan[1:], examples).done(1) != digest.done(1)
    assert C.PlanDigest(plan, examples, salt="ptx").done(1) != digest.done(1)
    assert digest.done(5) is None
    state = {"step": 2, "plan_done_sha256": digest.done(2)}
    C.check_plan(state, C.PlanDigest(plan[:2] + [[7, 6]], examples), "ckpt", "t")
    with pytest.raises(ConfigChanged, match="steps done differ"):
        C.check_plan(state, C.PlanDigest([[2, 3], [0, 1]] + plan[2:], examples), "ckpt", "t")
    legacy = {"step": 2, "plan_sha256": C.plan_digest(plan, examples)}
    C.check_plan(legacy, digest, "ckpt", "t")
    with pytest.raises(ConfigChanged):
        C.check_plan(legacy, C.PlanDigest(plan[:3], examples), "ckpt", "t")
