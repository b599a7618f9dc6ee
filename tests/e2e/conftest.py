"""Fixtures shared by the end-to-end tests (the tiny model and data come from tests/conftest.py)."""
import pytest

from tests.e2e.helpers import REPO, run_cli


@pytest.fixture(scope="session")
def tiny_rm(tiny_model, tiny_data, tmp_path_factory):
    """A tiny reward model: 2 steps of `turborlhf rm` from the tiny causal LM, on the CPU so that
    every host (a GPU one too) gives the tests the same weights."""
    out = tmp_path_factory.mktemp("rm")
    run_cli("rm", "--config", REPO / "configs/tiny/rm.yaml", f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", "data.max_samples=16", "train.max_steps=2",
            f"output_dir={out}", "log.tensorboard=false", "model.device=cpu")
    return out
