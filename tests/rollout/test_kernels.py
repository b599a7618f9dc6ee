"""The fused C decode kernels (turborlhf.rollout.kernels): the same maths as the torch path, in
the engine and on their own, and a clean fallback when they cannot be built."""
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rollout_helpers import tiny_llama, tiny_qwen2
from turborlhf.rollout import SamplingParams
from turborlhf.rollout import kernels as K
from turborlhf.rollout.fast import FastEngine
from turborlhf.rollout.llama_ops import _rms

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


# ---------------------------------------------------------------- decode linears (bf16, fp32)
# each dtype's linears run where this process's instruction sets allow them (cpu_features(), the
# flags the kernels were compiled with): bf16 needs AVX-512-BF16, fp32 AVX2 + FMA
needs_linear = pytest.mark.skipif(KERN is None or not KERN.has_linear,
                                  reason="kernels without AVX-512-BF16 linears here (cpu_features lacks avx512_bf16)")
needs_f32_linear = pytest.mark.skipif(KERN is None or torch.float32 not in KERN.linear_dtypes,
                                      reason="kernels without fp32 linears here (cpu_features lacks avx2/fma)")
LINEAR_DTYPES = pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_linear),
                                                  pytest.param(torch.float32, marks=needs_f32_linear)])


def _packed(W, swiglu=False):
    p = KERN.new_packed(*W.shape, swiglu, W.dtype)
    KERN.pack_rows(W, p, 0, W.shape[0], swiglu)
    return p


@LINEAR_DTYPES
@pytest.mark.parametrize("M,K,N", [(1, 64, 96), (8, 576, 960), (13, 64, 40), (33, 130, 70), (200, 64, 48)])
def test_linear_ops_match_fp32_reference(M, K, N, dtype):
    """x·Wᵀ+b, + residual, and silu(gate)·up against fp32 maths on the same inputs (odd row
    counts cover the 8-row (bf16) / 6-row (fp32) tiles, N not a multiple of the block the tail)."""
    g = torch.Generator().manual_seed(M * 1000 + N)
    x = torch.randn(M, K, generator=g).to(dtype)
    W = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    other = torch.randn(M, N, generator=g).to(dtype)
    ref = x.float() @ W.float().T + b.float()
    p = _packed(W)
    y = KERN.linear(x, p, N, b, out_f32=True)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4)
    y = KERN.linear(x, p, N, None, other, KERN.ADD)
    assert y.dtype == dtype
    tol = (0.05, 1e-2) if dtype == torch.bfloat16 else (1e-4, 1e-4)
    assert torch.allclose(y.float(), ref - b.float() + other.float(), atol=tol[0], rtol=tol[1])
    if N % 2 == 0:
        I = N // 2
        y = KERN.linear(x, _packed(W, True), N, b, op=KERN.SWIGLU, out_f32=True)
        want = torch.nn.functional.silu(ref[:, :I]) * ref[:, I:]
        assert y.shape == (M, I) and torch.allclose(y, want, atol=1e-4, rtol=1e-4)


needs_amx = pytest.mark.skipif(KERN is None or not KERN.amx,
                               reason="bf16 linears without AMX tiles here (no amx_bf16, or Linux refused the tile state)")


@pytest.fixture
def amx_restored():
    """Leaves the kernels' AMX switch as the library sets it, whatever a test does to it."""
    yield KERN
    KERN.set_amx(True)


@needs_amx
@pytest.mark.parametrize("M", [1, 4, 15, 16, 17, 32, 33, 300])
@pytest.mark.parametrize("K,N,op", [(64, 96, 0), (576, 960, 1), (64, 80, 2), (96, 40, 0), (130, 70, 0), (1536, 48, 1)])
def test_amx_tiles_match_dot_products_and_fp32(amx_restored, M, K, N, op):
    """AMX tiles (row counts on both sides of each 16-row tile and of a 32-row pass, K not a
    multiple of 32 taking the dot products) against the AVX-512-BF16 dot products and fp32 maths
    on the same bf16 inputs: both sum bf16 products in fp32, so only the summation order differs."""
    g = torch.Generator().manual_seed(M * 7 + K + N)
    x = torch.randn(M, K, generator=g).bfloat16()
    W = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    other = torch.randn(M, N, generator=g).bfloat16() if op == KERN.ADD else None
    p = _packed(W, op == KERN.SWIGLU)
    ref = x.float() @ W.float().T + b.float() + (other.float() if other is not None else 0)
    if op == KERN.SWIGLU:
        ref = torch.nn.functional.silu(ref[:, :N // 2]) * ref[:, N // 2:]
    out = {}
    for amx in (False, True):
        assert amx_restored.set_amx(amx) is amx
        out[amx] = KERN.linear(x, p, N, b, other, op, out_f32=True)
    assert torch.allclose(out[True], ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(out[True], out[False], atol=1e-4, rtol=1e-4)


@needs_linear
def test_amx_switch(amx_restored):
    """set_amx(False) turns the tiles off on every host and stays off when another engine loads the
    kernels (the switch is the library's); on a CPU this process may not use AMX on, True stays
    False."""
    from turborlhf.engine.hardware import cpu_features

    assert KERN.set_amx(False) is False and KERN.amx is False
    other = K.load(warn=False)
    assert other.lib is KERN.lib and other.amx is False and KERN.amx is False
    if "amx_bf16" not in cpu_features():
        assert KERN.set_amx(True) is False and KERN.amx is False


@needs_amx
def test_amx_tiles_after_onednn_released_them():
    """oneDNN (torch's bf16 matmuls on an AMX CPU) configures and releases the same threads' tiles:
    the kernels must configure theirs on every call. In a child process, since a tile instruction
    without a configuration is SIGILL."""
    code = (
        "import torch\n"
        "from turborlhf.rollout import kernels\n"
        "K = kernels.load(warn=False); assert K.amx\n"
        "W = torch.randn(512, 256).bfloat16(); p = K.new_packed(512, 256); K.pack_rows(W, p, 0, 512)\n"
        "a = torch.randn(64, 256).bfloat16()\n"
        "for i in range(3):\n"
        "    K.linear(a[:32].contiguous(), p, 512)\n"
        "    torch.nn.functional.linear(a, W)\n"
        "    y = K.linear(a, p, 512, out_f32=True)\n"
        "assert torch.allclose(y, a.float() @ W.float().T, atol=1e-3)\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


@LINEAR_DTYPES
def test_pack_rows_in_pieces_equals_whole(dtype):
    g = torch.Generator().manual_seed(3)
    W = torch.randn(96, 64, generator=g).to(dtype)
    for swiglu in (False, True):
        whole = _packed(W, swiglu)
        parts = KERN.new_packed(96, 64, swiglu, dtype)
        for r0, r1 in ((0, 40), (40, 48), (48, 96)):                  # q/k/v-like and gate/up-like cuts
            KERN.pack_rows(W[r0:r1], parts, r0, 96, swiglu)
        assert torch.equal(whole, parts)
    with pytest.raises(ValueError, match="no linears for torch.float16 x"):   # x in another dtype than W
        KERN.linear(torch.zeros(2, 64, dtype=torch.float16), whole, 96)


@needs_f32_linear
@pytest.mark.parametrize("M,K,N", [(1, 64, 96), (8, 576, 960), (13, 64, 40), (33, 130, 70), (11, 65, 48), (3, 1, 17)])
def test_bf16_weight_linears_match_rounded_fp32_reference(M, K, N):
    """fp32 activations with bf16-stored weights (`weight_dtype=torch.bfloat16`): exactly the fp32
    maths of the bf16-rounded weights (widening is exact), for all three ops and the tails (N not
    a multiple of 16; an odd K, whose last step the tiles read in another order than the pairs)."""
    g = torch.Generator().manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=g)
    W = torch.randn(N, K, generator=g) / K ** 0.5
    b, other = torch.randn(N, generator=g), torch.randn(M, N, generator=g)
    Wr = W.bfloat16().float()                                        # round to nearest even
    ref = x @ Wr.T + b
    assert not torch.allclose(x @ W.T + b, ref, atol=1e-4, rtol=1e-4)   # the rounding is visible
    p = KERN.new_packed(N, K, False, torch.float32, torch.bfloat16)
    assert p.dtype == torch.bfloat16 and p.numel() == KERN.packed_numel(N, K, False, torch.float32)
    for r0, r1 in ((0, N // 3), (N // 3, N)):                       # packed in pieces, from fp32 rows
        KERN.pack_rows(W[r0:r1], p, r0, N, dtype=torch.float32)
    assert torch.allclose(KERN.linear(x, p, N, b), ref, atol=1e-4, rtol=1e-4)
    y = KERN.linear(x, p, N, None, other, KERN.ADD)
    assert y.dtype == torch.float32 and torch.allclose(y, ref - b + other, atol=1e-4, rtol=1e-4)
    if N % 2 == 0:
        I = N // 2
        ps = KERN.new_packed(N, K, True, torch.float32, torch.bfloat16)
        KERN.pack_rows(W, ps, 0, N, True, dtype=torch.float32)
        want = torch.nn.functional.silu(ref[:, :I]) * ref[:, I:]
        assert torch.allclose(KERN.linear(x, ps, N, b, op=KERN.SWIGLU), want, atol=1e-4, rtol=1e-4)


@needs_f32_linear
def test_bf16_weight_linear_errors():
    with pytest.raises(ValueError, match="with torch.float32 weights"):   # only fp32 compute widens
        KERN.new_packed(96, 64, False, torch.bfloat16, torch.float32)
    p = KERN.new_packed(96, 64, False, torch.float32, torch.bfloat16)
    # packed for fp32 x: the same size as a bf16-x layout here (96 × 64), so only the tag tells them apart
    with pytest.raises(ValueError, match="packed for torch.float32 x|no linears for torch.bfloat16 x"):
        KERN.linear(torch.zeros(2, 64, dtype=torch.bfloat16), p, 96)
    with pytest.raises(ValueError, match="no linears for torch.float16 x"):
        KERN.linear(torch.zeros(2, 64, dtype=torch.float16), p, 96)


@needs_linear
def test_pack_rows_errors():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(96, 64, generator=g).bfloat16()
    whole = _packed(W)
    with pytest.raises(ValueError, match="do not fit"):
        KERN.pack_rows(W, KERN.new_packed(96, 64), 10, 96)
    with pytest.raises(ValueError, match="does not match"):
        KERN.pack_rows(W, KERN.new_packed(64, 64), 0, 96)
    with pytest.raises(ValueError, match="even width"):
        KERN.linear(torch.zeros(2, 63, dtype=torch.bfloat16), KERN.new_packed(96, 63), 96)
    with pytest.raises(ValueError, match="op ADD"):
        KERN.linear(torch.zeros(2, 64, dtype=torch.bfloat16), whole, 96, op=KERN.ADD)


@needs_linear
def test_kernel_backend_with_biases_and_untied_head(prompts):
    """Qwen2-style q/k/v biases and an untied LM head through the kernel linears: the same
    log-probs as the dense bf16 backend, to bf16 rounding."""
    q = tiny_qwen2(tie=False)
    kern = FastEngine(q, dtype="bf16", linear_backend="kernel")
    dense = FastEngine(q, dtype="bf16", linear_backend="dense")
    out = kern.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, return_logprobs=True))
    a = kern.score_logprobs(prompts, out.response_ids)
    b = dense.score_logprobs(prompts, out.response_ids)
    assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) < 0.1
    assert max(abs(x - y) for ra, rb in zip(out.logprobs, a) for x, y in zip(ra, rb)) < 0.1


@pytest.mark.parametrize("dtype,weight_dtype", [pytest.param(torch.bfloat16, None, marks=needs_linear),
                                                pytest.param(torch.float32, None, marks=needs_f32_linear),
                                                pytest.param(torch.float32, "bf16", marks=needs_f32_linear)])
def test_decode_layers_in_one_call_equals_per_layer_calls(model, prompts, dtype, weight_dtype):
    """decode_layers (all layers of a step in one C call) runs the same kernels in the same
    order as the per-layer calls: identical tokens and log-probs, bit for bit."""
    eng = FastEngine(model, dtype=dtype, linear_backend="kernel", weight_dtype=weight_dtype)
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=4, return_logprobs=True)
    calls = []
    real = eng._k.decode_layers
    eng._k.decode_layers = lambda *a, **k: calls.append(1) or real(*a, **k)
    one = eng.generate(prompts, sp)
    assert len(calls) == 9                                       # 10 tokens: 9 decode steps
    eng._one_call = False
    per_layer = eng.generate(prompts, sp)
    assert len(calls) == 9
    assert one.response_ids == per_layer.response_ids and one.logprobs == per_layer.logprobs


def _round_matrices(model):
    """A copy of `model` whose 2-D weights (embeddings, the decoder's matrices and the LM head) are
    rounded to bf16 and back: the policy a FastEngine with weight_dtype='bf16' runs, in plain fp32."""
    import copy
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(p.bfloat16().float())
    return m


@needs_f32_linear
@pytest.mark.parametrize("tie", [False, True])
def test_engine_with_bf16_weights_samples_the_rounded_policy(prompts, tie):
    """weight_dtype='bf16': the 2-D weights are rounded to bf16, everything else is fp32, so the
    engine equals an fp32 engine on a model with those weights rounded (same draws, log-probs to
    fp32 noise), scores what it samples, and differs from the unrounded fp32 engine."""
    model = tiny_llama(3, tie=tie)
    w16 = FastEngine(model, dtype="fp32", weight_dtype="bf16")
    assert w16.weight_dtype == torch.bfloat16 and w16._kp[0].dtype == torch.bfloat16
    rounded = FastEngine(_round_matrices(model), dtype="fp32", linear_backend="kernel")
    exact = FastEngine(model, dtype="fp32", linear_backend="kernel")
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=2, n=2, return_logprobs=True)
    a, b = w16.generate(prompts, sp), rounded.generate(prompts, sp)
    assert a.response_ids == b.response_ids
    diff = lambda u, v: max(abs(x - y) for ru, rv in zip(u, v) for x, y in zip(ru, rv))  # noqa: E731
    assert diff(a.logprobs, b.logprobs) < 1e-4
    rep = [p for p in prompts for _ in range(2)]
    assert diff(w16.score_logprobs(rep, a.response_ids), a.logprobs) < 1e-4
    assert diff(exact.score_logprobs(rep, a.response_ids), a.logprobs) > 1e-4
    # a weight push re-rounds in place
    w16.load_weights(tiny_llama(4, tie=tie).state_dict().items())
    c = w16.generate(prompts, sp)
    d = FastEngine(tiny_llama(4, tie=tie), dtype="fp32", weight_dtype="bf16").generate(prompts, sp)
    assert c.response_ids == d.response_ids and diff(c.logprobs, d.logprobs) < 1e-5


def test_bf16_weight_storage_errors(model):
    with pytest.raises(ValueError, match="only bf16 weights with fp32 compute"):
        FastEngine(model, dtype="bf16", weight_dtype="fp32")
    with pytest.raises(ValueError, match="needs the fp32 kernel linears"):
        FastEngine(model, dtype="fp32", linear_backend="dense", weight_dtype="bf16")
    assert FastEngine(model, dtype="fp32", linear_backend="dense", weight_dtype="fp32").weight_dtype == torch.float32


def test_bf16_weight_storage_falls_back_where_the_host_lacks_the_kernel_linears(tmp_path):
    """A host without the fp32 kernel linears (here: kernels switched off, as where no C compiler
    or AVX2 exists) given weight_dtype='bf16' by a config resolved elsewhere (a Ray driver on
    another kind of host) keeps fp32 weights with one warning instead of failing; options that
    rule the kernels out explicitly still raise (test above)."""
    code = f"""
import sys, warnings, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from rollout_helpers import tiny_llama
from turborlhf.rollout import SamplingParams
from turborlhf.rollout.fast import FastEngine
model = tiny_llama(4)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    e = FastEngine(model, dtype="fp32", weight_dtype="bf16")
msgs = [str(x.message) for x in w if "kernel linears" in str(x.message)]
assert e.weight_dtype == torch.float32 and e.linear_backend != "kernel", (e.weight_dtype, e.linear_backend)
assert len(msgs) == 1 and "TURBORLHF_KERNELS" in msgs[0] and "keeping the weights in fp32" in msgs[0], msgs
sp = SamplingParams(max_new_tokens=6, temperature=0.0, return_logprobs=True)
a = e.generate([[1, 2, 3]], sp)
b = FastEngine(model, dtype="fp32").generate([[1, 2, 3]], sp)
assert a.response_ids == b.response_ids
print("ok")
"""
    env = {**os.environ, "TURBORLHF_KERNELS": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@needs_kernels
def test_sampler_matches_inverse_cdf_sampling():
    """The three-pass C sampler (AVX-512, or the plain loops built without it: the emulated-AVX2
    test runs those) against sampling.inverse_cdf_sample on the same uniforms: the same ids
    except at float-rounding CDF boundaries, the log-prob of the drawn id, never a -inf token,
    and the right frequencies."""
    from turborlhf.rollout.sampling import inverse_cdf_sample
    g = torch.Generator().manual_seed(0)
    B, V = 64, 1000
    x = torch.randn(B, V, generator=g) * 3
    x[:, 500:] = float("-inf")                                    # half the vocabulary forbidden
    x[0, :] = float("-inf"); x[0, 7] = 0.0                        # a row with one possible token
    for T in (1.0, 0.7):
        ids_ref, lp_ref = inverse_cdf_sample(x / T, torch.Generator().manual_seed(1))
        u = torch.rand(B, 1, generator=torch.Generator().manual_seed(1)).view(-1)
        ids, lp = KERN.sample(x.contiguous(), T, u)
        assert ids.dtype == torch.int64 and (ids < 500).all() and ids[0] == 7
        assert (ids == ids_ref).float().mean() >= 0.95
        want = torch.log_softmax(x / T, -1).gather(-1, ids[:, None]).squeeze(-1)
        assert torch.allclose(lp, want, atol=1e-4)
    # frequencies: 3 tokens with probabilities 0.5, 0.3, 0.2
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(20000, 1).contiguous()
    ids, _ = KERN.sample(logits, 1.0, torch.rand(20000, generator=g))
    freq = torch.bincount(ids, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)
    with pytest.raises(ValueError, match="temperature"):
        KERN.sample(logits, 0.0, torch.rand(20000))
    # a tiny temperature (x/T near 3000): the drawn token's log-prob to 1e-5, never above 0 (scaling
    # x before subtracting the max left rounding errors of x/T's size: 5e-4 off, above 0 for the top)
    ids, lp = KERN.sample(x[1:].contiguous(), 1e-3, torch.rand(B - 1, generator=g))
    want = torch.log_softmax(x[1:].double() / 1e-3, -1).gather(-1, ids[:, None]).squeeze(-1)
    assert (lp <= 0).all() and torch.allclose(lp.double(), want, atol=1e-5)


@LINEAR_DTYPES
def test_engine_sampler_path_and_suppression(model, prompts, dtype):
    """FastEngine samples with the C sampler, top-p too (after `top_p_filter`); min_new_tokens
    still keeps the stop id out; top-k goes through the torch sampler."""
    eng = FastEngine(model, dtype=dtype, linear_backend="kernel")
    used = []
    real = eng._k.sample
    eng._k.sample = lambda *a: used.append(1) or real(*a)
    stop = eng.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0)).response_ids[0][0]
    out = eng.generate(prompts, SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=1.0, seed=0,
                                               stop_token_ids=(stop,)))
    assert used and all(stop not in r for r in out.response_ids) and all(len(r) == 6 for r in out.response_ids)
    n = len(used)
    eng.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, top_k=20, seed=0))
    assert len(used) == n
    nucleus = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.8, seed=3, return_logprobs=True)
    c = eng.generate(prompts, nucleus)
    assert len(used) > n
    eng._k.sample = lambda *a: pytest.fail("the torch path must not call the C sampler")
    eng._k.has_sampler = False                           # the torch sampler, same uniforms
    try:
        t = eng.generate(prompts, nucleus)
    finally:
        eng._k.has_sampler = True
        eng._k.sample = real
    assert c.response_ids == t.response_ids
    for a, b in zip(c.logprobs, t.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)


def test_rope_signed_equals_rotate_half_bit_for_bit():
    """The 4-op RoPE of the engine (roll and a pre-negated sin) is transformers' rotate_half form."""
    from turborlhf.rollout.llama_ops import _rope, _rope_signed
    g = torch.Generator().manual_seed(0)
    x, cos, sin = (torch.randn(3, 5, 64, generator=g).bfloat16() for _ in range(3))
    sins = torch.cat((-sin[..., :32], sin[..., 32:]), dim=-1)
    assert torch.equal(_rope(x, cos, sin), _rope_signed(x, cos, sins))
