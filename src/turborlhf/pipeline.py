"""`turborlhf pipeline`: prepare data → SFT → RM → PPO → evaluation in one run directory.

    turborlhf pipeline --config configs/hh_smollm2/demo.yaml

Stage wiring (each stage section of the YAML overrides the command's own config):
- prepare: raw HH lines → ``<run_dir>/data`` (pairs, NeMo-style comparisons and prompts, KTO).
- sft: base model on the chosen responses of the train pairs → ``<run_dir>/sft``.
- rm: SFT model + scalar head on the train pairs → ``<run_dir>/rm`` (InstructGPT initialises
  the RM from the SFT model).
- ppo: actor and reference = SFT model, critic initialised from the RM → ``<run_dir>/ppo``.
- eval: RM accuracy on the test pairs; SFT and PPO policies sampled with the same seed on the
  same test prompts and scored by the same RM, each prompt's two answers in one pass
  (`turborlhf.evaluate.eval_policy_pair`); a plot and a summary.

``--resume`` skips stages whose directory holds a ``.done`` marker, only while the stage's settings
are the ones it finished with (a training stage's config; the prepare stage's section, raw file and
tokenizer; the eval section): a changed one is refused, naming the fields, or with
``--resume-changed`` runs that stage again, and every later one. A stage whose input stage
finished again since (in this or an earlier invocation) runs again too. An interrupted stage
resumes from its last checkpoint, unless one of its input stages finished again since it started
(its ``.started`` marker): then it starts over. Without ``sft`` in ``stages``, RM, PPO and the
evaluation start from an SFT model an earlier run finished in ``run_dir``, else from the base
model. The stage sections cannot move a stage's output (``output_dir``) or its wired inputs (the models and data
files the pipeline passes between stages): the stages find each other's models under ``run_dir``.

The training stages (sft, rm, ppo) each run in a fresh process (`run_stage_in_child`), as the
separate commands of TRL's and OpenRLHF's recipes do: a stage started in the process that had
just trained the reward model ran slower on the same work. Measured 2026-11-27 on a 2-core Xeon
(AMX, bf16), the demo's 16 PPO steps after its RM stage in one process: 108 s against 84 s for
the same steps (same prompts, responses and lengths) in a process of their own, every phase
slower (experience 1.39×, training 1.30×). The evaluation runs in the pipeline's own process.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import uuid
import time
import traceback
from pathlib import Path
from typing import Optional

from turborlhf.config import (PipelineConfig, PPOConfig, RMConfig, SFTConfig, _deep_update, config_to_dict,
                              validate_section)
from turborlhf.metrics import format_duration

logger = logging.getLogger(__name__)

__all__ = ["run"]


# what the pipeline wires between its stages: a stage section setting one would train on other
# inputs than the evaluation compares (PPO scored by another RM, trained on the held-out prompts)
_WIRED = {"model.name_or_path": "the base model is the pipeline's `model`, the RM's the SFT stage's",
          "actor.name_or_path": "the actor starts from the SFT stage's model",
          "reference": "the reference is the SFT stage's model",
          "reward_model": "PPO and the evaluation score with the RM stage's model",
          "data.train_file": "the prepare stage writes the data", "data.test_file": "the prepare stage writes the data",
          "data.prompts_file": "the prepare stage writes the data"}


def _stage_cfg(cls, base: dict, section: dict, name: str):
    from turborlhf.config import ConfigError

    if "output_dir" in section:
        raise ConfigError(f"{name}.output_dir: the pipeline writes each stage to <run_dir>/{name}, where the "
                          f"next stages read it; set run_dir instead")
    for key, why in _WIRED.items():
        node = section
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            raise ConfigError(f"{name}.{key}: set by the pipeline ({why}); run the command on its own to choose it")
    tree = json.loads(json.dumps(base))
    _deep_update(tree, json.loads(json.dumps(section)))
    return validate_section(cls, tree, name)


def stage_configs(cfg: PipelineConfig, model: str) -> dict:
    """The validated SFT, RM and PPO configs the pipeline runs, with the paths between stages
    (data files, the SFT model feeding RM and PPO, the RM feeding PPO) filled in; `model` is the
    base model (path or zoo name). Raises ConfigError naming the stage section."""
    run_dir = Path(cfg.run_dir)
    data = run_dir / "data"
    sft_out = _sft_model(cfg, run_dir, model)
    pairs = {"train_file": str(data / "train_pairs.jsonl"), "test_file": str(data / "test_pairs.jsonl")}
    ppo_base = {"actor": {"name_or_path": sft_out}, "reference": sft_out, "reward_model": str(run_dir / "rm"),
                "output_dir": str(run_dir / "ppo"), "data": {"prompts_file": str(data / "train_prompts.jsonl")}}
    return {
        "sft": _stage_cfg(SFTConfig, {"model": {"name_or_path": model}, "output_dir": str(run_dir / "sft"),
                                      "data": pairs}, cfg.sft, "sft"),
        "rm": _stage_cfg(RMConfig, {"model": {"name_or_path": sft_out}, "output_dir": str(run_dir / "rm"),
                                    "data": pairs}, cfg.rm, "rm"),
        "ppo": _stage_cfg(PPOConfig, ppo_base, cfg.ppo, "ppo"),
    }


def _sft_model(cfg: PipelineConfig, run_dir: Path, model: str) -> str:
    """The model RM, PPO and the evaluation start from: the SFT stage's, when it is listed or an
    earlier run finished it in `run_dir` (``stages: [ppo, eval]`` after ``[prepare, sft, rm]``),
    else the base `model`."""
    sft = run_dir / "sft"
    return str(sft) if "sft" in cfg.stages or (sft / ".done").exists() else model


def _marker(d: Path, name: str = ".done") -> dict:
    try:
        return json.loads((d / name).read_text())
    except (OSError, ValueError):
        return {}


def run(cfg: PipelineConfig, resume: bool = False) -> dict:
    """Run `cfg`'s stages in order (module docstring); returns the summary (also written to
    ``<run_dir>/summary.json``). The training stages are spawned processes: a script that calls
    this needs Python's ``if __name__ == "__main__":`` guard, as for any `multiprocessing` use.
    Raises the first stage's error (`ConfigError` for a bad stage section before any stage runs)."""
    from turborlhf.engine.checkpoint import atomic_write_text
    from turborlhf.engine.malloc import release_freed_memory
    from turborlhf.models.zoo import resolve_model_path

    run_dir = Path(cfg.run_dir)
    data = run_dir / "data"
    model = resolve_model_path(cfg.model)
    stage_dirs = {"prepare": data, "sft": run_dir / "sft", "rm": run_dir / "rm", "ppo": run_dir / "ppo",
                  "eval": run_dir / "eval"}
    # validate every stage config and what each stage reads before spending minutes on the first one
    stage_cfgs = stage_configs(cfg, model)
    _check_stage_inputs(cfg.stages, stage_dirs)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "pipeline.json", json.dumps(config_to_dict(cfg), indent=2))
    sft_out = _sft_model(cfg, run_dir, model)
    if "sft" not in cfg.stages:
        logger.info(f"[pipeline] the SFT model: {sft_out}")
    settings = _stage_settings(cfg, model, sft_out)
    reads = {stage: [n for n in _READS.get(stage, ()) if n != "sft" or sft_out != model] for stage in stage_dirs}
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    rerun = False                         # a stage ran again: the later ones build on its new output
    for stage in cfg.stages:
        done = stage_dirs[stage] / ".done"
        again = rerun                     # a finished stage trained again (changed config, or an earlier one did)
        if resume and done.exists() and not rerun:
            marker = _marker(stage_dirs[stage])
            inputs = {n: _marker(stage_dirs[n]).get("id") for n in reads[stage]}
            if "inputs" in marker and (moved := [n for n in inputs if marker["inputs"].get(n) != inputs[n]]):
                # an earlier stage finished again since (another invocation: a changed config, a new split)
                logger.warning(f"[pipeline] {stage}: the {', '.join(moved)} stage's output changed since it "
                               "finished: run again")
                rerun = again = True
        if resume and done.exists() and not rerun:
            changed = (_finished_with_another_config(stage_cfgs[stage], stage_dirs[stage]) if stage in _TRAINERS
                       else _changed_settings(marker.get("settings"), settings[stage]))
            if not changed:
                logger.info(f"[pipeline] {stage}: done before, skipped")
                continue
            from turborlhf.engine.lifecycle import ConfigChanged, config_change_allowed

            if not config_change_allowed():
                where = stage_dirs[stage] / ("config.yaml" if stage in _TRAINERS else ".done")
                raise ConfigChanged(f"{stage}: finished before with other settings ({changed}); run with those in "
                                    f"{where}, or pass --resume-changed to run the stage again")
            logger.warning(f"[pipeline] {stage}: finished before with another config ({changed}): trained again")
            again = True
        inputs = {n: _marker(stage_dirs[n]).get("id") for n in reads[stage]}
        if stage in _TRAINERS and resume and not again and not done.exists():
            # an interrupted stage: its checkpoints grew out of the outputs it read when it started
            started = _marker(stage_dirs[stage], ".started").get("inputs")
            if started is not None and (moved := [n for n in inputs if started.get(n) != inputs[n]]):
                logger.warning(f"[pipeline] {stage}: the {', '.join(moved)} stage's output changed since this stage "
                               "started: its checkpoints are of the earlier one, trained again from the start")
                again = True
        logger.info(f"\n[pipeline] ===== {stage} =====")
        done.unlink(missing_ok=True)      # a stage run again is not done until it finishes again
        if stage in _TRAINERS and (again or not resume):
            # the ids of the outputs it starts from: a --resume of it interrupted compares them
            atomic_write_text(stage_dirs[stage] / ".started", json.dumps({"inputs": inputs}))
        t0 = time.perf_counter()
        if stage == "prepare":
            _prepare(cfg, model, data)
        elif stage in _TRAINERS:
            run_stage_in_child(stage, stage_cfgs[stage], resume and not again)
        elif stage == "eval":
            from turborlhf.report import evaluate_pipeline

            evaluate_pipeline(cfg, run_dir, sft_out, data, timings, stage_cfgs["rm"].data.max_len,
                              stage_cfgs["rm"].model.dtype, stage_cfgs["rm"].model.device)
        rerun = True                      # every later stage reads this one's new (or resumed) output
        timings[stage] = round(time.perf_counter() - t0, 1)
        release_freed_memory()    # the next stage's working set differs (engine.malloc)
        stage_dirs[stage].mkdir(parents=True, exist_ok=True)
        # its own id, and the ids of the outputs it read: a later --resume runs it again when one of
        # them finished again since (in another invocation)
        atomic_write_text(done, json.dumps({"seconds": timings[stage], "settings": settings.get(stage),
                                            "id": uuid.uuid4().hex,
                                            "inputs": {n: _marker(stage_dirs[n]).get("id") for n in reads[stage]}}))
        logger.info(f"[pipeline] {stage} took {format_duration(timings[stage])}")
    total = time.perf_counter() - t_all
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if set(timings) - {"eval"} and "eval" not in timings:
        # a stage ran again after the evaluation: that evaluation is of the models before it
        summary = {"stage_seconds": summary.get("stage_seconds", {}) if resume else {}}
    summary.setdefault("stage_seconds", {}).update(timings)
    for stage, d in stage_dirs.items():         # stages finished in earlier invocations keep their times
        if stage not in timings and "seconds" in (m := _marker(d)):
            summary["stage_seconds"].setdefault(stage, m["seconds"])
    summary["stage_seconds"] = {st: summary["stage_seconds"][st] for st in stage_dirs if st in summary["stage_seconds"]}
    summary["total_seconds"] = round(total, 1)      # this invocation's
    atomic_write_text(summary_path, json.dumps(summary, indent=2))
    from turborlhf.report import print_summary

    print_summary(summary)
    logger.info(f"[pipeline] finished in {format_duration(total)}; summary: {summary_path}")
    return summary


# stage → the stages whose output it reads (the SFT model only where `_sft_model` is the SFT stage's)
_READS = {"sft": ("prepare",), "rm": ("prepare", "sft"), "ppo": ("prepare", "sft", "rm"),
          "eval": ("prepare", "sft", "rm", "ppo")}


def _check_stage_inputs(stages: list[str], stage_dirs: dict) -> None:
    """`ConfigError` naming ``stages`` when a stage reads an output that no earlier listed stage
    writes and that a finished earlier run did not leave in ``run_dir`` (``.done``): found before
    the first stage, not after the ones before it trained (``[prepare, sft, rm, eval]`` failed at
    eval, for want of a PPO model, once SFT and RM had run)."""
    from turborlhf.config import ConfigError

    for i, stage in enumerate(stages):
        for need in _READS.get(stage, ()):
            if need == "sft" and "sft" not in stages:
                continue                          # a finished SFT stage, or the base model (`_sft_model`)
            if need not in stages[:i] and not (stage_dirs[need] / ".done").exists():
                raise ConfigError(f"stages: {stage} reads the {need} stage's output ({stage_dirs[need]}), which no "
                                  f"earlier stage writes and no finished run left there: list {need} before {stage}")


def _finished_with_another_config(cfg, out: Path) -> str:
    """The fields (``a.b: old -> new``) in which `cfg`, resolved for this host as the stage would,
    differs from the ``config.yaml`` of the finished stage in `out` (empty: none, or no file)."""
    import yaml

    from turborlhf.engine.lifecycle import _is_field_default, config_changes
    from turborlhf.engine.run import resolve_hardware

    saved = out / "config.yaml"
    if not saved.exists():
        return ""
    cfg = resolve_hardware(cfg, show=False)
    changed = {k: v for k, v in config_changes(yaml.safe_load(saved.read_text()) or {}, config_to_dict(cfg)).items()
               if not (v[0] == "<unset>" and _is_field_default(cfg, k, v[1]))}
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())


def _stage_settings(cfg: PipelineConfig, model: str, sft_out: str) -> dict:
    """What the non-training stages read besides the earlier stages' models (each training stage
    keeps its own ``config.yaml``): saved in the stage's ``.done`` marker, compared by ``--resume``.
    The prepare stage's raw file counts by its SHA-256, the tokenizer by the base model's path."""
    from turborlhf.data.jsonl import file_sha256

    digest = file_sha256(cfg.prepare.input) if Path(cfg.prepare.input).is_file() else None
    return {"prepare": {"model": model, **config_to_dict(cfg.prepare), "input_sha256": digest},
            "eval": {"policy": sft_out, **config_to_dict(cfg.eval)}}


def _changed_settings(saved, now) -> str:
    """`_finished_with_another_config` for a non-training stage's `_stage_settings` (empty when
    the marker predates them)."""
    if saved is None or now is None:
        return ""
    from turborlhf.engine.lifecycle import config_changes

    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in config_changes(saved, now).items())


def _prepare(cfg: PipelineConfig, model: str, data: Path) -> None:
    from turborlhf.data.hh_rlhf import prepare_hh
    from turborlhf.models.load import load_tokenizer

    tok = load_tokenizer(model)
    report = prepare_hh(cfg.prepare.input, data, tok, test_fraction=cfg.prepare.test_fraction,
                        strict=cfg.prepare.strict)
    logger.info(f"[prepare] {json.dumps({k: v for k, v in report.items() if not isinstance(v, (dict, list))})}")


# stage → (module, function) of its trainer
_TRAINERS = {"sft": ("turborlhf.trainers.sft", "train"), "rm": ("turborlhf.trainers.reward_model", "train"),
             "ppo": ("turborlhf.trainers.ppo", "train")}


def run_stage_in_child(stage: str, cfg, resume: bool) -> None:
    """Train `stage` ('sft', 'rm' or 'ppo') with its validated `cfg` in a fresh process (spawned:
    nothing of this process's heap, threads or imports), and wait for it.

    The child takes this process's malloc settings (`turborlhf.engine.malloc.keep_freed_memory`),
    console logging and ``--resume-changed`` permission, and runs in a process group of its own:
    SIGINT/SIGTERM sent to the pipeline (a terminal's Ctrl-C, ``kill``) reach it once, forwarded
    from here, so it finishes its step and saves a checkpoint as the command would (a second
    signal stops it at once); if this process dies, the child gets SIGTERM. An error of the child
    is raised here again (`UserError`, `RunError`, `RunInterrupted` with its exit code: the CLI
    prints its one line); an unexpected one prints its traceback in the child first. Raises
    `RunError` if the child dies without reporting (e.g. killed by the kernel's OOM killer)."""
    from turborlhf.engine.lifecycle import config_change_allowed
    from turborlhf.engine.malloc import keeps_freed_memory

    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_stage_main, name=f"turborlhf-{stage}",
                        args=(stage, cfg, resume, config_change_allowed(), keeps_freed_memory(), send))
    sys.stdout.flush()            # the child writes to the same stdout and stderr
    sys.stderr.flush()
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        if child.pid is None:      # not started yet: passed on once it is
            return
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    in_main_thread = threading.current_thread() is threading.main_thread()       # where handlers can be set
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main_thread else {}
    try:
        child.start()
        send.close()
        for signum in forwarded:   # received while the child was being started
            os.kill(child.pid, signum)
        report, reading = None, True
        while child.is_alive():
            # the report is read as it comes, not after the child's exit: one larger than the pipe's
            # buffer (a long error message) blocked the child's write while this process waited for it
            if reading and recv.poll(0.5):
                report, reading = _receive(recv), False
            elif not reading:
                child.join(0.5)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if reading:
        report = _receive(recv) if recv.poll() else None
    if report is not None:
        err, exit_code = pickle.loads(report)
        if exit_code is not None:
            err.exit_code = exit_code
        raise err
    if child.exitcode is not None and child.exitcode < 0 and -child.exitcode in forwarded:
        # the signal the pipeline got and passed on, arriving before the stage's own handlers were
        # installed (it was still starting up): a stop asked for, not a crash
        from turborlhf.engine.lifecycle import RunInterrupted

        name = signal.Signals(-child.exitcode).name
        raise RunInterrupted(f"[pipeline] {name} while the {stage} stage was starting; --resume continues from its "
                             "last checkpoint", -child.exitcode)
    if child.exitcode != 0:
        from turborlhf.errors import RunError

        raise RunError(f"[pipeline] the {stage} stage's process ended with code {child.exitcode} without an error "
                       "report (-9: killed, e.g. by the kernel's OOM killer); --resume continues from its last "
                       "checkpoint")


def _receive(recv) -> Optional[bytes]:
    """The child's report from `recv`, or None: closed without one (the stage succeeded, or died,
    perhaps part-way through writing it)."""
    try:
        return recv.recv()
    except (EOFError, OSError):
        return None


def _stage_main(stage: str, cfg, resume: bool, allow_changed: bool, keep_freed: bool, conn) -> None:
    """The child of `run_stage_in_child`."""
    os.setpgid(0, 0)                  # signals come forwarded from the pipeline, once
    _die_with_parent()
    import importlib

    from turborlhf.engine import malloc
    from turborlhf.engine.lifecycle import allow_config_change
    from turborlhf.metrics import console_logging

    malloc.prefer_huge_pages()
    if keep_freed:
        malloc.keep_freed_memory()
    console_logging()
    module, func = _TRAINERS[stage]
    try:
        with allow_config_change(allow_changed):
            getattr(importlib.import_module(module), func)(cfg, resume=resume)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the pipeline, which raises it
        from turborlhf.distributed.group import WorkerError
        from turborlhf.engine.lifecycle import RunInterrupted
        from turborlhf.errors import RunError, UserError

        if not isinstance(e, (UserError, RunError, RunInterrupted, WorkerError, KeyboardInterrupt)):
            traceback.print_exc()        # a bug: its traceback, here where it happened
        try:
            report = pickle.dumps((e, getattr(e, "exit_code", None)))
            pickle.loads(report)
        except Exception:  # noqa: BLE001 - an exception that does not survive pickling: its kind and text
            kind = next((k for k in (UserError, RunError, WorkerError) if isinstance(e, k)), RuntimeError)
            report = pickle.dumps((kind(f"{e}" if kind is not RuntimeError else f"{type(e).__name__}: {e}"), None))
        conn.send(report)
        conn.close()
        sys.exit(1)


def _die_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere
    nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)    # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
