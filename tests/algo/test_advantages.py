"""Rewards / GAE / returns / group advantages against docs/reference/formulas.md §9 and reference loops."""

import pytest
import torch

from turborlhf.algo import (
    discounted_returns,
    gae,
    group_mean_baseline,
    group_normalized_advantages,
    kl_penalized_rewards,
    leave_one_out_advantages,
    sequence_to_token,
)

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


# ----------------------------------------------------------------------------- reward shaping


def test_reward_shaping_golden():
    r = kl_penalized_rewards(t([1.0]), t([[0.2, -0.1, 0.3, 0.0]]), torch.tensor([[1, 1, 1, 0]]), 0.1)
    assert torch.allclose(r, t([[-0.02, 0.01, 0.97, 0.0]]))
    ret = discounted_returns(r, torch.tensor([[1, 1, 1, 0]]), gamma=1.0)
    assert torch.allclose(ret, t([[0.96, 0.98, 0.97, 0.0]]))


def test_reward_shaping_score_position_clip_and_empty():
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 0]])
    kl = torch.full((4, 4), float("nan"), dtype=D).masked_fill(mask.bool(), 0.0)
    r = kl_penalized_rewards(t([5.0, -20.0, 3.0, 2.0]), kl, mask, 0.1, clip=10.0)
    expected = t([[0, 0, 0, 5.0], [-10.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 2.0, 0]])
    assert torch.equal(r, expected)  # garbage KL in padding is ignored; empty row drops its score
    r2 = kl_penalized_rewards(t([5.0, -20.0, 3.0, 2.0]), kl, mask, 0.0, clip=(-1.0, 4.0))
    assert r2[0, 3] == 4.0 and r2[1, 0] == -1.0
    with pytest.raises(ValueError):
        kl_penalized_rewards(t([1.0]), kl, mask, 0.1)
    with pytest.raises(ValueError):
        kl_penalized_rewards(t([1.0] * 4), kl, mask, -0.1)


# ------------------------------------------------------------------------------------- GAE

V = t([[0.5, 0.6, 0.7, 0.0]])
R = t([[0.0, 0.0, 1.0, 0.0]])
M = torch.tensor([[1, 1, 1, 0]])


@pytest.mark.parametrize(
    "gamma,lam,adv,ret",
    [
        (1.0, 0.95, [0.46575, 0.385, 0.3, 0], [0.96575, 0.985, 1, 0]),
        (0.99, 0.95, [0.446828575, 0.37515, 0.3, 0], [0.946828575, 0.97515, 1, 0]),
        (1.0, 1.0, [0.5, 0.4, 0.3, 0], [1, 1, 1, 0]),
    ],
)
def test_gae_golden(gamma, lam, adv, ret):
    a, r = gae(V, R, M, gamma, lam)
    assert torch.allclose(a, t([adv]), rtol=1e-9, atol=1e-12)
    assert torch.allclose(r, t([ret]), rtol=1e-9, atol=1e-12)


def _gae_reference(values, rewards, mask, gamma, lam):
    """Scalar loop over the valid tokens of each row (the textbook definition)."""
    adv = torch.zeros_like(values)
    for b in range(values.shape[0]):
        idx = [i for i in range(values.shape[1]) if mask[b, i]]
        last = 0.0
        for k in reversed(range(len(idx))):
            i = idx[k]
            next_v = values[b, idx[k + 1]].item() if k + 1 < len(idx) else 0.0
            delta = rewards[b, i].item() + gamma * next_v - values[b, i].item()
            last = delta + gamma * lam * last
            adv[b, i] = last
    return adv, torch.where(mask.bool(), adv + values, 0.0)


def _openrlhf_gae(values, rewards, mask, gamma, lam):
    """OpenRLHF get_advantages_and_returns, verbatim maths (right padding)."""
    values, rewards = values * mask, rewards * mask
    last, rev = 0, []
    T = rewards.size(1)
    for i in reversed(range(T)):
        nextvalues = values[:, i + 1] if i < T - 1 else 0.0
        delta = rewards[:, i] + gamma * nextvalues - values[:, i]
        last = delta + gamma * lam * last
        rev.append(last)
    adv = torch.stack(rev[::-1], dim=1)
    return adv, adv + values


def test_gae_equivalences_and_garbage_padding():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 11
    lengths = torch.tensor([11, 1, 5, 0, 7, 3])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    values = torch.randn(B, T, dtype=D, generator=g)
    rewards = torch.randn(B, T, dtype=D, generator=g)
    a, r = gae(values, rewards, mask, 0.99, 0.95)
    a_ref, r_ref = _gae_reference(values, rewards, mask, 0.99, 0.95)
    assert torch.allclose(a, a_ref) and torch.allclose(r, r_ref)
    a_or, r_or = _openrlhf_gae(values, rewards, mask.to(D), 0.99, 0.95)  # right padding: identical
    assert torch.allclose(a, a_or) and torch.allclose(r, r_or)
    junk = torch.where(mask, values, torch.full_like(values, float("inf")))
    junk_r = torch.where(mask, rewards, torch.full_like(rewards, float("nan")))
    a2, r2 = gae(junk, junk_r, mask, 0.99, 0.95)
    assert torch.equal(a2, a) and torch.equal(r2, r)


def test_gae_left_padding_equals_right_padding():
    g = torch.Generator().manual_seed(3)
    values, rewards = torch.randn(1, 4, dtype=D, generator=g), torch.randn(1, 4, dtype=D, generator=g)
    right_mask = torch.tensor([[1, 1, 1, 0]])
    a_right, _ = gae(values, rewards, right_mask, 0.9, 0.8)
    shifted_v = torch.cat([values.new_full((1, 1), 9.0), values[:, :3]], dim=1)
    shifted_r = torch.cat([rewards.new_full((1, 1), 9.0), rewards[:, :3]], dim=1)
    a_left, _ = gae(shifted_v, shifted_r, torch.tensor([[0, 1, 1, 1]]), 0.9, 0.8)
    assert torch.allclose(a_left[:, 1:], a_right[:, :3]) and a_left[0, 0] == 0


def test_gae_errors():
    with pytest.raises(ValueError):
        gae(V, R, M, 1.1, 0.95)
    with pytest.raises(ValueError):
        gae(V, R[:, :3], M, 1.0, 0.95)


def test_discounted_returns_gamma():
    out = discounted_returns(t([[1.0, 0.0, 2.0, 5.0]]), torch.tensor([[1, 1, 1, 0]]), 0.5)
    assert torch.allclose(out, t([[1.5, 1.0, 2.0, 0.0]]))


# -------------------------------------------------------------------------- group advantages

SCORES = t([[1, 0, 0, 1], [0.5, 0.2, 0.9, 0.4]])


def test_grpo_trl_golden():
    out = group_normalized_advantages(SCORES, eps=1e-4)
    exp = t([[0.8658754298, -0.8658754298, -0.8658754298, 0.8658754298], [0, -1.0187032944, 1.3582710592, -0.3395677648]])
    assert torch.allclose(out, exp, rtol=1e-8, atol=1e-10)
    assert torch.equal(group_normalized_advantages(SCORES), out)  # default eps = TRL's 1e-4


def test_grpo_openrlhf_golden():
    out = group_normalized_advantages(SCORES, eps=1e-9)
    exp = t([[0.8660254023, -0.8660254023, -0.8660254023, 0.8660254023], [0, -1.0190493273, 1.3587324364, -0.3396831091]])
    assert torch.allclose(out, exp, rtol=1e-8, atol=1e-10)


def test_dr_grpo_and_baseline_golden():
    exp = t([[0.5, -0.5, -0.5, 0.5], [0, -0.3, 0.4, -0.1]])
    assert torch.allclose(group_normalized_advantages(SCORES, std=False), exp)
    assert torch.allclose(group_mean_baseline(SCORES), exp)


def test_rloo_golden():
    exp = t([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, -0.4, 0.5333333333, -0.1333333333]])
    out = leave_one_out_advantages(SCORES)
    assert torch.allclose(out, exp, rtol=1e-8, atol=1e-9)
    assert torch.allclose(out, 4 / 3 * group_mean_baseline(SCORES))


def test_rloo_trl_legacy_layout():
    # TRL test_rloo_reward: rewards laid out (rloo_k=4, local_batch=3) → A[0] = 1 - (2+5+8)/3.
    rewards = t([1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10]).view(4, 3).T  # (prompts=3, G=4)
    adv = leave_one_out_advantages(rewards)
    assert adv[0, 0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)
    assert adv[1, 2].item() == pytest.approx(6 - (3 + 2 + 9) / 3)  # TRL's A[7]: prompt 1, sample 2


def test_identical_group_gives_zero_and_errors():
    assert torch.equal(group_normalized_advantages(t([[3.0, 3.0, 3.0]])), t([[0.0, 0.0, 0.0]]))
    for fn in (group_normalized_advantages, group_mean_baseline, leave_one_out_advantages):
        with pytest.raises(ValueError):
            fn(t([[1.0], [2.0]]))
        with pytest.raises(ValueError):
            fn(t([1.0, 2.0]))


def test_sequence_to_token():
    out = sequence_to_token(t([1.0, -2.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert torch.equal(out, t([[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0]]))


def test_int_and_bool_rewards_are_computed_in_float():
    """A 0/1 verifier's rewards as an int or bool tensor (``torch.tensor([1, 0, 1, 1])``) crashed the group
    baselines with raw torch errors (``mean(): could not infer output dtype``, bool subtraction), and
    discounted returns and GAE truncated to integers (or stayed bool) silently; all compute in float now."""
    from turborlhf.algo import kept_groups_mask

    ref = t([[1.0, 0.0, 1.0, 1.0]])
    for scores in (torch.tensor([[1, 0, 1, 1]]), torch.tensor([[True, False, True, True]])):
        for fn in (group_normalized_advantages, group_mean_baseline, leave_one_out_advantages):
            got = fn(scores)
            assert got.is_floating_point() and torch.allclose(got.double(), fn(ref), atol=1e-6)
        assert kept_groups_mask(scores.view(-1), 2).tolist() == [True, False]
    mask = torch.ones(1, 3, dtype=torch.long)
    for rewards in (torch.tensor([[0, 0, 1]]), torch.tensor([[False, False, True]])):
        assert torch.allclose(discounted_returns(rewards, mask, 0.9), torch.tensor([[0.81, 0.9, 1.0]]))
        adv, ret = gae(torch.zeros(1, 3, dtype=torch.long), rewards, mask, 1.0, 0.95)
        assert torch.allclose(adv, torch.tensor([[0.9025, 0.95, 1.0]])) and torch.allclose(ret, adv)
    r = kl_penalized_rewards(torch.tensor([1]), torch.tensor([[1, 0, 0]]), mask, 0.1, clip=0.5)
    assert torch.allclose(r, torch.tensor([[-0.1, 0.0, 0.5]]))


def test_negative_eps_and_inverted_clip_are_refused():
    """A negative GRPO eps gave inf advantages (std + eps = 0) and a negative or inverted score clip set
    every score to the clip's upper end, both silently; each is a ValueError naming the argument."""
    with pytest.raises(ValueError, match="eps must be >= 0, got -0.5"):
        group_normalized_advantages(t([[1.0, 0.0, 1.0, 1.0]]), eps=-0.5)
    args = (t([0.3]), t([[0.0, 0.0]]), torch.ones(1, 2), 0.1)
    for clip in (-1.0, (1.0, -1.0)):
        with pytest.raises(ValueError, match=r"kl_penalized_rewards: clip must be >= 0 or a range"):
            kl_penalized_rewards(*args, clip=clip)
    assert kl_penalized_rewards(*args, clip=(-0.1, 0.1))[0, 1].item() == pytest.approx(0.1)
