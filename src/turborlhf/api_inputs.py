"""How the library API's in-memory arguments become what every command reads: a model or
tokenizer object saved as a Hugging Face directory, a ``datasets.Dataset`` or a list of dicts
written as a dataset file, inside the run's ``output_dir`` (`turborlhf.api`). Each refuses in one
line (`UserError`) what it cannot write, or a destination turborlhf did not write itself."""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Sequence

from turborlhf.errors import UserError


def _same_tokenizer(processing_class, path: str) -> None:
    """`UserError` when `processing_class` differs (vocabulary or chat template) from the tokenizer
    of the model directory `path`, which every stage reads: it would be ignored, silently."""
    from turborlhf.models.load import load_tokenizer

    own = load_tokenizer(path)
    differs = [what for what, a, b in (("vocabulary", own.get_vocab(), processing_class.get_vocab()),
                                       ("chat template", own.chat_template, processing_class.chat_template),
                                       ("eos_token", own.eos_token, processing_class.eos_token))
               if a != b]
    if differs:
        raise UserError(f"processing_class: differs from the tokenizer of model {path} (its {' and '.join(differs)}), "
                        "which the run reads from the model directory; save it there "
                        "(processing_class.save_pretrained), or pass the model loaded in memory")


def _is_hf_model(obj: Any) -> bool:
    return hasattr(obj, "save_pretrained") and hasattr(obj, "config") and not isinstance(obj, (str, os.PathLike))


def _own_tokenizer(model, fallback, what: str):
    """The tokenizer saved beside `model`'s ``name_or_path`` (a reward model reads its own
    vocabulary, not the policy's), else `fallback` with a warning."""
    from turborlhf.models.load import load_tokenizer

    source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    try:
        return load_tokenizer(source)
    except Exception:
        if fallback is not None:
            warnings.warn(f"{what}: no tokenizer found at the model's name_or_path ({source!r}); it scores token "
                          "ids of the policy's processing_class, which must be its vocabulary too", stacklevel=3)
        return fallback


def _save_model(model, tokenizer, dest: Path, what: str) -> str:
    """An in-memory model (and its tokenizer) as a HF directory `dest`; returns its path."""
    from turborlhf.models.load import is_lora, load_tokenizer

    if is_lora(model):      # save_pretrained would write the adapters alone, which no trainer can start from
        raise UserError(f"{what}: a peft (LoRA) model; pass its merged model (merge_and_unload()), or its base "
                        "model with LoRA set in args (model.lora.rank / actor.lora.rank)")
    if tokenizer is None:
        source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
        try:
            tokenizer = load_tokenizer(source) if source else None
        except Exception:
            tokenizer = None
        if tokenizer is None:
            raise UserError(f"{what}: an in-memory model whose tokenizer cannot be found from its name_or_path "
                            f"({source!r}); pass processing_class=<its tokenizer>")
    _replaceable(dest, what)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    on_device = {str(p.device) for p in model.parameters() if p.device.type not in ("cpu", "meta")}
    if on_device:       # the trainer loads its own copy: this one would hold the device's memory twice over
        gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        warnings.warn(f"{what}: the trainer loads its own copy from {dest}; the model passed in stays on "
                      f"{', '.join(sorted(on_device))} ({gib:.2f} GiB): move it to the CPU or delete it to free "
                      "that memory", stacklevel=3)
    return str(dest)


_STAGED = ".turborlhf-inputs"     # marks a directory whose staged inputs turborlhf wrote


def _replaceable(dest: Path, what: str) -> None:
    """`UserError` unless `dest` (where an in-memory input is written, inside output_dir) is absent
    or lies in a turborlhf run directory (a ``config.yaml``, or inputs staged there before): a
    project folder given as output_dir lost its own ``data/train`` or ``input_model`` to the
    staging. Marks the directory as one whose inputs turborlhf writes."""
    run_dir = dest.parent.parent if dest.parent.name == "data" else dest.parent
    if dest.exists() and not ((run_dir / "config.yaml").exists() or (run_dir / _STAGED).exists()):
        raise UserError(f"{what}: {dest} exists and was not written by turborlhf (no config.yaml in {run_dir}); "
                        "use another output_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / _STAGED).touch()


def _is_saved_at(data, dest: Path) -> bool:
    """Whether the Dataset `data` is the one ``save_to_disk`` left at `dest`, unchanged: its files
    there, no index mapping (``select``, ``shuffle``) and the saved fingerprint (``map`` writes its
    cache into the same directory)."""
    files = [Path(f["filename"]).resolve() for f in data.cache_files]
    if not files or not dest.is_dir() or not all(dest.resolve() in f.parents for f in files):
        return False
    try:
        saved = json.loads((dest / "state.json").read_text()).get("_fingerprint")
    except (OSError, ValueError):
        return False
    return getattr(data, "_indices", None) is None and saved is not None and saved == getattr(data, "_fingerprint", None)


def _write_dataset(data: Any, dest: Path, what: str) -> str:
    """A dataset argument as a path the loaders read: paths unchanged; a ``datasets.Dataset`` saved
    with ``save_to_disk`` to `dest`; a list of dicts as JSON lines ``dest.jsonl``."""
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    import datasets

    if isinstance(data, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise UserError(f"{what}: a DatasetDict; pass one split (dataset['train'])")
    if isinstance(data, datasets.IterableDataset):
        raise UserError(f"{what}: an IterableDataset is not supported; pass a Dataset, a list of dicts or a path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, datasets.Dataset):
        if _is_saved_at(data, dest):
            return str(dest)        # loaded from this very directory (load_from_disk), unchanged: it is the data already
        _replaceable(dest, what)
        staged = dest.with_name(f".{dest.name}.new")       # a dataset derived from dest's files can't overwrite them
        shutil.rmtree(staged, ignore_errors=True)
        data.save_to_disk(str(staged))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staged, dest)
        return str(dest)
    if isinstance(data, Sequence) and all(isinstance(r, dict) for r in data):
        path = dest.with_suffix(".jsonl")
        try:
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data)
        except TypeError as e:
            raise UserError(f"{what}: a list of dicts with a value JSON cannot hold ({e}); pass a datasets.Dataset")
        _replaceable(path, what)
        path.write_text(text, encoding="utf-8")
        return str(path)
    raise UserError(f"{what}: expected a datasets.Dataset, a list of dicts or a path, got {type(data).__name__}")
