"""Checkpoints that survive crashes: every directory is written to a temporary sibling, its files
and directories fsynced, and then renamed into place (and the parent directory fsynced), so a
crash or power loss mid-save leaves the previous checkpoint intact. Old checkpoints are renamed
out of ``step-*`` before they are deleted, so a kill mid-deletion never leaves a partial
``step-N``. What a killed process leaves behind (``.step-*.tmp-*`` staging directories,
``.step-*.old-*`` directories being deleted, ``.latest.*`` temp files, a ``step-N`` without its
``trainer_state.pt``) is removed by the next complete save; the dead leftovers that no live
writer can still be using (all but the staging directories) also by `latest_checkpoint`, i.e. on
``--resume``.

Layout of a run directory::

    <output_dir>/
      checkpoints/step-000040/      resumable: one HF dir per model + trainer_state.pt
          actor/  critic/ ...       save_pretrained layout + tokenizer (LoRA: the adapters only)
          trainer_state.pt          optimizers, schedulers, RNG, step, data position, extra
          export_config.json        the last one, where the final evaluation measured them: config
                                    fields the export adds (a reward model's reward_mean/reward_std)
      checkpoints/latest            text file: name of the newest complete checkpoint
      final/ (or the trainer's own name)  the exported model (HF dir)
      run_id                        the identity of the run that started at step 0 here (`new_run_id`),
                                    copied into each checkpoint it writes (``step-*/run_id``): a
                                    resume continues only the run's own checkpoints
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from turborlhf.data.jsonl import usual_mode
from turborlhf.engine.train import load_optimizer_and_schedule, rng_state, set_rng_state
from turborlhf.models.load import is_lora, merge_lora_for_save

logger = logging.getLogger(__name__)

__all__ = ["save_hf_dir", "save_checkpoint", "latest_checkpoint", "clear_checkpoints", "load_trainer_state",
           "plan_digest", "check_plan", "atomic_write_text", "trainer_state", "restore", "record_export_config",
           "export_config_of", "remove_killed_exports", "new_run_id", "earlier_run_checkpoints"]

# a `.latest.*` temp file older than this is a crash's leftover (writing one takes milliseconds);
# younger ones may belong to a live writer when `latest_checkpoint` runs beside a training run
_STALE_TEMP_S = 60.0


def _fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first."""
    dirs = []
    for d, _, files in os.walk(root):
        dirs.append(Path(d))
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        _fsync_dir(d)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a fsynced temp file (``.<name>.*``) renamed into place; a
    failed write (a full disk) removes the temp file and re-raises, leaving `path` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        usual_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def _host() -> str:
    """This host's name as it goes into a file name (no ``-``, ``/`` or other separators)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "localhost"


def _writer_tag() -> str:
    """``<pid>@<host>`` of this process: in the name of a temporary directory it writes, so that a
    later export can tell what a killed writer left (`remove_killed_exports`) from a live one's."""
    return f"{os.getpid()}@{_host()}"


def _writer_gone(rest: str) -> bool:
    """Whether a name's part after its prefix starts with the `_writer_tag` of a process of this
    host that no longer runs. False for another host's (it cannot be checked from here), a name
    without a tag (an older version's) and on Windows (``os.kill`` there terminates)."""
    m = re.match(r"(\d+)@([A-Za-z0-9._]+)", rest)
    if m is None or m.group(2) != _host() or os.name == "nt":
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except OSError:             # another user's process: running
        return False
    return False


def remove_killed_exports(parent: str | Path, prefixes: tuple[str, ...]) -> list[str]:
    """Remove the directories in `parent` that exports killed mid-way left behind: named
    ``<prefix><pid>@<host>...`` for a prefix in `prefixes` (a staging directory, or a replaced
    export renamed aside), whose writer `pid` of this host no longer runs. An export still running
    keeps its own; one of another host, or named by an older version (no ``<pid>@<host>``), is kept
    too. Logs one line naming what it removed; returns those names, sorted."""
    d = Path(parent)
    if not d.is_dir():
        return []
    gone = []
    for p in sorted(d.iterdir()):
        rest = next((p.name[len(x):] for x in prefixes if p.name.startswith(x)), None)
        if rest is not None and p.is_dir() and not p.is_symlink() and _writer_gone(rest):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name)
    if gone:
        logger.warning(f"[export] removed what killed exports left in {d}: {', '.join(gone)}")
    return gone


def _remove_dir(path: Path) -> None:
    """Delete a directory so that a kill mid-way leaves no partial `path`: rename it to a hidden
    ``.<name>.del-<pid>`` sibling first (atomic), then delete that."""
    old = path.with_name(f".{path.name}.del-{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    os.replace(path, old)
    shutil.rmtree(old, ignore_errors=True)


def _replace_dir(staged: Path, final: Path) -> None:
    """fsync `staged`, move it to `final` and fsync the parent; an existing `final` is renamed
    aside first (``.<name>.old-<pid>@<host>``, complete until `final` is in place: a kill between
    the two renames leaves it for `_remove_dead_leftovers` to put back, or an export's for
    `remove_killed_exports` to remove) and removed after."""
    _fsync_tree(staged)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{_writer_tag()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(staged, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_hf(model, tokenizer, out: Path, extra_config: Optional[dict] = None, merge: bool = True) -> None:
    """save_pretrained + tokenizer. A LoRA model is written merged (a plain HF model), or with
    ``merge=False`` as its peft adapter directory (adapter_config.json + adapter_model.safetensors,
    the base named in the config), which is what a resumable checkpoint needs."""
    if not merge and is_lora(model):
        model.save_pretrained(out, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        return
    plain = merge_lora_for_save(model)
    if extra_config:
        for k, v in extra_config.items():
            setattr(plain.config, k, v)
    # gradient checkpointing turned the config's use_cache off for training: saved as it came
    use_cache = getattr(model, "_use_cache_before_checkpointing", None)
    trained_with = plain.config.use_cache if use_cache is not None else None
    gen = plain.generation_config if tokenizer is not None and plain.can_generate() else None
    eos_before = gen.eos_token_id if gen is not None else None
    try:
        if use_cache is not None:
            plain.config.use_cache = use_cache
        if gen is not None:
            gen.eos_token_id = _stop_ids_for_generate(eos_before, tokenizer)
        plain.save_pretrained(out, safe_serialization=True)
    finally:
        if use_cache is not None:
            plain.config.use_cache = trained_with
        if gen is not None:
            gen.eos_token_id = eos_before
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    for p in Path(out).rglob("*"):     # safetensors writes its file 0600: readable as any file here
        usual_mode(p)


def _stop_ids_for_generate(eos, tokenizer):
    """The ``generation_config.eos_token_id`` an export gets: its own, plus the tokens a rollout of
    `tokenizer` stops at (`turborlhf.data.chat.stop_ids`: the chat template's end-of-turn token, as
    ``<|im_end|>`` when a base model is trained with ``data.chat_template=chatml``), so plain HF
    ``generate`` stops where the trained responses end. An int where there is one."""
    from turborlhf.data.chat import stop_ids

    have = [eos] if isinstance(eos, int) else list(eos or [])
    want = list(dict.fromkeys([*have, *stop_ids(tokenizer)]))
    return want[0] if len(want) == 1 else (want or None)


def save_hf_dir(model, tokenizer, out_dir: str | Path, extra_config: Optional[dict] = None) -> Path:
    """Atomically write a Hugging Face directory (weights, config, tokenizer): staged in a hidden
    ``.<name>.tmp-<pid>@<host>-*`` sibling, then renamed into place (`_replace_dir`). What killed
    exports to `out_dir` left beside it is removed first (`remove_killed_exports`)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_killed_exports(out.parent, (f".{out.name}.tmp-", f".{out.name}.old-"))
    staged = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{_writer_tag()}-"))
    usual_mode(staged)
    try:
        _write_hf(model, tokenizer, staged, extra_config)
        _replace_dir(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return out


_PROTECTED: set[Path] = set()   # paths the running run reads (`protect_inputs`): never rotated away


def protect_inputs(paths) -> None:
    """Checkpoint rotation in this process keeps any checkpoint that holds one of `paths` (resolved):
    a fresh run that starts from an earlier checkpoint in its own output_dir deleted it at its first
    save, so it could never be resumed. Replaces the previous run's set."""
    _PROTECTED.clear()
    _PROTECTED.update(Path(p).resolve() for p in paths)


def _checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint after `step` steps (``step-000042``)."""
    return f"step-{step:06d}"


def save_checkpoint(output_dir: str | Path, step: int, models: dict[str, Any], tokenizer,
                    state: dict[str, Any], keep: int = 1) -> Path:
    """Write ``checkpoints/step-XXXXXX`` atomically, point ``latest`` at it, prune old ones.

    Args:
        models: name → model, each saved as an HF dir; a LoRA model as its adapter directory
            (load it with peft's ``AutoPeftModelForCausalLM`` / ``PeftModel.from_pretrained`` on
            the base named in ``adapter_config.json``; the final export is merged); or name → a
            callable ``writer(dir)`` that writes that directory itself (a model held by a remote worker).
        state: picklable trainer state (optimizer/scheduler state dicts, RNG, step, data position).
        keep: number of complete checkpoints of this run to keep (an earlier run's are not counted).

    The checkpoint gets a copy of ``<output_dir>/run_id`` (`new_run_id`) where there is one.
    """
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = _checkpoint_name(step)
    staged = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.tmp-"))
    usual_mode(staged)
    try:
        for mname, model in models.items():
            if isinstance(model, torch.nn.Module) or not callable(model):
                _write_hf(model, tokenizer, staged / mname, merge=False)
            else:
                model(staged / mname)
        torch.save(state, staged / "trainer_state.pt")
        run_id = _run_id(Path(output_dir))
        if run_id is not None:
            (staged / RUN_ID).write_text(run_id + "\n")
        _replace_dir(staged, root / name)
    except BaseException as e:
        shutil.rmtree(staged, ignore_errors=True)
        if isinstance(e, RuntimeError) and shutil.disk_usage(root).free < (64 << 20):
            # torch's writer says only "unexpected pos" when the disk fills: name the disk and the path
            import errno
            raise OSError(errno.ENOSPC, "No space left on device (checkpoint not written; the previous one is "
                                        "intact)", str(root / name)) from e
        raise
    atomic_write_text(root / "latest", name)
    # the run's own `keep` newest by step number, the one just written always among them; an earlier
    # run's kept checkpoint (one this run started from) takes no slot and is not rotated away
    others = [p for p in _complete_checkpoints(Path(output_dir))[0] if p.name != name]
    for old in others[:max(0, len(others) - (keep - 1))]:
        if not any(p == old.resolve() or old.resolve() in p.parents for p in _PROTECTED):
            _remove_dir(old)
    _remove_stale_staging(root)
    _remove_dead_leftovers(root, keep=root / name, min_age_s=0.0)
    return root / name


EXPORT_CONFIG = "export_config.json"


def record_export_config(output_dir: str | Path, step: int, model_name: str, fields: dict) -> None:
    """Note in checkpoint `step` of the run in `output_dir` the config fields that the trainer's
    export of its model `model_name` adds to the checkpointed config (a reward model's
    ``reward_mean``/``reward_std``: the final evaluation measures them after the last checkpoint
    is written), so that `export_config_of` gives them to ``turborlhf export`` of that checkpoint.
    Written atomically beside ``trainer_state.pt``; other models' fields kept. Nothing for empty
    `fields` or a checkpoint that is not there."""
    ckpt = Path(output_dir) / "checkpoints" / _checkpoint_name(step)
    if not fields or not (ckpt / "trainer_state.pt").exists():
        return
    path = ckpt / EXPORT_CONFIG
    noted = json.loads(path.read_text()) if path.exists() else {}
    noted[model_name] = dict(fields)
    atomic_write_text(path, json.dumps(noted, indent=2) + "\n")


def export_config_of(model_dir: str | Path) -> dict:
    """The config fields `record_export_config` noted for `model_dir`, a model directory inside a
    checkpoint (``checkpoints/step-N/<model>``); {} for one without them or any other directory."""
    d = Path(model_dir)
    path = d.parent / EXPORT_CONFIG
    if not ((d.parent / "trainer_state.pt").exists() and path.exists()):
        return {}
    return dict(json.loads(path.read_text()).get(d.name) or {})


def _step_number(p: Path) -> int:
    """The step of a ``step-N`` checkpoint directory (-1 for a name without one)."""
    tail = p.name.removeprefix("step-")
    return int(tail) if tail.isdigit() else -1


def clear_checkpoints(output_dir: str | Path) -> int:
    """Remove every checkpoint under ``<output_dir>/checkpoints`` (a fresh run in a directory an
    earlier run used: its checkpoints would outrank the new run's in rotation and be what a later
    ``--resume`` continues). Returns how many complete checkpoints were removed."""
    for left in Path(output_dir).glob(".checkpoints.del-*"):       # a clearing cut short by a kill
        shutil.rmtree(left, ignore_errors=True)
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return 0
    n = sum(1 for p in root.glob("step-*") if (p / "trainer_state.pt").exists())
    if any(root.iterdir()):
        _remove_dir(root)
    return n


def _remove_stale_staging(root: Path) -> None:
    """Remove half-written ``.step-*.tmp-*`` directories left by an earlier crash. A save's own
    clean-up can miss them: a process killed mid-save never runs it, and a remote worker that
    outlives the driver's error may still be writing into the directory while the driver removes
    it. Called only after a complete save, by the run that owns `root`."""
    for p in root.glob(".step-*.tmp-*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _remove_dead_leftovers(root: Path, keep: Optional[Path], min_age_s: float) -> None:
    """Remove what only a killed process leaves and no live writer uses: ``.step-*.del-*``
    directories (a deletion cut short), ``.step-*.old-*`` ones (a replaced checkpoint, see
    `_replace_dir`), ``step-*`` directories without ``trainer_state.pt`` (one caught mid-deletion
    by an older version, which deleted in place), and ``.latest.*`` temp files older than
    `min_age_s` seconds. `keep` is never touched. A replaced checkpoint whose replacement never
    arrived (a kill between `_replace_dir`'s two renames: ``step-N`` missing, ``latest`` naming it)
    is put back instead: it is the run's last checkpoint."""
    import time

    marker = root / "latest"
    latest = marker.read_text().strip() if marker.is_file() else None
    for p in root.glob(".step-*.old-*"):
        name = p.name[1:].rsplit(".old-", 1)[0]
        if p.is_dir() and name == latest and not (root / name).exists() and (p / "trainer_state.pt").exists():
            os.replace(p, root / name)
            logger.warning(f"[checkpoint] {root / name}: restored (its re-save was cut short)")
    for p in [*root.glob(".step-*.old-*"), *root.glob(".step-*.del-*")]:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step-*"):
        if p.is_dir() and p != keep and not (p / "trainer_state.pt").exists():
            shutil.rmtree(p, ignore_errors=True)
    now = time.time()
    for p in root.glob(".latest.*"):
        try:
            if p.is_file() and now - p.stat().st_mtime >= min_age_s:
                p.unlink()
        except FileNotFoundError:
            pass


RUN_ID = "run_id"


def new_run_id(output_dir: str | Path) -> str:
    """Give the run that starts from step 0 in `output_dir` a new identity: a random hex string in
    ``<output_dir>/run_id`` (written atomically), which `save_checkpoint` copies into every
    checkpoint. `latest_checkpoint` then passes over checkpoints an earlier run left there (a fresh
    run that starts from one of them keeps them): a --resume before the new run's first save
    continued the earlier run with the new config. Returns the identity."""
    import uuid

    run_id = uuid.uuid4().hex
    atomic_write_text(Path(output_dir) / RUN_ID, run_id + "\n")
    return run_id


def _run_id(d: Path) -> Optional[str]:
    """The run identity in directory `d` (a run's output_dir or one of its checkpoints), or None."""
    try:
        return (d / RUN_ID).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def _complete_checkpoints(output_dir: Path) -> tuple[list[Path], list[Path]]:
    """The complete checkpoints (with ``trainer_state.pt``) of `output_dir` by step: (the run's own,
    an earlier run's). With a ``run_id`` in `output_dir`, those whose own differs or is missing are
    an earlier run's; without one (a run started by a version that recorded none) all are its own."""
    root = output_dir / "checkpoints"
    done = sorted((p for p in root.glob("step-*") if (p / "trainer_state.pt").exists()),
                  key=_step_number) if root.is_dir() else []
    mine = _run_id(output_dir)
    own = [p for p in done if mine is None or _run_id(p) == mine]
    return own, [p for p in done if p not in own]


def earlier_run_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints in ``<output_dir>/checkpoints`` that an earlier run wrote (see
    `new_run_id`), by step: `latest_checkpoint` never returns one of them."""
    return _complete_checkpoints(Path(output_dir))[1]


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint directory (one with ``trainer_state.pt``) of the run in
    `output_dir`, or None. An earlier run's checkpoints there (`earlier_run_checkpoints`: a fresh
    run that starts from one of them keeps them) are passed over.

    Also removes the dead leftovers of killed saves (`_remove_dead_leftovers`: ``.step-*.old-*``
    directories, incomplete ``step-*`` directories, ``.latest.*`` temp files older than a minute);
    half-written staging directories are left to the next complete save."""
    root = Path(output_dir) / "checkpoints"
    if root.is_dir():
        _remove_dead_leftovers(root, keep=None, min_age_s=_STALE_TEMP_S)
    own = _complete_checkpoints(Path(output_dir))[0]
    marker = root / "latest"
    if marker.exists():
        p = root / marker.read_text().strip()
        if p in own:
            return p
    return own[-1] if own else None


def load_trainer_state(ckpt_dir: str | Path) -> dict:
    return torch.load(Path(ckpt_dir) / "trainer_state.pt", map_location="cpu", weights_only=False)


def plan_digest(plan: list[list[int]], examples: Optional[list] = None) -> str:
    """SHA-256 of a run's step plan (the example indices of every optimizer step, in order) and,
    given `examples` (the encoded training examples the indices point into), of the examples each
    step takes: a training file edited in place changes it though the indices may not change."""
    import hashlib
    import json

    h = hashlib.sha256(json.dumps(plan, separators=(",", ":")).encode())
    if examples is not None:
        for i in sorted({i for step in plan for i in step}):
            h.update(json.dumps(examples[i], sort_keys=True, separators=(",", ":"), default=str).encode())
    return h.hexdigest()


class PlanDigest:
    """Digests of a run's step plan (the example indices of every optimizer step, in order) and of
    the examples each step takes, step by step: `done` gives the digest of the steps a checkpoint
    has done, so a resume that changes only the steps still to come (``--resume-changed`` of
    ``train.max_steps``; the plan is prefix-stable) compares equal, while other data or another
    batching of the steps done does not.

    plan: `turborlhf.engine.run.plan_steps` output; examples: the encoded training examples the
    indices point into (a training file edited in place changes the digest though the indices may
    not change); salt: a digest of further inputs of every step (PPO-ptx examples), or None.
    """

    def __init__(self, plan: list[list[int]], examples: Optional[list] = None, salt: Optional[str] = None):
        import hashlib
        import json

        self._plan, self._examples, self._salt = plan, examples, salt
        dump = lambda x: json.dumps(x, sort_keys=True, separators=(",", ":"), default=str).encode()  # noqa: E731
        seen: dict[int, bytes] = {}
        self._steps: list[bytes] = []
        for step in plan:
            h = hashlib.sha256(dump(step))
            if examples is not None:
                for i in step:
                    if i not in seen:
                        seen[i] = hashlib.sha256(dump(examples[i])).digest()
                    h.update(seen[i])
            self._steps.append(h.digest())

    def done(self, steps: int) -> Optional[str]:
        """SHA-256 of the first `steps` steps (and the salt); None past the plan's end (a lowered
        ``max_steps``: nothing is left to train)."""
        import hashlib

        if steps > len(self._steps):
            return None
        h = hashlib.sha256((self._salt or "").encode())
        for d in self._steps[:steps]:
            h.update(d)
        return h.hexdigest()

    def whole(self) -> str:
        """The whole plan's `plan_digest` (with the salt), as checkpoints before `done` recorded it."""
        d = plan_digest(self._plan, self._examples)
        return plan_digest([[0, 1]], [d, self._salt]) if self._salt else d


def check_plan(state: dict, plan: "PlanDigest | str | None", ckpt: str | Path, tag: str) -> None:
    """Raise `turborlhf.engine.lifecycle.ConfigChanged` if the checkpoint `state` was written with
    another plan than the resuming run's, unless ``--resume-changed`` allows it (then warn).

    plan: a trainer's `PlanDigest`, compared over the steps the checkpoint has done (``state["step"]``);
    or a digest string (rejection sampling's prompts, conditional SFT's data), compared with
    ``state["plan_sha256"]``. Nothing to compare in a checkpoint written before it was recorded."""
    if isinstance(plan, PlanDigest):
        if "plan_done_sha256" in state:
            saved, mine = state["plan_done_sha256"], plan.done(state["step"])
        else:
            saved, mine = state.get("plan_sha256"), (plan.whole() if "plan_sha256" in state else None)
    else:
        saved, mine = state.get("plan_sha256"), plan
    if mine is None or saved is None or saved == mine:
        return
    from turborlhf.engine.lifecycle import ConfigChanged, config_change_allowed

    what = (f"--resume from {ckpt}: the examples of the steps done differ from the run's (the training data "
            "or its batching changed since the checkpoint was written), so the rest of the run would repeat "
            "some examples and skip others")
    if not config_change_allowed():
        raise ConfigChanged(f"{what}; start a new run, or pass --resume-changed to continue anyway")
    logger.warning(f"[{tag}] --resume-changed: {what}")


def trainer_state(optimizer: torch.optim.Optimizer, scheduler, step: int, plan: Optional[PlanDigest] = None) -> dict:
    """The resumable state of a one-optimizer trainer: optimizer, scheduler, RNG, `step`
    (optimizer steps done) and its `PlanDigest` of the steps done; the counterpart of `restore`."""
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state(),
             "step": step}
    if plan is not None:
        state["plan_done_sha256"] = plan.done(step)
    return state


def restore(ckpt: Optional[str | Path], optimizer: torch.optim.Optimizer, scheduler, tag: str = "train",
            plan: Optional[PlanDigest] = None) -> int:
    """Load the state written by `trainer_state` from checkpoint directory `ckpt` into `optimizer`
    and `scheduler`, restore the RNG, and return the step to continue from (0 when `ckpt` is None:
    a fresh run). Raises FileNotFoundError if `ckpt` has no ``trainer_state.pt``, and
    `turborlhf.engine.lifecycle.ConfigChanged` if `plan`'s steps done differ from the checkpoint's
    (other data, or another batching of it: the rest of the run would repeat some examples and skip
    others), unless ``--resume-changed`` allows it."""
    if ckpt is None:
        return 0
    state = load_trainer_state(ckpt)
    check_plan(state, plan, ckpt, tag)
    load_optimizer_and_schedule(optimizer, scheduler, lambda: optimizer.load_state_dict(state["optimizer"]),
                                state["scheduler"])
    set_rng_state(state["rng"])
    logger.info(f"[{tag}] resumed from {ckpt} at step {state['step']}")
    return state["step"]
