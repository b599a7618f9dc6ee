"""RLVR losses and tricks on hand-derived numbers: DAPO group filter and overlong penalty, GSPO,
CISPO, TIS/MIS rollout weights and the engine/trainer mismatch statistics."""

import math

import pytest
import torch

from turborlhf.algo import (cispo_policy_loss, gspo_policy_loss, kept_groups_mask, overlong_penalty, ppo_policy_loss,
                            reduce_loss, rollout_is_weights, rollout_mismatch_stats)

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


# ------------------------------------------------------------------------- DAPO dynamic sampling

def test_kept_groups_mask():
    scores = t([1, 1, 0, 1, 2, 2, 2, 2, 0, 0, 0, 0.5])              # N = 3 groups of G = 4
    assert kept_groups_mask(scores, 4).tolist() == [True, False, True]
    assert kept_groups_mask(scores, 4, atol=0.6).tolist() == [True, False, False]   # spread 0.5 ≤ 0.6
    assert kept_groups_mask(scores, 2).tolist() == [False, True, False, False, False, True]
    for bad in ((scores, 5), (scores.view(3, 4), 4), (scores, 0)):
        with pytest.raises(ValueError):
            kept_groups_mask(*bad)


# ----------------------------------------------------------------------- DAPO overlong shaping

def test_overlong_penalty_eq13():
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    # L_max = 10, L_cache = 4: 0 up to 6 tokens, then (6 - |y|)/4, -1 at and beyond 10
    assert torch.allclose(overlong_penalty(lengths, 10, 4), torch.tensor([0, 0, -0.25, -0.5, -1, -1.0]))
    assert torch.allclose(overlong_penalty(lengths, 10, 4, penalty_factor=2.0), torch.tensor([0, 0, -0.5, -1, -2, -2.0]))
    assert torch.allclose(overlong_penalty(lengths, 10, 10), torch.tensor([-0.3, -0.6, -0.7, -0.8, -1, -1.0]))
    for bad in ((lengths, 10, 0), (lengths, 10, 11), (lengths.view(2, 3), 10, 4)):
        with pytest.raises(ValueError):
            overlong_penalty(*bad)
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 10, 4, penalty_factor=-1.0)


# ----------------------------------------------------------------------------------------- GSPO

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
ADV = t([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])


def _logp():
    # row 0: mean log-ratio 0.1 → s0 = e^0.1 (inside [0.8, 1.2]); row 1: mean -0.3 → s1 = e^-0.3 = 0.741 < 0.8
    return t([[0.3, -0.1, 0.1], [-0.2, -0.4, float("nan")]]).requires_grad_()


def test_gspo_sequence_ratio_values_and_clip():
    logp = _logp()
    loss, stats = gspo_policy_loss(logp, OLD, ADV, MASK, eps_low=0.2, eps_high=0.2)
    s0 = math.exp(0.1)
    # row 0 unclipped: -s0·A; row 1: A < 0 and s1 < 1-ε, so min(s1·A, 0.8·A) = 0.8·(-2) → loss 1.6
    assert torch.allclose(loss, t([[-s0, -s0, -s0], [1.6, 1.6, 0.0]]))
    assert stats["clipfrac"].item() == pytest.approx(2 / 5)              # row 1's two tokens
    assert stats["seq_ratio"].item() == pytest.approx((s0 + math.exp(-0.3)) / 2)
    total = reduce_loss(loss, MASK, "seq_mean_token_mean")
    assert total.item() == pytest.approx((-s0 + 1.6) / 2)
    total.backward()
    # d/dlogp_0t of -(1/2)·s0·A0 with s0 = exp(mean_t logp_0t): -(1/2)·s0/3; clipped row 1: no gradient
    assert torch.allclose(logp.grad, t([[-s0 / 6] * 3, [0.0, 0.0, 0.0]]))


def test_gspo_equals_the_sequence_objective_gradient():
    """GSPO-token with a per-response advantage == autograd of (1/G) Σ_i -min(s_i A_i, clip(s_i) A_i)."""
    logp = _logp()
    loss, _ = gspo_policy_loss(logp, OLD, ADV, MASK, eps_low=0.5, eps_high=0.5)   # nothing clipped
    reduce_loss(loss, MASK, "seq_mean_token_mean").backward()
    logp2 = _logp()
    s = torch.stack([logp2[0, :3].mean().exp(), logp2[1, :2].mean().exp()])
    (-(s * t([1.0, -2.0])).mean()).backward()
    assert torch.allclose(logp.grad[MASK.bool()], logp2.grad[MASK.bool()])
    # the token-level PPO ratio is a different objective: its per-token gradients differ
    logp3 = _logp()
    ppo, _ = ppo_policy_loss(logp3, OLD, ADV, MASK, 0.5)
    reduce_loss(ppo, MASK, "seq_mean_token_mean").backward()
    assert not torch.allclose(logp3.grad[MASK.bool()], logp2.grad[MASK.bool()])


def test_gspo_rejects_bad_input():
    with pytest.raises(ValueError):
        gspo_policy_loss(_logp(), OLD, ADV, MASK, eps_low=1.0)
    with pytest.raises(ValueError):
        gspo_policy_loss(_logp(), OLD[:, :2], ADV, MASK)


# ---------------------------------------------------------------------------------------- CISPO

def test_cispo_values_gradient_and_no_dropped_token():
    mask = torch.ones(2, 2)
    old = torch.zeros(2, 2, dtype=D)
    adv = t([[1.0, 1.0], [-1.0, -1.0]])
    logp = t([[0.5, -0.1], [-1.0, 0.0]]).requires_grad_()      # ratios e^.5, e^-.1, e^-1, 1
    loss, stats = cispo_policy_loss(logp, old, adv, mask, eps_high=0.2)
    w = t([[1.2, math.exp(-0.1)], [math.exp(-1.0), 1.0]])          # capped at 1.2, no lower bound
    assert torch.allclose(loss, t([[-0.6, w[0, 1] * 0.1], [-w[1, 0], 0.0]]))
    assert stats["clipfrac"].item() == pytest.approx(1 / 4)
    loss.sum().backward()
    assert torch.allclose(logp.grad, -w * adv)                      # sg(w)·A·∇logp, every token
    # the PPO clip drops token (0, 0) (ratio 1.65 > 1.2 with A > 0): zero gradient there
    logp2 = t([[0.5, -0.1], [-1.0, 0.0]]).requires_grad_()
    ppo, _ = ppo_policy_loss(logp2, old, adv, mask, 0.2)
    ppo.sum().backward()
    assert logp2.grad[0, 0].item() == 0.0 and logp.grad[0, 0].item() == pytest.approx(-1.2)
    # a lower bound when asked for: e^-1 = 0.37 → 0.5
    loss_lo, stats_lo = cispo_policy_loss(logp.detach(), old, adv, mask, eps_high=0.2, eps_low=0.5)
    assert loss_lo[1, 0].item() == pytest.approx(-0.5) and stats_lo["clipfrac"].item() == pytest.approx(2 / 4)
    with pytest.raises(ValueError):
        cispo_policy_loss(logp, old, adv, mask, eps_high=-0.1)


# ----------------------------------------------------------------------------------- TIS / MIS

# log ρ = old - rollout: row 0 ρ = (3, 0.5, 1.5); row 1 ρ = (2.5, padding)
IS_OLD = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
IS_ROLL = -torch.log(t([[3.0, 0.5, 1.5], [2.5, 1e-30, 7.0]]))
IS_MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("mode, level, C, expected, clipfrac", [
    ("tis", "token", 2.0, [[2.0, 0.5, 1.5], [2.0, 0, 0]], 2 / 4),
    ("mis", "token", 2.0, [[0.0, 0.5, 1.5], [0.0, 0, 0]], 2 / 4),
    ("tis", "sequence", 2.0, [[2.0, 2.0, 2.0], [2.0, 0, 0]], 4 / 4),      # ρ_seq = 3·0.5·1.5 = 2.25, and 2.5
    ("mis", "sequence", 2.0, [[0.0, 0.0, 0.0], [0.0, 0, 0]], 4 / 4),
    ("mis", "sequence", 2.4, [[2.25, 2.25, 2.25], [0.0, 0, 0]], 1 / 4),
    ("tis", "sequence", 3.0, [[2.25, 2.25, 2.25], [2.5, 0, 0]], 0.0),
])
def test_rollout_is_weights(mode, level, C, expected, clipfrac):
    w, stats = rollout_is_weights(IS_OLD, IS_ROLL, IS_MASK, mode, C, level)
    assert torch.allclose(w, t(expected))
    assert stats["is_clipfrac"].item() == pytest.approx(clipfrac)
    exp = t(expected)
    assert stats["is_weight_mean"].item() == pytest.approx(float(exp[IS_MASK.bool()].mean()), rel=1e-6)


def test_rollout_is_weights_errors():
    with pytest.raises(ValueError):
        rollout_is_weights(IS_OLD, IS_ROLL, IS_MASK, "cap", 2.0)
    with pytest.raises(ValueError):
        rollout_is_weights(IS_OLD, IS_ROLL, IS_MASK, "tis", 0.0)
    with pytest.raises(ValueError):
        rollout_is_weights(IS_OLD, IS_ROLL[:, :2], IS_MASK, "tis", 2.0)


def test_rollout_mismatch_stats():
    m = rollout_mismatch_stats(IS_OLD, IS_ROLL, IS_MASK)
    rho = [3.0, 0.5, 1.5, 2.5]
    assert m["kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in rho) / 4)       # k3 of KL(μ‖π_old)
    assert m["k1"] == pytest.approx(-sum(math.log(r) for r in rho) / 4)
    assert m["max_ratio"] == pytest.approx(3.0) and m["min_ratio"] == pytest.approx(0.5)
    same = rollout_mismatch_stats(IS_OLD, IS_OLD, IS_MASK)
    assert same == {"kl": 0.0, "k1": 0.0, "max_ratio": 1.0, "min_ratio": 1.0}
    assert rollout_mismatch_stats(IS_OLD, IS_ROLL, torch.zeros(2, 3))["max_ratio"] == 1.0


def test_dynamic_sampling_counts_each_engines_items_once_per_round(monkeypatch):
    """Each kept group carried its round's per-engine counts and the batch summed them: 2 rounds of
    2 items on each of 2 engines were logged as 8 each (4 kept groups × 2), rounds whose groups
    were all dropped as nothing."""
    from types import SimpleNamespace as NS

    import turborlhf.trainers.ppo.rlvr as rlvr

    G, rounds = 2, []

    def generate(cluster, cfg, tok, prompts, step, attempt):
        rounds.append(attempt)
        B = len(prompts) * G
        return [[5, 6]] * B, [True] * B, [2, 2], [[-0.1, -0.2]] * B, None

    def score_rows(cluster, cfg, ids, attn, prompts, responses, columns):
        s = (torch.tensor([1.0, 0.0] * 2 + [1.0, 1.0] * 2) if len(rounds) == 1      # round 1: 2 of 4 groups live
             else torch.tensor([1.0, 0.0] * (len(responses) // 2)))
        return lambda: (s, {"r": s})
    monkeypatch.setattr(rlvr, "generate", generate)
    monkeypatch.setattr(rlvr, "score_rows", score_rows)
    cfg = NS(algo=NS(n_samples_per_prompt=G, dynamic_sampling=True, dynamic_sampling_max_tries=5,
                     dynamic_sampling_fill=True, normalize_reward=False, overlong_buffer_len=0, overlong_filter=False,
                     missing_eos_penalty=None, reward_clip=10.0), rollout=NS(max_new_tokens=8), train=NS(seed=1))
    ro = rlvr.collect_rollouts(None, cfg, NS(pad_token_id=0), [[1, 2]] * 10, [0, 1, 2, 3], 0)
    assert len(rounds) == 2 and ro.metrics["rollout/groups_trained"] == 4
    assert ro.per_engine == [4, 4]
    # both rounds' 8 rows of 2 tokens were generated (rollout/tokens_per_s counted the 8 trained rows only)
    assert ro.metrics["rollout/tokens_generated"] == 2 * 8 * 2
