"""Install a peer (TRL at a pinned version) into its own folder, never into the running environment.

The folder is ``<cache>/peers/<package>-<version>-py<XY>/site-packages`` (cache =
``$TURBORLHF_CACHE`` or ``~/.cache/turborlhf``; `peer_dir` says why the last part matters), and the
peer's child process gets it first on ``PYTHONPATH``. Recipe:

1. ask pip what installing ``package==version`` into *this* interpreter's environment would add
   (``pip install --dry-run --report``): only the packages the environment lacks, or holds at a
   version the peer does not accept, are listed (for TRL: ``datasets``, ``pyarrow``,
   ``pandas``, ``dill``, ``multiprocess``, ``xxhash``);
2. install exactly those, ``--no-deps``, with ``pip install --target`` into a staging folder;
3. write a marker file listing them and rename the folder into place (atomic; a second run finds
   the marker and does nothing).

A listed package that the environment already holds at another version (say ``transformers``)
would shadow it for the peer only; `PeerInstall.shadowed` names such packages so the report can
say so.

``deps=False`` skips step 1 and installs the package's own files only: for a peer whose declared
dependencies must not be installed (OpenRLHF's deepspeed, vLLM, flash-attn, Ray...) and whose
compared modules need only what the environment holds.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

__all__ = ["PeerUnavailable", "PeerInstall", "peer_dir", "parse_pip_report", "ensure_package", "TRL_VERSIONS",
           "trl_version_for"]

# TRL 1.13 removed PPO (it lived in trl.experimental.ppo until 1.12); everything else uses the
# release current when the harness was written.
TRL_VERSIONS = {"ppo": "1.12.0", "default": "1.16.0"}
MARKER = ".turborlhf-peer.json"


def trl_version_for(command: str) -> str:
    """The TRL release the harness compares `command` (ppo, dpo, rm, grpo) against."""
    return TRL_VERSIONS.get(command, TRL_VERSIONS["default"])


class PeerUnavailable(RuntimeError):
    """The peer could not be installed (no network, no such version, pip failed); the message says why."""


@dataclass
class PeerInstall:
    """An installed peer: its folder (put it first on PYTHONPATH) and what was installed there."""

    path: Path
    package: str
    version: str
    installed: list[tuple[str, str]] = field(default_factory=list)   # (name, version) in the folder
    shadowed: list[str] = field(default_factory=list)                # also in the environment, other version


def _cache_root() -> Path:
    return Path(os.environ.get("TURBORLHF_CACHE", Path.home() / ".cache" / "turborlhf")) / "peers"


def peer_dir(package: str, version: str, root: Optional[Path] = None) -> Path:
    """``<root>/<package>-<version>-py<major><minor>/site-packages`` (wheels like pyarrow's are per
    Python version). The last part must be ``site-packages``: ``datasets`` hashes its tables with
    dill, and dill pickles a module by value, not by reference, when its file lies outside
    ``sys.prefix`` and has no ``site-packages`` in its path; for ``pyarrow`` that fails with
    "Can't pickle <class 'MonthDayNano'>"."""
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    return (root or _cache_root()) / f"{package}-{version}-{tag}" / "site-packages"


def parse_pip_report(report: dict) -> list[tuple[str, str]]:
    """``(name, version)`` of every package in a ``pip install --dry-run --report`` JSON object.

    Raises ValueError if the object is not a pip installation report (no ``install`` list, or an
    entry without ``metadata.name``/``metadata.version``).
    """
    items = report.get("install") if isinstance(report, dict) else None
    if not isinstance(items, list):
        raise ValueError("not a pip installation report: no 'install' list")
    out = []
    for i, item in enumerate(items):
        md = item.get("metadata") if isinstance(item, dict) else None
        if not isinstance(md, dict) or not md.get("name") or not md.get("version"):
            raise ValueError(f"pip report entry {i} has no metadata.name/metadata.version")
        out.append((str(md["name"]), str(md["version"])))
    return out


def _installed_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _read_marker(path: Path, package: str, version: str) -> Optional[PeerInstall]:
    m = path / MARKER
    if not m.exists():
        return None
    try:
        info = json.loads(m.read_text())
        return PeerInstall(path, package, version, [tuple(x) for x in info["installed"]], list(info["shadowed"]))
    except (ValueError, KeyError, TypeError):
        return None


def _tail(text: str, n: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _missing_packages(package: str, version: str, python: str, tmp: Path, timeout_s: float) -> list[tuple[str, str]]:
    """Step 1 of the module docstring: ``(name, version)`` of what pip would add to `python`'s environment."""
    report_path = tmp / "report.json"
    cmd = [python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report_path),
           f"{package}=={version}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerUnavailable(f"pip could not be run to resolve {package}=={version}: {e}") from e
    if res.returncode != 0 or not report_path.exists():
        raise PeerUnavailable(f"pip could not resolve {package}=={version} (exit {res.returncode}): "
                              f"{_tail(res.stderr or res.stdout)}")
    try:
        items = parse_pip_report(json.loads(report_path.read_text()))
    except ValueError as e:
        raise PeerUnavailable(f"unreadable pip report for {package}=={version}: {e}") from e
    if not any(n.lower() == package.lower() for n, _ in items):
        items.append((package, version))   # already in the environment: pip listed nothing for it
    return items


def ensure_package(package: str, version: str, root: Optional[Path] = None, python: str = sys.executable,
                   log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
                   timeout_s: float = 1800, deps: bool = True) -> PeerInstall:
    """Make ``package==version`` importable from its own folder (see the module docstring).

    Args:
        package: PyPI name, e.g. ``trl``.
        version: exact version, e.g. ``1.12.0``.
        root: parent folder of the peer folders (default ``<cache>/peers``).
        python: interpreter whose environment the peer runs on top of (its pip is used).
        log: receives one-line progress messages.
        timeout_s: limit for each pip call.
        deps: also install the dependencies the environment lacks (step 1 of the module docstring);
            False installs ``package==version`` alone.

    Returns:
        The `PeerInstall` (existing folders are reused as they are).

    Raises:
        PeerUnavailable: pip could not resolve or install the packages; the message carries pip's
            last lines.
    """
    target = peer_dir(package, version, root)
    found = _read_marker(target, package, version)
    if found is not None:
        return found
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"[bench] installing {package}=={version}" + (" and its missing dependencies" if deps else " alone")
        + f" into {target}")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{package}-{version}-") as tmp:
        items = _missing_packages(package, version, python, Path(tmp), timeout_s) if deps else [(package, version)]
        staging = Path(tmp) / "target"
        cmd = [python, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(staging),
               *[f"{n}=={v}" for n, v in items]]
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeerUnavailable(f"pip install of {package}=={version} failed: {e}") from e
        if res.returncode != 0:
            raise PeerUnavailable(f"pip install of {package}=={version} failed (exit {res.returncode}): "
                                  f"{_tail(res.stderr or res.stdout)}")
        shadowed = [n for n, v in items if n.lower() != package.lower() and _installed_version(n) not in (None, v)]
        (staging / MARKER).write_text(json.dumps({"package": package, "version": version, "installed": items,
                                                  "shadowed": shadowed, "python": sys.version.split()[0],
                                                  "date": time.strftime("%Y-%m-%d")}, indent=1))
        try:
            os.replace(staging, target)
        except OSError:   # another run installed it meanwhile
            if _read_marker(target, package, version) is None:
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging, target)
    log(f"[bench] installed {', '.join(f'{n}=={v}' for n, v in items)} in {time.perf_counter() - t0:.0f} s"
        + (f"; shadowing the environment's {', '.join(shadowed)}" if shadowed else ""))
    return PeerInstall(target, package, version, items, shadowed)
