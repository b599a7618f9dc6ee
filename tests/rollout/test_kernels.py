"""The fused C decode kernels (turborlhf.rollout.kernels): the same maths as the torch path, in
the engine and on their own, and a clean fallback when they cannot be built."""
import math
import warnings

import pytest
import torch

from rollout_helpers import tiny_llama
from turborlhf.rollout import SamplingParams
from turborlhf.rollout import kernels as K
from turborlhf.rollout.fast import FastEngine, _rms

KERN = K.load(warn=False)
needs_kernels = pytest.mark.skipif(KERN is None, reason="no C compiler / kernels did not build here")


def _reference_attention(qkv, cos, sins, Kc, Vc, start, H, col, scale):
    """Plain torch fp32: RoPE, cache write, softmax attention over [start_b, col]."""
    B, KV, T, D = Kc.shape
    G = H // KV
    f = lambda t: t.float()
    x = f(qkv)
    rope = lambda v: v * f(cos)[:, None] + v.roll(D // 2, dims=-1) * f(sins)[:, None]
    q = rope(x[:, : H * D].view(B, H, D))
    k = rope(x[:, H * D:(H + KV) * D].view(B, KV, D))
    v = x[:, (H + KV) * D:].view(B, KV, D)
    Kf, Vf = f(Kc).clone(), f(Vc).clone()
    Kf[:, :, col], Vf[:, :, col] = k, v
    out = torch.zeros(B, H, D)
    for b in range(B):
        for h in range(H):
            kv = h // G
            s = Kf[b, kv, start[b]: col + 1] @ q[b, h] * scale
            out[b, h] = torch.softmax(s, -1) @ Vf[b, kv, start[b]: col + 1]
    return out.view(B, H * D), Kf[:, :, col], Vf[:, :, col]


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_attention_kernel_matches_reference(dtype, tol):
    g = torch.Generator().manual_seed(0)
    B, H, KV, D, T, col = 5, 6, 2, 16, 24, 17
    qkv = torch.randn(B, (H + 2 * KV) * D, generator=g).to(dtype)
    ang = torch.rand(B, D // 2, generator=g) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sins = torch.cat([-ang.sin(), ang.sin()], -1).to(dtype)
    Kc = torch.randn(B, KV, T, D, generator=g).to(dtype)
    Vc = torch.randn(B, KV, T, D, generator=g).to(dtype)
    start = torch.tensor([0, 3, 17, 9, 1])                        # row 2 attends to itself only
    ref, k_ref, v_ref = _reference_attention(qkv, cos, sins, Kc, Vc, start, H, col, 1 / math.sqrt(D))
    before = Kc.clone()
    out = KERN.attention(qkv, cos, sins, Kc, Vc, start, torch.empty(B, H * D, dtype=dtype), H, col,
                         1 / math.sqrt(D))
    assert (out.float() - ref).abs().max() < tol
    assert (Kc[:, :, col].float() - k_ref).abs().max() < tol and torch.equal(Vc[:, :, col].float(), v_ref)
    other = [c for c in range(T) if c != col]
    assert torch.equal(Kc[:, :, other], before[:, :, other])       # only column `col` is written
    with pytest.raises(ValueError, match="contiguous"):
        KERN.attention(qkv, cos, sins, Kc.transpose(2, 3), Vc, start, out, H, col, 0.25)
    with pytest.raises(ValueError, match="column"):
        KERN.attention(qkv, cos, sins, Kc, Vc, start, out, H, T, 0.25)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_kernel_matches_torch(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 48, generator=g) * 3).to(dtype)
    w = torch.randn(48, generator=g).to(dtype)
    out = KERN.rms_norm(x, w, torch.empty_like(x), 1e-5)
    ref = _rms(x, w, 1e-5)
    # fp32: summation order only; bf16: at most one rounding step apart
    assert (out.float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 0.02 * ref.abs().max())


@needs_kernels
def test_engine_with_kernels_matches_torch_path_fp32():
    """Left-padded prompts of different lengths (per-row start columns), stop tokens and the
    compaction of finished rows: same greedy tokens and log-probs with and without kernels."""
    model = tiny_llama(3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 2, 11, 4, 9, 1)]
    a = FastEngine(model, dtype="fp32", kernels=True)
    b = FastEngine(model, dtype="fp32", kernels=False)
    assert a._k is not None and b._k is None
    ref = b.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    stop = ref.response_ids[0][3]
    for sp in (SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(stop,), return_logprobs=True),
               SamplingParams(max_new_tokens=10, temperature=1.0, seed=4, n=2, return_logprobs=True)):
        oa, ob = a.generate(prompts, sp), b.generate(prompts, sp)
        assert oa.response_ids == ob.response_ids and oa.finished == ob.finished
        d = max(abs(x - y) for ra, rb in zip(oa.logprobs, ob.logprobs) for x, y in zip(ra, rb))
        assert d < 1e-4
    assert any(ref.response_ids[i].count(stop) for i in range(1, len(prompts)))  # some rows stop early


@needs_kernels
def test_engine_with_kernels_bf16_consistent_with_scoring(model, prompts):
    eng = FastEngine(model, dtype="bf16", kernels=True)
    out = eng.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=1, return_logprobs=True))
    sc = eng.score_logprobs(prompts, out.response_ids)
    assert max(abs(x - y) for ra, rb in zip(out.logprobs, sc) for x, y in zip(ra, rb)) < 0.1


def test_disabled_or_unbuildable_falls_back(model, prompts, monkeypatch, tmp_path):
    from turborlhf.engine import cbuild

    monkeypatch.setattr(cbuild, "_loaded", {})
    monkeypatch.setenv("TURBORLHF_KERNELS", "0")
    assert K.load() is None
    assert FastEngine(model, dtype="fp32")._k is None                    # 'auto': torch ops
    with pytest.raises(ValueError, match="kernels=True"):
        FastEngine(model, dtype="fp32", kernels=True)
    with pytest.raises(ValueError, match="kernels must be"):
        FastEngine(model, dtype="fp32", kernels="yes")
    # a failing compiler: one warning, None, and the engine still generates
    monkeypatch.delenv("TURBORLHF_KERNELS")
    monkeypatch.setenv("TURBORLHF_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert K.load() is None
    assert any("kernels unavailable" in str(x.message) for x in w)
    eng = FastEngine(model, dtype="fp32")
    assert eng._k is None and len(eng.generate(prompts, SamplingParams(max_new_tokens=3)).response_ids) == 5
    assert not list(tmp_path.rglob("*.so"))                               # nothing half-written left
