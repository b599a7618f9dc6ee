"""The LM head's log-probs with the log-softmax in C (`head_logprobs`) against the plain autograd
path: the same log-probs, entropies and gradients in fp32 and under bf16 autocast, with the C
kernel and with its torch fallback; NaN logits give NaN; what takes the path."""
import pytest
import torch

import turborlhf.models.head_logprobs as HL
from turborlhf.algo.logprobs import entropy_from_logits
from turborlhf.models.head_logprobs import fusable_head, head_logprobs

needs_kernel = pytest.mark.skipif(HL.load_kernels(warn=False) is None, reason="no C compiler / kernels off")


def _plain(h, head, labels, T):
    logits = head(h).float() / T
    logp = logits.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
    return logp, entropy_from_logits(logits.detach())


def _case(N=37, H=24, V=301, seed=0, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * spread / H ** 0.5)
    h = torch.randn(N, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    w = torch.randn(N, generator=g)
    return h, head, labels, w


def _run(fn, h, head, labels, w, bf16=False):
    hh = h.clone().requires_grad_()
    head.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        lp, ent = fn(hh, head, labels)
    (lp * w).sum().backward()
    return lp.detach(), ent, hh.grad, head.weight.grad.clone()


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    if request.param == "kernel":
        if HL.load_kernels(warn=False) is None:
            pytest.skip("no C compiler / kernels off")
    else:
        monkeypatch.setattr(HL, "_kernel", lambda z, which: None)
    return request.param


@pytest.mark.parametrize("T", [1.0, 0.7])
@pytest.mark.parametrize("rows", [1024, 8])
def test_equals_the_plain_path_in_fp32(path, T, rows):
    h, head, labels, w = _case(spread=30.0)       # some log-probs far below -80: the clamped exp's range
    ours = _run(lambda *a: head_logprobs(*a, temperature=T, with_entropy=True, rows=rows), h, head, labels, w)
    ref = _run(lambda *a: _plain(*a, T), h, head, labels, w)
    assert ref[0].min() < -80
    for a, b, what in zip(ours, ref, ("logp", "entropy", "dh", "dW")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=what)


def test_bf16_autocast_matches_the_plain_path(path):
    h, head, labels, w = _case(N=64, H=64, V=512, seed=1)
    ours = _run(lambda *a: head_logprobs(*a, temperature=0.7, with_entropy=True), h, head, labels, w, bf16=True)
    ref = _run(lambda *a: _plain(*a, 0.7), h, head, labels, w, bf16=True)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-5)       # the same bf16 logits
    torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=1e-4)
    assert ours[2].dtype == ours[3].dtype == torch.float32
    for a, b in zip(ours[2:], ref[2:]):                                   # gradients: one bf16 rounding apart
        assert (a - b).norm() / b.norm() < 0.01


def test_without_grad_equals_with_grad_and_keeps_nothing(path):
    h, head, labels, _ = _case()
    with torch.no_grad():
        lp, ent = head_logprobs(h, head, labels, 0.7, True, rows=5)
    lp2, ent2 = head_logprobs(h.clone().requires_grad_(), head, labels, 0.7, True)
    # chunked matmuls may round differently from one over all rows (the BLAS's blocking)
    torch.testing.assert_close(lp, lp2.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent, ent2, rtol=1e-6, atol=1e-5)
    assert not lp.requires_grad


def test_frozen_head_gets_no_gradient_and_only_plain_linears_are_fused(path):
    h, head, labels, w = _case()
    head.requires_grad_(False)
    hh = h.clone().requires_grad_()
    (head_logprobs(hh, head, labels)[0] * w).sum().backward()
    assert head.weight.grad is None and hh.grad is not None
    assert fusable_head(head)
    assert not fusable_head(torch.nn.Linear(4, 5, bias=True))
    hooked = torch.nn.Linear(4, 5, bias=False)
    hooked.register_forward_hook(lambda m, i, o: o)
    assert not fusable_head(hooked)


@needs_kernel
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_logit_makes_its_row_nan(bad):
    h, head, labels, w = _case()
    h[3, 0] = bad
    with torch.no_grad():
        lp, ent = head_logprobs(h, head, labels, 1.0, True)
    assert lp[3].isnan() and ent[3].isnan()
    assert torch.isfinite(torch.cat([lp[:3], lp[4:]])).all()


def test_labels_outside_the_vocabulary_are_refused():
    h, head, labels, _ = _case()
    labels[2] = head.weight.shape[0]
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 301\), got"):
        head_logprobs(h, head, labels)


def _saved_shapes(fn):
    """Shapes of every tensor autograd saves for the backward while `fn` runs."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


@pytest.mark.parametrize("frozen_head", [False, True])
def test_recomputed_logits_give_the_kept_ones_results_and_are_not_saved(path, frozen_head):
    h, head, labels, w = _case(N=37, V=301, spread=30.0)
    head.requires_grad_(not frozen_head)
    results = {}
    for keep in (True, False):
        hh = h.clone().requires_grad_()
        head.zero_grad()
        (lp, ent), shapes = _saved_shapes(lambda: head_logprobs(hh, head, labels, 0.7, True, rows=8, keep_logits=keep))
        (lp * w).sum().backward()
        assert ((37, 301) in shapes) == keep, shapes                     # the N×V logits, kept or not
        results[keep] = (lp.detach(), ent, hh.grad, None if frozen_head else head.weight.grad.clone())
    for a, b, what in zip(results[True], results[False], ("logp", "entropy", "dh", "dW")):
        if a is not None:
            # the recomputing path's matmuls go 8 rows at a time, the kept path's over all rows: the
            # BLAS may round them differently (bit-identical on the AMX Xeon, ~1e-6 of the norm when
            # limited to AVX2, for gradients of up to ~100)
            assert (a - b).norm() <= 1e-5 * b.norm(), what


def test_logits_above_the_limit_are_recomputed_on_both_paths(monkeypatch):
    """`keep_logits=None` keeps them up to MAX_KEPT_LOGITS_BYTES; the plain path (a wrapped head)
    checkpoints its chunks above it. Same log-probs and gradients either way."""
    from turborlhf.models.forward import response_logprobs
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    ids = torch.randint(0, 300, (3, 12))
    mask, target = torch.ones_like(ids), torch.zeros_like(ids)
    target[:, 5:] = 1
    n_scored = 3 * 7

    def run():
        model.zero_grad()
        (lp, _), shapes = _saved_shapes(lambda: response_logprobs(model, ids, mask, target, with_entropy=True,
                                                                  chunk_tokens=8))
        lp.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        return lp.detach(), grads, any(s[-1:] == (300,) and len(s) == 2 and s[0] >= 8 for s in shapes)

    for plain in (False, True):
        if plain:                                       # a hook makes the head unfusable: the plain path
            model.lm_head.register_forward_hook(lambda m, i, o: o)
        monkeypatch.setattr(HL, "MAX_KEPT_LOGITS_BYTES", 1 << 30)
        lp_kept, g_kept, saved_logits = run()
        assert saved_logits
        monkeypatch.setattr(HL, "MAX_KEPT_LOGITS_BYTES", n_scored * 300 * 4 - 1)
        lp_re, g_re, saved_logits = run()
        assert not saved_logits
        torch.testing.assert_close(lp_re, lp_kept, rtol=1e-4, atol=1e-5)    # chunked matmuls may round apart
        for a, b in zip(g_re, g_kept):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_kept_logits_on_the_torch_path_go_rows_at_a_time(monkeypatch):
    """Without the C kernel (a GPU) the kept logits' log-softmax goes `rows` rows at a time, so no
    fp32 copy of all N×V logits is made; with it, one call over all rows."""
    real, seen = HL._forward, []

    def spy(z, *a):
        seen.append(z.shape[0])
        return real(z, *a)

    monkeypatch.setattr(HL, "_forward", spy)
    monkeypatch.setattr(HL, "_kernel", lambda z, which: None)
    h, head, labels, w = _case(N=37)
    ours = _run(lambda *a: head_logprobs(*a, with_entropy=True, rows=8), h, head, labels, w)
    ref = _run(lambda *a: _plain(*a, 1.0), h, head, labels, w)
    assert seen == [8, 8, 8, 8, 5]
    for a, b, what in zip(ours, ref, ("logp", "entropy", "dh", "dW")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=what)


def _bf16_head_grad_error(fn):
    """Relative error of the head weight's gradient under bf16 autocast against fp64 autograd."""
    h, head, labels, _ = _case(N=4096, H=64, V=1024, seed=3, spread=1.0)
    w = -torch.ones(4096) / 4096                    # an SFT-like upstream gradient: every chunk adds alike
    W64 = head.weight.detach().double().requires_grad_()
    (torch.log_softmax(h.double() @ W64.t(), -1).gather(-1, labels[:, None]).squeeze(-1) * w.double()).sum().backward()
    dW = _run(fn, h, head, labels, w, bf16=True)[3]
    return float((dW.double() - W64.grad).norm() / W64.grad.norm())


def test_the_head_weight_gradient_of_many_bf16_chunks_is_summed_in_fp32(path):
    """64 chunks of rows: each chunk's weight gradient adds into an fp32 sum, so the error stays that
    of one bf16 matmul (summed in bf16 it grew with the chunks: 4.7× at 64 chunks)."""
    one = _bf16_head_grad_error(lambda *a: head_logprobs(*a, rows=4096))
    many = _bf16_head_grad_error(lambda *a: head_logprobs(*a, rows=64))
    assert one < 5e-3 and many < 1.3 * one


def test_the_plain_head_path_casts_the_weight_per_chunk_under_bf16():
    """The plain path (an entropy bonus, a wrapped head) in 64 chunks: autocast's one cached cast of
    the head weight summed the chunks' gradients in bf16 (3.6× the error of one chunk); each chunk
    casts for itself now, and the chunks' gradients meet in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from turborlhf.models.forward import response_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    ids = torch.randint(0, 2048, (4, 1025))
    mask = torch.ones_like(ids)

    def head_grad(bf16, chunk):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            lp, _ = response_logprobs(model, ids, mask, mask, with_entropy=True, entropy_grad=True, chunk_tokens=chunk)
        (-lp.sum() / lp.numel()).backward()
        return model.lm_head.weight.grad.clone()

    ref = head_grad(False, 4096)
    one, many = ((head_grad(True, c) - ref).norm() / ref.norm() for c in (4096, 64))
    assert one < 5e-3 and many < 1.3 * one
