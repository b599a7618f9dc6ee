"""Fused RMSNorm / SwiGLU: same values and gradients as transformers' Llama modules, fewer saved bytes.

The model-level tests run twice: with the C kernels (rmsnorm.c, swiglu.c) and with the torch ops
they replace; the kernel tests compare the two paths directly."""
import copy

import pytest
import torch

import turborlhf.models.fused as FU
from turborlhf.engine.train import autocast
from turborlhf.models.fused import (cast_linear, fused_layer_count, fused_rms_norm, silu_mul, silu_mul_linear,
                                   use_fused_layers)
from turborlhf.models.tiny import tiny_llama_config

_have_kernels = FU.load_rms_kernels(warn=False) is not None and FU.load_swiglu_kernels(warn=False) is not None
needs_kernels = pytest.mark.skipif(not _have_kernels, reason="no C compiler / kernels off")


def _torch_ops(monkeypatch):
    monkeypatch.setattr(FU, "_rms_kernels", lambda *a, **k: None)
    monkeypatch.setattr(FU, "_swiglu_kernels", lambda *a, **k: None)


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    if request.param == "kernel" and not _have_kernels:
        pytest.skip("no C compiler / kernels off")
    if request.param == "torch":
        _torch_ops(monkeypatch)
    return request.param


def _models(seed=0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_llama_config(300, hidden_size=64, layers=2, **kw)
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():                       # norms start at 1: give them values so their gradients mean something
        for n, p in plain.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    fused = copy.deepcopy(plain)
    assert use_fused_layers(fused) == 2 * (2 + 1 + 7)    # per layer: 2 norms, 1 MLP, 7 projections
    assert fused_layer_count(fused) == 20 and fused_layer_count(plain) == 0
    return plain, fused


def _loss_and_grads(model, ids, dtype):
    model.zero_grad()
    with autocast(dtype):
        logits = model(input_ids=ids).logits
    loss = logits.float().log_softmax(-1)[..., 3].mean()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fp32_values_and_gradients_equal_the_modules(path):
    plain, fused = _models()
    ids = torch.randint(3, 300, (3, 11))
    a, ga = _loss_and_grads(plain, ids, "fp32")
    b, gb = _loss_and_grads(fused, ids, "fp32")
    assert torch.allclose(a, b, atol=1e-5)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], atol=1e-6, rtol=1e-4), n


def test_bf16_autocast_forward_is_bit_identical_and_gradients_close(path):
    plain, fused = _models(seed=1)
    ids = torch.randint(3, 300, (4, 13))
    a, ga = _loss_and_grads(plain, ids, "bf16")
    b, gb = _loss_and_grads(fused, ids, "bf16")
    assert torch.equal(a, b)
    for n in ga:
        rel = float((ga[n] - gb[n]).norm() / ga[n].norm().clamp_min(1e-12))
        assert rel < 2e-2, (n, rel)          # bf16 rounding of the saved normalised input


def test_no_grad_runs_the_original_forward(path):
    plain, fused = _models(seed=2)
    ids = torch.randint(3, 300, (2, 7))
    with torch.no_grad(), autocast("bf16"):
        assert torch.equal(plain(input_ids=ids).logits, fused(input_ids=ids).logits)
    bf = copy.deepcopy(fused).to(torch.bfloat16)            # a frozen bf16 model: not fp32, original path
    bp = copy.deepcopy(plain).to(torch.bfloat16)
    assert torch.equal(bp(input_ids=ids).logits, bf(input_ids=ids).logits)


def test_rms_norm_gradcheck_in_fp64():
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: fused_rms_norm(x, w, 1e-6), (x, w))
    g = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(silu_mul, (g, u))
    w = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u, w: silu_mul_linear(g, u, w, torch.float64), (g, u, w))
    assert torch.autograd.gradcheck(lambda x, w: cast_linear(x, w, torch.float64), (u, w))


def _grads(fn, *tensors, dtype="bf16"):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    with autocast(dtype):
        y = fn(*leaves)
    y.backward(torch.linspace(-1, 1, y.numel()).view(y.shape).to(y.dtype))
    return y.detach(), [t.grad for t in leaves if t.requires_grad]


@pytest.mark.parametrize("frozen", [False, True])
def test_cast_linear_equals_autocast_linear_and_keeps_no_weight_cast(frozen):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 48, dtype=torch.bfloat16, requires_grad=True)     # a bf16 activation
    w = torch.randn(40, 48, requires_grad=not frozen)                         # an fp32 master weight
    y0, g0 = _grads(lambda x, w: torch.nn.functional.linear(x, w), x, w)
    y1, g1 = _grads(lambda x, w: cast_linear(x, w, torch.bfloat16), x, w)
    assert torch.equal(y0, y1) and g1[0].dtype == torch.bfloat16
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-3)          # the same matmuls (equal on tested hosts)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), autocast("bf16"):
        cast_linear(x, w, torch.bfloat16)
    assert all(t.dtype != torch.bfloat16 or t.shape != w.shape for t in saved)       # no cast of W kept
    assert [t.data_ptr() for t in saved if t.shape == x.shape] == ([] if frozen else [x.data_ptr()])


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_silu_mul_linear_equals_down_of_silu_mul(path, dtype):
    torch.manual_seed(1)
    act = torch.bfloat16 if dtype == "bf16" else torch.float32
    gate, up = (torch.randn(3, 5, 64, dtype=act, requires_grad=True) for _ in range(2))
    w = torch.randn(24, 64, requires_grad=True)
    y0, g0 = _grads(lambda g, u, w: torch.nn.functional.linear(silu_mul(g, u), w), gate, up, w, dtype=dtype)
    y1, g1 = _grads(silu_mul_linear, gate, up, w, dtype=dtype)
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-3)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), autocast(dtype):
        silu_mul_linear(gate, up, w)
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (gate, up, w))


def _saved_bytes(model, ids, dtype):
    """Bytes autograd keeps for backward, parameters (kept by reference, not copied) left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(dtype):
        model(input_ids=ids).logits.sum()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fewer_bytes_saved_for_backward(path, dtype):
    E, I, L = 64, 128, 2
    plain, fused = _models(seed=3)
    ids = torch.randint(3, 300, (4, 32))
    N = ids.numel()
    saved_plain, saved_fused = _saved_bytes(plain, ids, dtype), _saved_bytes(fused, ids, dtype)
    # per layer and token (module docstring; both sides keep one fp32 rstd per norm):
    # bf16: norms 26E → 8E, MLP 8I → 4I; fp32: norms x and x̂ → x̂ (−4E each), MLP keeps gate and up
    # only (−8I: SiLU's output and the product)
    per_token = (18 * E + 4 * I) if dtype == "bf16" else (8 * E + 8 * I)
    # and in bf16 no projection keeps its weight's cast (2 bytes a weight)
    casts = 2 * sum(m.weight.numel() for n, m in fused.named_modules() if n.rsplit(".", 1)[-1] in FU.PROJECTIONS)
    expected = L * N * per_token + (casts if dtype == "bf16" else 0)
    assert saved_plain - saved_fused == pytest.approx(expected, rel=1e-3), (saved_plain, saved_fused)


# ---- the C kernels against the torch ops they replace ----------------------------------------

def _rms_run(x, w, out_dtype, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fused_rms_norm(x, w, 1e-5, out_dtype)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _both(fn, monkeypatch, *args):
    with monkeypatch.context() as m:
        _torch_ops(m)
        ref = fn(*args)
    return fn(*args), ref


@needs_kernels
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_rms_kernel_forward_is_bit_identical_and_backward_close(monkeypatch, out_dtype, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2, 96) * torch.logspace(-3, 3, 96)          # columns of very different scales
    w = torch.rand(96) + 0.5
    dy = torch.randn(rows, 2, 96).to(out_dtype)
    assert FU._rms_kernels(x.dtype, out_dtype, w, x) is not None
    assert FU._rms_kernels(x.dtype, out_dtype, w, x.to(out_dtype), dy) is not None
    (y, dx, dw), (y0, dx0, dw0) = _both(_rms_run, monkeypatch, x, w, out_dtype, dy)
    assert y.dtype == out_dtype and torch.equal(y, y0)
    assert torch.allclose(dx, dx0, rtol=1e-5, atol=1e-6 * float(dx0.abs().max()))
    assert torch.allclose(dw, dw0, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_rms_kernel_saves_what_the_torch_path_saves(monkeypatch):
    x, w = torch.randn(5, 64, requires_grad=True), torch.rand(64, requires_grad=True)

    def saved():
        out = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: out.append(t.clone()) or t, lambda t: t):
            fused_rms_norm(x, w, 1e-6, torch.bfloat16)
        return out

    for a, b in zip(*_both(saved, monkeypatch)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _swiglu_run(g, u, dh):
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    silu_mul(g, u).backward(dh)
    return g.grad, u.grad


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_kernel_backward_matches_the_torch_ops(monkeypatch, dtype):
    torch.manual_seed(0)
    g = (torch.randn(7, 3000) * 4).to(dtype)            # through both tails of the sigmoid
    g[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0]).to(dtype)
    u, dh = torch.randn(7, 3000).to(dtype), torch.randn(7, 3000).to(dtype)
    assert FU._swiglu_kernels(g, u, dh) is not None
    for a, b in zip(*_both(_swiglu_run, monkeypatch, g, u, dh)):
        assert a.dtype == dtype
        if dtype == torch.float32:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
        else:   # expf's last bit can move a rounding of SiLU's output by one bf16 step (a tie), rarely,
            diff = (a.float() - b.float()).abs()      # and the product after it by up to two
            assert bool((diff <= b.float().abs() * 2**-6 + 1e-30).all())
            assert float((diff > 0).float().mean()) < 0.01


@needs_kernels
def test_kernels_propagate_nan():
    x, w = torch.randn(3, 32, requires_grad=True), torch.rand(32, requires_grad=True)
    dy = torch.randn(3, 32, dtype=torch.bfloat16)
    dy[1, 5] = float("nan")
    fused_rms_norm(x, w, 1e-6, torch.bfloat16).backward(dy)
    assert bool(x.grad[1].isnan().all()) and not bool(x.grad[[0, 2]].isnan().any())
    assert bool(w.grad[5].isnan()) and int(w.grad.isnan().sum()) == 1       # Σ_rows dy·xhat per column
    g = torch.randn(4, 16, dtype=torch.bfloat16)
    g[2, 3] = float("nan")
    ga, gu = _swiglu_run(g, torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16))
    assert bool(ga[2, 3].isnan()) and bool(gu[2, 3].isnan()) and int(ga.isnan().sum()) == 1
