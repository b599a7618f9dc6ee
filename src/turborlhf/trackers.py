"""Experiment trackers behind `log.report_to`: TensorBoard, Weights & Biases, MLflow, Trackio.

Each tracker is the library's own client, set up as Hugging Face's ``TrainingArguments.report_to``
integrations do, and configured the same way, by the library's environment variables:

============ ========================================= =============================================
name         what is written                           settings
============ ========================================= =============================================
tensorboard  ``<output_dir>/tb`` event files           -
wandb        a W&B run (files under ``<output_dir>``)  ``WANDB_MODE=offline`` (no account needed;
                                                       ``wandb sync`` later), ``WANDB_PROJECT``,
                                                       ``WANDB_ENTITY``, ``WANDB_API_KEY``
mlflow       an MLflow run in experiment ``project``   ``MLFLOW_TRACKING_URI``; without it
                                                       ``file:<output_dir>/mlruns`` (a local file
                                                       store, ``mlflow ui --backend-store-uri``;
                                                       ``MLFLOW_ALLOW_FILE_STORE`` defaults to true)
trackio      a Trackio run in project ``project``      ``TRACKIO_DIR`` (local SQLite, default
                                                       ``$HF_HOME/trackio``; ``trackio show``),
                                                       ``TRACKIO_SPACE_ID`` to log to a Space
============ ========================================= =============================================

Every tracker gets the run's whole config once (flattened dotted keys for MLflow) and, per logged
step, the finite numeric metrics under their canonical names (``train/loss``, ``policy/kl``...).
A tracker that fails to log a step is dropped with a warning (the run and ``metrics.jsonl`` go
on). Each run ends recorded as finished, failed (an exception) or killed (a signal, Ctrl-C), where
the tracker keeps a status (W&B: a non-zero exit code for both; MLflow: ``FINISHED``/``FAILED``/
``KILLED``). A fresh run in a directory that has TensorBoard events of an earlier run hides them
(``purge_step``). A requested tracker whose package is missing raises `TrackerUnavailable` (a `UserError` and an
``ImportError``) naming the extra to install, when the run starts (`check_installed`), before any
data or model loads; one that fails to start (W&B without an API key) raises it naming the tracker.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from turborlhf.errors import UserError

__all__ = ["TRACKERS", "OUTCOMES", "Tracker", "TrackerUnavailable", "make_trackers", "check_installed", "flatten"]

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
_INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install 'turborlhf[wandb]'",
            "mlflow": "pip install 'turborlhf[mlflow]'", "trackio": "pip install 'turborlhf[trackio]'"}


class TrackerUnavailable(UserError, ImportError):
    """A tracker of `log.report_to` cannot be used here (package missing, or it failed to start)."""


def check_installed(names: Sequence[str]) -> None:
    """`TrackerUnavailable` for the first tracker of `names` whose package is not installed (checked
    without importing it, so at the start of a run rather than after its models load)."""
    import sys
    from importlib.util import find_spec

    for n in names:
        if n in _INSTALL and (sys.modules[n] is None if n in sys.modules else find_spec(n) is None):
            raise TrackerUnavailable(f"log.report_to: {n} needs the {n!r} package ({_INSTALL[n]})")


#: how a run ended, for `Tracker.close`: its last step done, an exception, or stopped (a signal,
#: Ctrl-C, a trainer object closed before its last step)
OUTCOMES = ("finished", "failed", "killed")


class Tracker:
    """One destination of scalar metrics."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self, outcome: str = "finished") -> None:
        """End the run, recorded as `outcome` (one of `OUTCOMES`) where the tracker keeps a status."""


def _need(module: str, name: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerUnavailable(f"log.report_to: {name} needs the {package!r} package ({_INSTALL[name]})") from e


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1e-5}}`` -> ``{"optim.lr": 1e-5}`` (lists kept as values)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class TensorBoardTracker(Tracker):
    def __init__(self, out: Path, purge_step: Optional[int] = None, **_):
        _need("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(out / "tb"), purge_step=purge_step)   # resumed: drop events from there on

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.w.add_scalar(k, v, step)

    def close(self, outcome: str = "finished") -> None:
        self.w.close()


class WandbTracker(Tracker):
    def __init__(self, out: Path, project: str, run_name: str, config: dict):
        wandb = _need("wandb", "wandb", "wandb")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", project), name=run_name, config=config,
                              dir=str(out), reinit="create_new")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, outcome: str = "finished") -> None:
        self.run.finish(exit_code=0 if outcome == "finished" else 1)      # W&B: "failed" for a non-zero code


class MLflowTracker(Tracker):
    def __init__(self, out: Path, project: str, run_name: str, config: dict):
        mlflow = _need("mlflow", "mlflow", "mlflow")
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (out / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless this says otherwise
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        # MLflow caps a parameter value at 6000 characters (500 in older servers)
        params = [mlflow.entities.Param(k, str(v)[:500]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.uri = uri

    def log(self, step: int, scalars: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_MLFLOW_BAD_CHARS.sub("_", k), v, now, step)
                                                    for k, v in scalars.items()])

    def close(self, outcome: str = "finished") -> None:
        self.client.set_terminated(self.run_id, outcome.upper())       # FINISHED, FAILED, KILLED


# MLflow allows letters, digits, ``_ - . / :`` and spaces in a metric name; a reward source's own
# name (``rollout/reward_len<=8_mean``) may have others: they become ``_`` there
_MLFLOW_BAD_CHARS = re.compile(r"[^\w\-./: ]")


class TrackioTracker(Tracker):
    def __init__(self, out: Path, project: str, run_name: str, config: dict):
        self.trackio = _need("trackio", "trackio", "trackio")
        self.run = self.trackio.init(project=project, name=run_name, config=config, embed=False)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, outcome: str = "finished") -> None:
        self.run.finish()               # Trackio keeps no run status


_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MLflowTracker,
            "trackio": TrackioTracker}


def make_trackers(names: Sequence[str], out: Path, project: str = "turborlhf", run_name: Optional[str] = None,
                  config: Optional[dict] = None, purge_step: Optional[int] = None) -> list[Tracker]:
    """One ``Tracker`` per name of ``TRACKERS`` (``run_name`` defaults to the output directory's name).
    `purge_step` (a resumed run's first step): TensorBoard discards its events from that step on.

    Raises ``ValueError`` for an unknown name, `TrackerUnavailable` for a missing package or a
    tracker that fails to start (after closing those already started).
    """
    unknown = [n for n in names if n not in _CLASSES]
    if unknown:
        raise ValueError(f"log.report_to: unknown tracker(s) {unknown}; known: {', '.join(TRACKERS)}")
    started: list[Tracker] = []
    try:
        for n in dict.fromkeys(names):
            extra = {"purge_step": purge_step} if n == "tensorboard" else {}
            try:
                started.append(_CLASSES[n](out, project=project, run_name=run_name or out.resolve().name,
                                           config=config or {}, **extra))
            except (TrackerUnavailable, KeyboardInterrupt):
                raise
            except Exception as e:      # e.g. W&B without an API key: the library's own message, one line
                hint = " (W&B without an account: WANDB_MODE=offline)" if n == "wandb" else ""
                first = (str(e).strip().splitlines() or [""])[0]
                raise TrackerUnavailable(f"log.report_to: {n} failed to start: {type(e).__name__}: {first}{hint}") \
                    from e
    except BaseException:
        for t in started:
            t.close("failed")
        raise
    return started


def finite_scalars(row: dict) -> dict[str, float]:
    """The finite numbers of a metrics row (``step`` and non-numbers left out)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
