"""masked_* against docs/reference/formulas.md §8 (TRL TestCore) and §9 (whitening golden values)."""

import pytest
import torch

from turborlhf.algo import masked_mean, masked_sum, masked_var, masked_whiten

D = torch.float64
A_BT = torch.tensor([[0.46575, 0.385, 0.3, 123.0], [1.0, -2.0, float("nan"), -7.0]], dtype=D)
M_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
BIASED = [0.4172060521, 0.3398658576, 0.2584551266, 0.9288964408, -1.9444234772]
UNBIASED = [0.3731604359, 0.3039852632, 0.2311692921, 0.8308302313, -1.7391452224]


def test_trl_core():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=D)
    m = torch.tensor([0, 1, 1, 0])
    assert masked_mean(x, m).item() == pytest.approx(2.5)
    assert masked_var(x, m, unbiased=True).item() == pytest.approx(torch.var(torch.tensor([2.0, 3.0])).item())
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(0.25)
    w = masked_whiten(x, m, unbiased=True)
    ref = (x[1:3] - 2.5) * torch.rsqrt(torch.tensor(0.5, dtype=D) + 1e-8)
    assert torch.allclose(w[1:3], ref)
    assert w[0] == 0 and w[3] == 0


@pytest.mark.parametrize("unbiased,expected", [(False, BIASED), (True, UNBIASED)])
def test_whiten_golden(unbiased, expected):
    w = masked_whiten(A_BT, M_BT, unbiased=unbiased)
    valid = w[M_BT.bool()]
    assert torch.allclose(valid, torch.tensor(expected, dtype=D), rtol=1e-8, atol=1e-9)
    assert torch.all(w[~M_BT.bool()] == 0)
    assert torch.isfinite(w).all()


def test_whiten_default_is_biased():
    assert torch.equal(masked_whiten(A_BT, M_BT), masked_whiten(A_BT, M_BT, unbiased=False))


def test_whiten_no_shift_keeps_mean():
    w = masked_whiten(A_BT, M_BT, shift_mean=False)
    mean = masked_mean(A_BT, M_BT)
    assert masked_mean(w, M_BT).item() == pytest.approx(mean.item())


def test_garbage_in_padding_is_ignored():
    clean = torch.where(M_BT.bool(), A_BT, 0.0)
    assert masked_sum(A_BT, M_BT).item() == pytest.approx(clean.sum().item())
    assert masked_mean(A_BT, M_BT, dim=1).tolist() == pytest.approx([(0.46575 + 0.385 + 0.3) / 3, -0.5])
    assert torch.equal(masked_whiten(A_BT, M_BT), masked_whiten(clean, M_BT))


def test_empty_mask_conventions():
    x = torch.ones(2, 3, dtype=D)
    m = torch.zeros(2, 3)
    assert masked_mean(x, m).item() == 0.0
    assert masked_mean(x, torch.tensor([[1, 0, 0], [0, 0, 0]]), dim=1).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError):
        masked_var(x, m)
    with pytest.raises(ValueError):
        masked_var(x, torch.tensor([[1, 0, 0], [0, 0, 0]]), unbiased=True)
    assert masked_var(x, torch.tensor([[1, 0, 0], [0, 0, 0]]), unbiased=False).item() == 0.0


def test_mask_broadcast_and_float_mask():
    x = torch.arange(6, dtype=D).view(2, 3)
    assert masked_mean(x, torch.tensor([1.0, 0.0, 1.0])).item() == pytest.approx((0 + 2 + 3 + 5) / 4)
