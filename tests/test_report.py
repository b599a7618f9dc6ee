"""The pipeline's printed summary."""
from turborlhf.report import print_summary

_POLICY = {"reward_mean": 0.5, "reward_std": 1.0, "response_length_mean": 20.0, "n": 4, "kl_to_reference": 1.0}


def _summary(stage_seconds: dict, total: float) -> dict:
    return {"rm_test_accuracy": 0.63, "rm_test_pairs": 184, "sft_policy": _POLICY, "ppo_policy": _POLICY,
            "ppo_minus_sft_reward_in_sft_std": 0.8, "stage_seconds": stage_seconds, "total_seconds": total}


def test_stage_times_total_is_this_invocations_and_says_so_after_a_resume(capsys):
    print_summary(_summary({"prepare": 6, "sft": 264, "eval": 176}, 447))
    assert "eval 2m56s; total 7m27s" in capsys.readouterr().out
    # a --resume that ran the evaluation alone: the other stages' times come from the earlier invocation
    print_summary(_summary({"prepare": 6, "sft": 264, "eval": 125}, 129))
    assert "eval 2m05s; 6m35s in all, this invocation 2m09s" in capsys.readouterr().out
