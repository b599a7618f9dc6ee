"""Comparison cases against OpenRLHF 0.11.2 (and 0.9.0 for KTOLoss), registered with `@case`
into `compare_core.CASES`; run by `compare_algo.py` (docstring there)."""
from __future__ import annotations

from compare_core import (SHAPES, _BF16_LOGPROBS, _entropy_vs, _logprobs_bf16_vs, _logprobs_vs, _pairs, case, junk, rand,
                          randn, rmask)

ORL = "openrlhf-0.11.2"
ORL_KTO = "openrlhf-0.9.0"


@case(ORL, "masked_mean", "openrlhf.models.utils.masked_mean", "dim=None and dim=1 (non-empty rows)")
def orl_masked_mean(P, dt, g, d, dd):
    from turborlhf.algo import masked_mean

    for B, T in SHAPES:
        m = rmask(g, B, T)
        x = junk(randn(g, B, T, dt=dt), m, g)
        d.add(masked_mean(x, m), P.utils.masked_mean(x, m.to(x.dtype)))
        d.add(masked_mean(x, m, dim=1), P.utils.masked_mean(x, m.to(x.dtype), dim=1))


@case(ORL, "reduce_loss(token_mean)", "openrlhf.models.loss.aggregate_loss(token_level_loss=True)",
      "local count; and two micro-batches summed with the global num_tokens (= batch_num_tokens, dp_size=1)")
def orl_reduce_token(P, dt, g, d, dd):
    import torch

    from turborlhf.algo import reduce_loss

    agg = P.loss.aggregate_loss
    for B, T in SHAPES:
        m = rmask(g, B, T)
        mf = m.to(getattr(torch, dt))
        loss = junk(randn(g, B, T, dt=dt, scale=2), m, g)
        d.add(reduce_loss(loss, m, "token_mean"), agg(loss, mf))
        if B > 1:
            k, n = B // 2, mf.sum()
            ours = reduce_loss(loss[:k], m[:k], num_tokens=n) + reduce_loss(loss[k:], m[k:], num_tokens=n)
            peer = agg(loss[:k], mf[:k], batch_num_tokens=n) + agg(loss[k:], mf[k:], batch_num_tokens=n)
            d.add(ours, peer)


@case(ORL, "reduce_loss(seq_mean_token_mean)", "openrlhf.models.loss.aggregate_loss(token_level_loss=False)",
      "with an empty sequence; local count, and two micro-batches with the global num_seqs (= global_batch_size)")
def orl_reduce_seq(P, dt, g, d, dd):
    import torch

    from turborlhf.algo import reduce_loss

    agg = P.loss.aggregate_loss
    for B, T in SHAPES:
        m = rmask(g, B, T, empty=1 if B > 2 else 0)
        mf = m.to(getattr(torch, dt))
        loss = junk(randn(g, B, T, dt=dt, scale=2), m, g)
        d.add(reduce_loss(loss, m, "seq_mean_token_mean"), agg(loss, mf, token_level_loss=False))
        if B > 1:
            k, s = B // 2, (m.sum(1) > 0).sum().to(mf.dtype)
            ours = sum(reduce_loss(loss[a:b], m[a:b], "seq_mean_token_mean", num_seqs=s) for a, b in [(0, k), (k, B)])
            peer = sum(agg(loss[a:b], mf[a:b], token_level_loss=False, global_batch_size=s)
                       for a, b in [(0, k), (k, B)])
            d.add(ours, peer)


def _ppo_inputs(g, B, T, dt, extreme: bool, junk_scale=50.0, big_frac=0.1):
    import torch

    m = rmask(g, B, T)
    old = -rand(g, B, T, dt=dt, scale=3.0)
    delta = randn(g, B, T, dt=dt, scale=0.3)
    big = rand(g, B, T) < big_frac                 # a few large ratios (dual clip becomes active)
    delta = torch.where(big, delta + 1.5 * torch.sign(delta), delta)
    if extreme:                                    # |log ratio| > 20: OpenRLHF's and our clamp
        huge = rand(g, B, T) < 0.05
        delta = torch.where(huge, delta + 25.0 * torch.sign(delta), delta)
    logp = old + delta
    adv = randn(g, B, T, dt=dt)
    return m, junk(logp, m, g, junk_scale), junk(old, m, g, junk_scale), junk(adv, m, g, junk_scale)


@case(ORL, "ppo_policy_loss + reduce_loss(token_mean)", "openrlhf.models.loss.PolicyLoss (ppo)",
      "eps_low/eps_high/dual_clip = (0.2,0.2,-), (0.2,0.28,-), (0.1,0.3,3); loss, clipfrac=clip_ratio, "
      "ppo_kl; |log ratio| > 20 in fp64")
def orl_policy_loss(P, dt, g, d, dd):
    from turborlhf.algo import ppo_policy_loss, reduce_loss

    for el, eh, dc in [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)]:
        layer = P.loss.PolicyLoss(clip_eps_low=el, clip_eps_high=eh, dual_clip=dc)
        for B, T in SHAPES:
            m, logp, old, adv = _ppo_inputs(g, B, T, dt, extreme=dt == "float64")
            loss, clip_ratio, ppo_kl = layer(logp, old, adv, action_mask=m.to(logp.dtype))[:3]
            ours, st = ppo_policy_loss(logp, old, adv, m, el, eh, dc)
            d.add(reduce_loss(ours, m), loss)
            d.add(st["clipfrac"], clip_ratio)
            d.add(st["ppo_kl"], ppo_kl)


@case(ORL, "value_loss + reduce_loss(token_mean)", "openrlhf.models.loss.ValueLoss",
      "clip None, 0.2, 0.5 (the 1/2 is inside value_loss)")
def orl_value_loss(P, dt, g, d, dd):
    from turborlhf.algo import reduce_loss, value_loss

    for clip in (None, 0.2, 0.5):
        layer = P.loss.ValueLoss(clip_eps=clip)
        for B, T in SHAPES:
            m = rmask(g, B, T)
            old = randn(g, B, T, dt=dt)
            v = junk(old + randn(g, B, T, dt=dt, scale=0.4), m, g)
            ret = junk(randn(g, B, T, dt=dt), m, g)
            old = junk(old, m, g)
            d.add(reduce_loss(value_loss(v, old, ret, m, clip), m), layer(v, old, ret, action_mask=m.to(v.dtype)))


@case(ORL, "pairwise_rm_loss + reduce_seq_loss", "openrlhf.models.loss.PairWiseLoss, LogExpLoss",
      "no margin / margin; LogExp = no margin")
def orl_rm_loss(P, dt, g, d, dd):
    from turborlhf.algo import pairwise_rm_loss, reduce_seq_loss

    for B in (1, 3, 8, 33):
        c, r = randn(g, B, dt=dt, scale=2), randn(g, B, dt=dt, scale=2)
        margin = randn(g, B, dt=dt).abs()
        d.add(reduce_seq_loss(pairwise_rm_loss(c, r)[0]), P.loss.PairWiseLoss()(c, r))
        d.add(reduce_seq_loss(pairwise_rm_loss(c, r, margin)[0]), P.loss.PairWiseLoss()(c, r, margin))
        d.add(reduce_seq_loss(pairwise_rm_loss(c, r)[0]), P.loss.LogExpLoss()(c, r))



@case(ORL, "dpo_loss + reduce_seq_loss", "openrlhf.models.loss.DPOLoss",
      "variant sigmoid / cdpo (label_smoothing 0.1, 0.3) / ipo (summed log-probs), beta 0.1, 0.5; loss and "
      "chosen/rejected rewards", dtypes=("float64",))
def orl_dpo(P, dt, g, d, dd):
    from turborlhf.algo import dpo_loss, reduce_seq_loss

    for variant, eps, ipo in [("sigmoid", 0.0, False), ("cdpo", 0.1, False), ("cdpo", 0.3, False), ("ipo", 0.0, True)]:
        for beta in (0.1, 0.5):
            layer = P.loss.DPOLoss(beta, label_smoothing=eps, ipo=ipo)
            for B in (1, 3, 8, 33):
                pc, pr, rc, rr = _pairs(g, B, dt)
                loss, cr, rj = layer(pc, pr, rc, rr)
                ours, st = dpo_loss(pc, pr, rc, rr, beta, variant, label_smoothing=eps)
                d.add(reduce_seq_loss(ours), loss)
                d.add(st["chosen_rewards"], cr)
                d.add(st["rejected_rewards"], rj)


@case(ORL, "kl_estimate", "openrlhf.models.utils.compute_approx_kl", "k1, k2, k3 with clamp=10.0",
      doc="docs/algorithms/ppo.md", default_note="clamp=None (no clamp, as TRL and the paper formulas)")
def orl_kl(P, dt, g, d, dd):
    from turborlhf.algo import kl_estimate

    for est in ("k1", "k2", "k3"):
        for B, T in SHAPES + [(4, 64)]:
            logp = -rand(g, B, T, dt=dt, scale=3)
            ref = logp + randn(g, B, T, dt=dt, scale=6)      # |log ratio| up to ~20: the clamp matters
            peer = P.utils.compute_approx_kl(logp, ref, kl_estimator=est)
            d.add(kl_estimate(logp, ref, est, clamp=10.0), peer)
            dd.add(kl_estimate(logp, ref, est), peer)


@case(ORL, "kl_penalized_rewards", "openrlhf.models.utils.compute_reward",
      "kl_coef 0, 0.05; clip=(-2, 2) = reward_clip_range; valid positions (OpenRLHF leaves -coef*kl of the "
      "caller's already-masked kl at padding)")
def orl_reward(P, dt, g, d, dd):
    from turborlhf.algo import kl_penalized_rewards

    for coef in (0.0, 0.05):
        for B, T in SHAPES:
            m = rmask(g, B, T)
            scores = randn(g, B, dt=dt, scale=3)
            kl = junk(randn(g, B, T, dt=dt, scale=0.1), m, g)
            peer = P.utils.compute_reward(scores, coef, kl, action_mask=m, reward_clip_range=(-2.0, 2.0))
            d.add(kl_penalized_rewards(scores, kl, m, coef, clip=(-2.0, 2.0)), peer, mask=m)


@case(ORL, "gae", "RemoteExperienceMaker.get_advantages_and_returns (unbound, self unused)",
      "(gamma, lam) = (1, .95), (.99, .95), (1, 1), (.9, 0); advantages and returns, whole tensor")
def orl_gae(P, dt, g, d, dd):
    from turborlhf.algo import gae

    f = P.em.RemoteExperienceMaker.get_advantages_and_returns
    for gamma, lam in [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0), (0.9, 0.0)]:
        for B, T in SHAPES:
            m = rmask(g, B, T)
            v, r = junk(randn(g, B, T, dt=dt), m, g), junk(randn(g, B, T, dt=dt, scale=0.3), m, g)
            pa, pr = f(None, v, r, m, gamma, lam)
            oa, orr = gae(v, r, m, gamma, lam)
            d.add(oa, pa)
            d.add(orr, pr)


@case(ORL, "discounted_returns", "RemoteExperienceMaker.get_cumulative_returns (unbound, self unused)",
      "gamma 1, 0.9; whole tensor")
def orl_returns(P, dt, g, d, dd):
    from turborlhf.algo import discounted_returns

    f = P.em.RemoteExperienceMaker.get_cumulative_returns
    for gamma in (1.0, 0.9):
        for B, T in SHAPES:
            m = rmask(g, B, T)
            r = junk(randn(g, B, T, dt=dt, scale=0.3), m, g)
            d.add(discounted_returns(r, m, gamma), f(None, r, m, gamma))


def _orl_pipeline(P, est, dt, g, d, dd, gamma, lam, kl_coef=0.01, n_samples=4, prompts=3):
    """OpenRLHF's whole compute_advantages_and_returns (baseline, reward shaping, returns, global whitening)
    on two experiences holding a shuffled rollout, against the same steps written with turborlhf.algo."""
    import functools
    import types

    import torch

    from turborlhf.algo import (discounted_returns, gae, group_mean_baseline, group_normalized_advantages,
                                kl_penalized_rewards, leave_one_out_advantages, masked_whiten)

    REM = P.em.RemoteExperienceMaker
    N = prompts * n_samples
    for T in (1, 6, 20):
        m = rmask(g, N, T)
        scores = randn(g, N, dt=dt)
        scores[:n_samples] = 1.0                                  # one group with identical rewards
        kl = torch.where(m, randn(g, N, T, dt=dt, scale=0.05), torch.zeros((), dtype=scores.dtype))
        values = torch.where(m, randn(g, N, T, dt=dt), torch.zeros((), dtype=scores.dtype))
        perm = torch.randperm(N, generator=g).tolist()
        parts = [perm[:5], perm[5:]]
        exps = [types.SimpleNamespace(rewards=scores[idx].clone(), index=list(idx), kl=kl[idx], action_mask=m[idx],
                                      values=values[idx], info={}, advantages=None, returns=None) for idx in parts]
        args = types.SimpleNamespace(
            rollout=types.SimpleNamespace(n_samples_per_prompt=n_samples),
            algo=types.SimpleNamespace(advantage=types.SimpleNamespace(estimator=est, gamma=gamma, lambd=lam,
                                                                       no_std_norm=False)),
            reward=types.SimpleNamespace(clip_range=(-10.0, 10.0)))
        self = types.SimpleNamespace(strategy=types.SimpleNamespace(args=args), advantage_estimator=est,
                                     kl_ctl=types.SimpleNamespace(value=kl_coef))
        self.get_advantages_and_returns = functools.partial(REM.get_advantages_and_returns, self)
        self.get_cumulative_returns = functools.partial(REM.get_cumulative_returns, self)
        REM.compute_advantages_and_returns(self, exps)

        def ours(eps):
            s = scores.view(prompts, n_samples)
            if est == "rloo":
                s = leave_one_out_advantages(s)
            elif est == "reinforce_baseline":
                s = group_mean_baseline(s)
            elif est == "dr_grpo":
                s = group_normalized_advantages(s, std=False)
            elif est == "group_norm":
                s = group_normalized_advantages(s) if eps is None else group_normalized_advantages(s, eps=eps)
            rewards = kl_penalized_rewards(s.reshape(-1), kl, m, kl_coef, clip=(-10.0, 10.0))
            if est == "gae":
                adv, ret = gae(values, rewards, m, gamma, lam)
            else:
                ret = discounted_returns(rewards, m, gamma)
                adv = ret
            if est in ("gae", "reinforce", "reinforce_baseline"):
                adv = masked_whiten(adv, m)
            return adv, ret

        for diff, eps in ((d, 1e-9), (dd, None)):
            if diff is dd and est != "group_norm":
                continue
            adv, ret = ours(eps)
            for e in exps:
                idx = torch.tensor(e.index)
                diff.add(adv[idx], e.advantages, mask=m[idx])
                diff.add(ret[idx], e.returns, mask=m[idx])


def _pipeline_case(est, gamma, lam, ours_desc, doc=None, default_note=""):
    def fn(P, dt, g, d, dd):
        _orl_pipeline(P, est, dt, g, d, dd, gamma, lam)
    fn.__name__ = f"orl_pipeline_{est}"
    case(ORL, f"advantage pipeline: {ours_desc}",
         f"RemoteExperienceMaker.compute_advantages_and_returns (estimator={est}, stand-in self)",
         f"gamma={gamma}, lam={lam}, kl_coef 0.01, reward clip (-10, 10), 3 prompts x 4 samples shuffled into 2 "
         "experiences; advantages and returns at valid positions"
         + ("; group_normalized_advantages(eps=1e-9)" if est == "group_norm" else ""),
         doc=doc, default_note=default_note)(fn)


_pipeline_case("gae", 1.0, 0.95, "kl_penalized_rewards, gae, masked_whiten (biased)")
_pipeline_case("reinforce", 0.95, 1.0, "kl_penalized_rewards, discounted_returns, masked_whiten")
_pipeline_case("rloo", 1.0, 1.0, "leave_one_out_advantages, kl_penalized_rewards, discounted_returns")
_pipeline_case("reinforce_baseline", 1.0, 1.0, "group_mean_baseline, ..., discounted_returns, masked_whiten")
_pipeline_case("group_norm", 1.0, 1.0, "group_normalized_advantages, kl_penalized_rewards, discounted_returns",
               doc="docs/algorithms/critic_free.md", default_note="eps=1e-4 on the std (TRL's value)")
_pipeline_case("dr_grpo", 1.0, 1.0, "group_normalized_advantages(std=False), kl_penalized_rewards, "
               "discounted_returns")


@case(ORL, "AdaptiveKLController, FixedKLController", "openrlhf.trainer.ppo_utils.kl_controller",
      "30 updates with random current KL and n_steps; value after each", dtypes=("float64",))
def orl_klctl(P, dt, g, d, dd):
    from turborlhf.algo import AdaptiveKLController, FixedKLController

    for init, target, horizon in [(0.2, 6.0, 10000.0), (0.05, 0.5, 500.0)]:
        ours, peer = AdaptiveKLController(init, target, horizon), P.klc.AdaptiveKLController(init, target, horizon)
        fo, fp = FixedKLController(init), P.klc.FixedKLController(init)
        for cur, n in zip(rand(g, 30, scale=3 * target).tolist(), (rand(g, 30, scale=511) + 1).long().tolist()):
            ours.update(cur, n)
            peer.update(cur, n)
            fo.update(cur, n)
            fp.update(cur, n)
            d.add(ours.value, float(peer.value))
            d.add(fo.value, float(fp.value))


@case(ORL, "sft_nll_loss + reduce_loss", "openrlhf.models.loss.SFTLoss", "token_level_loss True = token_mean, "
      "False = seq_mean_token_mean")
def orl_sft(P, dt, g, d, dd):
    from turborlhf.algo import reduce_loss, sft_nll_loss

    for B, T in SHAPES:
        m = rmask(g, B, T)
        lp = junk(-rand(g, B, T, dt=dt, scale=5), m, g)
        mf = m.to(lp.dtype)
        d.add(reduce_loss(sft_nll_loss(lp, m), m), P.loss.SFTLoss(token_level_loss=True)(lp, mf))
        d.add(reduce_loss(sft_nll_loss(lp, m), m, "seq_mean_token_mean"),
              P.loss.SFTLoss(token_level_loss=False)(lp, mf))


def _lm_batch(g, B, L, V, dt):
    import torch

    logits = randn(g, B, L, V, dt=dt, scale=3)
    labels = torch.randint(0, V, (B, L), generator=g)
    prompt = torch.randint(0, L - 1, (B,), generator=g)
    lens = torch.randint(1, L, (B,), generator=g)
    pos = torch.arange(L)[None, :]
    keep = (pos > prompt[:, None]) & (pos <= prompt[:, None] + lens[:, None])
    keep[:, 0] = False
    keep[0, 1] = True                                    # at least one target
    return logits, labels.masked_fill(~keep, -100)


@case(ORL, "logprobs_from_logits + sft_nll_loss + reduce_loss", "openrlhf.models.loss.GPTLMLoss",
      "shifted logits/labels, -100 ignored; chunk_size=3")
def orl_gptlm(P, dt, g, d, dd):
    from turborlhf.algo import logprobs_from_logits, reduce_loss, sft_nll_loss

    for B, L, V in [(1, 3, 5), (3, 9, 11), (4, 17, 32)]:
        logits, labels = _lm_batch(g, B, L, V, dt)
        lab = labels[:, 1:]
        m = lab != -100
        lp = logprobs_from_logits(logits[:, :-1], lab, chunk_size=3)
        d.add(reduce_loss(sft_nll_loss(lp, m), m), P.loss.GPTLMLoss()(logits, labels))



@case(ORL, "logprobs_from_logits", "openrlhf.models.utils.log_probs_from_logits (torch fallback, no flash-attn)",
      "chunk_size 3 and default")
def orl_logprobs(P, dt, g, d, dd):
    _logprobs_vs(P.utils.log_probs_from_logits, dt, g, d)


@case(ORL, "logprobs_from_logits (bf16 logits)", "openrlhf.models.utils.log_probs_from_logits (bf16 row loop)",
      **_BF16_LOGPROBS)
def orl_logprobs_bf16(P, dt, g, d, dd):
    _logprobs_bf16_vs(P.utils.log_probs_from_logits, dt, g, d, dd)


@case(ORL, "entropy_from_logits", "openrlhf.models.utils.compute_entropy.__wrapped__ (eager, not compiled)",
      "chunk_size 3")
def orl_entropy(P, dt, g, d, dd):
    _entropy_vs(P.utils.compute_entropy.__wrapped__, dt, g, d)


# ============================================================================== OpenRLHF 0.9.0 (KTO)


@case(ORL_KTO, "kto_kl_estimate + kto_loss + reduce_seq_loss", "openrlhf.models.loss.KTOLoss (world_size 1, gloo)",
      "beta 0.1, 0.01, 0.5; weights (1,1), (1.33,1), (1,0.7); one side empty; z0 clamped and not; loss, KL, rewards")
def orl_kto(P, dt, g, d, dd):
    import torch

    from turborlhf.algo import kto_kl_estimate, kto_loss, reduce_seq_loss

    for beta, wd, wu in [(0.1, 1.0, 1.0), (0.01, 1.0, 1.0), (0.1, 1.33, 1.0), (0.5, 1.0, 0.7)]:
        layer = P.loss.KTOLoss(beta, wd, wu, world_size=1, device=torch.device("cpu"))
        for k, (b1, b2) in enumerate([(3, 2), (1, 4), (6, 6), (0, 3), (3, 0)]):
            pc, rc = -rand(g, b1, dt=dt, scale=20) - 1, -rand(g, b1, dt=dt, scale=20) - 1
            pr, rr = -rand(g, b2, dt=dt, scale=20) - 1, -rand(g, b2, dt=dt, scale=20) - 1
            rkl = -rand(g, b1 + b2, dt=dt, scale=20) - 1
            pkl = rkl + randn(g, b1 + b2, dt=dt, scale=0.5) + (0.3 if k % 2 else -0.3)
            loss, cr, rj, kl = layer(pc, pr, pkl, rc, rr, rkl)
            z0 = kto_kl_estimate(pkl, rkl)
            ours, st = kto_loss(pc, rc, pr, rr, z0, beta, wd, wu)
            d.add(reduce_seq_loss(ours), loss)
            d.add(z0, kl)
            d.add(st["chosen_rewards"], cr)
            d.add(st["rejected_rewards"], rj)


# ============================================================================== TRL 1.16.0
