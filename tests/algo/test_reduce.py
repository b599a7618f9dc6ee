"""reduce_loss: OpenRLHF aggregation tests (docs/reference/formulas.md §8) and micro-batch invariance."""

import pytest
import torch

from turborlhf.algo import reduce_loss, reduce_seq_loss

D = torch.float64


def _split_sum(loss, mask, splits, mode, **kw):
    total = 0.0
    start = 0
    for size in splits:
        total = total + reduce_loss(loss[start : start + size], mask[start : start + size], mode, **kw)
        start += size
    return total


def test_openrlhf_token_mean_dp():
    loss = torch.tensor([[1, 2, 0], [3, 4, 5], [7, 0, 0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    whole = reduce_loss(loss, mask)
    assert whole.item() == pytest.approx(22 / 6)
    assert _split_sum(loss, mask, [2, 1], "token_mean", num_tokens=6).item() == pytest.approx(22 / 6)


def test_openrlhf_seq_mean_token_mean_dp():
    loss = torch.tensor([[1, 3, 9], [2, 4, 0], [8, 0, 0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    whole = reduce_loss(loss, mask, "seq_mean_token_mean")
    assert whole.item() == pytest.approx((2 + 3 + 8) / 3)
    split = _split_sum(loss, mask, [2, 1], "seq_mean_token_mean", num_seqs=3)
    assert split.item() == pytest.approx(whole.item())


def test_fully_masked_sequence_excluded():
    loss = torch.tensor([[1, 3], [5, 7]], dtype=D)
    mask = torch.tensor([[1, 1], [0, 0]])
    assert reduce_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx(2.0)


def test_grad_accum_global_token_mean():
    # GAS=2 window with 2 and 5 tokens: global mean 4.0 differs from the mean of per-micro means.
    l1 = torch.tensor([[1, 2, 0, 0, 0]], dtype=D)
    m1 = torch.tensor([[1, 1, 0, 0, 0]])
    l2 = torch.tensor([[3, 4, 5, 6, 7]], dtype=D)
    m2 = torch.ones(1, 5)
    acc = reduce_loss(l1, m1, num_tokens=7) + reduce_loss(l2, m2, num_tokens=7)
    assert acc.item() == pytest.approx(4.0)
    assert ((reduce_loss(l1, m1) + reduce_loss(l2, m2)) / 2).item() != pytest.approx(4.0)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "token_sum_norm"])
def test_microbatch_invariance_values_and_grads(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 7, 9
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[3] = False  # one empty sequence
    base = torch.randn(B, T, dtype=D, generator=g)
    garbage = torch.where(mask, base, torch.full_like(base, float("nan")))

    kw = {
        "token_mean": dict(num_tokens=int(mask.sum())),
        "seq_mean_token_mean": dict(num_seqs=int((mask.sum(1) > 0).sum())),
        "token_sum_norm": dict(num_seqs=B, max_len=T),
    }[mode]
    p_whole = base.clone().requires_grad_(True)
    whole = reduce_loss(torch.where(mask, p_whole, garbage) * 2.0, mask, mode)
    whole.backward()

    p_split = base.clone().requires_grad_(True)
    split = _split_sum(torch.where(mask, p_split, garbage) * 2.0, mask, [3, 1, 3], mode, **kw)
    split.backward()
    assert torch.isfinite(whole)
    assert split.item() == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(p_split.grad, p_whole.grad)


def test_token_sum_norm_dr_grpo():
    loss = torch.tensor([[-1.2, 0.8, -2.2], [0.4, -1.2, 8.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert reduce_loss(loss, mask, "token_sum_norm").item() == pytest.approx(6.8 / 6)
    assert reduce_loss(loss, mask, "token_sum_norm", num_seqs=4, max_len=10).item() == pytest.approx(6.8 / 40)


def test_all_masked_gives_zero_with_grad():
    p = torch.randn(2, 3, dtype=D, requires_grad=True)
    out = reduce_loss(p, torch.zeros(2, 3))
    out.backward()
    assert out.item() == 0.0 and torch.all(p.grad == 0)


def test_errors():
    with pytest.raises(ValueError):
        reduce_loss(torch.zeros(2, 3), torch.ones(2, 3), "mean")
    with pytest.raises(ValueError):
        reduce_loss(torch.zeros(2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError):
        reduce_seq_loss(torch.zeros(2, 3))


def test_reduce_seq_loss():
    loss = torch.tensor([1.0, 2.0, 6.0], dtype=D)
    assert reduce_seq_loss(loss).item() == pytest.approx(3.0)
    assert (reduce_seq_loss(loss[:2], num_seqs=3) + reduce_seq_loss(loss[2:], num_seqs=3)).item() == pytest.approx(3.0)
    assert reduce_seq_loss(loss[:0]).item() == 0.0


def test_negative_counts_are_refused():
    """A negative num_tokens, num_seqs or max_len was clamped to 1 and gave a wrong loss silently (the sum
    instead of an error); numbers are checked, tensors are not read (no device sync)."""
    loss, mask = torch.ones(2, 3), torch.ones(2, 3)
    for mode, arg in (("token_mean", "num_tokens"), ("seq_mean_token_mean", "num_seqs"), ("token_sum_norm", "max_len")):
        with pytest.raises(ValueError, match=f"reduce_loss: {arg} must be >= 0, got -5"):
            reduce_loss(loss, mask, mode, **{arg: -5})
    with pytest.raises(ValueError, match="reduce_seq_loss: num_seqs must be >= 0, got -1"):
        reduce_seq_loss(torch.ones(2), num_seqs=-1)
    assert reduce_loss(loss, mask, num_tokens=torch.tensor(6)).item() == 1.0
    assert reduce_loss(loss * 0, mask * 0, num_tokens=0).item() == 0.0
