"""Chunked log-probs / entropy vs fp64 references, including gradients."""

import pytest
import torch

from turborlhf.algo import entropy_from_logits, logprobs_from_logits

D = torch.float64


def _data(B=3, T=7, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, dtype=D, generator=g) * 3
    labels = torch.randint(0, V, (B, T), generator=g)
    return logits, labels


def _ref_logp(logits, labels):
    return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk", [None, 1, 2, 5, 7, 8, 15, 100])
def test_logprobs_match_fp64_reference(chunk):
    logits, labels = _data()
    out = logprobs_from_logits(logits, labels, chunk_size=chunk)
    assert out.dtype == D
    assert torch.allclose(out, _ref_logp(logits, labels), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk", [None, 3, 7, 16])
def test_logprob_grads_match_autograd(chunk):
    logits, labels = _data(seed=1)
    w = torch.randn(labels.shape, dtype=D)
    a = logits.clone().requires_grad_(True)
    (logprobs_from_logits(a, labels, chunk_size=chunk) * w).sum().backward()
    b = logits.clone().requires_grad_(True)
    (_ref_logp(b, labels) * w).sum().backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_logprobs_bf16_and_fp32_inputs():
    logits, labels = _data(B=2, T=9, V=64, seed=2)
    ref = _ref_logp(logits.to(torch.bfloat16).to(D), labels)  # same quantised inputs in fp64
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = logits.to(dtype)
        out = logprobs_from_logits(x, labels, chunk_size=4)
        assert out.dtype == torch.float32
        ref_d = _ref_logp(x.to(D), labels)
        assert torch.allclose(out.double(), ref_d, atol=1e-5)
    x = logits.to(torch.bfloat16).requires_grad_(True)
    logprobs_from_logits(x, labels, chunk_size=5).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()
    assert ref.shape == labels.shape


def test_logprobs_noncontiguous_slice_ignore_index_and_2d():
    logits, labels = _data(T=8)
    sliced = logits[:, :-1]  # the usual next-token alignment; a non-contiguous view
    lab = labels[:, 1:].clone()
    lab[0, 3] = -100
    out = logprobs_from_logits(sliced, lab, chunk_size=3)
    ref = _ref_logp(sliced, lab.clamp(min=0))
    ref[0, 3] = 0.0
    assert torch.allclose(out, ref)
    flat = logprobs_from_logits(logits.reshape(-1, 50), labels.reshape(-1), chunk_size=4)
    assert torch.allclose(flat, _ref_logp(logits, labels).reshape(-1))
    a = sliced.detach().clone().requires_grad_(True)
    logprobs_from_logits(a, lab).sum().backward()
    assert torch.all(a.grad[0, 3] == 0)


def test_logprobs_errors():
    logits, labels = _data()
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, labels[:, :-1])
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, labels, chunk_size=0)


@pytest.mark.parametrize("chunk", [None, 1, 4, 16])
def test_entropy_matches_reference_and_grads(chunk):
    logits, _ = _data(seed=3)
    a = logits.clone().requires_grad_(True)
    ent = entropy_from_logits(a, chunk_size=chunk)
    b = logits.clone().requires_grad_(True)
    p = torch.softmax(b, -1)
    ref = -(p * torch.log_softmax(b, -1)).sum(-1)
    assert torch.allclose(ent, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(ent.shape, dtype=D)
    (ent * w).sum().backward()
    (ref * w).sum().backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12)


def test_entropy_fp32_precision():
    """fp32 entropy of large-vocabulary, large-scale logits stays within 1e-5 of fp64: the form
    lse - Σ p·z lost ~1e-4 here to cancellation (docs/algorithms/README.md)."""
    g = torch.Generator().manual_seed(0)
    z = 5 + 10 * torch.randn(64, 50_000, generator=g)
    err = (entropy_from_logits(z).double() - entropy_from_logits(z.double())).abs().max()
    assert err < 1e-5


def test_entropy_shapes_and_bf16():
    assert entropy_from_logits(torch.zeros(8, dtype=D)).item() == pytest.approx(torch.log(torch.tensor(8.0)).item())
    x = torch.randn(2, 3, 4, 16).to(torch.bfloat16)
    out = entropy_from_logits(x, chunk_size=5)
    assert out.shape == (2, 3, 4) and out.dtype == torch.float32
    ref = -(torch.softmax(x.double(), -1) * torch.log_softmax(x.double(), -1)).sum(-1)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_no_fp32_vocab_tensor_is_saved_for_backward():
    """Autograd keeps only the bf16 logits (and per-row floats), never an fp32 B×T×V copy."""
    logits = torch.randn(2, 6, 40).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 40, (2, 6))
    saved = []

    def pack(x):
        saved.append((x.dtype, tuple(x.shape)))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logprobs_from_logits(logits, labels, chunk_size=4).sum()
        entropy_from_logits(logits, chunk_size=4).sum()
    big = [s for s in saved if len(s[1]) == 3 and s[1][-1] == 40]
    assert big and all(dtype == torch.bfloat16 for dtype, _ in big), saved
