"""One short run of the whole pipeline on the real SmolLM2-135M-Instruct (fetched by `make test`)."""
import json
import math

import pytest

from tests.e2e.helpers import REPO, run_cli


@pytest.mark.slow
def test_real_model_pipeline_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBORLHF_THREADS", "0")  # all cores for the real model
    from turborlhf.models.zoo import resolve_model_path

    try:
        resolve_model_path("smollm2-135m-instruct", fetch=False)
    except Exception as e:  # pragma: no cover - make test fetches it first
        pytest.skip(f"real model not cached: {e}")
    run_dir = tmp_path / "smoke"
    run_cli("pipeline", "--config", REPO / "configs/hh_smollm2/smoke.yaml", f"run_dir={run_dir}",
            f"prepare.input={REPO / 'data/hh-rlhf/harmless-base-1800.jsonl.gz'}")
    s = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= s["rm_test_accuracy"] <= 1.0
    for pol in ("sft_policy", "ppo_policy"):
        assert math.isfinite(s[pol]["reward_mean"]) and s[pol]["n"] == 8
    assert math.isfinite(s["ppo_policy"]["kl_to_reference"])
    # the real model's chat template renders HH dialogues
    first = json.loads((run_dir / "data" / "train_pairs.jsonl").read_text().splitlines()[0])
    assert first["prompt"].startswith("<|im_start|>") and first["prompt"].endswith("<|im_start|>assistant\n")
