"""MetricsLogger on --resume: rows past the checkpoint go, a torn last line (a killed writer)
is dropped with one warning, any other bad line is an error naming it."""
import json
import warnings

import pytest

from turborlhf.metrics import MetricsLogger


def _rows(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def _write(path, steps, tail=""):
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in steps) + tail)


def test_resume_drops_a_torn_last_line_with_one_warning(tmp_path):
    _write(tmp_path / "metrics.jsonl", [1, 2, 3], tail='{"step": 4, "train/lo')    # killed mid-write
    with pytest.warns(RuntimeWarning, match=r"metrics\.jsonl:4: dropped a torn last line") as w:
        log = MetricsLogger(tmp_path, "t", 6, tensorboard=False, progress=False, resume=True, start_step=2)
    assert len(w) == 1
    log.log(3, {"train/loss": 0.5})
    log.close()
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_resume_without_a_torn_line_does_not_warn(tmp_path):
    _write(tmp_path / "metrics.jsonl", [1, 2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MetricsLogger(tmp_path, "t", 6, tensorboard=False, progress=False, resume=True, start_step=3).close()
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    _write(tmp_path / "metrics.jsonl", [1], tail="not json\n" + json.dumps({"step": 2}) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON line"):
        MetricsLogger(tmp_path, "t", 6, tensorboard=False, progress=False, resume=True, start_step=2)


def test_metric_names_keep_one_convention():
    """Every canonical name is ``<part>/<name>`` with one of the run's parts as prefix (critic
    metrics under critic/, none bare), and no two names collide."""
    from turborlhf.metrics import M

    parts = {"train", "eval", "policy", "critic", "rollout", "timing", "sync", "rewards", "logps"}
    names = {k: v for k, v in vars(M).items() if k.isupper()}
    bad = {k: v for k, v in names.items() if v.count("/") != 1 or v.split("/")[0] not in parts}
    assert not bad, bad
    assert len(set(names.values())) == len(names)
    assert M.VALUE_LOSS.startswith("critic/") and M.EXPLAINED_VAR.startswith("critic/")


def test_console_logging_prints_messages_as_they_are(capsys):
    """The ``turborlhf`` logger's console handler writes the bare message (no level or time) to the
    current stdout (warnings to stderr), so CLI output is what `print` gave; set up twice, it
    still prints once; `redirect_stdout` (``eval-* --json`` sends logs to stderr) is honoured."""
    import contextlib
    import io
    import logging

    from turborlhf.metrics import console_logging

    console_logging()
    console_logging()
    log = logging.getLogger("turborlhf.trainers.example")
    log.info("[sft] saved policy to runs/x")
    log.warning("[sft] TensorBoard disabled: no module")
    log.debug("not shown at the default level")
    out, err = capsys.readouterr()
    assert out == "[sft] saved policy to runs/x\n"
    assert err == "[sft] TensorBoard disabled: no module\n"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        log.info("[generate] 4 prompts")
    assert buf.getvalue() == "[generate] 4 prompts\n" and capsys.readouterr().out == ""
    assert sum(type(h).__name__ == "_Console" for h in logging.getLogger("turborlhf").handlers) == 1


def test_an_evaluation_row_gives_its_own_seconds_not_a_rate(tmp_path, monkeypatch):
    """The final evaluation's progress line divided the whole run's time, evaluation and export
    included, by the steps: "390.24 s/step" after steps of ~70 s."""
    import turborlhf.metrics as m

    clock = iter([0.0, 70.0, 140.0, 400.0])
    monkeypatch.setattr(m.time, "perf_counter", lambda: next(clock))
    log = MetricsLogger(tmp_path, "t", 2, tensorboard=False, progress=False)
    assert "| 70.00 s/step" in log.progress_line(1, {})
    assert "| 70.00 s/step" in log.progress_line(2, {})
    assert log.progress_line(2, {"eval/loss": 1.0}).endswith("| 260.0 s after the step")
    log.close()


def test_non_finite_values_are_written_as_strict_json_nulls(tmp_path):
    """A NaN loss was written as a bare NaN, which is no JSON: jq and JavaScript readers failed on
    the whole file."""
    log = MetricsLogger(tmp_path, "t", 2, tensorboard=False, progress=False)
    log.log(1, {"train/loss": float("nan"), "train/grad_norm": float("inf"), "train/lr": 1e-5,
                "extra": {"a": [1.0, float("-inf")]}})
    log.close()
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    row = json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {line}"))
    assert row["train/loss"] is None and row["train/grad_norm"] is None and row["train/lr"] == 1e-5
    assert row["extra"] == {"a": [1.0, None]}
