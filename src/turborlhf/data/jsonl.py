"""JSON-lines reading and atomic writing (``.jsonl`` and gzip-compressed ``.jsonl.gz``), and a data
file's content digest (`file_sha256`)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from turborlhf.data.errors import DataFileError


class JsonLineError:
    """A line that is not valid JSON: ``message`` from the decoder and the raw ``text``."""

    __slots__ = ("message", "text")

    def __init__(self, message: str, text: str):
        self.message = message
        self.text = text

    def __repr__(self) -> str:
        return f"JsonLineError({self.message!r})"


def _open_text(path: Path, mode: str, gz: bool) -> io.TextIOBase:
    if gz:
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")


def _publish(tmp: str, path: Path) -> None:
    """Give the temp file normal permissions (mkstemp makes it 0600), then move it into place."""
    usual_mode(tmp)
    os.replace(tmp, path)


def usual_mode(path: str | os.PathLike) -> None:
    """Give a file or directory made by ``tempfile`` (0600 / 0700) the permissions an ordinary one
    gets under the umask, before it is renamed into place (a run's config, checkpoints and export
    were unreadable to anyone else: a serving process, a teammate)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_no, obj)`` for each non-blank line of a ``.jsonl`` / ``.jsonl.gz`` file.

    ``line_no`` is 1-based and counts blank lines too, so it matches ``sed -n Np``. A line that is
    not valid JSON yields ``(line_no, JsonLineError)`` instead of raising, so callers can report
    it. Raises ``DataFileError`` (a ``FileNotFoundError`` and a ``UserError``) naming the file if
    ``path`` does not exist, is a directory, is a damaged gzip file, or holds a line that is not
    UTF-8 text (the line named).
    """
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"{path}: {'is a directory, not a file' if path.is_dir() else 'no such file'}")
    gz = path.name.endswith(".gz")
    try:
        f = gzip.open(path, "rb") if gz else open(path, "rb")
    except OSError as e:
        raise DataFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    with f:
        for line_no, raw in enumerate(_lines(f, path), start=1):
            try:
                line = raw.decode("utf-8").removeprefix("\ufeff")    # a BOM (some editors; files joined by cat)
            except UnicodeDecodeError as e:
                raise DataFileError(f"{path}: line {line_no} is not UTF-8 text (byte {e.start + 1}: {e.reason}); "
                                    "convert the file to UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:     # RecursionError: absurdly nested
                obj = JsonLineError(str(e) or type(e).__name__, line.rstrip("\n"))
            if "\\u" in line and _has_lone_surrogate(obj):          # "\ud83d" alone: no text a tokenizer takes
                obj = JsonLineError("a \\uD800-\\uDFFF escape that is not half of a surrogate pair (not text)",
                                    line.rstrip("\n"))
            yield line_no, obj


def _has_lone_surrogate(obj: Any) -> bool:
    """Whether a parsed JSON value holds a string with an unpaired UTF-16 surrogate (JSON's
    ``"\\ud83d"`` alone parses, then fails to encode, later and far from its line)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(obj, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_lone_surrogate(v) for v in obj)
    return False


def _lines(f, path: Path) -> Iterator[bytes]:
    """The byte lines of an open (possibly gzip) file; a damaged gzip stream is a DataFileError."""
    try:
        yield from f
    except (OSError, EOFError) as e:
        raise DataFileError(f"{path}: cannot be read ({e})") from None


def write_jsonl(path: str | os.PathLike, rows: Iterable[Any]) -> int:
    """Write ``rows`` one JSON object per line, atomically; return the number of rows written.

    Writes to a temporary file in the same directory, then ``os.replace``s it onto ``path``, so a
    reader never sees a half-written file. Gzip-compresses when ``path`` ends in ``.gz``.
    Non-ASCII text is written as UTF-8, not escaped.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    n = 0
    try:
        with _open_text(Path(tmp), "w", path.name.endswith(".gz")) as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                n += 1
        _publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return n


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: temp file in the same directory, then replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        _publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of the file's bytes: names a data file by its content, so a result computed on it
    is recognised after the run directory was copied or moved. Raises OSError if it cannot be read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
