"""KL estimators and controllers against docs/reference/formulas.md §9 (KL, Adaptive KL)."""

import pytest
import torch

from turborlhf.algo import AdaptiveKLController, FixedKLController, kl_estimate

D = torch.float64
LOGP = torch.tensor([[-1.0, -2.0, -0.5]], dtype=D)
REF = torch.tensor([[-1.2, -1.5, -0.5]], dtype=D)


@pytest.mark.parametrize(
    "estimator,expected",
    [("k1", [0.2, -0.5, 0.0]), ("k2", [0.02, 0.125, 0.0]), ("k3", [0.0187307531, 0.1487212707, 0.0])],
)
def test_estimators_golden(estimator, expected):
    out = kl_estimate(LOGP, REF, estimator)
    assert torch.allclose(out, torch.tensor([expected], dtype=D), rtol=1e-8, atol=1e-10)


def test_k3_matches_naive_formula_and_is_nonnegative():
    g = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(4, 16, dtype=D, generator=g), torch.randn(4, 16, dtype=D, generator=g)
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.allclose(k3, torch.exp(ref - logp) - 1 - (ref - logp))
    assert (k3 >= 0).all() and (kl_estimate(logp, ref, "k2") >= 0).all()


def test_clamp_option_and_dtype():
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.bfloat16)
    ref = torch.tensor([[-30.0, 30.0]], dtype=torch.bfloat16)
    assert kl_estimate(logp, ref, "k1").tolist() == [[30.0, -30.0]]  # default: no clamp (TRL)
    out = kl_estimate(logp, ref, "k1", clamp=10.0)  # OpenRLHF
    assert out.dtype == torch.float32 and out.tolist() == [[10.0, -10.0]]


def test_errors():
    with pytest.raises(ValueError):
        kl_estimate(LOGP, REF, "k4")
    with pytest.raises(ValueError):
        kl_estimate(LOGP, REF[:, :2])
    with pytest.raises(ValueError):
        kl_estimate(LOGP, REF, clamp=0.0)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.2, 0.0, 10000)
    with pytest.raises(ValueError):
        FixedKLController(-1.0)


@pytest.mark.parametrize("current,expected", [(9.0, 0.201024), (5.0, 0.1991466667)])
def test_adaptive_golden(current, expected):
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    assert ctl.update(current, n_steps=256) == pytest.approx(expected, rel=1e-9)
    assert ctl.value == pytest.approx(expected, rel=1e-9)


def test_adaptive_error_is_clipped_and_state_roundtrip():
    ctl = AdaptiveKLController(0.2, 6.0, 10000)
    ctl.update(1000.0, 256)  # error clipped at +0.2
    assert ctl.value == pytest.approx(0.201024)
    other = AdaptiveKLController(1.0, 1.0, 1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.update(5.0, 256) == pytest.approx(0.201024 * (1 - (1 / 6) * 0.0256))


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    assert ctl.update(100.0, 1000) == 0.05 and ctl.value == 0.05
