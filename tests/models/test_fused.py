"""Fused RMSNorm / SwiGLU: same values and gradients as transformers' Llama modules, fewer saved bytes."""
import copy

import pytest
import torch

from turborlhf.engine.train import autocast
from turborlhf.models.fused import fused_layer_count, fused_rms_norm, silu_mul, use_fused_layers
from turborlhf.models.tiny import tiny_llama_config


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
    assert use_fused_layers(fused) == 2 * 2 + 2          # 2 norms + 1 MLP per layer
    assert fused_layer_count(fused) == 6 and fused_layer_count(plain) == 0
    return plain, fused


def _loss_and_grads(model, ids, dtype):
    model.zero_grad()
    with autocast(dtype):
        logits = model(input_ids=ids).logits
    loss = logits.float().log_softmax(-1)[..., 3].mean()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fp32_values_and_gradients_equal_the_modules():
    plain, fused = _models()
    ids = torch.randint(3, 300, (3, 11))
    a, ga = _loss_and_grads(plain, ids, "fp32")
    b, gb = _loss_and_grads(fused, ids, "fp32")
    assert torch.allclose(a, b, atol=1e-5)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], atol=1e-6, rtol=1e-4), n


def test_bf16_autocast_forward_is_bit_identical_and_gradients_close():
    plain, fused = _models(seed=1)
    ids = torch.randint(3, 300, (4, 13))
    a, ga = _loss_and_grads(plain, ids, "bf16")
    b, gb = _loss_and_grads(fused, ids, "bf16")
    assert torch.equal(a, b)
    for n in ga:
        rel = float((ga[n] - gb[n]).norm() / ga[n].norm().clamp_min(1e-12))
        assert rel < 2e-2, (n, rel)          # bf16 rounding of the saved normalised input


def test_no_grad_runs_the_original_forward():
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


def _saved_bytes(model, ids, dtype):
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(dtype):
        model(input_ids=ids).logits.sum()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fewer_bytes_saved_for_backward(dtype):
    E, I, L = 64, 128, 2
    plain, fused = _models(seed=3)
    ids = torch.randint(3, 300, (4, 32))
    N = ids.numel()
    saved_plain, saved_fused = _saved_bytes(plain, ids, dtype), _saved_bytes(fused, ids, dtype)
    # per layer and token (module docstring; both sides keep one fp32 rstd per norm):
    # bf16: norms 26E → 8E, MLP 8I → 6I; fp32: norms x and x̂ → x̂ (−4E each), MLP drops SiLU's output (−4I)
    per_token = (18 * E + 2 * I) if dtype == "bf16" else (8 * E + 4 * I)
    assert saved_plain - saved_fused == pytest.approx(L * N * per_token, rel=1e-3), (saved_plain, saved_fused)
