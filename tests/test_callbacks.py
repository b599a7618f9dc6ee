"""`MetricsLogger` calls the active callbacks' hooks (`turborlhf.metrics.use_callbacks`)."""
from __future__ import annotations

from turborlhf.metrics import MetricsLogger, TrainerCallback, use_callbacks


class Record:          # any object with some of the hooks will do
    def __init__(self):
        self.events = []

    def on_train_begin(self, name, total_steps):
        self.events.append(("begin", name, total_steps))

    def on_step_end(self, step, metrics):
        self.events.append(("step", step, metrics))

    def on_log(self, step, metrics):
        self.events.append(("log", step, metrics))

    def on_train_end(self, name, step):
        self.events.append(("end", name, step))


def test_hooks_in_order_eval_rows_only_logged(tmp_path):
    rec, partial = Record(), type("OnlyLog", (), {"rows": [], "on_log": lambda self, s, m: self.rows.append(s)})()
    with use_callbacks([rec, partial]):
        log = MetricsLogger(tmp_path, "sft", 2, tensorboard=False, progress=False)
    log.log(1, {"train/loss": 1.5})
    log.log(2, {"train/loss": 1.0})
    log.log(2, {"eval/loss": 2.0})          # the final evaluation: same step, not a new step
    log.close()
    log.close()                             # once only
    assert rec.events == [("begin", "sft", 2), ("step", 1, {"train/loss": 1.5}), ("log", 1, {"train/loss": 1.5}),
                          ("step", 2, {"train/loss": 1.0}), ("log", 2, {"train/loss": 1.0}),
                          ("log", 2, {"eval/loss": 2.0}), ("end", "sft", 2)]
    assert partial.rows == [1, 2, 2]


def test_no_callbacks_outside_the_block_and_resumed_steps(tmp_path):
    rec = Record()
    with use_callbacks([rec]):
        pass
    MetricsLogger(tmp_path, "rm", 3, tensorboard=False, progress=False).log(1, {"x": 1.0})
    assert rec.events == []
    with use_callbacks([rec, TrainerCallback()]):     # the base class's hooks do nothing
        log = MetricsLogger(tmp_path, "rm", 3, tensorboard=False, progress=False, resume=True, start_step=2)
    log.log(3, {"x": 2.0})
    log.close()
    assert [e[:2] for e in rec.events] == [("begin", "rm"), ("step", 3), ("log", 3), ("end", "rm")]


def test_a_callback_added_between_steps_sees_the_next_ones(tmp_path):
    """A trainer object's add_callback after its first step had no effect: the logger kept the
    callbacks of the block active when it was made."""
    first, late = Record(), Record()
    callbacks = [first]
    with use_callbacks(callbacks):
        log = MetricsLogger(tmp_path, "sft", 2, tensorboard=False, progress=False)
        log.log(1, {"x": 1.0})
    callbacks.append(late)
    with use_callbacks(callbacks):                    # the trainer's next step, in a new block
        log.log(2, {"x": 2.0})
        log.close()
    assert [e[:2] for e in late.events] == [("step", 2), ("log", 2), ("end", "sft")]
    assert [e[:2] for e in first.events] == [("begin", "sft"), ("step", 1), ("log", 1), ("step", 2), ("log", 2),
                                             ("end", "sft")]


def test_a_callback_class_instead_of_an_instance_is_named():
    """``callbacks=[MyCallback]`` (the class) was diagnosed as a hook with the wrong signature (its unbound
    ``on_step_end(self, step, metrics)``), or accepted when it had no hooks; a transformers callback class
    gets the transformers message, not an invitation to instantiate it."""
    import pytest
    from transformers import TrainerCallback as HFCallback

    from turborlhf.api import _check_callback
    from turborlhf.errors import UserError
    from turborlhf.metrics import check_callback

    for cls in (Record, TrainerCallback, type("Empty", (), {})):
        want = rf"^callbacks\[1\]: a class, not an instance: pass {cls.__name__}\(\)$"
        for check in (check_callback, _check_callback):
            with pytest.raises(UserError, match=want):
                check(cls, "callbacks[1]")
        check_callback(cls(), "callbacks[1]")
    with pytest.raises(UserError, match=r"^callback: a transformers TrainerCallback \(TrainerCallback\) takes HF's"):
        _check_callback(HFCallback, "callback")
