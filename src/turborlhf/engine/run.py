"""Run scaffolding shared by trainers as plain functions (no base class): output directory and
config snapshot, the deterministic batch plan, and the final model export."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TypeVar

import yaml

from turborlhf.config import Cfg, config_to_dict
from turborlhf.engine.checkpoint import _fsync_dir, _fsync_tree, _write_hf, _writer_tag, remove_killed_exports
from turborlhf.engine.lifecycle import RunInterrupted  # noqa: F401  (re-exported: its old home)

C = TypeVar("C", bound=Cfg)

__all__ = ["setup_run", "resolve_hardware", "plan_steps", "export_model", "print_batch_table", "RunInterrupted"]


def setup_run(cfg: Cfg, output_dir: str) -> Path:
    """Create the run directory and write the resolved config as ``config.yaml``, and the host and
    the device/precision choices of `resolve_hardware` (with their reasons) as ``hardware.json``
    (trainers call `turborlhf.engine.lifecycle.start_run`, which checks a resumed run's config first)."""
    from turborlhf.engine.checkpoint import atomic_write_text
    from turborlhf.engine.hardware import host_summary

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # atomic: a kill mid-write must not leave a torn config.yaml for the next --resume to check against
    atomic_write_text(out / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    record = {"host": host_summary(), "choices": cfg._hardware}
    atomic_write_text(out / "hardware.json", json.dumps(record, indent=2) + "\n")
    return out


def _device_type(name: str, check: bool, field: str = "device") -> str:
    """``resolve_device(name).type``; with `check` False an explicit name is taken as given (a
    plan for a device this host lacks). `field`: the config field `name` came from, which a
    `HardwareError` names (``model.device=cuda but torch sees no CUDA device ...``)."""
    from turborlhf.engine.hardware import resolve_device

    return resolve_device(name, field).type if check or name in ("auto", None) else name


def _device_of(section: Cfg, top: Cfg, check: bool = True, field: str = "device") -> str:
    """The device type a model/engine section computes on ('cpu', 'cuda', 'mps'); `field` names
    its ``device`` setting in errors."""
    dist = getattr(top, "distributed", None)
    if dist is not None and getattr(dist, "device", None) in ("cpu", "gpu"):      # ppo: roles by distributed.device
        return "cuda" if dist.device == "gpu" else "cpu"
    return _device_type(getattr(section, "device", "auto"), check, field)


def resolve_hardware(cfg: C, name: str = "", show: bool = True, check_devices: bool = True) -> C:
    """`cfg` with every ``auto`` of device and precision replaced by this host's choice
    (`turborlhf.engine.hardware`): ``model.device``/``dtype`` of each model section,
    ``distributed.device`` (ppo), ``rollout.device`` (CUDA for vLLM, else where the policy trains),
    ``rollout.dtype`` (for that device; `choose_rollout_dtype`), ``rollout.weight_dtype``
    (`turborlhf.rollout.backends.choose_weight_dtype`) and ``optim.state_dtype``
    (`choose_state_dtype`: bf16 moments where the models train on the CPU and its kernel builds).
    Prints the choices once as a start-up table (`name` labels it; not with `show=False`);
    `setup_run` saves them in ``hardware.json``. Explicit values are kept
    (`choose_precision` warns once where an explicit bf16 is emulated). Raises `HardwareError` for
    a device this host lacks, naming its field (``model.device=cuda but torch sees no CUDA
    device ...``), unless `check_devices` is False (`turborlhf plan` sizing a run for another
    machine: explicit devices are taken as given, precision as for that device)."""
    from turborlhf.config import SYNC_TOLERANCE, ConfigError, ModelCfg, OptimCfg, RolloutCfg
    from turborlhf.engine.hardware import choose_precision, choose_state_dtype
    from turborlhf.rollout.backends import choose_rollout_dtype, choose_weight_dtype

    choices: dict[str, dict] = {}
    dist = getattr(cfg, "distributed", None)
    if dist is not None and getattr(dist, "device", None) == "auto":
        actor = getattr(cfg, "actor", None)
        dev = _device_type(getattr(actor, "device", "auto"), check_devices, "actor.device")
        kind = "gpu" if dev == "cuda" else "cpu"
        why = "a CUDA device is visible" if kind == "gpu" else f"roles run on a CPU slot (best device here: {dev})"
        if kind == "cpu" and dist.backend == "ray" and (dist.ray_address or os.environ.get("RAY_ADDRESS")):
            # the driver of a joined cluster (a CPU-only head node) cannot see its workers' GPUs
            why += "; the Ray cluster this run joins may have GPUs this process cannot see"
            warnings.warn("distributed.device auto chose cpu: this process sees no CUDA device, but the Ray cluster "
                          "it joins may have GPUs elsewhere; set distributed.device=gpu to place the roles on them",
                          stacklevel=2)
        choices["distributed.device"] = {"value": kind, "reason": why}
        cfg = cfg.model_copy(update={"distributed": dist.model_copy(update={"device": kind})})

    compute, devices = [], []

    def walk(node: Cfg, path: str) -> Cfg:
        updates = {}
        for field in type(node).model_fields:
            value = getattr(node, field)
            where = f"{path}{field}"
            if isinstance(value, ModelCfg):
                dev = _device_of(value, cfg, check_devices, f"{where}.device")
                if value.load_in_4bit and check_devices:       # before anything is written or loaded
                    from turborlhf.models.load import quantization_config_4bit
                    quantization_config_4bit(f"{where}.load_in_4bit")
                if dist is not None and value.device not in ("auto", dev):
                    raise ConfigError(f"{where}.device={value.device}: ppo places every model by distributed.device, "
                                      f"a CPU slot or one CUDA GPU (here {cfg.distributed.device}); leave "
                                      f"{where}.device at auto, or set distributed.device")
                upd = {}
                if value.device == "auto":
                    upd["device"] = dev
                    choices[f"{where}.device"] = {"value": dev, "reason": "as distributed.device" if dist is not None
                                                  else "the first of cuda, mps, cpu that torch can use"}
                prec = choose_precision(value.dtype, dev)
                compute.append(prec.dtype)
                devices.append(dev)
                if value.dtype == "auto" or prec.dtype != value.dtype:
                    upd["dtype"] = prec.dtype
                choices[f"{where}.dtype"] = {"value": prec.dtype, "reason": prec.reason}
                if upd:
                    updates[field] = value.model_copy(update=upd)
            elif isinstance(value, RolloutCfg):
                upd = {}
                if value.engine == "vllm":         # vLLM places itself: its GPU build, or its CPU one
                    from turborlhf.rollout.backends import vllm_device_type
                    dev = vllm_device_type()
                elif value.device == "auto" and value.engine == "fast":
                    dev = upd["device"] = "cpu"
                    choices[f"{where}.device"] = {"value": dev, "reason": "rollout.engine=fast runs on the CPU"}
                elif value.device == "auto":
                    policy = getattr(cfg, "model", None)        # the trainers with one model section
                    own = isinstance(policy, ModelCfg)
                    dev = _device_of(policy if own else value, cfg, check_devices,
                                     "model.device" if own else f"{where}.device")
                    upd["device"] = dev
                    choices[f"{where}.device"] = {"value": dev, "reason": "where the policy trains" + (
                        " (FastEngine is CPU-only: HFEngine there)" if dev != "cpu" and value.engine == "auto" else "")}
                else:
                    dev = _device_type(value.device, check_devices, f"{where}.device")
                if value.engine == "fast" and dev != "cpu":   # it failed once every model had loaded
                    raise ConfigError(f"{where}.engine=fast runs on the CPU only, not on {dev} ({where}.device="
                                      f"{value.device}); use {where}.engine=auto or hf there, or {where}.device=cpu")
                prec = choose_precision(value.dtype, dev)
                rdt, rwhy = choose_rollout_dtype(prec.dtype, prec.reason, value.dtype, value.engine, dev,
                                                 value.weight_dtype)
                choices[f"{where}.dtype"] = {"value": rdt, "reason": rwhy}
                if value.dtype != rdt:
                    upd["dtype"] = rdt
                try:
                    wd, why = choose_weight_dtype(value.weight_dtype, rdt, value.engine, dev)
                except ValueError as e:
                    chose = f" (rollout.dtype auto chose {rdt} here)" if value.dtype == "auto" else ""
                    raise ConfigError(f"{where}.weight_dtype: {e}{chose}") from None
                choices[f"{where}.weight_dtype"] = {"value": wd, "reason": why}
                if value.weight_dtype != wd:
                    upd["weight_dtype"] = wd
                if value.sync_tolerance is None:            # the weight-sync check's tolerance for that dtype
                    upd["sync_tolerance"] = SYNC_TOLERANCE[rdt]
                if upd:
                    updates[field] = value.model_copy(update=upd)
            elif isinstance(value, Cfg) and not isinstance(value, OptimCfg):
                new = walk(value, f"{where}.")
                if new is not value:
                    updates[field] = new
        return node.model_copy(update=updates) if updates else node

    # ppo: a critic section without its own dtype computes as the actor (the reward model's scores
    # and the critic's values then share a frozen trunk's cache too)
    actor, critic = getattr(cfg, "actor", None), getattr(cfg, "critic", None)
    as_actor = isinstance(actor, ModelCfg) and isinstance(critic, ModelCfg) and critic.dtype == "auto"
    if as_actor and actor.dtype != "auto":
        cfg = cfg.model_copy(update={"critic": critic.model_copy(update={"dtype": actor.dtype})})
    cfg = walk(cfg, "")
    if (dist is not None and dist.device == "gpu" and check_devices
            and not (dist.backend == "ray" and (dist.ray_address or os.environ.get("RAY_ADDRESS")))):
        import torch

        if not torch.cuda.is_available():      # it failed after loading every model (or waited 120 s on Ray)
            raise ConfigError("distributed.device=gpu: this host sees no CUDA device (and the run joins no Ray "
                              "cluster that may have them); use distributed.device=cpu or auto")
    if as_actor:
        choices["critic.dtype"]["reason"] = "as actor.dtype"

    def optim(node: Cfg, path: str) -> Cfg:
        updates = {}
        for field in type(node).model_fields:
            value = getattr(node, field)
            if isinstance(value, OptimCfg) and value.state_dtype == "auto":
                sd, why = choose_state_dtype(compute, devices)
                choices[f"{path}{field}.state_dtype"] = {"value": sd, "reason": why}
                updates[field] = value.model_copy(update={"state_dtype": sd})
            elif isinstance(value, Cfg) and not isinstance(value, (ModelCfg, RolloutCfg)):
                new = optim(value, f"{path}{field}.")
                if new is not value:
                    updates[field] = new
        return node.model_copy(update=updates) if updates else node

    cfg = optim(cfg, "")
    if choices and show:
        width = max(len(k) for k in choices)
        print("\n".join([f"[{name or 'run'}] device and precision:"] +
                        [f"  {k:<{width}}  {v['value']:<4}  {v['reason']}" for k, v in choices.items()]), flush=True)
    cfg._hardware = choices
    return cfg


def plan_steps(lengths: list[int], per_step: int, epochs: float, max_steps: int, seed: int) -> list[list[int]]:
    """Deterministic list of optimizer steps, each a list of example indices.

    Within an epoch, examples are shuffled (seed + epoch) and the last ``n mod per_step`` of that
    order left out (a random remainder, as a shuffled loader's ``drop_last``; a different one each
    epoch), then grouped into mega-batches of ``50 · per_step`` sorted by length, so each step
    holds similar lengths and padding is small; step order is shuffled again. Fewer examples than
    ``per_step`` make one short step. Epochs may be fractional; ``max_steps > 0`` caps the plan (and
    extends it with further epochs when the data is short). The plan depends only on its inputs,
    so a resumed run replays exactly the same batches.
    """
    import random

    n = len(lengths)
    if n == 0:
        raise ValueError("no training examples")
    steps_per_epoch = max(1, n // per_step)
    total = max_steps if max_steps > 0 else max(1, math.ceil(epochs * steps_per_epoch))
    plan: list[list[int]] = []
    epoch = 0
    while len(plan) < total:
        rng = random.Random(seed + epoch)
        idx = list(range(n))
        rng.shuffle(idx)
        if n >= per_step:        # never the remainder of a length-sorted chunk: its longest examples
            idx = idx[:n - n % per_step]
        mega = 50 * per_step
        batches = []
        for s in range(0, len(idx), mega):
            chunk = sorted(idx[s:s + mega], key=lambda i: lengths[i])
            batches += [chunk[b:b + per_step] for b in range(0, len(chunk), per_step)]
        rng.shuffle(batches)
        plan += batches
        epoch += 1
    return plan[:total]


def export_model(model, tokenizer, output_dir: str | Path, extra_config: dict | None = None) -> Path:
    """Write the final HF model files (config, safetensors, tokenizer) into `output_dir`.

    Files are staged in a temporary directory and moved in one by one with ``os.replace`` (each
    move is atomic), weights last; the run's other files (metrics, checkpoints) stay beside them,
    so `output_dir` itself is loadable with ``from_pretrained``. The staging directory is
    ``.export-<pid>@<host>-*``; those that killed exports left in `output_dir` are removed first
    (`turborlhf.engine.checkpoint.remove_killed_exports`), a running export's kept.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_killed_exports(out, (".export-",))
    staged = Path(tempfile.mkdtemp(dir=out, prefix=f".export-{_writer_tag()}-"))
    try:
        _write_hf(model, tokenizer, staged, extra_config)
        _fsync_tree(staged)
        files = sorted(staged.iterdir(), key=lambda p: p.suffix == ".safetensors")
        for f in files:
            os.replace(f, out / f.name)
        _fsync_dir(out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out


# what `save_pretrained` of a model and its tokenizer writes besides the weights
# (`is_exported_weights`): an output holding only these is an earlier export
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "adapter_config.json",
                "adapter_model.safetensors", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
                "chat_template.json")


def is_exported_weights(name: str) -> bool:
    """Whether a file name in a run directory is part of its exported weights (``model*.safetensors``
    and their index, a peft adapter's, ``pytorch_model*.bin``)."""
    return (name in ("model.safetensors.index.json", "adapter_model.safetensors", "adapter_config.json")
            or (name.startswith("model") and name.endswith(".safetensors"))
            or (name.startswith("pytorch_model") and name.endswith((".bin", ".bin.index.json"))))


def clear_export(output_dir: str | Path) -> list[str]:
    """Remove the weights an earlier run exported into `output_dir` (``model*.safetensors``, their
    index, a peft adapter's, ``pytorch_model*.bin``), so that until the new run exports, the
    directory cannot load as the old model beside the new run's config, and the rest of that
    export (`EXPORT_FILES`: a chat template or tokenizer file the new run's tokenizer does not
    write stayed and changed how the new export renders), and its final evaluation
    (``eval.json``: a new run without a test set would leave the old one beside its model), and
    PPO's ``ema/`` export (a new run without ``algo.ema_beta`` left the old EMA as its own), and
    conditional SFT's tag file (`eval-policy` tags the prompts of any policy beside one).
    Returns the names removed."""
    from turborlhf.data.conditioning import TAG_FILE

    out = Path(output_dir)
    if not out.is_dir():
        return []
    gone = []
    for f in sorted(out.iterdir()):
        if f.is_file() and (is_exported_weights(f.name) or f.name in EXPORT_FILES
                          or f.name in ("eval.json", TAG_FILE)):
            f.unlink()
            gone.append(f.name)
    ema = out / "ema"          # PPO's exported EMA of the actor (algo.ema_beta)
    if ema.is_dir() and (ema / "config.json").exists():
        shutil.rmtree(ema)
        gone.append("ema/")
    return gone


def print_batch_table(name: str, rows: list[tuple[str, object]]) -> None:
    """Start-up table of derived batch sizes (habit: sizes carry their unit in their names)."""
    width = max(len(k) for k, _ in rows)
    print(f"[{name}] " + ", ".join(f"{k}={v}" for k, v in rows) if width > 60 else
          "\n".join([f"[{name}] batch sizes:"] + [f"  {k:<{width}}  {v}" for k, v in rows]), flush=True)
