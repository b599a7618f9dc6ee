"""How every training command starts and stops: one implementation shared by all trainers.

Start (`start_run`): the run directory (locked: one run at a time in it), the checkpoint to resume
from, and on ``--resume`` a check
that the config is the one the checkpoint was trained with. A changed config is refused, naming the
changed fields, unless the caller allows it (``--resume-changed``, `allow_config_change`);
``config.yaml`` is written only after that check passed. ``--resume`` with no checkpoint says so in
one line and starts from step 0.

Stop (`checkpointed_steps`): the loop's step iterator. It saves a checkpoint every ``save_every``
steps, and on SIGINT/SIGTERM it lets the current optimizer step finish, saves a resumable
checkpoint whatever ``save_every`` is, and raises `RunInterrupted` (the CLI prints its message,
which names the checkpoint, and exits with 128 + the signal number: 130 for SIGINT, 143 for
SIGTERM). A second signal stops at once (``KeyboardInterrupt``). Torchrun's elastic agent, Slurm
and Kubernetes all send SIGTERM before killing a job, so a preempted run keeps its progress.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import yaml

from turborlhf.config import Cfg, config_to_dict
from turborlhf.engine.checkpoint import (atomic_write_text, clear_checkpoints, earlier_run_checkpoints,
                                         latest_checkpoint, new_run_id, protect_inputs)
from turborlhf.errors import UserError

logger = logging.getLogger(__name__)

__all__ = ["RunInterrupted", "ConfigChanged", "start_run", "checkpointed_steps", "stop_requested",
           "allow_config_change", "config_change_allowed", "config_changes", "RESUME_EXEMPT", "run_to_end",
           "eval_due", "log_due"]

# Fields that may differ on --resume without changing what is computed: where things go (the output
# directory, the placement of roles on workers: Ray and the local backend train the same numbers),
# how much is printed, how often checkpoints are kept or evaluations run, thread counts. Prefixes end
# with ".".
RESUME_EXEMPT = ("output_dir", "log.", "distributed.", "train.threads", "train.save_every",
                 "train.keep_checkpoints", "train.eval_every")
# ...except these, which change the numbers: a rollout work item's size sets which prompts share a
# sampling seed (`turborlhf.trainers.ppo.rollout.rollout_items`)
RESUME_COMPARED = ("distributed.rollout_chunk",)

_ALLOW_CHANGED: contextvars.ContextVar[bool] = contextvars.ContextVar("turborlhf_allow_config_change",
                                                                      default=False)


class RunInterrupted(RuntimeError):
    """The run stopped on SIGINT/SIGTERM after saving a resumable checkpoint (the message names it).

    ``exit_code`` is 128 + the signal number, as a shell reports a process killed by it."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class ConfigChanged(UserError):
    """``--resume`` with a config that differs from the run's ``config.yaml`` (fields named)."""


@contextlib.contextmanager
def allow_config_change(allowed: bool = True) -> Iterator[None]:
    """Within the block, `start_run` resumes with a changed config (``--resume-changed``)."""
    token = _ALLOW_CHANGED.set(allowed)
    try:
        yield
    finally:
        _ALLOW_CHANGED.reset(token)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def config_change_allowed() -> bool:
    """Whether `allow_config_change` is in force here (``--resume-changed``): for a process that
    runs a stage elsewhere and passes the permission on (`turborlhf.pipeline.run_stage_in_child`)."""
    return _ALLOW_CHANGED.get()


def config_changes(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """``{dotted field: (old, new)}`` for every leaf that differs, fields in `RESUME_EXEMPT` left out."""
    a, b = _flatten(old), _flatten(new)
    out = {}
    for key in sorted(a.keys() | b.keys()):
        if key not in RESUME_COMPARED and any(key == e or (e.endswith(".") and key.startswith(e))
                                              for e in RESUME_EXEMPT):
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            out[key] = (a.get(key, "<unset>"), b.get(key, "<unset>"))
    return out


def _is_field_default(cfg: Cfg, key: str, value: Any) -> bool:
    """Whether `value` is the declared default of the config field at dotted `key` (a field added
    after a run started is absent from its saved config; at its default it changes nothing)."""
    *path, name = key.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part, None)
    field = getattr(type(node), "model_fields", {}).get(name)
    if field is None or field.is_required():
        return False
    default = field.get_default(call_default_factory=True)
    if default == "auto":                   # a per-host choice (device, dtype): resolved, never "auto" here
        return True
    return default == value or (hasattr(default, "model_dump") and default.model_dump() == value)


def _check_resume_config(cfg: Cfg, out: Path, ckpt: Path, tag: str) -> None:
    """Refuse (ConfigChanged) a config that differs from ``out/config.yaml``, unless allowed; then
    the previous config is kept: as ``config.before-resume.yaml`` at the first changed resume (the
    run's original config), as ``config.before-resume.2.yaml``, ``.3``... at the later ones, none
    overwritten."""
    saved = out / "config.yaml"
    if not saved.exists():
        return
    old = yaml.safe_load(saved.read_text()) or {}
    new = config_to_dict(cfg)
    changed = {k: v for k, v in config_changes(old, new).items()
               if not (v[0] == "<unset>" and _is_field_default(cfg, k, v[1]))}   # a field newer than the run
    if not changed:
        return
    listing = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in changed.items()))
    if not _ALLOW_CHANGED.get():
        raise ConfigChanged(f"--resume from {ckpt} with a changed config ({listing}); run with the config in "
                            f"{saved}, or pass --resume-changed to continue with the new one")
    kept = out / "config.before-resume.yaml"
    n = 2
    while kept.exists():
        kept, n = out / f"config.before-resume.{n}.yaml", n + 1
    atomic_write_text(kept, saved.read_text())
    logger.warning(f"[{tag}] --resume-changed: continuing {ckpt} with {listing} (previous config kept in {kept})")


def start_run(cfg: Cfg, resume: bool, tag: str) -> tuple[Path, Optional[Path]]:
    """Create ``cfg.output_dir`` and return it with the checkpoint to resume from (None: step 0).

    With `resume`: the run's newest complete checkpoint; none there is said in one line on stderr
    and the run starts from step 0; a config that differs from the saved one raises `ConfigChanged`
    (a `UserError`) naming the fields, unless `allow_config_change` is active. Without `resume`,
    checkpoints an earlier run left in the directory are removed, with a warning: they would
    outrank the new run's in rotation and be what a later ``--resume`` continues (as ``config.yaml``
    and the outputs, they belong to the run now starting there); those the new run starts from are
    kept. A run that starts from step 0 gets a new identity (`turborlhf.engine.checkpoint.new_run_id`),
    so a later ``--resume`` continues its own checkpoints only, never a kept one of the earlier run.
    An output_dir that is itself one of the run's inputs (its model, reference...) raises
    `ConfigError`, as does a config without what a run needs (`turborlhf.config_base.check_complete`:
    one built directly, ``SFTConfig()`` without a data file). The resolved config is written to
    ``config.yaml`` only after these checks.
    """
    from turborlhf.config_base import check_complete
    from turborlhf.engine.run import clear_export, setup_run
    from turborlhf.metrics import console_logging

    check_complete(cfg)
    console_logging()           # the run's messages on the console (once per process)
    out = Path(cfg.output_dir)
    _check_not_an_input(cfg, out)
    lock_output_dir(out)
    if getattr(cfg, "log", None) is not None and cfg.log.report_to:
        from turborlhf.trackers import check_installed
        check_installed(cfg.log.report_to)      # before the data and models load
    if not resume:              # a mistyped path must not cost the earlier run's checkpoints (cleared below)
        _check_inputs_exist(cfg)
    protect_inputs(p for _, p in _config_paths(cfg))
    ckpt = latest_checkpoint(out) if resume else None
    if resume and ckpt is None:
        earlier = ", ".join(p.name for p in earlier_run_checkpoints(out))
        where = (f"of this run in {out / 'checkpoints'} ({earlier}: an earlier run's, which a resume never "
                 f"continues)" if earlier else f"in {out / 'checkpoints'}")
        logger.warning(f"[{tag}] --resume: no checkpoint {where}; starting from step 0")
    if ckpt is not None:
        _check_resume_config(cfg, out, ckpt, tag)
    if not resume and _reads_from(cfg, out):
        logger.warning(f"[{tag}] a fresh run in {out} that starts from files inside it: the earlier run's "
                       "checkpoints and export are kept (the new run overwrites them as it goes)")
    elif not resume:
        n = clear_checkpoints(out)
        if n:
            logger.warning(f"[{tag}] a fresh run in {out}: removed {n} checkpoint(s) of an earlier run there "
                           "(--resume continues a run instead)")
        gone = clear_export(out)
        if gone:
            logger.warning(f"[{tag}] a fresh run in {out}: removed the earlier run's exported model "
                           f"({', '.join(gone)})")
    if ckpt is None:            # before config.yaml: a kill in between must not make old checkpoints the new run's
        new_run_id(out)
    return setup_run(cfg, str(out)), ckpt


def _check_inputs_exist(cfg: Cfg) -> None:
    """`ConfigError` naming the field for a data file (``*_file``) or model (``name_or_path``,
    ``reference``, ``reward_model``, a ``model`` reward source's ``path``) given as a local path that
    does not exist, or a directory that is no model: found before a fresh run clears the earlier
    run's checkpoints and export, not after (the trainers read their inputs later). Hub ids and zoo
    names are left to the loaders."""
    import re

    from turborlhf.config_base import ConfigError
    from turborlhf.data.sources import missing_source
    from turborlhf.models.zoo import ModelFetchError, NotAModelError, resolve_model_path

    def model_problem(name: str) -> Optional[str]:
        try:
            resolve_model_path(name, fetch=False)
        except NotAModelError as e:
            return str(e)
        except ModelFetchError:          # a zoo name not cached yet: fetched when the model loads
            pass
        return None

    for key, value in _config_strings(cfg):
        last = key.rsplit(".", 1)[-1]
        source = re.fullmatch(r"rewards\[(\d+)\]\.path", key)
        if last.endswith("_file"):
            problem = missing_source(value)
        elif last in ("name_or_path", "reference", "reward_model") or (
                source and cfg.rewards[int(source.group(1))].kind == "model"):
            problem = model_problem(value)
        else:
            continue
        if problem:
            raise ConfigError(f"{key}: {problem}")


_LOCKS: dict[Path, Any] = {}     # output_dir → the open lock file this process holds (until it exits)


def lock_output_dir(out: Path) -> bool:
    """Hold an exclusive lock on ``<out>/.turborlhf.lock`` for the rest of this process: a second run
    started on the same output_dir (another process) deleted the first one's checkpoints and both
    appended to one metrics.jsonl. `UserError` naming the holder's pid. Runs in this process may
    share it (a Python session that trains, then resumes). Returns whether this call took it (False:
    held by this process already, or no ``fcntl``: Windows)."""
    try:
        import fcntl
    except ImportError:
        return False
    key = out.resolve()
    if key in _LOCKS:
        return False
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / ".turborlhf.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"output_dir {out} is in use by a running turborlhf run ({holder}); wait for it, or use "
                        "another output_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}")
    f.flush()
    _LOCKS[key] = f
    import atexit
    atexit.register(f.close)
    return True


def unlock_output_dir(out: Path) -> None:
    """Release this process's lock on `out` (`lock_output_dir`); nothing if it holds none."""
    f = _LOCKS.pop(Path(out).resolve(), None)
    if f is not None:
        f.close()


def _config_strings(cfg: Cfg) -> Iterator[tuple[str, str]]:
    """(dotted field, value) of every non-empty text value of `cfg` but ``output_dir``."""
    def walk(node: Any, key: str) -> Iterator[tuple[str, str]]:
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, f"{key}.{k}" if key else k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from walk(v, f"{key}[{i}]")
        elif isinstance(node, str) and node:
            yield key, node

    yield from walk({k: v for k, v in config_to_dict(cfg).items() if k != "output_dir"}, "")


def _config_paths(cfg: Cfg) -> Iterator[tuple[str, Path]]:
    """(dotted field, resolved path) of every text value of `cfg` but ``output_dir``."""
    return ((k, Path(v).resolve()) for k, v in _config_strings(cfg))


def _reads_from(cfg: Cfg, out: Path) -> bool:
    """Whether a path in `cfg` (a model, reference, reward model...) lies in what a fresh run clears
    in `out` (an earlier run's checkpoints or ``ema/`` export): it must not delete what it reads.
    Other files inside `out` (the Python API's staged inputs, ``data/``, ``input_model``) do not
    count: counting them kept an earlier run's checkpoints, which a later --resume continued."""
    cleared = (out.resolve() / "checkpoints", out.resolve() / "ema")
    return any(c == p or c in p.parents for _, p in _config_paths(cfg) for c in cleared)


def _check_not_an_input(cfg: Cfg, out: Path) -> None:
    """ConfigError when `out` is itself a directory the run reads (its model, reference, reward
    model): the final export would overwrite it, and a --resume would start from the trained
    weights (a LoRA run's adapters added again; DPO's reference recomputed from the policy)."""
    target = out.resolve()
    models = ("name_or_path", "reference", "reward_model", ".path")      # model fields, not data or names
    if same := [k for k, p in _config_paths(cfg) if p == target and k.endswith(models)]:
        from turborlhf.config import ConfigError

        raise ConfigError(f"output_dir {out} is also {same[0]}: the run's export would overwrite what it reads; "
                          "use another output_dir")


class _StopOnSignal:
    """SIGINT/SIGTERM handlers for the duration of a loop: the first signal is recorded (the loop
    stops after its current step); a second one interrupts at once. Off the main thread (where
    Python cannot install handlers) it records nothing."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.signum: Optional[int] = None
        self._old: dict = {}

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        _ACTIVE.append(self)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.signum = signum
        print(f"\n[{self.tag}] {signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


_ACTIVE: list[_StopOnSignal] = []     # the handlers of the running `checkpointed_steps` loops
_STOP_NEXT = threading.local()        # `stop_at_next_step` asked this thread's next loop to stop


def stop_at_next_step() -> None:
    """Make this thread's next `checkpointed_steps` loop to resume stop as on a signal: save the steps done,
    then raise `RunInterrupted`. `turborlhf.api`'s ``close()`` of a run stepped part-way resumes
    its loop once with this, so the last step taken is kept."""
    _STOP_NEXT.asked = True


def stop_requested() -> Optional[int]:
    """The signal number a running `checkpointed_steps` loop received (None: none, or no loop
    running). For work inside one step that can itself save and stop part-way (rejection
    sampling's SFT within a round)."""
    return next((s.signum for s in reversed(_ACTIVE) if s.signum is not None), None)


def checkpointed_steps(start: int, total: int, save: Callable[[int], Path], save_every: int,
                       tag: str) -> Iterator[int]:
    """The step indices ``start … total-1`` of a training loop, with its checkpoints in between.

    After the loop body of step i returns (``done = i + 1`` steps finished):

    - a SIGINT/SIGTERM received during that step (or `stop_at_next_step`): ``save(done)``, then
      `RunInterrupted` naming the
      checkpoint and the signal (raised from the loop's ``for``); also after the last step, so that
      a run stopped there keeps its steps (``--resume`` then runs only the final evaluation and
      export, which the caller does after the loop with the default signal handlers back);
    - otherwise every `save_every` steps (0 = never), and after the last step whatever
      `save_every` is: a checkpoint is written while the handlers still turn a signal into a
      stop right after it (a SIGTERM during the last one killed the run with no checkpoint at all;
      one during a periodic one ran a further step and saved again).

    `save(done)` writes a resumable checkpoint after `done` steps and returns its directory. The
    signal handlers are installed when the loop starts and restored when it ends (also on errors).
    """
    with _StopOnSignal(tag) as stop:
        for step in range(start, total):
            yield step
            done = step + 1
            asked = getattr(_STOP_NEXT, "asked", False)
            _STOP_NEXT.asked = False
            if stop.signum is not None or asked:
                path = save(done)
                name = signal.Signals(stop.signum).name if stop.signum is not None else "close()"
                raise RunInterrupted(f"{name} at step {done}/{total}: kept checkpoint {path}; "
                                     "continue with --resume", stop.signum or signal.SIGTERM)
            if done == total or (save_every and done % save_every == 0):
                path = save(done)
                if stop.signum is not None:      # received while writing it: complete, stop (not after another step)
                    name = signal.Signals(stop.signum).name
                    where = f"after the last step {total}" if done == total else f"at step {done}/{total}"
                    raise RunInterrupted(f"{name} {where}: kept checkpoint {path}; continue with --resume",
                                         stop.signum)


def eval_due(done: int, total: int, eval_every: int, has_eval_data: bool) -> bool:
    """Whether a trainer evaluates after its optimizer step `done` (1-based) of `total`:
    ``train.eval_every`` steps apart, not after the last (the final evaluation follows it)."""
    return bool(has_eval_data and eval_every and done % eval_every == 0 and done < total)


def log_due(done: int, total: int, log_every: int, evaluated: bool) -> bool:
    """Whether step `done`'s metrics are logged: ``log.every`` steps apart, the last step, and any
    step that evaluated (its evaluation would be computed and lost otherwise)."""
    return done % log_every == 0 or done == total or evaluated


def run_to_end(steps: Iterator[Any]) -> Any:
    """Exhaust a trainer's step generator (``train_steps``: one item per optimizer step) and return
    its return value (the output directory). Each trainer's ``train(cfg, resume)`` is this over its
    ``train_steps``, so the command line and `turborlhf.api`'s ``.train()``/``.step()`` run one loop."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
