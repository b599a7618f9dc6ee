"""`turborlhf.pipeline` without training: what a stage's process reports back, and which stages a
``--resume`` runs again."""
from __future__ import annotations

import multiprocessing
import threading

import pytest

from turborlhf.errors import UserError


class _LongError:
    """A stage config whose first use raises a UserError of ~300 kB (more than a pipe holds)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise UserError("bad: " + "x" * 300_000)


def test_a_long_error_of_a_stage_comes_back_whole():
    """The child's report went through the pipe only after the child had exited; a report larger
    than the pipe's buffer blocked the child's write while the pipeline waited for it to exit."""
    from turborlhf.pipeline import run_stage_in_child

    def watchdog():                       # the old code hung: end the child, so the test fails, not hangs
        for c in multiprocessing.active_children():
            c.kill()
    timer = threading.Timer(60, watchdog)
    timer.start()
    try:
        with pytest.raises(UserError, match=r"^bad: x+$") as e:
            run_stage_in_child("sft", _LongError(), False)
    finally:
        timer.cancel()
    assert len(str(e.value)) == 300_005


def test_an_interrupted_stage_whose_input_finished_again_since_starts_over(tiny_model, tmp_path, monkeypatch):
    """``--resume`` continued an interrupted stage's checkpoints even when the stage it reads had
    finished again since (another invocation ran it alone): the RM went on from weights grown out of
    the SFT model it replaced. It starts over now, as a finished stage in that case runs again."""
    from turborlhf import pipeline
    from turborlhf.config import PipelineConfig, load_config
    from turborlhf.engine.lifecycle import RunInterrupted

    from tests.conftest import HH_FILE, REPO

    runs = []

    def stage(name, cfg, resume):
        runs.append((name, resume))
        if name == "rm" and len(runs) == 2:
            raise RunInterrupted("SIGTERM at step 1/2", 15)
    monkeypatch.setattr(pipeline, "run_stage_in_child", stage)
    monkeypatch.setattr(pipeline, "_prepare", lambda cfg, model, data: data.mkdir(parents=True, exist_ok=True))

    def cfg(*over):
        return load_config(PipelineConfig, REPO / "configs/tiny/pipeline.yaml",
                           [f"model={tiny_model}", f"run_dir={tmp_path / 'pipe'}", f"prepare.input={HH_FILE}", *over])
    with pytest.raises(RunInterrupted):
        pipeline.run(cfg("stages=[prepare,sft,rm]"))
    pipeline.run(cfg("stages=[sft]"))                       # the SFT stage alone, again: another SFT model
    runs.clear()
    pipeline.run(cfg("stages=[prepare,sft,rm]"), resume=True)
    assert runs == [("rm", False)]
    runs.clear()                                            # interrupted on the same input: continued
    (tmp_path / "pipe" / "rm" / ".done").unlink()
    pipeline.run(cfg("stages=[prepare,sft,rm]"), resume=True)
    assert runs == [("rm", True)]
