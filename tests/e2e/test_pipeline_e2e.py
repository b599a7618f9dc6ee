import json
import subprocess
import sys

from tests.e2e.helpers import REPO, run_cli


def test_tiny_pipeline_and_eval_commands(tiny_model, tmp_path):
    run_dir = tmp_path / "pipe"
    run_cli("pipeline", "--config", REPO / "configs/tiny/pipeline.yaml", f"model={tiny_model}", f"run_dir={run_dir}",
            f"prepare.input={REPO / 'data/hh-rlhf/harmless-base-1800.jsonl.gz'}")
    s = json.loads((run_dir / "summary.json").read_text())
    for k in ("rm_test_accuracy", "sft_policy", "ppo_policy", "ppo_minus_sft_reward_in_sft_std", "stage_seconds",
              "samples"):
        assert k in s, k
    assert (run_dir / "ppo_curves.png").stat().st_size > 1000
    for stage in ("sft", "rm", "ppo"):
        assert (run_dir / stage / "config.json").exists() and (run_dir / stage / "model.safetensors").exists()
    assert s["ppo_policy"]["kl_to_reference"] == s["ppo_policy"]["kl_to_reference"]  # finite, not nan
    rm_eval = json.loads((run_dir / "rm" / "eval.json").read_text())    # the RM stage's scores, not a second pass
    assert (s["rm_test_accuracy"], s["rm_test_pairs"], s["rm_test_length"]) == (rm_eval["accuracy"], rm_eval["n"],
                                                                              rm_eval["length"])

    # the evaluation commands print one JSON object (last line) on stdout
    exe = [sys.executable, "-m", "turborlhf"]
    out = subprocess.run(exe + ["eval-rm", "--model", run_dir / "rm", "--data",
                                REPO / "data/hh-rlhf/harmless-base-1800.jsonl.gz", "--limit", "20", "--json"],
                         check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["n"] == 20 and 0 <= res["accuracy"] <= 1
    L = res["length"]  # the strata re-add to the overall accuracy
    n_s = L["n_chosen_shorter"]
    assert 0 < n_s < 20 and L["shorter_wins"] == n_s / 20
    assert abs(L["accuracy_chosen_shorter"] * n_s + L["accuracy_chosen_not_shorter"] * (20 - n_s)
               - res["accuracy"] * 20) < 1e-6
    assert s["rm_test_length"]["shorter_wins"] is not None
    out = subprocess.run(exe + ["eval-policy", "--policy", run_dir / "ppo", "--reward-model", run_dir / "rm",
                                "--prompts", run_dir / "data" / "test_prompts.jsonl", "--n", "4",
                                "--max-new-tokens", "6", "--json"], check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    for k in ("reward_mean", "reward_std", "n", "response_length_mean"):
        assert k in res
    assert res["n"] == 4

    # --resume skips finished stages
    run_cli("pipeline", "--config", REPO / "configs/tiny/pipeline.yaml", f"model={tiny_model}", f"run_dir={run_dir}",
            f"prepare.input={REPO / 'data/hh-rlhf/harmless-base-1800.jsonl.gz'}", "--resume")
