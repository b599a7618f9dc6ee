"""Trainer objects in TRL's shape: ``SFTTrainer``, ``RewardTrainer``, ``DPOTrainer``, ``KTOTrainer``,
``PPOTrainer``, ``GRPOTrainer`` and ``RLOOTrainer``, importable from ``turborlhf``::

    from datasets import Dataset
    from turborlhf import GRPOTrainer

    def accuracy(prompts, completions, answer, **kwargs):
        return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]

    ds = Dataset.from_list([{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}])
    trainer = GRPOTrainer(model="smollm2-135m-instruct", reward_funcs=accuracy, train_dataset=ds,
                          args={"train": {"max_steps": 10}, "output_dir": "runs/grpo"})
    result = trainer.train()            # TrainResult: output_dir, global_step, metrics

They are a thin layer over the commands: each builds the command's config (`turborlhf.config`,
validated by the same pydantic classes, errors naming the field) and runs the same
``train_steps`` generator that ``turborlhf <command>`` runs to its end (`run_to_end`), so the
command line and Python share one implementation.

Arguments (each trainer):

- ``model``: a local directory, hub id or zoo name, or an in-memory ``transformers`` model, which
  is saved (with ``processing_class``, else the tokenizer of its ``name_or_path``) to
  ``<output_dir>/input_model`` and trained from there;
- ``args``: the command's config object (``SFTConfig``, ``GRPOConfig`` ...) or a dict of the same
  fields as its YAML (``{"optim": {"lr": 1e-5}, "train": {"max_steps": 10}}``); ``model`` and the
  datasets given as arguments override its fields. As in TRL, a config may leave out the data file
  (``SFTConfig(output_dir="runs/sft")``) and an RL config its reward, which ``train_dataset`` and
  ``reward_funcs`` then give (`turborlhf.config_base.run_input`); without either, the trainer is
  refused with a `ConfigError` naming the field;
- ``train_dataset`` / ``eval_dataset``: a ``datasets.Dataset``, a list of dicts or a path (any
  source of `turborlhf.data.sources`: JSON lines, Parquet, a ``save_to_disk`` directory, a hub id).
  In-memory data is written to ``<output_dir>/data/`` (a ``Dataset`` with ``save_to_disk``, a
  list as JSON lines) and read back by the command's loader, so ``data.*_key`` and
  ``data.chat_template`` apply and the run's ``config.yaml`` names files that exist;
- ``callbacks``: objects with any of `turborlhf.metrics.TrainerCallback`'s hooks;
- RL trainers: ``reward_funcs`` (one or a list): Python callables
  (`turborlhf.rewards.callables`: called as ``fn(prompts=, completions=, **columns)`` with the
  dataset's other columns, as TRL does), reward-model directories, ``path/to/file.py:function``
  specs or ``http(s)://`` `turborlhf serve-rm` URLs, or loaded reward models; ``reward_weights``
  weighs them and ``reward_processing_classes`` gives a loaded reward model its tokenizer
  (default: the one beside its ``name_or_path``) (TRL's names).
  Callables travel to Ray workers (``distributed.backend=ray``) with cloudpickle, by value.

``.train()`` runs every step (or the rest, after ``.step()`` calls) and returns a `TrainResult`;
``.step()`` runs one optimizer step (one PPO step for the RL trainers) and returns its metrics;
after the last one it also runs the final evaluation, checkpoint and export. Between ``.step()``
calls the run's SIGINT/SIGTERM handlers stay installed (a signal stops it after the next step with
a checkpoint, `turborlhf.engine.lifecycle`); ``.close()`` ends a run before its last step with a
checkpoint of the steps taken (its workers are shut down; ``train(resume_from_checkpoint=True)`` on
a new trainer continues from it). A script that ends without ``close()`` gets the same at
interpreter exit, and one line on stderr says so.

``.save_model(dir)`` copies the exported model (TRL's call). Not offered: TRL's
``compute_metrics``, ``data_collator``, ``optimizers=`` and
``peft_config=`` (use ``args["model"]["lora"]``); the multi-stage commands (rejection sampling,
conditional SFT, pipeline) have no trainer object.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence

from turborlhf.api_inputs import _is_hf_model, _own_tokenizer, _same_tokenizer, _save_model, _write_dataset
from turborlhf.errors import UserError

__all__ = ["SFTTrainer", "RewardTrainer", "DPOTrainer", "KTOTrainer", "PPOTrainer", "GRPOTrainer", "RLOOTrainer",
           "TrainResult", "TrainerState"]


@dataclass
class TrainResult:
    """What ``.train()`` returns: the output directory (the trained model, loadable with
    ``from_pretrained``; also ``os.fspath(result)``), optimizer steps done, and the last step's metrics."""

    output_dir: Path
    global_step: int
    metrics: dict = field(default_factory=dict)

    def __fspath__(self) -> str:
        return str(self.output_dir)


@dataclass
class TrainerState:
    """``trainer.state``: steps done (``global_step`` of ``max_steps``) and every row logged
    (``log_history``, as HF's TrainerState; each row a dict with ``step``)."""

    global_step: int = 0
    max_steps: int = 0
    log_history: list = field(default_factory=list)


class _History:
    """The callback that fills ``trainer.state.log_history``; a resumed run's history starts with
    the rows its ``metrics.jsonl`` kept from before (as HF's TrainerState is restored)."""

    def __init__(self, state: TrainerState, output_dir: Path) -> None:
        self.state, self.output_dir = state, Path(output_dir)

    def on_log(self, step: int, metrics: dict) -> None:
        if not self.state.log_history:       # this row is the file's last one: the earlier rows come first
            from turborlhf.metrics import _read_rows

            path = self.output_dir / "metrics.jsonl"
            self.state.log_history.extend(row for _, row in (_read_rows(path) if path.exists() else [])[:-1])
        self.state.log_history.append({"step": step, **metrics})


def _check_callback(cb: Any, what: str) -> None:
    """A transformers ``TrainerCallback`` (HF's ``(args, state, control)`` hooks; its class or an
    instance), a class given instead of an instance, or any hook that cannot take turborlhf's
    arguments is refused naming it (`UserError`, `turborlhf.metrics.check_callback`)."""
    from turborlhf.metrics import check_callback

    kind = cb if isinstance(cb, type) else type(cb)
    if kind.__module__.startswith("transformers"):
        raise UserError(f"{what}: a transformers TrainerCallback ({kind.__name__}) takes HF's "
                        "(args, state, control) arguments; write an object with turborlhf's hooks "
                        "(turborlhf.metrics.TrainerCallback: on_train_begin, on_step_end, on_log, on_train_end)")
    check_callback(cb, what)


_EXPORT_METADATA = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt"}


def _is_export_file(name: str) -> bool:
    """A file of a run directory's Hugging Face export (not its config.yaml, metrics or evaluation)."""
    from turborlhf.engine.run import is_exported_weights

    return is_exported_weights(name) or name in _EXPORT_METADATA or name.endswith((".model", ".jinja"))


def _end_if_open(ref) -> None:
    """At interpreter exit: end the run of a trainer (a weak reference) still part-way, as ``close()``
    does (`_Trainer._end_at_exit`)."""
    trainer = ref()
    if trainer is not None and trainer._steps is not None:
        trainer._end_at_exit()


def _checkpoint_step(path: Path) -> int:
    """The optimizer steps a checkpoint directory (``step-000002``) holds."""
    return int(path.name.rsplit("-", 1)[-1])


def _path_arg(value: Any, what: str) -> str:
    """A model argument that is not a model object: a directory, hub id or zoo name."""
    if not isinstance(value, (str, os.PathLike)):
        raise UserError(f"{what}: expected a path, a hub id or a transformers model, got {type(value).__name__}")
    return os.fspath(value)


def _plain(value: Any) -> Any:
    """A value of an ``args`` dict as YAML holds it: paths as strings; anything else is refused."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise UserError(f"args: {value!r} ({type(value).__name__}) is not a config value (numbers, strings, lists, "
                    "mappings)")


def _set_values(args: Any, cls: type) -> dict:
    """The values set in `args`, a config of `cls`'s parent class (a PPOConfig for GRPOTrainer).
    Raises UserError for one whose ``algo`` section has every field set (`load_config` sets
    them all): its PPO values would replace every setting of `cls`'s preset, silently."""
    algo = getattr(args, "algo", None)
    if algo is not None and set(type(algo).model_fields) <= algo.model_fields_set:
        raise UserError(f"args: this {type(args).__name__} sets every algo field (load_config gives every field a "
                        f"value), which would replace all of {cls.__name__}'s settings; build it as {cls.__name__} "
                        f"(load_config({cls.__name__}, ...)) or pass a dict of the fields to change")
    return args.model_dump(mode="json", exclude_unset=True)


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"args: {p} must be a mapping")
    node[last] = value


class _Trainer:
    """Shared mechanics of the trainer objects (module docstring); subclasses name the command."""

    command: ClassVar[str]                      # turborlhf <command>
    module: ClassVar[str]                       # its trainer module (train_steps)
    config_name: ClassVar[str]                  # config class in turborlhf.config
    model_field: ClassVar[str] = "model.name_or_path"
    train_field: ClassVar[str] = "data.train_file"
    eval_field: ClassVar[Optional[str]] = "data.test_file"
    ref_field: ClassVar[Optional[str]] = None   # where ref_model= goes

    def __init__(self, model: Any = None, args: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, callbacks: Optional[Sequence[Any]] = None,
                 ref_model: Any = None) -> None:
        from turborlhf.config import load_config

        cls = self._config_class()
        if args is None:
            tree: dict = {}
        elif isinstance(args, dict):
            tree = json.loads(json.dumps(args, default=_plain))
        elif isinstance(args, self._accepted_config()):
            if not isinstance(args, cls) and not issubclass(cls, type(args)):    # RLOOConfig to GRPOTrainer
                raise UserError(f"args: {type(args).__name__} is another preset than {cls.__name__}, whose settings "
                                f"it would mix with its own; pass a {cls.__name__} or a "
                                f"{self._accepted_config().__name__}, or give it to its own trainer")
            # the values set in it, over the command's defaults (those it left are the same): a critic
            # section without name_or_path starts from a reward model given as reward_funcs=, not from
            # ModelCfg's default model; a parent class's object (a PPOConfig given to GRPOTrainer) goes
            # over this trainer's preset; a preset's object (a GRPOConfig given to PPOTrainer) counts
            # its preset's defaults as set (`turborlhf.presets`), so they go over the parent's
            tree = args.model_dump(mode="json", exclude_unset=True) if isinstance(args, cls) \
                else _set_values(args, cls)
        else:
            raise UserError(f"args: expected a {cls.__name__} or a dict of its fields, got {type(args).__name__}")
        out = Path(tree.get("output_dir") or cls.model_fields["output_dir"].default).expanduser()
        tree["output_dir"] = str(out)
        from turborlhf.engine.lifecycle import lock_output_dir

        took = lock_output_dir(out)      # before anything is written there: a running run's inputs stay its own
        try:
            for i, cb in enumerate(callbacks or []):
                _check_callback(cb, f"callbacks[{i}]")
            if model is not None:
                path = _save_model(model, processing_class, out / "input_model", "model") if _is_hf_model(model) \
                    else _path_arg(model, "model")
                if processing_class is not None and not _is_hf_model(model):
                    _same_tokenizer(processing_class, path)
                _set(tree, self.model_field, path)
            elif processing_class is not None:
                warnings.warn("processing_class is used with an in-memory model only; the tokenizer is read from the "
                              "model directory", stacklevel=2)
            if ref_model is not None:
                if self.ref_field is None:
                    raise UserError(f"{type(self).__name__} takes no ref_model")
                path = _save_model(ref_model, processing_class, out / "ref_model", "ref_model") \
                    if _is_hf_model(ref_model) else _path_arg(ref_model, "ref_model")
                _set(tree, self.ref_field, path)
            if train_dataset is not None:
                _set(tree, self.train_field, _write_dataset(train_dataset, out / "data" / "train", "train_dataset"))
            if eval_dataset is not None:
                if self.eval_field is None:
                    raise UserError(f"eval_dataset: {type(self).__name__} has no held-out evaluation during training; "
                                    "evaluate the result with turborlhf.evaluate.eval_policy")
                _set(tree, self.eval_field, _write_dataset(eval_dataset, out / "data" / "eval", "eval_dataset"))
            self._extend_tree(tree, out)
            self.args = load_config(cls, base=tree)           # ConfigError naming the field
            self.train_dataset = train_dataset
            self.callbacks: list = list(callbacks or [])
            self.state = TrainerState()
            self._steps: Optional[Iterator] = None
            self._result: Optional[TrainResult] = None
            self._stopped: Optional[BaseException] = None
            self._ends_at_exit = False
        except BaseException:
            if took:                  # a trainer that could not be built holds nothing
                from turborlhf.engine.lifecycle import unlock_output_dir
                unlock_output_dir(out)
            raise

    # -- the command behind the object

    @classmethod
    def _config_class(cls):
        from turborlhf import config

        return getattr(config, cls.config_name)

    @classmethod
    def _accepted_config(cls) -> type:
        return cls._config_class()

    def _extend_tree(self, tree: dict, out: Path) -> None:
        """Subclasses add their own arguments (reward functions) to the config tree."""

    def _train_steps(self, resume: bool) -> Iterator:
        import importlib

        return importlib.import_module(self.module).train_steps(self.args, resume)

    # -- public API

    @property
    def output_dir(self) -> Path:
        return Path(self.args.output_dir)

    def add_callback(self, callback: Any) -> None:
        """Add a callback (an object with some of `turborlhf.metrics.TrainerCallback`'s hooks).
        Raises UserError for a hook that cannot take turborlhf's arguments."""
        _check_callback(callback, "callback")
        self.callbacks.append(callback)

    def _next(self) -> tuple[int, int, dict]:
        from turborlhf.metrics import use_callbacks

        if self._stopped is not None:
            raise RuntimeError(f"{type(self).__name__}: the run stopped ({type(self._stopped).__name__}: "
                               f"{self._stopped}); continue it with a new trainer's train(resume_from_checkpoint=True)")
        with use_callbacks([_History(self.state, self.output_dir), *self.callbacks]):
            try:
                done, total, metrics = next(self._steps)
                self.state.global_step, self.state.max_steps = done, total
                self._end_at_exit_if_open()
                if done >= total:                 # the last step: final evaluation, checkpoint, export
                    try:
                        next(self._steps)
                    except StopIteration as stop:
                        self._finish(stop.value, metrics)
                return done, total, metrics
            except StopIteration as stop:         # a run with nothing left to do (resumed at its end)
                from turborlhf.engine.checkpoint import latest_checkpoint

                newest = latest_checkpoint(self.output_dir)
                if newest is not None and not self.state.global_step:
                    self.state.global_step = self.state.max_steps = _checkpoint_step(newest)
                self._finish(stop.value, {})
                raise
            except BaseException as e:            # an error or a signal: this run object is done
                self._steps, self._stopped = None, e
                self._release()
                raise

    def _start(self, resume: bool) -> None:
        """Set the run's step generator up (its setup runs with the first step)."""
        self._steps = self._train_steps(resume)

    def _end_at_exit_if_open(self) -> None:
        """After the first step: a script that ends with the run part-way (steps taken, no close())
        ends it at exit as close() does, while the modules still exist (the generator was collected at
        interpreter teardown: two "Exception ignored" tracebacks, no on_train_end, the steps lost).
        Registered after the run's setup, so it runs before the exit handlers that setup registered
        (atexit runs the newest first): registered before them, it ran after Ray's shutdown and the save
        failed."""
        if not self._ends_at_exit:
            import atexit
            import weakref

            atexit.register(_end_if_open, weakref.ref(self))
            self._ends_at_exit = True

    def _end_at_exit(self) -> None:
        """`close()` at interpreter exit, with one line on stderr saying where the steps were kept.
        Where the checkpoint cannot be written (an error, a second Ctrl-C), the line names the steps
        lost instead of a traceback."""
        import sys

        from turborlhf.engine.checkpoint import latest_checkpoint

        name, done, total = type(self).__name__, self.state.global_step, self.state.max_steps
        try:
            self._end_part_way("ended at interpreter exit")
        except (Exception, KeyboardInterrupt) as e:
            newest = latest_checkpoint(self.output_dir)
            kept = _checkpoint_step(newest) if newest is not None else 0
            if kept >= done:        # saved; closing the run failed after it: that error is shown as it was
                raise
            why, lost = (str(e).splitlines() or [""])[0], done - kept
            print(f"{name}: left open at exit after step {done}/{total}; its checkpoint could not be saved "
                  f"({type(e).__name__}: {why}), losing the last {lost} step{'s' * (lost != 1)} (since "
                  f"{newest or 'the start'}); call close() to end a run part-way", file=sys.stderr, flush=True)
            return
        print(f"{name}: left open at exit after step {done}/{total}; kept a checkpoint of it in "
              f"{self.output_dir / 'checkpoints'} (a new trainer's train(resume_from_checkpoint=True) continues "
              "it); call close() to end a run part-way", file=sys.stderr, flush=True)

    def _end_part_way(self, why: str) -> None:
        """End the run stepped part-way (`close()` and the exit path): its loop resumes once to save a
        checkpoint of the steps taken (as on SIGTERM), then it is closed (loggers and callbacks end,
        workers stop) and ``output_dir`` freed; nothing is exported. Raises what the save or the
        closing raised, after both."""
        from turborlhf.engine.lifecycle import RunInterrupted, stop_at_next_step
        from turborlhf.metrics import use_callbacks

        steps, self._steps = self._steps, None
        # this object's run is over: train()/step() would start it again from step 0
        self._stopped = RuntimeError(why)
        try:
            with use_callbacks([_History(self.state, self.output_dir), *self.callbacks]):
                try:
                    if self.state.global_step:
                        stop_at_next_step()
                        next(steps)
                except (RunInterrupted, StopIteration):
                    pass
                finally:
                    steps.close()          # its finally blocks: loggers and callbacks end, workers stop
        finally:
            self._release()

    def _finish(self, out: Any, metrics: dict) -> None:
        self._steps = None
        self._result = TrainResult(Path(out or self.output_dir), self.state.global_step, metrics)
        self._release()

    def _release(self) -> None:
        """Let other processes use ``output_dir`` again (a notebook held it until it exited)."""
        from turborlhf.engine.lifecycle import unlock_output_dir

        unlock_output_dir(self.output_dir)

    def step(self) -> dict:
        """Run one optimizer step (RL trainers: one rollout-and-update step) and return its metrics
        (``{name: value}``, `turborlhf.metrics.M`'s names). The first call sets the run up (output
        directory, data, models); the last one also evaluates, checkpoints and exports the model.

        Raises:
            RuntimeError: every step is done already (``.train()`` or earlier ``.step()`` calls).
        """
        if self._result is not None:
            raise RuntimeError(f"{type(self).__name__}: all {self.state.global_step} steps are done; the model "
                               f"is in {self._result.output_dir}")
        if self._steps is None and self._stopped is None:
            self._start(False)
        try:
            return self._next()[2]
        except StopIteration:
            raise RuntimeError(f"{type(self).__name__}: no step left to run (the run in {self.output_dir} is "
                               "complete)") from None

    def train(self, resume_from_checkpoint: bool | str | os.PathLike | None = False) -> TrainResult:
        """Run every step (after ``.step()`` calls: the rest) and return a `TrainResult`.

        Args:
            resume_from_checkpoint: True: continue from the newest checkpoint in ``output_dir`` (as
                ``--resume``; a changed config is refused, naming the fields). A checkpoint path
                (TRL's form) is taken when it is that newest one, else refused (a run continues
                from its newest checkpoint only). Only before any ``.step()`` call.

        Raises:
            RunInterrupted: SIGINT/SIGTERM stopped the run after saving a checkpoint.
            UserError: bad input (config field, data file, model directory, reward function).
        """
        if self._result is not None:
            return self._result
        if resume_from_checkpoint is None:          # TRL's default
            resume_from_checkpoint = False
        elif not isinstance(resume_from_checkpoint, bool):
            resume_from_checkpoint = self._newest_checkpoint_is(Path(resume_from_checkpoint))
        if self._steps is None and self._stopped is None:
            self._start(resume_from_checkpoint)
        elif resume_from_checkpoint:
            raise RuntimeError("train(resume_from_checkpoint=True) after .step(): the run is going on already")
        while self._result is None:
            try:
                self._next()
            except StopIteration:
                pass
        return self._result

    def _newest_checkpoint_is(self, path: Path) -> bool:
        """`train(resume_from_checkpoint=path)`: True where `path` is ``output_dir``'s newest
        checkpoint (or ``output_dir`` itself); UserError otherwise."""
        from turborlhf.engine.checkpoint import latest_checkpoint

        newest = latest_checkpoint(self.output_dir)
        if path.resolve() == Path(self.output_dir).resolve() or (newest is not None
                                                                  and path.resolve() == newest.resolve()):
            return True
        raise UserError(f"resume_from_checkpoint={str(path)!r}: a run continues from the newest checkpoint of its "
                        f"output_dir ({newest or 'none yet'}); pass True, or that path")

    def save_model(self, output_dir: str | os.PathLike | None = None) -> Path:
        """Write the trained model (weights, config, tokenizer: the export of ``output_dir``) to
        `output_dir` (TRL's call; default: the run's ``output_dir``, where it is already) and
        return that directory. RuntimeError before the run has finished (the export comes last)."""
        if self._result is None:
            raise RuntimeError(f"{type(self).__name__}.save_model(): the model is exported when the run ends; call "
                               "train() (or step() to the last step) first")
        src = Path(self._result.output_dir)
        dest = Path(output_dir) if output_dir is not None else src
        if dest.resolve() != src.resolve():
            dest.mkdir(parents=True, exist_ok=True)
            for f in src.iterdir():
                if f.is_file() and _is_export_file(f.name):
                    shutil.copy2(f, dest / f.name)
        return dest

    def close(self) -> None:
        """End a run that was stepped part-way: a checkpoint of the steps taken is saved (as on
        SIGTERM; a new trainer's ``train(resume_from_checkpoint=True)`` continues from it), its
        signal handlers and workers are released, and nothing is exported. A script that ends
        without it gets the same at interpreter exit. Raises what writing the checkpoint raised
        (``OSError``: a full disk), after the run is ended."""
        if self._steps is None:
            if self._result is None and self._stopped is None:      # never started: it held output_dir all the same
                self._stopped = RuntimeError("close() ended it")
                self._release()
            return
        self._end_part_way("close() ended it")


class SFTTrainer(_Trainer):
    """``turborlhf sft``: next-token loss on response tokens (`turborlhf.trainers.sft`). Data:
    ``{prompt, response|completion}``, ``{messages}`` or pair records (trains on chosen)."""

    command, module, config_name = "sft", "turborlhf.trainers.sft", "SFTConfig"

    def __init__(self, model: Any = None, args: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, callbacks: Optional[Sequence[Any]] = None) -> None:
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, callbacks)


class RewardTrainer(_Trainer):
    """``turborlhf rm``: Bradley-Terry reward model (`turborlhf.trainers.reward_model`). Data:
    ``{prompt, chosen, rejected}`` pairs (or conversations, raw HH)."""

    command, module, config_name = "rm", "turborlhf.trainers.reward_model", "RMConfig"

    def __init__(self, model: Any = None, args: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, callbacks: Optional[Sequence[Any]] = None) -> None:
        if _has_column(train_dataset, "margin"):
            args = _margin_on(args)
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, callbacks)


def _has_column(data: Any, name: str) -> bool:
    """Whether an in-memory dataset (a ``datasets.Dataset`` or a list of dicts) has the column `name`."""
    if isinstance(data, (str, os.PathLike)) or data is None:
        return False
    cols = getattr(data, "column_names", None)
    if isinstance(cols, list):
        return name in cols
    return isinstance(data, Sequence) and bool(data) and all(isinstance(r, dict) and name in r for r in data)


def _margin_on(args: Any) -> Any:
    """`args` with ``train.margin`` true unless it sets it: TRL's RewardTrainer subtracts a dataset's
    ``margin`` column in the loss (−log σ(r_c − r_r − margin)); it was ignored here."""
    if args is None:
        return {"train": {"margin": True}}
    if isinstance(args, dict):
        train = args.get("train")
        if isinstance(train, dict) and "margin" in train:
            return args
        return {**args, "train": {**(train if isinstance(train, dict) else {}), "margin": True}}
    train = getattr(args, "train", None)
    if train is not None and hasattr(train, "model_fields_set") and "margin" not in train.model_fields_set:
        return args.model_copy(update={"train": train.model_copy(update={"margin": True})})
    return args


class DPOTrainer(_Trainer):
    """``turborlhf dpo``: DPO and its variants (`turborlhf.trainers.dpo`); ``ref_model``: the
    reference (default: the policy's initial weights)."""

    command, module, config_name, ref_field = "dpo", "turborlhf.trainers.dpo", "DPOConfig", "reference"


class KTOTrainer(_Trainer):
    """``turborlhf kto``: KTO on ``{prompt, completion, label}`` or pair data (`turborlhf.trainers.kto`)."""

    command, module, config_name, ref_field = "kto", "turborlhf.trainers.kto", "KTOConfig", "reference"


class _RLTrainer(_Trainer):
    """The ppo trainer (`turborlhf.trainers.ppo`) with its reward sources given as objects."""

    module = "turborlhf.trainers.ppo"
    model_field, train_field, eval_field, ref_field = "actor.name_or_path", "data.prompts_file", None, "reference"

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, callbacks: Optional[Sequence[Any]] = None,
                 reward_weights: Optional[Sequence[float]] = None, ref_model: Any = None,
                 reward_model: Any = None, value_model: Any = None,
                 reward_processing_classes: Any = None) -> None:
        funcs = [] if reward_funcs is None else (list(reward_funcs) if isinstance(reward_funcs, (list, tuple))
                                                 else [reward_funcs])
        # TRL's reward_processing_classes: one tokenizer per reward function (None: the model's own), or one
        # for a single function; used for reward models passed as objects
        toks = reward_processing_classes
        toks = [None] * len(funcs) if toks is None else (list(toks) if isinstance(toks, (list, tuple)) else [toks])
        if len(toks) != len(funcs):
            raise UserError(f"reward_processing_classes: {len(toks)} for {len(funcs)} reward functions")
        if reward_model is not None:
            funcs.insert(0, reward_model)
            toks.insert(0, None)
        self._reward_tokenizers = toks
        if reward_weights is not None and len(reward_weights) != len(funcs):
            raise UserError(f"reward_weights: {len(reward_weights)} weights for {len(funcs)} reward functions")
        self._funcs, self._weights = funcs, reward_weights
        self._value_model = value_model
        self._callables: dict[str, Callable] = {}
        self._processing_class = processing_class
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, callbacks, ref_model)

    @classmethod
    def _accepted_config(cls) -> type:
        from turborlhf.config import PPOConfig

        return PPOConfig

    def _extend_tree(self, tree: dict, out: Path) -> None:
        sources = list(tree.get("rewards") or [])
        for i, fn in enumerate(self._funcs):
            weight = float(self._weights[i]) if self._weights is not None else 1.0
            if isinstance(fn, (str, os.PathLike)):
                spec = os.fspath(fn)
                from turborlhf.rewards.verifiers import BUILTIN_REWARDS

                kind = "remote" if spec.startswith(("http://", "https://")) else \
                    "function" if (":" in spec or spec in BUILTIN_REWARDS) and not Path(spec).exists() else "model"
                sources.append({"kind": kind, "path": spec, "weight": weight})
            elif _is_hf_model(fn):      # reward_processing_classes[i], else its own tokenizer (TRL's default)
                tok = self._reward_tokenizers[i] or _own_tokenizer(fn, self._processing_class, f"reward_funcs[{i}]")
                path = _save_model(fn, tok, out / f"reward_model_{i}", f"reward_funcs[{i}]")
                sources.append({"kind": "model", "path": path, "weight": weight})
            elif callable(fn):
                base = getattr(fn, "__name__", "") or type(fn).__name__
                base = base if base.isidentifier() else f"reward{i}"
                key = base if base not in self._callables else f"{base}_{i}"
                self._callables[key] = fn
                sources.append({"kind": "callable", "path": key, "name": key, "weight": weight})
            else:
                raise UserError(f"reward_funcs[{i}]: expected a callable, a reward-model directory, "
                                f"'path/to/file.py:function' or an http(s) URL, got {type(fn).__name__}")
        if sources:
            tree["rewards"] = sources
        if self._value_model is not None:
            path = _save_model(self._value_model, self._processing_class, out / "value_model", "value_model") \
                if _is_hf_model(self._value_model) else _path_arg(self._value_model, "value_model")
            tree.setdefault("critic", {})["name_or_path"] = path

    def _train_steps(self, resume: bool) -> Iterator:
        from turborlhf.rewards.callables import RewardCallables
        from turborlhf.trainers.ppo import train_steps

        from turborlhf.rewards.callables import callable_kwargs

        callables = None
        if self._callables:
            table = self._prompt_columns()
            names = {k: [] for cols in table.values() for k in cols}
            for key, fn in self._callables.items():     # a column the function needs but the data lacks: now
                # completion_ids: given at every call
                callable_kwargs(fn, [], [], names, f"reward function {key!r}", completion_ids=[])
            callables = RewardCallables(self._callables, table)
        return train_steps(self.args, resume, callables)

    def _prompt_columns(self):
        """The training rows' other fields by prompt token ids, for the callables (`PromptColumns`)."""
        from turborlhf.data.errors import DataError
        from turborlhf.data.loaders import load_prompts
        from turborlhf.data.sources import Rows, open_rows
        from turborlhf.data.tokenize import encode_prompt
        from turborlhf.models.load import load_tokenizer
        from turborlhf.rewards.callables import PromptColumns

        cfg = self.args
        tok = load_tokenizer(cfg.actor.name_or_path)
        kw = cfg.data.loader_kwargs()
        table = PromptColumns()
        _, rows = open_rows(cfg.data.prompts_file)
        for _, row in rows:
            if not isinstance(row, dict):
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    (prompt,) = load_prompts(Rows([row]), tok, **kw)
            except (DataError, ValueError):          # a row the trainer skips too
                continue
            ids = tuple(encode_prompt(tok, prompt, cfg.rollout.max_prompt_len))
            table.setdefault(ids, {k: v for k, v in row.items() if k != cfg.data.prompt_key})
        return table


class PPOTrainer(_RLTrainer):
    """``turborlhf ppo``: PPO with actor, critic, reward and reference (`turborlhf.trainers.ppo`).
    ``reward_model``/``reward_funcs``: the reward sources; ``value_model``: the critic's start
    (default: the reward model); ``ref_model``: the reference (default: the actor's start)."""

    command, config_name = "ppo", "PPOConfig"


class GRPOTrainer(_RLTrainer):
    """``turborlhf grpo``: the ppo trainer with GRPO's preset (`turborlhf.presets.GRPOConfig`):
    group-normalised advantages over 4 samples per prompt, no critic, k3 KL loss."""

    command, config_name = "grpo", "GRPOConfig"


class RLOOTrainer(_RLTrainer):
    """``turborlhf rloo``: the ppo trainer with RLOO's preset (`turborlhf.presets.RLOOConfig`):
    leave-one-out baseline, no critic, KL in the reward."""

    command, config_name = "rloo", "RLOOConfig"
