"""`turborlhf.pipeline.run_stage_in_child` without a model: what a stage's process reports back."""
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
