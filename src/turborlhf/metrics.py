"""Metrics: one logger writes each step to the console (a compact progress line), JSONL and the
experiment trackers of ``log.report_to`` (TensorBoard, W&B, MLflow, Trackio: ``trackers.py``).

Canonical metric names are defined here once and used by every trainer (`M`): one prefix per
part of the run, ``train/`` (the optimised model's step: loss, lr, grad norm), ``eval/``,
``policy/`` (the actor), ``critic/`` (the value model), ``rollout/`` (generation and rewards),
``timing/``, ``sync/`` (weight-sync checks), and TRL's ``rewards/``/``logps/`` for DPO and KTO.

Console messages: every module logs to ``logging.getLogger(__name__)`` under the ``turborlhf``
logger; `console_logging` (called once by the CLI and at the start of every run) gives that logger
a handler that prints each message as it is, info to stdout and warnings to stderr. Results that
are a command's product (``--json`` objects, generated text, tables) are printed, not logged.

Callbacks (the Python API's ``callbacks=``, `turborlhf.api`): objects with any of the hooks of
`TrainerCallback`, active for the duration of a `use_callbacks` block. Every trainer logs through
`MetricsLogger`, so this is the one place they are called, for every command alike.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

__all__ = ["MetricsLogger", "M", "trim_jsonl", "format_duration", "tracker_kwargs", "TrainerCallback", "use_callbacks",
           "console_logging"]

logger = logging.getLogger(__name__)


class _Console(logging.Handler):
    """Writes each record's message, unformatted, to the *current* ``sys.stdout`` (INFO and below)
    or ``sys.stderr`` (WARNING and above), looked up per record so that
    ``contextlib.redirect_stdout`` and test capture see it; flushed like ``print(..., flush=True)``."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001  (logging's contract: never raise from a handler)
            self.handleError(record)


def console_logging(level: int = logging.INFO) -> logging.Logger:
    """Give the ``turborlhf`` logger its console handler (once per process; later calls only
    return it) and `level` if it has none. The handler prints messages as they are, without
    level or time prefixes (every message already names its command, e.g. ``[ppo] ...``), and
    the logger does not propagate, so a root handler set up by the caller does not print twice;
    to send turborlhf's messages elsewhere, add handlers to ``logging.getLogger("turborlhf")``."""
    root = logging.getLogger("turborlhf")
    if not any(isinstance(h, _Console) for h in root.handlers):
        root.addHandler(_Console())
        root.propagate = False
    if root.level == logging.NOTSET:
        root.setLevel(level)
    return root


class M:
    """Canonical metric names (TensorBoard tags / JSONL keys)."""

    LOSS = "train/loss"
    LR = "train/lr"
    GRAD_NORM = "train/grad_norm"
    TOKENS_PER_S = "train/tokens_per_s"
    RM_ACC = "train/accuracy"
    RM_MARGIN = "train/margin"
    EVAL_LOSS = "eval/loss"
    EVAL_ACC = "eval/accuracy"
    REWARD_MEAN = "rollout/reward_mean"
    REWARD_STD = "rollout/reward_std"
    REWARD_MEAN_TRAINED = "rollout/reward_mean_trained"   # dynamic sampling: over the kept rows (REWARD_MEAN: all)
    SCORE_MEAN = "rollout/score_mean"
    RESPONSE_LEN = "rollout/response_length"
    EOS_FRAC = "rollout/eos_fraction"
    ADV_MEAN = "rollout/advantage_mean"     # every estimator's, critic or not (so rollout/, not critic/)
    RETURN_MEAN = "rollout/return_mean"
    KL = "policy/kl"
    KL_COEF = "policy/kl_coef"
    KL_PER_TOKEN = "policy/kl_per_token"
    KL_LOSS = "policy/kl_loss"
    ENTROPY = "policy/entropy"              # mean per response token (nats), whatever algo.loss_reduction
    CLIPFRAC = "policy/clipfrac"
    APPROX_KL = "policy/approx_kl"
    POLICY_LOSS = "policy/loss"
    POLICY_GRAD_NORM = "policy/grad_norm"   # actor, before clipping
    PTX_LOSS = "policy/ptx_loss"            # PPO-ptx: the SFT term of the actor's loss
    VALUE_LOSS = "critic/loss"
    VALUE_GRAD_NORM = "critic/grad_norm"    # critic, before clipping
    VALUE_CLIPFRAC = "critic/clipfrac"
    EXPLAINED_VAR = "critic/explained_variance"
    T_GENERATE = "timing/generate"
    T_EXPERIENCE = "timing/experience"
    T_TRAIN = "timing/train"
    T_STEP = "timing/step"
    # preference optimisation (DPO, KTO): implicit rewards β·(logπ - logπ_ref), TRL's names
    R_CHOSEN = "rewards/chosen"
    R_REJECTED = "rewards/rejected"
    R_ACC = "rewards/accuracy"
    R_MARGIN = "rewards/margin"
    LOGP_CHOSEN = "logps/chosen"
    LOGP_REJECTED = "logps/rejected"
    T_WEIGHT_PUSH = "timing/weight_push"
    T_WEIGHT_SYNC = "timing/weight_sync"
    T_SYNC_VERIFY = "timing/sync_verify"
    SYNC_LOGP_DIFF = "sync/logprob_mean_diff"
    SYNC_ROW_DIFF = "sync/logprob_max_row_diff"
    SYNC_TOKEN_DIFF = "sync/logprob_token_diff"


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _close_tracker(t, outcome: str) -> None:
    """End tracker `t`'s run; a failure there is a warning (the run's own outcome stands)."""
    try:
        t.close(outcome)
    except Exception as e:
        logger.warning(f"{type(t).__name__} failed to close: {type(e).__name__}: {e}")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.2e}"
        return f"{v:.4g}"
    return str(v)


def tracker_kwargs(cfg) -> dict[str, Any]:
    """``MetricsLogger`` keywords from a command's config: its ``log`` section's trackers, project
    and run name, and the whole config (recorded once by each tracker)."""
    from turborlhf.config import config_to_dict

    log = cfg.log
    names = list(dict.fromkeys(log.report_to)) if log.report_to is not None else (
        ["tensorboard"] if log.tensorboard else [])
    return {"report_to": names, "project": log.project, "run_name": log.run_name, "config": config_to_dict(cfg)}


class TrainerCallback:
    """The hooks a callback may define (HF ``TrainerCallback``'s names; subclassing is optional: any
    object with some of these methods works, the others are skipped). Called on the process that
    runs the training loop (the driver, for ``distributed.backend=ray``).

    - ``on_train_begin(name, total_steps)``: the loop starts (``name``: ``sft``, ``rm``, ``dpo``,
      ``kto``, ``ppo``); ``total_steps``: its optimizer steps;
    - ``on_step_end(step, metrics)``: optimizer step ``step`` (1-based) finished and was logged
      (every ``log.every`` steps, 1 by default, and the last one); ``metrics``: ``{name: value}``
      with the canonical names of `M`;
    - ``on_log(step, metrics)``: every row written to ``metrics.jsonl`` (the step rows above, and
      evaluation rows such as the final ``eval/*``);
    - ``on_train_end(name, step)``: the loop's logger closed (after the last step, or when the run
      stopped).

    An exception raised by a hook stops the run (it propagates out of the training loop).
    """

    def on_train_begin(self, name: str, total_steps: int) -> None: ...

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None: ...

    def on_log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def on_train_end(self, name: str, step: int) -> None: ...


_CALLBACKS: contextvars.ContextVar[tuple] = contextvars.ContextVar("turborlhf_callbacks", default=())


@contextlib.contextmanager
def use_callbacks(callbacks: Sequence[Any]) -> Iterator[None]:
    """Within the block, every `MetricsLogger` created calls `callbacks`' hooks (`TrainerCallback`)."""
    token = _CALLBACKS.set(tuple(callbacks))
    try:
        yield
    finally:
        _CALLBACKS.reset(token)


_HOOK_ARGS = {"on_train_begin": ("sft", 1), "on_step_end": (1, {}), "on_log": (1, {}), "on_train_end": ("sft", 1)}


def check_callback(cb: Any, what: str) -> None:
    """Refuse (`turborlhf.errors.UserError` naming `what` and the hook) a callback whose hook
    cannot take the arguments `TrainerCallback` documents (HF's ``(args, state, control, ...)``
    failed at the first call, mid-run), or a class given instead of an instance (its hooks are
    unbound: they were blamed for their signature); warn about ``on_*`` methods no run calls
    (HF's ``on_evaluate``, ``on_save``...: the evaluation rows reach ``on_log``)."""
    import inspect
    import warnings

    from turborlhf.errors import UserError

    if isinstance(cb, type):
        raise UserError(f"{what}: a class, not an instance: pass {cb.__name__}()")
    for hook, args in _HOOK_ARGS.items():
        fn = getattr(cb, hook, None)
        if fn is None:
            continue
        try:
            inspect.signature(fn).bind(*args)
        except TypeError:
            raise UserError(f"{what}.{hook}{inspect.signature(fn)}: turborlhf calls it as {hook}"
                            f"({', '.join(_HOOK_DOC[hook])}) (turborlhf.metrics.TrainerCallback)") from None
        except ValueError:       # no signature to read (a builtin): left to the call
            pass
    unknown = sorted(n for n in dir(cb) if n.startswith("on_") and n not in _HOOK_ARGS and callable(getattr(cb, n)))
    if unknown:
        warnings.warn(f"{what}: {', '.join(unknown)} never called (turborlhf's hooks: {', '.join(_HOOK_ARGS)}; "
                      "evaluation rows reach on_log)", stacklevel=3)


_HOOK_DOC = {"on_train_begin": ("name", "total_steps"), "on_step_end": ("step", "metrics"),
             "on_log": ("step", "metrics"), "on_train_end": ("name", "step")}


def _call(callbacks: Sequence[Any], hook: str, *args: Any) -> None:
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(*args)


def _read_rows(path: Path) -> list[tuple[str, dict]]:
    """(line, parsed row) of a metrics.jsonl. A torn final line (the process was killed while
    writing it) is dropped with a warning; a bad line elsewhere raises ValueError naming it."""
    lines = [(i, l) for i, l in enumerate(path.read_text().splitlines(), 1) if l.strip()]
    rows = []
    for k, (i, l) in enumerate(lines):
        try:
            row = json.loads(l)
        except json.JSONDecodeError as e:
            if k == len(lines) - 1:
                warnings.warn(f"{path}:{i}: dropped a torn last line (the run was killed while writing it): "
                              f"{l[:60]!r}", RuntimeWarning, stacklevel=3)
                break
            raise ValueError(f"{path}:{i}: not a JSON line ({e.msg}): {l[:60]!r}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
        rows.append((l, row))
    return rows


def trim_jsonl(path: Path, last_step: int, one_row_per_step: bool = False) -> None:
    """Keep only the rows of JSON-lines file `path` that a run resumed from step `last_step`'s
    checkpoint does not write again: those of steps up to `last_step`. With `one_row_per_step`
    (``metrics.jsonl``) only the first row of `last_step` stays: it was logged before the
    checkpoint, a later one is the final evaluation, which runs after the last checkpoint and
    again on resume. Atomic; no file, no-op."""
    if not path.exists():
        return
    keep, seen_last = [], False
    for l, row in _read_rows(path):
        step = row.get("step", 0)
        if step < last_step or (step == last_step and not (one_row_per_step and seen_last)):
            keep.append(l)
        seen_last = seen_last or step == last_step
    tmp = path.with_name(f".{path.name}.resume-tmp")
    tmp.write_text("".join(l + "\n" for l in keep))
    os.replace(tmp, path)


def _json_safe(v: Any) -> Any:
    """`v` for strict JSON: a non-finite float becomes null (`metrics.jsonl`'s convention for a value
    that is not a number: a NaN loss, a mean over no rows)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


class MetricsLogger:
    """Write metrics to ``<output_dir>/metrics.jsonl``, experiment trackers and the console log
    (one progress line per logged step, `console_logging`).

    Args:
        output_dir: run directory.
        name: short stage name shown in the progress line (``sft``, ``rm``, ``ppo``).
        total_steps: for the progress percentage and the time-left estimate.
        show: keys shown in the progress line (others only go to files).
        tensorboard: TensorBoard events in ``<output_dir>/tb`` when ``report_to`` is None.
        report_to: trackers (``turborlhf.trackers.TRACKERS``); a missing TensorBoard only warns,
            any other missing tracker package raises ``ImportError``.
        project, run_name, config: passed to the trackers (``tracker_kwargs(cfg)`` fills them).
        resume: append to an existing metrics file instead of starting it anew.
    """

    def __init__(self, output_dir: str | Path, name: str, total_steps: int, show: tuple[str, ...] = (),
                 tensorboard: bool = True, progress: bool = True, resume: bool = False, start_step: int = 0,
                 report_to: Optional[Sequence[str]] = None, project: str = "turborlhf",
                 run_name: Optional[str] = None, config: Optional[dict] = None):
        from turborlhf.trackers import make_trackers

        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name, self.total, self.show, self.progress = name, total_steps, show, progress
        path = self.dir / "metrics.jsonl"
        if resume:  # drop rows past the checkpoint we resume from
            trim_jsonl(path, start_step, one_row_per_step=True)
        names = list(report_to) if report_to is not None else (["tensorboard"] if tensorboard else [])
        self._trackers = []
        if "tensorboard" in names:
            try:   # TensorBoard hides the events of the run's steps to come: a resumed run's past the
                # checkpoint, a fresh run's of an earlier run in this directory (all)
                self._trackers += make_trackers(["tensorboard"], self.dir,
                                                purge_step=start_step + 1 if resume else 1)
            except Exception as e:  # tensorboard missing or broken: keep going with JSONL
                logger.warning(f"[{name}] TensorBoard disabled: {e}")
        self._trackers += make_trackers([n for n in names if n != "tensorboard"], self.dir, project, run_name, config)
        self._jsonl = open(path, "a" if resume else "w")
        self._t0 = time.perf_counter()
        self._start_step = start_step
        self._progress_at: tuple[int, float] = (start_step, 0.0)   # the last step a progress line timed
        self._started_with = _CALLBACKS.get()   # the `use_callbacks` block active now
        self._last_step = start_step
        _call(self._callbacks, "on_train_begin", name, total_steps)

    @property
    def _callbacks(self) -> tuple:
        """The callbacks of the `use_callbacks` block active at each event (a trainer object's
        ``add_callback`` between steps reaches the next ones), else those active at the start."""
        return _CALLBACKS.get() or self._started_with

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from turborlhf.trackers import finite_scalars

        row = {"step": step, **{k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str)) else v)
                                for k, v in metrics.items()}}
        # strict JSON: a bare NaN/Infinity (Python's default) breaks jq, JavaScript and other readers
        self._jsonl.write(json.dumps({k: _json_safe(v) for k, v in row.items()}, allow_nan=False) + "\n")
        self._jsonl.flush()
        scalars = finite_scalars(row)
        for t in list(self._trackers):
            try:
                t.log(step, scalars)
            except Exception as e:      # a tracker's server hiccup: the run and metrics.jsonl go on
                logger.warning(f"[{self.name}] {type(t).__name__} failed to log step {step} and is dropped for the "
                               f"rest of the run ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}); "
                               "every metric is still in metrics.jsonl")
                self._trackers.remove(t)
                _close_tracker(t, "failed")
        if self.progress:
            logger.info(self.progress_line(step, row))
        if self._callbacks:
            cb_metrics = {k: v for k, v in row.items() if k != "step"}
            if step > self._last_step:       # a step's first row; a later row of the same step is an evaluation
                self._last_step = step
                _call(self._callbacks, "on_step_end", step, dict(cb_metrics))
            _call(self._callbacks, "on_log", step, cb_metrics)

    def progress_line(self, step: int, row: dict) -> str:
        """``[name] step/total (pct%) <shown metrics> | s/step, time left``. A later row of a step
        already shown (its evaluation) gives its own seconds instead: the rate over the whole run
        counted the evaluation and export as training time (390 s/step after 70 s steps)."""
        elapsed = time.perf_counter() - self._t0
        parts = [f"[{self.name}] {step}/{self.total} ({100 * step / max(self.total, 1):.0f}%)"]
        for k in self.show:
            if k in row:
                parts.append(f"{k.split('/')[-1]} {_fmt(row[k])}")
        shown_step, shown_at = self._progress_at
        if step == shown_step and step > self._start_step:
            parts.append(f"| {elapsed - shown_at:.1f} s after the step")
        else:
            rate = elapsed / max(step - self._start_step, 1)
            parts.append(f"| {rate:.2f} s/step, {format_duration(rate * max(self.total - step, 0))} left")
        self._progress_at = (step, elapsed)
        return " ".join(parts)

    def close(self) -> None:
        """Close metrics.jsonl and end the trackers' runs, recorded as finished, failed (an exception
        is on its way: this is called from the trainers' ``finally``) or killed (a signal, Ctrl-C,
        a trainer object closed before its last step)."""
        if self._jsonl.closed:
            return
        self._jsonl.close()
        from turborlhf.engine.lifecycle import RunInterrupted

        error = sys.exc_info()[1]
        outcome = ("finished" if error is None else
                   "killed" if isinstance(error, (RunInterrupted, KeyboardInterrupt, GeneratorExit, SystemExit))
                   else "failed")
        for t in self._trackers:
            _close_tracker(t, outcome)
        self._trackers = []
        _call(self._callbacks, "on_train_end", self.name, self._last_step)
