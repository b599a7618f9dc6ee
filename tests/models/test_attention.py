"""The short-sequence training attention: exact gradients against an fp64 reference and against
transformers' sdpa on a tiny model, used only where it should be, and never saved into a config."""
import json

import pytest
import torch

import turborlhf.models.attention as attn_mod
from turborlhf.data.tokenize import pad_batch
from turborlhf.models.attention import MASKED, math_attention
from turborlhf.models.forward import response_logprobs
from turborlhf.models.load import load_causal_lm


def _reference(q, k, v, mask_bool):
    """Plain fp64 softmax attention with repeated KV heads (head h uses KV head h // rep)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask_bool, MASKED)
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def _inputs(B=3, H=6, KV=2, T=9, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64) for h in (H, KV, KV))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False                                            # left padding on two rows
    valid[2, :5] = False
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    dout = torch.randn(B, T, H, D, generator=g, dtype=torch.float64) * valid[:, :, None, None]
    return q, k, v, mask, dout


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "causal-none"])
def test_math_attention_matches_reference_values_and_gradients(mask_kind):
    q, k, v, mask, dout = _inputs()
    if mask_kind == "causal-none":                                  # no padding: causal only
        mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None].expand(3, 1, 9, 9)
        dout = torch.randn_like(dout)
    given = {"bool": mask, "additive": torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf")),
             "causal-none": None}[mask_kind]
    grads = []
    for fn, m in ((lambda *a: math_attention(*a, given, 8 ** -0.5, True), None), (_reference, mask)):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = fn(qq, kk, vv) if m is None else fn(qq, kk, vv, m)
        (out * dout).sum().backward()
        grads.append((out.detach(), qq.grad, kk.grad, vv.grad))
    valid_rows = mask[:, 0].any(-1)[:, :, None, None]               # B×T×1×1: rows with some key
    (o1, *g1), (o2, *g2) = grads
    assert torch.allclose(o1 * valid_rows, o2 * valid_rows, atol=1e-10)
    for a, b, name in zip(g1, g2, "qkv"):
        assert torch.allclose(a, b, atol=1e-10), name


def test_math_attention_bf16_under_autocast_is_close_to_fp64():
    q, k, v, mask, dout = _inputs(T=40, D=16, seed=1)
    qq, kk, vv = (x.float().requires_grad_() for x in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = math_attention(qq, kk, vv, mask, 16 ** -0.5, True)
    assert out.dtype == torch.bfloat16
    (out.double() * dout).sum().backward()
    ref_q = q.clone().requires_grad_()
    ref = _reference(ref_q, k, v, mask)
    (ref * dout).sum().backward()
    rows = mask[:, 0].any(-1)[:, :, None, None]
    assert ((out.double() - ref) * rows).norm() / (ref * rows).norm() < 0.02
    assert (qq.grad.double() - ref_q.grad).norm() / ref_q.grad.norm() < 0.03


def _batch():
    seqs = [[5, 9, 14, 3, 22, 7, 8, 41, 2], [6, 7, 8, 9, 10], [30, 31, 32, 33, 34, 35, 36]]
    ids, am = pad_batch(seqs, 0)
    ids, am = torch.flip(ids, [1]), torch.flip(am, [1])             # left padding, as PPO's prompts
    return ids, am


def _grads(model, ids, am):
    model.zero_grad()
    target = am.clone()
    target[:, 1:] &= am[:, :-1]                                     # tokens with a real token before them
    logp, _ = response_logprobs(model, ids, am, target)
    logp.sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_loaded_models_use_it_with_grad_and_match_sdpa(tiny_model, monkeypatch):
    ours = load_causal_lm(str(tiny_model))
    assert ours.config._attn_implementation == "turborlhf"
    sdpa = load_causal_lm(str(tiny_model))
    sdpa.set_attn_implementation("sdpa")
    calls = []
    real = attn_mod._SoftmaxAttention.apply
    monkeypatch.setattr(attn_mod._SoftmaxAttention, "apply", lambda *a: calls.append(1) or real(*a))
    ids, am = _batch()
    _grads(ours, ids, am)
    assert calls == []                          # fp32 packed sequences: per-sequence sdpa, not the matmul path
    # the rule bf16 follows (with grad, up to MATH_MAX_KEYS keys), applied to these fp32 tensors
    monkeypatch.setattr(attn_mod, "_pads_for_matmul_path",
                        lambda q, n: torch.is_grad_enabled() and q.requires_grad and n <= attn_mod.MATH_MAX_KEYS)
    lp1, g1 = _grads(ours, ids, am)
    n_layers = ours.config.num_hidden_layers
    assert len(calls) == n_layers                                   # the matmul path ran in every layer
    lp2, g2 = _grads(sdpa, ids, am)
    assert torch.allclose(lp1, lp2, atol=1e-5)
    assert g1.keys() == g2.keys()
    for n in g1:
        assert torch.allclose(g1[n], g2[n], atol=1e-5), n
    with torch.no_grad():                                           # no grad: sdpa, the matmul path unused
        response_logprobs(ours, ids, am, am)
    assert len(calls) == n_layers
    monkeypatch.setattr(attn_mod, "MATH_MAX_KEYS", 4)               # longer than the cut-off: sdpa
    _grads(ours, ids, am)
    assert len(calls) == n_layers


def test_saved_config_does_not_name_it(tiny_model, tmp_path):
    model = load_causal_lm(str(tiny_model))
    model.save_pretrained(tmp_path)
    assert "turborlhf" not in (tmp_path / "config.json").read_text()
    assert json.loads((tmp_path / "config.json").read_text()).get("_attn_implementation") in (None, "sdpa")


def test_a_cpu_loaded_model_computing_on_a_gpu_goes_back_to_sdpa_and_plain_layers(tiny_model):
    """Offloaded reference/reward models are loaded on the CPU (which gives them this attention)
    but compute on the GPU: there they get sdpa back, and the log-probs stay the same; on the CPU
    they keep it. No GPU is needed: only the device's type is read."""
    from turborlhf.models.attention import attention_for_compute_device
    from turborlhf.models.forward import packs_sequences
    from turborlhf.models.fused import fused_layer_count

    model = load_causal_lm(str(tiny_model))
    fused = fused_layer_count(model)
    assert fused > 0
    ids, am = _batch()
    target = am.clone()
    target[:, 1:] &= am[:, :-1]                                     # tokens with a real token before them
    with torch.no_grad():
        before = response_logprobs(model, ids, am, target)[0]
    assert attention_for_compute_device(model, "cpu").config._attn_implementation == "turborlhf"
    assert fused_layer_count(model) == fused
    assert attention_for_compute_device(model, torch.device("cuda")) is model
    assert model.config._attn_implementation == "sdpa" and not packs_sequences(model.model)
    assert fused_layer_count(model) == 0            # the CPU's fused norm/SwiGLU/cast forwards go too
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(model, ids, am, target)[0], before, rtol=1e-5, atol=1e-5)


def test_math_attention_switches_off_the_autocast_of_its_inputs_device(monkeypatch):
    """`_SoftmaxAttention` must run with autocast off on the device it computes on: under CUDA
    autocast its fp32 score matmuls would run in bf16. The inputs sit on the meta device (which
    runs these ops without data); the autocast contexts entered are recorded."""
    entered = []

    class _Recorder:
        def __init__(self, device_type, *args, **kwargs):
            entered.append((device_type, kwargs.get("enabled", True)))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch, "autocast", _Recorder)
    monkeypatch.setattr(attn_mod, "_compute_dtype", lambda x: x.dtype)   # torch has no meta autocast to ask
    q, k, v = (torch.empty(1, h, 4, 8, device="meta") for h in (4, 2, 2))
    out = math_attention(q, k, v, None, 8 ** -0.5, causal=True)
    assert out.device.type == "meta" and out.shape == (1, 4, 4, 8)
    assert entered == [("meta", False)]
