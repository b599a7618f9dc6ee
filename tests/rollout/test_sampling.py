"""Sampling helpers: distribution, filters, greedy, determinism."""
import pytest
import torch

from turborlhf.rollout.sampling import inverse_cdf_sample, sample, suppress_tokens, top_k_filter, top_p_filter


def _freqs(ids, V):
    return torch.bincount(ids, minlength=V).float() / ids.numel()


def test_inverse_cdf_matches_distribution():
    V, N = 16, 200_000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 2
    g = torch.Generator().manual_seed(1)
    ids, logp = inverse_cdf_sample(logits.expand(N, V), g)
    p = torch.softmax(logits, -1)
    f = _freqs(ids, V)
    chi2 = (N * (f - p) ** 2 / p).sum().item()
    assert chi2 < 45.0  # chi-square, 15 dof: p(chi2 > 45) ~ 1e-4
    assert torch.allclose(logp, torch.log_softmax(logits, -1)[ids], atol=1e-5)


def test_temperature_scaling_distribution():
    V, N, T = 8, 100_000, 0.5
    logits = torch.linspace(-1, 1, V)
    ids, logp = sample(logits.expand(N, V), temperature=T, generator=torch.Generator().manual_seed(2))
    p = torch.softmax(logits / T, -1)
    chi2 = (N * (_freqs(ids, V) - p) ** 2 / p).sum().item()
    assert chi2 < 35.0
    assert torch.allclose(logp, torch.log(p)[ids], atol=1e-5)


def test_top_k_never_samples_filtered():
    V, N, k = 50, 20_000, 5
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)).repeat(N // 4, 1)
    ids, logp = sample(logits, temperature=1.0, top_k=k, generator=torch.Generator().manual_seed(4))
    allowed = torch.topk(logits, k, -1).indices
    assert (allowed == ids[:, None]).any(-1).all()
    # log-probs are under the renormalised top-k distribution
    ref = torch.log_softmax(top_k_filter(logits, k), -1).gather(-1, ids[:, None]).squeeze(-1)
    assert torch.allclose(logp, ref, atol=1e-5)


def test_top_p_never_samples_filtered_and_keeps_top():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).expand(10_000, 4)
    ids, _ = sample(logits, top_p=0.8, generator=torch.Generator().manual_seed(5))
    assert set(ids.tolist()) <= {0, 1}
    ids, _ = sample(logits, top_p=0.81, generator=torch.Generator().manual_seed(5))
    assert set(ids.tolist()) == {0, 1, 2}
    ids, _ = sample(logits, top_p=0.1, generator=torch.Generator().manual_seed(5))
    assert set(ids.tolist()) == {0}
    f = top_p_filter(torch.log(probs)[None], 0.8)
    assert torch.isinf(f[0, 2:]).all() and torch.isfinite(f[0, :2]).all()


def test_top_p_filter_equals_a_full_sort_for_narrow_and_wide_nuclei():
    """Rows whose nucleus lies within `TOP_P_CANDIDATES` tokens (peaked) and rows where it does not
    (flat, thousands of tokens, sorted whole) in one batch keep exactly the tokens a full sort keeps."""
    from turborlhf.rollout.sampling import TOP_P_CANDIDATES

    g = torch.Generator().manual_seed(11)
    logits = torch.randn(8, 5000, generator=g)
    logits[:4, :12] += 9.0                                                # peaked rows
    logits[2, 100:] = float("-inf")                                       # and one with -inf logits

    def by_sort(x, p):
        s, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(s, dim=-1)
        keep = torch.zeros_like(x, dtype=torch.bool).scatter(-1, order, torch.cumsum(probs, -1) - probs < p)
        return x.masked_fill(~keep, float("-inf"))

    for p in (0.5, 0.9):
        got, want = top_p_filter(logits, p), by_sort(logits, p)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), p
        kept = torch.isfinite(got).sum(-1)
        assert (kept[:4] < TOP_P_CANDIDATES).all() and (kept[4:] > TOP_P_CANDIDATES).all()
        assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])


def test_greedy_is_argmax():
    logits = torch.randn(7, 100, generator=torch.Generator().manual_seed(6))
    ids, logp = sample(logits, temperature=0.0)
    assert torch.equal(ids, logits.argmax(-1))
    assert torch.allclose(logp, torch.log_softmax(logits, -1).max(-1).values, atol=1e-6)


def test_suppression():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 100.0
    ids, _ = sample(logits, temperature=0.0, suppress_ids=[4])
    assert (ids != 4).all()
    ids, _ = sample(logits, temperature=1.0, suppress_ids=torch.tensor([4, 5]),
                    generator=torch.Generator().manual_seed(0))
    assert not set(ids.tolist()) & {4, 5}
    assert suppress_tokens(logits, None) is logits
    assert logits[0, 4] == 100.0  # input unchanged


def test_same_seed_same_tokens():
    logits = torch.randn(32, 1000)
    a, _ = sample(logits, generator=torch.Generator().manual_seed(7))
    b, _ = sample(logits, generator=torch.Generator().manual_seed(7))
    c, _ = sample(logits, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_negative_temperature_rejected():
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 3), temperature=-1.0)
