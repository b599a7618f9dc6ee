"""Step 3 of a PPO/GRPO step against what the rollout wrote: tokens a rollout tool wrote carry
no KL and stay out of whitening."""
import pytest
import torch

from turborlhf.config import PPOAlgoCfg
from turborlhf.trainers.ppo.driver import score_and_advantages


def _tool_experience(est: str, ref_shift: float):
    B, R = 2, 6
    mask = torch.ones(B, R)
    mask[1, 4:] = 0
    tool = torch.zeros(B, R, dtype=torch.bool)
    tool[0, 2:4] = True                                   # row 0: tokens 2 and 3 written by the tool
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(B, R, generator=g)
    ref = old.clone() - 0.3 * torch.rand(B, R, generator=g)
    ref[0, 2:4] -= ref_shift                              # only the tool tokens' reference log-probs move
    values = 0.1 * torch.randn(B, R, generator=g) * mask if est == "gae" else None
    A = PPOAlgoCfg(advantage_estimator=est, n_samples_per_prompt=2, kl_coef=0.1, missing_eos_penalty=None)
    exp = score_and_advantages(A, None, None, 0, mask, [True, True], old, ref * mask, values,
                               torch.tensor([1.0, 0.0]), {}, 0.1, None, None, None, tool)
    return exp, mask * ~tool


@pytest.mark.parametrize("est", ["gae", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_tool_tokens_carry_no_kl_and_do_not_move_the_advantages(est):
    """The KL-in-reward penalty of tokens the policy never sampled used to flow into the returns of
    the tokens before them (rloo: advantages 1.0 → 0.0 when only the tool tokens' reference moved)."""
    exp, sampled = _tool_experience(est, 0.0)
    moved, _ = _tool_experience(est, 5.0)
    assert float(exp.kl_BR[0, 2:4].abs().max()) == 0.0 and float(exp.kl_BR[0, :2].abs().min()) > 0
    torch.testing.assert_close(moved.adv_BR * sampled, exp.adv_BR * sampled)
    if est in ("gae", "reinforce_pp", "reinforce_pp_baseline"):            # whitened over the sampled tokens
        adv = exp.adv_BR[sampled.bool()]
        assert abs(float(adv.mean())) < 1e-6 and float(adv.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
