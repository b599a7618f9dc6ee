"""Losses against docs/reference/formulas.md §9 (RM, DPO, KTO, PPO, Value) plus invariances."""

import math

import pytest
import torch

from turborlhf.algo import (
    dpo_loss,
    kto_kl_estimate,
    kto_loss,
    pairwise_rm_loss,
    ppo_policy_loss,
    reduce_loss,
    reduce_seq_loss,
    sft_nll_loss,
    value_clipfrac,
    value_loss,
)

D = torch.float64
REL = 1e-8


def t(x):
    return torch.tensor(x, dtype=D)


# ------------------------------------------------------------------------------------- SFT


def test_sft_nll():
    logp = t([[-1.0, -2.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    loss = sft_nll_loss(logp, mask)
    assert torch.equal(loss, t([[1.0, 2.0, 0.0]]))
    assert reduce_loss(loss, mask).item() == pytest.approx(1.5)


# -------------------------------------------------------------------------------------- RM

RC, RR, MARGIN = t([1.0, 0.5, -0.2]), t([0.0, 0.7, -0.2]), t([0.5, 0.0, 1.0])


def test_rm_golden():
    loss, stats = pairwise_rm_loss(RC, RR)
    assert loss.mean().item() == pytest.approx(0.6015159125, rel=REL)
    assert stats["accuracy"].item() == pytest.approx(1 / 3)  # tie counts as wrong
    assert stats["margin"].item() == pytest.approx((1.0 - 0.2 + 0.0) / 3)
    loss_m, _ = pairwise_rm_loss(RC, RR, MARGIN)
    assert loss_m.mean().item() == pytest.approx(0.861825847, rel=REL)
    loss_c, _ = pairwise_rm_loss(RC, RR, center_coef=0.01)
    assert (loss_c.mean() - loss.mean()).item() == pytest.approx(0.0086666667, rel=1e-7)
    logexp = torch.log1p(torch.exp(RR - RC)).mean()  # OpenRLHF LogExpLoss
    assert logexp.item() == pytest.approx(loss.mean().item(), rel=1e-12)


# ------------------------------------------------------------------------------------- DPO

PI_C, PI_R, REF_C, REF_R = t([-10.0, -8.0]), t([-12.0, -7.0]), t([-11.0, -8.5]), t([-11.5, -7.5])


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(variant="sigmoid"), 0.6570521142),
        (dict(variant="cdpo", label_smoothing=0.1), 0.6645521142),
        (dict(variant="sigmoid", label_smoothing=0.1), 0.6645521142),  # author code / OpenRLHF
        (dict(variant="robust", label_smoothing=0.1), 0.6476771142),
        (dict(variant="ipo"), 18.625),
        (
            dict(variant="ipo", ipo_normalize_by_length=True, len_c_B=torch.tensor([4, 2]), len_r_B=torch.tensor([5, 3])),
            22.8980555556,
        ),
        (dict(variant="sigmoid", reference_free=True), 0.6712677647),
    ],
)
def test_dpo_golden(kwargs, expected):
    loss, stats = dpo_loss(PI_C, PI_R, REF_C, REF_R, beta=0.1, **kwargs)
    assert loss.shape == (2,)
    assert loss.mean().item() == pytest.approx(expected, rel=REL)
    # implicit-reward stats always use summed log-ratios against the given reference
    assert torch.allclose(stats["chosen_rewards"], t([0.1, 0.05]))
    assert torch.allclose(stats["rejected_rewards"], t([-0.05, 0.05]))
    assert stats["accuracy"].item() == 0.5
    assert stats["margin"].item() == pytest.approx(0.075)


def test_dpo_at_init_is_ln2_and_grads():
    pi_c = t([-3.0, -4.0]).requires_grad_(True)
    pi_r = t([-5.0, -1.0]).requires_grad_(True)
    loss, _ = dpo_loss(pi_c, pi_r, pi_c.detach(), pi_r.detach(), beta=0.1)
    assert loss.mean().item() == pytest.approx(math.log(2))
    reduce_seq_loss(loss).backward()
    assert torch.allclose(pi_c.grad, t([-0.025, -0.025])) and torch.allclose(pi_r.grad, t([0.025, 0.025]))


def test_dpo_errors():
    with pytest.raises(ValueError):
        dpo_loss(PI_C, PI_R, REF_C, REF_R, 0.1, variant="hinge")
    with pytest.raises(ValueError):
        dpo_loss(PI_C, PI_R, REF_C, REF_R, 0.0)
    with pytest.raises(ValueError):
        dpo_loss(PI_C, PI_R, REF_C, REF_R, 0.1, variant="robust", label_smoothing=0.5)
    with pytest.raises(ValueError):
        dpo_loss(PI_C, PI_R, REF_C, REF_R, 0.1, variant="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError):
        dpo_loss(PI_C, PI_R, REF_C, REF_R, 0.1, variant="ipo", ipo_normalize_by_length=True)
    with pytest.raises(ValueError):
        dpo_loss(PI_C, PI_R, REF_C, REF_R[:1], 0.1)


# ------------------------------------------------------------------------------------- KTO


def test_kto_golden():
    z0 = kto_kl_estimate(t([-9.0, -8.0, -10.0]), t([-9.3, -8.1, -9.9]))
    assert z0.item() == pytest.approx(0.1, rel=1e-12)
    loss, stats = kto_loss(t([-5.0, -6.0]), t([-5.5, -6.0]), t([-7.0]), t([-6.5]), z0, beta=0.1)
    assert torch.allclose(loss, t([0.4900013331, 0.5024999792, 0.4850044984]), rtol=REL)
    assert reduce_seq_loss(loss).item() == pytest.approx(0.4925019369, rel=REL)
    weighted, _ = kto_loss(t([-5.0, -6.0]), t([-5.5, -6.0]), t([-7.0]), t([-6.5]), z0, 0.1, desirable_weight=1.33)
    assert weighted.mean().item() == pytest.approx(0.6016770812, rel=REL)
    assert torch.allclose(stats["chosen_rewards"], t([0.05, 0.0]))
    assert torch.allclose(stats["rejected_rewards"], t([-0.05]))


def test_kto_kl_clamped_and_empty_sides():
    assert kto_kl_estimate(t([-9.0]), t([-8.0])).item() == 0.0
    assert kto_kl_estimate(t([]), t([])).item() == 0.0
    z0 = t(0.1)
    only_chosen, _ = kto_loss(t([-5.0]), t([-5.5]), t([]), t([]), z0, 0.1)
    assert only_chosen.tolist() == pytest.approx([0.4900013331])
    only_rejected, _ = kto_loss(t([]), t([]), t([-7.0]), t([-6.5]), z0, 0.1)
    assert only_rejected.tolist() == pytest.approx([0.4850044984])
    with pytest.raises(ValueError):
        kto_loss(t([-5.0]), t([-5.5]), t([]), t([]), t([0.1, 0.2]), 0.1)


# ------------------------------------------------------------------------------------- PPO

RATIO = t([[1.5, 0.5, 1.1], [0.7, 1.3, 4.0]])
ADV = t([[1.0, -1.0, 2.0], [-0.5, 1.0, -2.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
LOGP = torch.log(RATIO)
OLD = torch.zeros_like(LOGP)


def test_ppo_golden():
    loss, stats = ppo_policy_loss(LOGP, OLD, ADV, MASK)
    assert torch.allclose(loss, t([[-1.2, 0.8, 0.0], [0.4, -1.2, 8.0]]))
    assert reduce_loss(loss, MASK).item() == pytest.approx(1.36, rel=REL)
    assert reduce_loss(loss, MASK, "seq_mean_token_mean").item() == pytest.approx(1.1, rel=REL)
    assert reduce_loss(loss, MASK, "token_sum_norm").item() == pytest.approx(6.8 / 6, rel=REL)
    assert stats["clipfrac"].item() == pytest.approx(0.8)
    assert stats["ppo_kl"].item() == pytest.approx(-LOGP[MASK.bool()].mean().item())
    k3 = (RATIO - 1) - LOGP
    assert stats["approx_kl"].item() == pytest.approx(k3[MASK.bool()].mean().item())


def test_ppo_dual_clip_golden():
    loss, stats = ppo_policy_loss(LOGP, OLD, ADV, MASK, dual_clip=3.0)
    assert loss[1, 2].item() == pytest.approx(6.0)
    assert reduce_loss(loss, MASK).item() == pytest.approx(0.96, rel=REL)
    assert reduce_loss(loss, MASK, "seq_mean_token_mean").item() == pytest.approx(0.7666666667, rel=REL)
    assert stats["dual_clipfrac"].item() == pytest.approx(0.2)
    with pytest.raises(ValueError):
        ppo_policy_loss(LOGP, OLD, ADV, MASK, dual_clip=1.0)


def test_ppo_asymmetric_clip():
    loss, _ = ppo_policy_loss(LOGP, OLD, ADV, MASK, eps_low=0.2, eps_high=0.28)
    assert loss[0, 0].item() == pytest.approx(-1.28) and loss[1, 1].item() == pytest.approx(-1.28)
    assert loss[0, 1].item() == pytest.approx(0.8)


def test_ppo_kl_metric_not_clamped():
    new, old = t([[100.0]]), t([[0.0]])
    loss, stats = ppo_policy_loss(new, old, t([[1.0]]), torch.ones(1, 1))
    assert stats["ppo_kl"].item() == -100.0
    assert torch.isfinite(loss).all() and torch.isfinite(stats["approx_kl"])


def test_ppo_microbatch_equivalence_grads_and_garbage():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 8
    mask = torch.rand(B, T, generator=g) > 0.25
    old = -torch.rand(B, T, dtype=D, generator=g) * 3
    adv = torch.randn(B, T, dtype=D, generator=g)
    base = old + 0.3 * torch.randn(B, T, dtype=D, generator=g)
    junk = torch.full_like(base, float("nan"))

    p = base.clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(p, old, adv, mask)
    whole = reduce_loss(loss, mask)
    whole.backward()
    assert torch.isfinite(p.grad).all() and p.grad[mask].abs().sum() > 0

    q = base.clone().requires_grad_(True)
    n_tok = int(mask.sum())
    acc = 0.0
    for sl in (slice(0, 2), slice(2, 5), slice(5, 6)):
        lp = torch.where(mask[sl], q[sl], junk[sl])  # garbage at padded positions
        adv_j = torch.where(mask[sl], adv[sl], junk[sl])
        l_mb, _ = ppo_policy_loss(lp, old[sl], adv_j, mask[sl])
        acc = acc + reduce_loss(l_mb, mask[sl], num_tokens=n_tok)
    acc.backward()
    assert acc.item() == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(q.grad, p.grad)


def test_ppo_bf16_grads_finite():
    logp = torch.randn(2, 5, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = ppo_policy_loss(logp, torch.zeros(2, 5), torch.randn(2, 5), torch.ones(2, 5))
    reduce_loss(loss.float(), torch.ones(2, 5)).backward()
    assert torch.isfinite(logp.grad.float()).all()


# ----------------------------------------------------------------------------------- value

VAL = t([[1.0, 0.5, 0.0], [0.2, -0.3, 0.9]])
VOLD = t([[0.8, 0.9, 0.0], [0.2, 0.0, 0.0]])
RET = t([[1.5, 0.4, 0.0], [0.0, 0.1, 1.0]])


def test_value_golden():
    loss = value_loss(VAL, VOLD, RET, MASK, clip=0.2)
    assert torch.allclose(loss, 0.5 * t([[0.25, 0.09, 0.0], [0.04, 0.16, 0.64]]))
    assert reduce_loss(loss, MASK).item() == pytest.approx(0.118, rel=REL)  # the ½ applied once
    assert value_clipfrac(VAL, VOLD, RET, MASK, 0.2).item() == pytest.approx(0.4)
    unclipped = value_loss(VAL, VOLD, RET, MASK)
    assert reduce_loss(unclipped, MASK).item() == pytest.approx(0.047, rel=REL)
    assert value_clipfrac(VAL, VOLD, RET, MASK, None).item() == 0.0
    with pytest.raises(ValueError):
        value_loss(VAL, VOLD, RET, MASK, clip=0.0)


def test_value_grads_and_garbage_padding():
    v = VAL.clone().requires_grad_(True)
    ret_junk = torch.where(MASK.bool(), RET, torch.full_like(RET, float("nan")))
    loss = value_loss(v, VOLD, ret_junk, MASK, clip=0.2)
    reduce_loss(loss, MASK).backward()
    assert torch.isfinite(v.grad).all()
    assert v.grad[0, 2] == 0 and v.grad[0, 1] == 0  # token (0,1): clipped branch active → no grad


def test_value_clipfrac_refuses_a_clip_value_loss_refuses():
    """``value_clipfrac`` took a negative clip and counted every moved token as clipped (1.0 instead of
    0.5), silently, where ``value_loss`` refuses ``clip <= 0``."""
    v, old, ret, mask = t([[0.5, 0.0]]), t([[0.0, 0.0]]), t([[1.0, 1.0]]), torch.ones(1, 2)
    assert value_clipfrac(v, old, ret, mask, 0.2).item() == pytest.approx(0.5)
    for clip in (-0.2, 0.0):
        with pytest.raises(ValueError, match=f"value_clipfrac: clip must be > 0, got {clip}"):
            value_clipfrac(v, old, ret, mask, clip)
