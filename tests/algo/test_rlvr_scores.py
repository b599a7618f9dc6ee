"""Step 3 of a PPO/GRPO step against what the rollout filtered and wrote: tokens a rollout tool
wrote carry no KL and stay out of whitening; DAPO's group filter with normalised rewards."""
from types import SimpleNamespace

import pytest
import torch

from turborlhf.config import PPOAlgoCfg
from turborlhf.rewards.normalize import RunningMoments
from turborlhf.trainers.ppo.driver import score_and_advantages
from turborlhf.trainers.ppo.rlvr import Rollouts, kept_groups


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


def _ro(finished):
    return Rollouts([0] * len(finished), [[1]] * len(finished), [[5, 6]] * len(finished), finished, None, [1])


def test_group_filter_with_normalised_rewards_drops_only_groups_equal_for_every_sigma():
    """raw [1, 0], the first response without EOS (penalty 1): raw + penalty reads [0, 0], and the
    filter dropped the group, but the trainer scores (raw − μ)/σ − penalty, apart unless σ = 1."""
    A = PPOAlgoCfg(advantage_estimator="grpo", n_samples_per_prompt=2, normalize_reward=True, dynamic_sampling=True,
                   missing_eos_penalty=1.0, kl_use_loss=True)
    cfg = SimpleNamespace(algo=A, rollout=SimpleNamespace(max_new_tokens=8))
    raw, ro = torch.tensor([1.0, 0.0]), _ro([False, True])
    assert kept_groups(cfg, raw, ro) == [True]
    exp = score_and_advantages(A, None, None, 0, torch.ones(2, 2), ro.finished, torch.zeros(2, 2), None, None, raw,
                               {}, 0.0, RunningMoments(mean=1.0, var=4.0, count=10 ** 6))
    assert abs(float(exp.scores_B[0] - exp.scores_B[1])) > 0.1            # the trainer sees signal
    assert kept_groups(cfg, torch.tensor([1.0, 1.0]), _ro([True, True])) == [False]    # equal for every σ
    assert kept_groups(cfg, torch.tensor([1.0, 1.0]), _ro([False, True])) == [True]    # the penalty differs
    # without normalisation the filter compares the trainer's own score: raw + penalty
    plain = SimpleNamespace(algo=A.model_copy(update={"normalize_reward": False}), rollout=cfg.rollout)
    assert kept_groups(plain, raw, ro) == [False]
    assert kept_groups(plain, torch.tensor([1.0, 1.0]), _ro([False, True])) == [True]


def test_dynamic_sampling_drops_a_group_the_overlong_filter_masks_entirely():
    """Every response of the group cut at max_new_tokens: overlong_filter masks them all out of the
    loss, yet their distinct scores kept the group, so a step could train on nothing."""
    A = PPOAlgoCfg(advantage_estimator="grpo", n_samples_per_prompt=2, dynamic_sampling=True, kl_use_loss=True,
                   missing_eos_penalty=None, overlong_filter=True)
    cfg = SimpleNamespace(algo=A, rollout=SimpleNamespace(max_new_tokens=8))
    raw = torch.tensor([1.0, 0.0, 1.0, 0.0])
    ro = Rollouts([0] * 4, [[1]] * 4, [[5, 6]] * 4, [False, False, False, True], None, [1])
    assert kept_groups(cfg, raw, ro) == [False, True]
    plain = SimpleNamespace(algo=A.model_copy(update={"overlong_filter": False}), rollout=cfg.rollout)
    assert kept_groups(plain, raw, ro) == [True, True]


def test_dynamic_sampling_refuses_the_kl_in_the_reward():
    """With the KL penalty in the reward, a group of equal scores still has non-zero advantages (the
    KL term's): dropping it as signal-free was silently wrong."""
    with pytest.raises(ValueError, match="algo.kl_use_loss=true"):
        PPOAlgoCfg(advantage_estimator="grpo", n_samples_per_prompt=2, dynamic_sampling=True, kl_coef=0.05)
    PPOAlgoCfg(advantage_estimator="grpo", n_samples_per_prompt=2, dynamic_sampling=True, kl_coef=0.0)
    PPOAlgoCfg(advantage_estimator="rloo", n_samples_per_prompt=2, dynamic_sampling=True, kl_use_loss=True)


def test_a_reward_source_that_scored_no_row_logs_no_mean():
    """A reward function returning None for every row of a batch (a code checker on a math-only
    batch) logged its mean as NaN, which reads as a broken run in every tracker."""
    from turborlhf.trainers.ppo.driver import _rollout_metrics
    A = PPOAlgoCfg(advantage_estimator="grpo", n_samples_per_prompt=2, missing_eos_penalty=None)
    per = {"acc": torch.tensor([1.0, 0.0]), "code": torch.tensor([float("nan")] * 2)}
    exp = score_and_advantages(A, None, None, 0, torch.ones(2, 2), [True, True], torch.zeros(2, 2), None, None,
                               torch.tensor([1.0, 0.0]), per, 0.0, None)
    out = _rollout_metrics(exp, 0.0)
    assert out["rollout/reward_acc_mean"] == 0.5 and "rollout/reward_code_mean" not in out
    assert all(v == v for v in out.values())


def test_one_row_logs_a_reward_std_of_zero():
    """One prompt and one sample per step (a valid config): torch's std of one value is NaN, which
    metrics.jsonl wrote as a bare NaN (not JSON for most readers)."""
    from turborlhf.trainers.ppo.driver import _rollout_metrics
    A = PPOAlgoCfg(advantage_estimator="reinforce_pp", n_samples_per_prompt=1, missing_eos_penalty=None)
    exp = score_and_advantages(A, None, None, 0, torch.ones(1, 2), [True], torch.zeros(1, 2), None, None,
                               torch.tensor([1.0]), {"acc": torch.tensor([1.0])}, 0.0, None)
    out = _rollout_metrics(exp, 0.0)
    assert out["rollout/reward_std"] == 0.0 and all(v == v for v in out.values())


def _two_rounds(monkeypatch):
    """`collect_rollouts` of 2 prompts × G = 2 with stubbed generation and two reward sources: round 1
    scores acc [1, 1 | 1, 0] (the all-correct group dropped), round 2 [1, 1 | 0, 1] → trained rows
    [1, 0, 0, 1] (mean 0.5) out of 8 generated (mean 0.75)."""
    import turborlhf.trainers.ppo.rlvr as rlvr

    rounds = [torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 1.0])]
    calls = []

    def generate(cluster, cfg, tok, prompts, step, attempt):
        B = len(prompts) * 2
        return [[5, 6]] * B, [True] * B, [1], None, None

    def score_rows(cluster, cfg, ids, attn, prompts, responses, columns):
        s = rounds[len(calls)]
        calls.append(1)
        return lambda: (s + 0.5, {"acc": s, "fmt": torch.full_like(s, 0.5)})
    monkeypatch.setattr(rlvr, "generate", generate)
    monkeypatch.setattr(rlvr, "score_rows", score_rows)
    A = PPOAlgoCfg(advantage_estimator="grpo", n_samples_per_prompt=2, dynamic_sampling=True, kl_use_loss=True,
                   missing_eos_penalty=None, normalize_reward=True)
    cfg = SimpleNamespace(algo=A, rollout=SimpleNamespace(max_new_tokens=8), train=SimpleNamespace(seed=1))
    ro = rlvr.collect_rollouts(None, cfg, SimpleNamespace(pad_token_id=0), [[1, 2]] * 4, [0, 1], 0)
    assert ro.metrics["rollout/sampling_rounds"] == 2 and ro.scores[1]["acc"].tolist() == [1.0, 0.0, 0.0, 1.0]
    return A, ro


def test_dropped_groups_count_in_the_logged_rewards_not_in_the_advantages(monkeypatch):
    """Dynamic sampling drops all-correct and all-wrong groups: the logged reward mean (the
    accuracy) was over the trained rows alone, 0.5 here for 6 correct answers out of 8 generated."""
    from turborlhf.trainers.ppo.driver import _rollout_metrics

    A, ro = _two_rounds(monkeypatch)
    raw, per = ro.scores
    exp = score_and_advantages(A, None, None, 0, torch.ones(4, 2), ro.finished, torch.zeros(4, 2), None, None, raw,
                               per, 0.0, None)
    out = _rollout_metrics(exp, 0.0, ro.generated_scores)
    assert out["rollout/reward_acc_mean"] == 0.75 and out["rollout/reward_mean"] == 1.25
    assert out["rollout/reward_std"] == pytest.approx(torch.tensor([1.0] * 6 + [0.0] * 2).std().item())
    assert out["rollout/reward_mean_trained"] == 1.0                    # the trained rows' (0.5 + 0.5)
    assert exp.adv_BR.shape == (4, 2)                                   # the advantages: kept groups only
    # without dynamic sampling every generated row trains: one mean, no separate trained one
    plain = _rollout_metrics(exp, 0.0)
    assert plain["rollout/reward_mean"] == 1.0 and "rollout/reward_mean_trained" not in plain


def test_the_running_reward_normaliser_sees_every_generated_row(monkeypatch):
    """algo.normalize_reward's running moments were updated with the trained rows alone: the
    filter's choice (mean 1.0, var 0.25 here) instead of the policy's scores (mean 1.25, var 0.1875)."""
    A, ro = _two_rounds(monkeypatch)
    stats = RunningMoments()
    exp = score_and_advantages(A, None, None, 0, torch.ones(4, 2), ro.finished, torch.zeros(4, 2), None, None,
                               ro.scores[0], ro.scores[1], 0.0, stats, stats_scores_B=ro.generated_scores[0])
    assert (stats.count, stats.mean, stats.var) == (8, pytest.approx(1.25), pytest.approx(0.1875))
    torch.testing.assert_close(exp.scores_B, (ro.scores[0] - 1.25) / 0.1875 ** 0.5)   # only the kept rows scored
    # without dynamic sampling (no generated scores) the trained rows are every generated row
    alone = RunningMoments()
    score_and_advantages(A, None, None, 0, torch.ones(4, 2), ro.finished, torch.zeros(4, 2), None, None,
                         ro.scores[0], ro.scores[1], 0.0, alone)
    assert (alone.count, alone.mean) == (4, pytest.approx(1.0))


@pytest.mark.parametrize("est", ["grpo", "rloo", "dr_grpo"])
def test_group_advantages_match_a_loop_over_the_groups(est):
    """Step 3 end to end against a plain re-implementation: score = raw + DAPO overlong penalty (Eq. 13,
    length with the stop token) − missing-EOS penalty; the group baseline over each prompt's G
    consecutive rows (GRPO: unbiased std + 1e-4 as TRL; RLOO: mean of the others; Dr. GRPO: r − mean);
    then the k1 KL penalty summed from each token to the response's end (OpenRLHF's critic-free recipe)."""
    B, G, R, beta = 8, 4, 6, 0.1
    lens = torch.tensor([6, 3, 5, 2, 1, 6, 4, 2])
    mask = (torch.arange(R)[None] < lens[:, None]).float()
    finished = [n < R for n in lens.tolist()]                       # the rows of length R were cut
    raw = torch.tensor([1.0, 0, 1, 0, 0, 0, 1, 1])
    g = torch.Generator().manual_seed(0)
    old, ref = -torch.rand(B, R, generator=g) * mask, -torch.rand(B, R, generator=g) * mask
    A = PPOAlgoCfg(advantage_estimator=est, n_samples_per_prompt=G, prompts_per_step=2, kl_coef=beta,
                   overlong_buffer_len=3, missing_eos_penalty=0.5)
    shaping = torch.tensor([min(0.0, max(-1.0, (R - 3 - n) / 3)) for n in lens.tolist()])
    exp = score_and_advantages(A, None, None, 0, mask, finished, old, ref, None, raw, {}, beta, None,
                               shaping_B=shaping)
    score = [float(raw[i] + shaping[i]) - (0.0 if finished[i] else 0.5) for i in range(B)]
    expected = torch.zeros(B, R)
    for i in range(B):
        grp = score[i // G * G:(i // G + 1) * G]
        mean = sum(grp) / G
        if est == "grpo":
            base = (score[i] - mean) / ((sum((x - mean) ** 2 for x in grp) / (G - 1)) ** 0.5 + 1e-4)
        elif est == "rloo":
            base = score[i] - (sum(grp) - score[i]) / (G - 1)
        else:
            base = score[i] - mean
        n = int(lens[i])
        for t in range(n):
            expected[i, t] = base - beta * float((old[i, t:n] - ref[i, t:n]).sum())
    torch.testing.assert_close(exp.adv_BR, expected, atol=1e-5, rtol=1e-5)
