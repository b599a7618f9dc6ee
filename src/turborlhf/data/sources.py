"""Where the trainers' records come from: a file, a directory or a hub id -> numbered row dicts.

``open_rows(spec)`` accepts

* ``.jsonl`` / ``.jsonl.gz`` / ``.ndjson`` (and any file of unknown suffix): read here line by
  line, numbered by *line* (blank lines counted, so ``sed -n Np`` shows it); a line that is not
  JSON becomes a ``JsonLineError`` the loader reports, so one bad record never stops a run; a
  line that is not UTF-8 is the file's problem (its encoding), a ``DataFileError`` naming it;
* ``.json`` / ``.json.gz``: a JSON array of objects (or an object holding one such array, as
  ``{"data": [...]}``), numbered by *row*; a ``.json`` file that is JSON lines is read as such;
* ``.parquet``, ``.arrow``, ``.csv``: through 🤗 datasets (``load_dataset(<builder>, data_files=)``,
  ``Dataset.from_file`` for Arrow), numbered by *row* (1-based);
* a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
  (``datasets.load_from_disk``), else a directory of data files (``load_dataset(dir)``);
* anything else that does not exist locally: a Hugging Face hub dataset id
  ``org/name[/data_dir][:split]``, ``datasets.load_dataset(id, data_dir=, split=)`` (needs
  network access; ``HF_HUB_OFFLINE=1`` refuses).

* in memory: a `Rows` list of dicts, or a 🤗 ``datasets.Dataset`` object (numbered by row;
  the Python API, `turborlhf.api`, renders prompts of its datasets this way).

A ``DatasetDict`` (a saved dict, a data directory or a hub id) gives its ``train`` split, or its
only split; ``SPEC:SPLIT`` picks another (``Anthropic/hh-rlhf:test``, ``saved_dir:test``).

JSON is read here rather than by datasets' JSON builder because that builder needs one schema for
the whole file (a ``prompt`` that is a string on one line and a message list on another is
refused) and loses line numbers. Cells that are ``None`` (a column absent from that row) are
dropped from the row dict, so they read as missing keys.
"""
from __future__ import annotations

import gzip
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from turborlhf.data.errors import DataError, DataFileError
from turborlhf.data.jsonl import JsonLineError, read_jsonl

__all__ = ["open_rows", "Rows", "DATASETS_SUFFIXES", "missing_source"]

# file suffix -> datasets builder
DATASETS_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
_JSON_SUFFIXES = (".json", ".json.gz")
_FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", *_JSON_SUFFIXES, *DATASETS_SUFFIXES)


class Rows(list):
    """Records held in memory (a list of dicts) as a source of `open_rows`; errors name it by `name`."""

    def __init__(self, rows=(), name: str = "<in-memory rows>") -> None:
        super().__init__(rows)
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _split_spec(spec: str) -> tuple[str, str | None]:
    """``"dir:test"`` -> ``("dir", "test")`` when ``spec`` itself does not exist; else no split."""
    if os.path.exists(spec) or ":" not in spec:
        return spec, None
    base, split = spec.rsplit(":", 1)
    if not split or "/" in split or os.sep in split:
        return spec, None
    return base, split


def missing_source(spec: Any) -> Optional[str]:
    """The message `open_rows` would raise for `spec` as a clearly local path that does not exist
    (a data-file suffix, absolute or ``./``-relative), without reading anything; None for an
    existing path, a hub id or an in-memory dataset. Lets a run refuse a mistyped data path before
    it touches its output_dir."""
    if not isinstance(spec, (str, os.PathLike)):
        return None
    text = os.fspath(spec)
    base, _ = _split_spec(text)
    p = Path(base)
    local = any(p.name.lower().endswith(s) for s in _FILE_SUFFIXES) or p.is_absolute() or base.startswith(".")
    return f"{text}: no such file" if local and not p.exists() else None


def open_rows(spec: "str | os.PathLike | Rows") -> tuple[str, Iterator[tuple[int, Any]]]:
    """``spec`` -> ``(unit, rows)``: unit is ``"line"`` or ``"row"``; rows yields ``(n, obj)``.

    ``obj`` is a dict for good rows, a ``JsonLineError`` for unreadable JSON lines, or whatever
    JSON value a line held. Raises ``DataFileError`` (a ``FileNotFoundError``) for a missing path with a data-file
    suffix, ``DataError`` (one line, naming ``spec``) for an unreadable file, directory or id.
    """
    if isinstance(spec, Rows):
        return "row", enumerate(spec, start=1)
    ds_mod = sys.modules.get("datasets")          # a Dataset object exists only if datasets was imported
    if ds_mod is not None and isinstance(spec, ds_mod.Dataset):
        return "row", _dataset_rows(spec, "<in-memory dataset>")
    text = os.fspath(spec)
    base, split = _split_spec(text)
    p = Path(base)
    name = p.name.lower()
    if p.is_dir():
        return "row", _dataset_rows(_load_dir(p, split, text), text)
    if any(name.endswith(s) for s in DATASETS_SUFFIXES):
        if not p.exists():
            raise DataFileError(f"{text}: no such file")
        return "row", _dataset_rows(_load_file(p, split, text), text)
    if split is not None and p.is_file():
        # a JSON file has no splits: reading it whole would evaluate on the training rows, unseen
        raise DataError(f"{text}: {base} is one JSON file, it has no split {split!r} (use a file per split)")
    if any(name.endswith(s) for s in _JSON_SUFFIXES):
        if not p.exists():
            raise DataFileError(f"{text}: no such file")
        whole = _json_document(p)
        if whole is not None:
            return "row", enumerate(whole, start=1)
        return "line", read_jsonl(p)
    if p.exists() or any(name.endswith(s) for s in _FILE_SUFFIXES) or p.is_absolute() or base.startswith("."):
        if not p.exists():
            raise DataFileError(f"{text}: no such file")
        return "line", read_jsonl(p)
    return "row", _dataset_rows(_load_hub(text), text)


def _json_document(p: Path) -> list | None:
    """The records of a whole-file JSON array (or ``{"key": [...]}``), or ``None`` if the file is
    not one JSON document (JSON lines)."""
    opener = gzip.open if p.name.lower().endswith(".gz") else open
    try:
        with opener(p, "rt", encoding="utf-8-sig") as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(doc, dict):  # {"data": [records]}; any other object is one record (JSON lines)
        (only,) = doc.values() if len(doc) == 1 else (None,)
        if not (isinstance(only, list) and all(isinstance(r, dict) for r in only)):
            return None
        if only and all(set(r) <= {"role", "content", "name", "tool_calls"} and "role" in r for r in only):
            return None       # one record {"messages": [chat turns]}, not a wrapper of records
        doc = only
    if not isinstance(doc, list):
        return None
    return doc


def _pick_split(ds, split: str | None, spec: str):
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        names = list(ds)
        want = split or ("train" if "train" in ds else (names[0] if len(names) == 1 else None))
        if want is None or want not in ds:
            raise DataError(f"{spec}: pick a split with {spec}:SPLIT; it has splits {names}")
        return ds[want]
    if split is not None:
        raise DataError(f"{spec}: a single dataset has no split {split!r}")
    return ds


def _load_dir(p: Path, split: str | None, spec: str):
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except FileNotFoundError:  # not a save_to_disk directory: a directory of data files
        try:
            ds = datasets.load_dataset(str(p))
        except Exception as e:
            raise DataError(f"{spec}: neither a save_to_disk directory nor a directory of data files "
                            f"datasets can read ({_first_line(e)})") from None
    return _pick_split(ds, split, spec)


def _load_file(p: Path, split: str | None, spec: str):
    import datasets

    builder = next(b for s, b in DATASETS_SUFFIXES.items() if p.name.lower().endswith(s))
    try:
        if builder == "arrow":
            ds = datasets.Dataset.from_file(str(p))
        else:
            ds = datasets.load_dataset(builder, data_files=str(p), split=split or "train")
            split = None
    except Exception as e:
        raise DataError(f"{spec}: not a readable {builder} file ({_first_line(e)})") from None
    return _pick_split(ds, split, spec)


def _load_hub(spec: str):
    import datasets

    from turborlhf.data.hh_rlhf import parse_hub_spec

    hub = parse_hub_spec(spec)
    if hub is None:
        raise DataFileError(f"{spec}: no such file or directory (and not a hub id like 'org/name[:split]')")
    repo_id, data_dir, split = hub
    try:
        ds = datasets.load_dataset(repo_id, data_dir=data_dir, split=split)
    except Exception as e:
        raise DataError(f"{spec}: no such file or directory, and loading it as a Hugging Face hub dataset "
                        f"failed ({type(e).__name__}: {_first_line(e)})") from None
    return _pick_split(ds, None, spec)


def _dataset_rows(ds, spec: str) -> Iterator[tuple[int, Any]]:
    for i, row in enumerate(ds, start=1):
        yield i, {k: v for k, v in row.items() if v is not None}


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__
