"""`log.report_to`: TensorBoard, W&B (offline), MLflow (file: store) and Trackio (local) get the same
metrics through their own libraries; `log.tensorboard` keeps working."""
import glob
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from turborlhf.config import ConfigError, SFTConfig, load_config

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"train/loss": 1.0 / s, "policy/kl": 0.1 * s, "note": "text", "nan": float("nan")} for s in (1, 2, 3)]

DRIVER = """
import json, sys
from turborlhf.metrics import MetricsLogger
log = MetricsLogger(sys.argv[1], "t", 3, report_to=["tensorboard", "wandb", "mlflow", "trackio"], progress=False,
                    project="proj", run_name="run1", config={"optim": {"lr": 0.001}, "data": {"train_file": "x"}})
for step, row in enumerate(json.loads(sys.argv[2]), start=1):
    log.log(step, row)
log.close()
from trackio.sqlite_storage import SQLiteStorage   # TRACKIO_DIR is read at import: read back here
print("TRACKIO" + json.dumps(SQLiteStorage.get_logs("proj", "run1")))
"""


def _wandb_history(run_file: str) -> list[dict]:
    """History rows of an offline W&B run file (LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, out = Path(run_file).read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            pos += left - 7
            continue
        buf, pos = buf + data[pos:pos + n], pos + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return out


def test_every_tracker_gets_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("trackio")
    out = tmp_path / "run"
    uri = (tmp_path / "mlruns").as_uri()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": uri, "TRACKIO_DIR": str(tmp_path / "trackio")}
    env.pop("MLFLOW_ALLOW_FILE_STORE", None)
    res = subprocess.run([sys.executable, "-c", DRIVER, str(out), json.dumps(ROWS)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    want = [(s, r["train/loss"], r["policy/kl"]) for s, r in enumerate(ROWS, start=1)]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tb"))
    ea.Reload()
    assert sorted(ea.Tags()["scalars"]) == ["policy/kl", "train/loss"]      # no text, no NaN
    assert [(e.step, pytest.approx(e.value)) for e in ea.Scalars("train/loss")] == [(s, l) for s, l, _ in want]

    (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    hist = _wandb_history(run_file)
    assert [(h["_step"], h["train/loss"], h["policy/kl"]) for h in hist] == want

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")     # to read it back here
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "run1" and run.data.params["optim.lr"] == "0.001"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "policy/kl")] == [
        (s, k) for s, _, k in want]

    logs = json.loads(res.stdout.split("TRACKIO", 1)[1].splitlines()[0])
    assert [(r["step"], r["train/loss"], r["policy/kl"]) for r in logs] == want


def test_report_to_config_and_tensorboard_flag(tmp_path, monkeypatch, capsys):
    from turborlhf.metrics import tracker_kwargs

    def trackers(*ov):
        return tracker_kwargs(load_config(SFTConfig, None, ["data.train_file=x", *ov]))["report_to"]

    assert trackers() == ["tensorboard"]
    assert trackers("log.tensorboard=false") == []
    assert trackers("log.report_to=[wandb,mlflow,wandb]") == ["wandb", "mlflow"]
    assert trackers("log.report_to=wandb") == ["wandb"] and trackers("log.report_to=none") == []   # HF's forms
    assert trackers("log.report_to=[]") == []
    with pytest.raises(ConfigError, match="log.report_to"):
        trackers("log.report_to=[comet]")

    from turborlhf.metrics import MetricsLogger

    monkeypatch.setitem(sys.modules, "wandb", None)   # not installed
    with pytest.raises(ImportError, match=r"turborlhf\[wandb\]"):
        MetricsLogger(tmp_path / "a", "t", 1, report_to=["wandb"])
    # from the command line: one line, exit 2, before the data or model loads (it was a traceback
    # after them); the model path here does not exist, so loading anything would fail differently
    from turborlhf.cli import main
    assert main(["sft", "data.train_file=x", "model.name_or_path=/nonexistent", f"output_dir={tmp_path / 'c'}",
                 "log.report_to=[wandb]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: log.report_to: wandb needs") and err.count("\n") == 1

    class Broken:                                      # a tracker whose library refuses to start
        def __init__(self, *a, **k):
            raise RuntimeError("api_key not configured (no-tty)\ncall wandb.login()")
    import turborlhf.trackers as T
    monkeypatch.setitem(T._CLASSES, "wandb", Broken)
    with pytest.raises(T.TrackerUnavailable, match=r"wandb failed to start: RuntimeError: api_key not configured "
                                                   r"\(no-tty\) \(W&B without an account: WANDB_MODE=offline\)"):
        T.make_trackers(["wandb"], tmp_path)
    log = MetricsLogger(tmp_path / "b", "t", 1, tensorboard=False, progress=False)
    log.log(1, {"train/loss": 1.0})
    log.close()
    assert not (tmp_path / "b" / "tb").exists() and (tmp_path / "b" / "metrics.jsonl").exists()


def test_sft_reports_to_mlflow(tiny_model, tiny_data, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from tests.e2e.helpers import metrics, run_cli

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "sft"
    run_cli("sft", "--config", REPO / "configs/tiny/sft.yaml", f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"output_dir={out}", "train.max_steps=2",
            "train.save_every=0", "log.report_to=[mlflow]", "log.project=tiny", "log.progress=false")
    assert not (out / "tb").exists()
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())   # the default: beside the run
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.run_name == "sft" and run.data.params["optim.lr"] == "0.001"
    losses = [r["train/loss"] for r in metrics(out) if "train/loss" in r]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")] == pytest.approx(losses)


class _Recorder:
    def __init__(self, fail_at=None):
        self.rows, self.closed, self.fail_at = [], None, fail_at

    def log(self, step, scalars):
        if step == self.fail_at:
            raise ConnectionError("tracking server hiccup")
        self.rows.append(step)

    def close(self, outcome="finished"):
        self.closed = outcome


def test_a_tracker_that_fails_to_log_is_dropped_and_the_run_goes_on(tmp_path, caplog):
    """One failed `log` call (a tracking server's hiccup) ended the training run with a traceback."""
    from turborlhf.metrics import MetricsLogger

    log = MetricsLogger(tmp_path, "t", 3, tensorboard=False, progress=False)
    flaky, steady = _Recorder(fail_at=2), _Recorder()
    log._trackers = [flaky, steady]
    for step in (1, 2, 3):
        log.log(step, {"train/loss": 1.0})
    log.close()
    assert flaky.rows == [1] and steady.rows == [1, 2, 3]
    assert (flaky.closed, steady.closed) == ("failed", "finished")
    assert "_Recorder failed to log step 2 and is dropped" in caplog.text and "ConnectionError" in caplog.text
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("error, outcome", [(None, "finished"), (ValueError("bad batch"), "failed"),
                                            (KeyboardInterrupt(), "killed")])
def test_trackers_record_how_the_run_ended(tmp_path, error, outcome):
    """Closed from the trainers' ``finally``: a crashed run was recorded as finished."""
    from turborlhf.metrics import MetricsLogger

    log = MetricsLogger(tmp_path, "t", 3, tensorboard=False, progress=False)
    rec = log._trackers = [_Recorder()]
    try:
        try:
            if error is not None:
                raise error
        finally:
            log.close()
    except BaseException as e:
        assert e is error
    assert rec[0].closed == outcome


def test_mlflow_gets_the_status_and_names_it_accepts(tmp_path, monkeypatch):
    """A reward source's name may hold characters MLflow refuses in a metric name (`len<=8`): they
    become ``_`` there (the run died at its first step); a failed run is FAILED, not FINISHED."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from turborlhf.trackers import MLflowTracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    t = MLflowTracker(tmp_path, project="p", run_name="r", config={})
    t.log(1, {"rollout/reward_len<=8_mean": 0.5, "policy/kl": 0.1})
    t.close("failed")
    client = MlflowClient(tracking_uri=t.uri)
    run = client.get_run(t.run_id)
    assert run.info.status == "FAILED"
    assert sorted(run.data.metrics) == ["policy/kl", "rollout/reward_len__8_mean"]


def test_a_fresh_run_hides_an_earlier_runs_tensorboard_events(tmp_path):
    """A second run in the same directory (not resumed): TensorBoard showed both runs' curves."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from turborlhf.metrics import MetricsLogger

    for run, loss in ((1, 5.0), (2, 1.0)):
        if run == 2:
            time.sleep(1.1)           # event files are named by the second they start in
        log = MetricsLogger(tmp_path, "t", 2, progress=False)
        for step in (1, 2):
            log.log(step, {"train/loss": loss + step})
        log.close()
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("train/loss")] == [(1, 2.0), (2, 3.0)]
