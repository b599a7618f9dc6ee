"""Checkpoints survive crashes: a failed save keeps the previous checkpoint, and what an earlier
crash left half-written is removed by the next complete save."""
import pytest
import torch

from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint


def _writer(text):
    def write(d):
        d.mkdir(parents=True)
        (d / "weights.txt").write_text(text)
    return write


def _crashing_writer(d):
    d.mkdir(parents=True)
    (d / "weights.txt").write_text("half")
    raise RuntimeError("worker died")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, {"actor": _writer("one")}, None, {"step": 1})
    with pytest.raises(RuntimeError, match="worker died"):
        save_checkpoint(tmp_path, 2, {"actor": _crashing_writer}, None, {"step": 2})
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step-000001" and load_trainer_state(ckpt)["step"] == 1
    assert (ckpt / "actor" / "weights.txt").read_text() == "one"
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))


def test_next_save_removes_what_a_killed_save_left(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(tmp_path, 1, {"actor": _writer("one")}, None, {"step": 1})
    # a process killed mid-save (or a remote writer still writing after the driver's clean-up)
    stale = root / ".step-000002.tmp-abc123" / "actor"
    stale.mkdir(parents=True)
    (stale / "weights.txt").write_text("half")
    (root / ".step-000001.old-4242").mkdir()
    (root / "notes").mkdir()                                  # not ours: left alone
    assert latest_checkpoint(tmp_path).name == "step-000001"  # the half-written one is never picked
    save_checkpoint(tmp_path, 2, {"actor": _writer("two")}, None, {"step": 2}, keep=2)
    assert not [p.name for p in root.iterdir() if p.name.startswith(".step-")]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["notes", "step-000001", "step-000002"]
    assert (latest_checkpoint(tmp_path) / "actor" / "weights.txt").read_text() == "two"


def test_keep_prunes_oldest(tmp_path):
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, {"actor": _writer(str(step))}, None, {"step": step, "t": torch.ones(2)}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-000003", "step-000004"]
    assert load_trainer_state(latest_checkpoint(tmp_path))["step"] == 4
