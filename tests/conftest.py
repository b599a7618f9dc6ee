"""Shared fixtures: a tiny random Llama + tiny tokenizer, and HH data converted with it."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HH_FILE = REPO / "data" / "hh-rlhf" / "harmless-base-1800.jsonl.gz"

os.environ.setdefault("TURBORLHF_THREADS", "1")  # tiny models: 1 thread is fastest, and immune to a busy machine
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# torch.compile's kernel cache of this test session only: a cache left by processes run with other
# CPU limits (ATEN_CPU_CAPABILITY, as the AVX2 tests set) has been seen to abort a later process
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="turborlhf-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from turborlhf.models.tiny import save_tiny_causal_lm

    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, tiny_model) -> Path:
    """The real HH sample converted with the tiny tokenizer (train/test pairs, prompts, KTO)."""
    from turborlhf.data.hh_rlhf import prepare_hh
    from turborlhf.models.load import load_tokenizer

    out = tmp_path_factory.mktemp("tiny_data")
    prepare_hh(HH_FILE, out, load_tokenizer(str(tiny_model)), test_fraction=0.1)
    return out
