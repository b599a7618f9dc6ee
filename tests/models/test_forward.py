"""Forward helpers: shared-prefix packing equals separate sequences; chunked log-probs equal HF."""
import torch

from turborlhf.data.tokenize import pad_batch
from turborlhf.models.forward import (last_token_scores, pack_shared_prefix, response_logprobs,
                                      shared_prefix_scores)
from turborlhf.models.load import load_causal_lm, load_scalar_model


def _pairs(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    toks = lambda k: torch.randint(3, 500, (k,), generator=g).tolist()
    A, B = [], []
    for _ in range(n):
        p = toks(r(1, 30))
        A.append(p + toks(r(1, 12)))
        B.append(p + toks(r(1, 12)))
    A.append([7, 8, 9])          # identical pair: continuation kept non-empty
    B.append([7, 8, 9])
    return A, B


def test_shared_prefix_scores_equal_separate_sequences(tiny_model):
    m = load_scalar_model(str(tiny_model)).eval()
    A, B = _pairs()
    with torch.no_grad():
        a, b = shared_prefix_scores(m, pack_shared_prefix(A, B, 0))
        ids, attn = pad_batch(A + B, 0)
        ref = last_token_scores(m, ids, attn)
    n = len(A)
    assert torch.allclose(a, ref[:n], atol=1e-5) and torch.allclose(b, ref[n:], atol=1e-5)


def test_shared_prefix_gradients_equal_separate(tiny_model):
    m = load_scalar_model(str(tiny_model))
    A, B = _pairs(seed=1)
    a, b = shared_prefix_scores(m, pack_shared_prefix(A, B, 0))
    (a - b).sum().backward()
    g1 = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    ids, attn = pad_batch(A + B, 0)
    s = last_token_scores(m, ids, attn)
    (s[:len(A)] - s[len(A):]).sum().backward()
    for k, p in m.named_parameters():
        assert torch.allclose(g1[k], p.grad, atol=1e-5), k


def test_response_logprobs_match_full_log_softmax(tiny_model):
    m = load_causal_lm(str(tiny_model)).eval()
    ids, attn = pad_batch([[1, 5, 9, 11, 13], [1, 4, 6]], 0)
    target = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float)
    with torch.no_grad():
        lp, ent = response_logprobs(m, ids, attn, target, with_entropy=True, chunk_tokens=2)
        full = torch.log_softmax(m(input_ids=ids, attention_mask=attn).logits.float(), -1)
    ref = torch.zeros_like(lp)
    ref[:, 1:] = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) * target[:, 1:]
    assert torch.allclose(lp, ref, atol=1e-5)
    ref_ent = -(full.exp() * full).sum(-1)
    assert torch.allclose(ent[:, 1:][target[:, 1:].bool()], ref_ent[:, :-1][target[:, 1:].bool()], atol=1e-4)
