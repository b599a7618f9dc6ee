"""FastEngine (and HFEngine) on tiny random models: exactness against transformers in fp32 and
the token-level contract of `RolloutEngine`."""
import pytest
import torch

from rollout_helpers import tiny_llama, tiny_qwen2
from turborlhf.rollout import RolloutEngine, SamplingParams, make_engine
from turborlhf.rollout.fast import FastEngine, is_supported
from turborlhf.rollout.hf import HFEngine


def hf_greedy(model, prompt, n_new):
    """Reference: transformers generate, one unpadded prompt, greedy, no stop."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, prompt, resp):
    ids = torch.tensor([prompt + resp])
    with torch.inference_mode():
        lp = model(ids).logits[0].float().log_softmax(-1)
    return lp[len(prompt) - 1: -1].gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def fast(model):
    return FastEngine(model, dtype="fp32")


GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)


def test_protocol(fast, model):
    assert isinstance(fast, RolloutEngine)
    assert isinstance(HFEngine(model, dtype="fp32"), RolloutEngine)


def test_greedy_matches_hf_generate(fast, model, prompts):
    out = fast.generate(prompts, GREEDY)
    for p, r in zip(prompts, out.response_ids):
        assert r == hf_greedy(model, p, 16)
    assert out.finished == [False] * len(prompts)


def test_greedy_untied_and_qwen2(prompts):
    m = tiny_llama(1, tie=False)
    out = FastEngine(m, dtype="fp32").generate(prompts, GREEDY)
    assert out.response_ids == [hf_greedy(m, p, 16) for p in prompts]
    q = tiny_qwen2(tie=True)
    assert is_supported(q.config)
    out = FastEngine(q, dtype="fp32").generate(prompts, GREEDY)
    assert out.response_ids == [hf_greedy(q, p, 16) for p in prompts]


def test_hf_engine_greedy_matches(model, prompts):
    out = HFEngine(model, dtype="fp32").generate(prompts, GREEDY)
    assert out.response_ids == [hf_greedy(model, p, 16) for p in prompts]


def test_score_logprobs_matches_hf_forward(fast, model, prompts):
    g = torch.Generator().manual_seed(0)
    resps = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (4, 7, 1, 0, 10)]
    got = fast.score_logprobs(prompts, resps)
    hf = HFEngine(model, dtype="fp32").score_logprobs(prompts, resps)
    for p, r, a, b in zip(prompts, resps, got, hf):
        assert len(a) == len(r) == len(b)
        if r:
            ref = hf_logprobs(model, p, r)
            assert torch.allclose(torch.tensor(a), ref, atol=1e-4)
            assert torch.allclose(torch.tensor(b), ref, atol=1e-4)


def test_sampled_logprobs_match_scoring(fast, prompts):
    out = fast.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3,
                                                return_logprobs=True))
    scored = fast.score_logprobs(prompts, out.response_ids)
    for a, b in zip(out.logprobs, scored):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)


@pytest.mark.parametrize("kind", ["fast", "hf"])
def test_raw_logprobs_are_the_temperature_1_scores(kind, model, prompts):
    """``raw_logprobs`` under temperature, top-p and min_new_tokens (EOS suppressed at first): the
    temperature-1 log-probs a forward computes (what PPO's old log-probs and eval's KL need), while
    ``processed_logprobs`` of the same draws are those of the transformed distribution."""
    eng = make_engine(kind, model, dtype="fp32")
    kw = dict(max_new_tokens=12, min_new_tokens=4, temperature=0.7, top_p=0.9, seed=3, return_logprobs=True,
              stop_token_ids=(7,))
    raw = eng.generate(prompts, SamplingParams(logprobs_mode="raw_logprobs", **kw))
    proc = eng.generate(prompts, SamplingParams(**kw))
    assert raw.response_ids == proc.response_ids                     # the mode changes no draw
    scored = HFEngine(model, dtype="fp32").score_logprobs(prompts, raw.response_ids)
    assert _max_diff(raw.logprobs, scored) < 1e-4
    assert _max_diff(proc.logprobs, scored) > 0.05                   # T 0.7 and top-p reshape the distribution


def test_logprobs_mode_checked():
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="raw")


def test_load_weights_matches_new_model(model, prompts):
    eng = FastEngine(model, dtype="fp32")
    other = tiny_llama(7)
    before = eng.generate(prompts, GREEDY).response_ids
    # names as a DDP/compiled trainer would hand them over
    eng.load_weights((f"module.{n}", p) for n, p in other.named_parameters())
    after = eng.generate(prompts, GREEDY).response_ids
    assert after != before
    assert after == [hf_greedy(other, p, 16) for p in prompts]
    with pytest.raises(KeyError):
        eng.load_weights([("model.nonexistent.weight", torch.zeros(1))])
    with pytest.raises(ValueError):
        eng.load_weights([("model.norm.weight", torch.zeros(3))])
    h = HFEngine(model, dtype="fp32")
    h.load_weights(other.named_parameters())
    assert h.generate(prompts, GREEDY).response_ids == after


def test_weights_are_copied_not_shared(model, prompts):
    m = tiny_llama(3)
    eng = FastEngine(m, dtype="fp32")
    before = eng.generate(prompts, GREEDY).response_ids
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.5)
    assert eng.generate(prompts, GREEDY).response_ids == before


@pytest.mark.parametrize("kind", ["fast", "hf"])
def test_stop_semantics(kind, model, prompts):
    eng = FastEngine(model, dtype="fp32") if kind == "fast" else HFEngine(model, dtype="fp32")
    free = eng.generate(prompts, GREEDY).response_ids
    stop = free[0][4]
    out = eng.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=(stop,)))
    for r_free, r, f in zip(free, out.response_ids, out.finished):
        if stop in r_free:
            j = r_free.index(stop)
            assert r == r_free[: j + 1] and f  # stop token included, finished
        else:
            assert r == r_free and not f      # cut at max_new_tokens
    assert out.finished[0]


@pytest.mark.parametrize("kind", ["fast", "hf"])
def test_min_new_tokens(kind, model, prompts):
    eng = FastEngine(model, dtype="fp32") if kind == "fast" else HFEngine(model, dtype="fp32")
    stops = tuple(range(0, 512, 2))  # half the vocabulary stops
    out = eng.generate(prompts, SamplingParams(max_new_tokens=12, min_new_tokens=6, temperature=1.0,
                                               stop_token_ids=stops, seed=0))
    for r, f in zip(out.response_ids, out.finished):
        assert len(r) >= 6
        assert not set(r[:5]) & set(stops)
        assert f == (r[-1] in stops)
        assert all(t not in stops for t in r[:-1])
    assert any(out.finished)


@pytest.mark.parametrize("kind", ["fast", "hf"])
def test_n_samples_consecutive(kind, model, prompts):
    eng = FastEngine(model, dtype="fp32") if kind == "fast" else HFEngine(model, dtype="fp32")
    out = eng.generate(prompts[:3], SamplingParams(max_new_tokens=8, temperature=0, n=3))
    base = eng.generate(prompts[:3], GREEDY.__class__(max_new_tokens=8, temperature=0)).response_ids
    assert out.response_ids == [r for r in base for _ in range(3)]
    # sampling: n=2 over [a, b] is the same request list as [a, a, b, b]
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=11)
    a = eng.generate(prompts[:2], sp).response_ids
    b = eng.generate([prompts[0]] * 2 + [prompts[1]] * 2,
                     SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)).response_ids
    assert a == b and len(a) == 4 and a[0] != a[1]


@pytest.mark.parametrize("kind", ["fast", "hf"])
def test_seed_reproducible(kind, model, prompts):
    eng = FastEngine(model, dtype="fp32") if kind == "fast" else HFEngine(model, dtype="fp32")
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=5)
    a, b = eng.generate(prompts, sp), eng.generate(prompts, sp)
    c = eng.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=6))
    assert a.response_ids == b.response_ids != c.response_ids


def test_first_token_distribution(fast, model):
    p, N, T = [7, 8, 9], 4000, 0.7
    out = fast.generate([p], SamplingParams(max_new_tokens=1, temperature=T, n=N, seed=0))
    with torch.inference_mode():
        probs = torch.softmax(model(torch.tensor([p])).logits[0, -1] / T, -1)
    f = torch.bincount(torch.tensor([r[0] for r in out.response_ids]), minlength=512).float() / N
    top = probs > 0.01  # compare where the expected count is large enough
    chi2 = (N * (f[top] - probs[top]) ** 2 / probs[top]).sum().item()
    assert chi2 < 3 * int(top.sum()) + 30
    assert f[~top].sum() < probs[~top].sum() + 0.02


def test_compaction_and_chunking_keep_greedy_outputs(model, prompts):
    ref = FastEngine(model, dtype="fp32", compact=False, dedupe_prompts=False).generate(prompts, GREEDY)
    stop = ref.response_ids[1][2]
    sp = SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=(stop,))
    a = FastEngine(model, dtype="fp32", compact=False).generate(prompts * 3, sp)
    b = FastEngine(model, dtype="fp32", compact=True).generate(prompts * 3, sp)
    c = FastEngine(model, dtype="fp32", max_batch_size=2).generate(prompts * 3, sp)
    assert a.response_ids == b.response_ids == c.response_ids
    assert a.finished == b.finished == c.finished


def _prefixed_prompts(prefix_len=10, tails=(1, 4, 7, 2, 5)):
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 512, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 512, (n,), generator=g).tolist() for n in tails]


@pytest.mark.parametrize("backend", ["kernel", "dense"])
def test_shared_prefix_prefill_matches_hf_and_the_unshared_prefill(model, backend, monkeypatch):
    """Prompts sharing 10 leading tokens: the prefix is prefilled once (checked), and greedy
    tokens equal transformers' per prompt; log-probs equal the unshared prefill's to rounding,
    with several samples per prompt and duplicate prompts."""
    kw = {} if backend == "kernel" else {"kernels": False}
    prompts = _prefixed_prompts()
    eng = FastEngine(model, dtype="fp32", linear_backend=backend, **kw)
    seen = []
    orig = FastEngine._shared_prefix_len
    monkeypatch.setattr(FastEngine, "_shared_prefix_len", lambda self, ps: seen.append(orig(self, ps)) or seen[-1])
    out = eng.generate(prompts, GREEDY)
    assert seen == [10]
    assert out.response_ids == [hf_greedy(model, p, 16) for p in prompts]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, n=3, seed=5, return_logprobs=True)
    a = eng.generate(prompts + prompts[:2], sp)
    assert seen[-1] == 10
    b = FastEngine(model, dtype="fp32", linear_backend=backend, share_prefix=False, **kw).generate(
        prompts + prompts[:2], sp)
    assert seen[-1] == 0
    assert a.response_ids == b.response_ids
    d = max(abs(x - y) for ra, rb in zip(a.logprobs, b.logprobs) for x, y in zip(ra, rb))
    assert d < 1e-4


@pytest.mark.parametrize("kernels", ["auto", False])
def test_uninitialised_cache_columns_are_never_read(model, monkeypatch, kernels):
    """Where the C attention reads the cache, the prefill allocates it with torch.empty (left
    padding and the columns past the prompts unwritten until decoding fills them). Filled with NaN
    instead, nothing changes: no reader looks at a column before it is written. Distinct prompts
    (the prefill writes the decode cache directly) and duplicates (rows copied), a shared prefix,
    left padding; the torch attention path (kernels=False) keeps zeroed caches."""
    prompts = _prefixed_prompts()
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11, return_logprobs=True)
    batches = (prompts, prompts + prompts[:2])
    ref = [FastEngine(model, dtype="fp32", kernels=kernels).generate(b, sp) for b in batches]
    real_empty = torch.empty

    def nan_empty(*a, **k):
        t = real_empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    eng = FastEngine(model, dtype="fp32", kernels=kernels)
    for b, r in zip(batches, ref):
        out = eng.generate(b, sp)
        assert out.response_ids == r.response_ids and out.logprobs == r.logprobs


def test_shared_prefix_length_rule(model):
    eng = FastEngine(model, dtype="fp32", min_shared_prefix=4)
    p = _prefixed_prompts(prefix_len=6, tails=(3, 2))
    assert eng._shared_prefix_len(p) == 6
    assert eng._shared_prefix_len([p[0], p[0][:7]]) == 6        # each prompt keeps its last token
    assert eng._shared_prefix_len([p[0], p[0][:5]]) == 4
    assert eng._shared_prefix_len([p[0], p[0][:4]]) == 0        # 3 shared < min_shared_prefix
    assert eng._shared_prefix_len([p[0]]) == 0                  # nothing to share with
    assert eng._shared_prefix_len([p[0], [p[0][0] + 1] + p[0][1:]]) == 0
    assert FastEngine(model, dtype="fp32", share_prefix=False)._shared_prefix_len(p) == 0
    # a prompt equal to the prefix plus one token, beside longer ones: greedy still matches
    prompts = [p[0][:7], p[0], p[1]]
    out = eng.generate(prompts, GREEDY)
    assert out.response_ids == [hf_greedy(model, q, 16) for q in prompts]


def test_bf16_close_to_fp32(model, prompts):
    resps = FastEngine(model, dtype="fp32").generate(prompts, GREEDY).response_ids
    a = FastEngine(model, dtype="fp32").score_logprobs(prompts, resps)
    b = FastEngine(model, dtype="bf16").score_logprobs(prompts, resps)
    d = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert d < 0.25
    out = FastEngine(model, dtype="bf16").generate(prompts, GREEDY)
    assert len(out.response_ids) == len(prompts)


def test_errors(fast):
    with pytest.raises(ValueError):
        fast.generate([[1, 2], []], GREEDY)
    with pytest.raises(ValueError):
        fast.generate([[1] * 500], SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError):
        fast.score_logprobs([[1]], [[2], [3]])
    # response ids and lengths are checked as generate's prompts are (an IndexError before)
    with pytest.raises(ValueError, match="response 1 has token ids outside"):
        fast.score_logprobs([[1], [1]], [[2], [fast.vocab_size]])
    with pytest.raises(ValueError, match="response 0 has token ids outside"):
        fast.score_logprobs([[1]], [[-1]])
    with pytest.raises(ValueError, match="past the model's"):
        fast.score_logprobs([[1] * (fast.max_positions - 2)], [[2, 3, 4]])


def test_make_engine(model):
    assert isinstance(make_engine("auto", model, dtype="fp32"), FastEngine)
    assert isinstance(make_engine("hf", model, dtype="fp32"), HFEngine)
    from transformers import GPT2Config, GPT2LMHeadModel
    g = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert not is_supported(g.config)
    assert isinstance(make_engine("auto", g, dtype="fp32"), HFEngine)
    with pytest.raises(ValueError):
        make_engine("nope", model)
    with pytest.raises((NotImplementedError, ImportError)):
        make_engine("vllm", model)


def test_fast_engine_from_directory(model, prompts, tmp_path):
    model.save_pretrained(tmp_path)
    eng = make_engine("auto", str(tmp_path), dtype="fp32")
    assert isinstance(eng, FastEngine)
    assert eng.generate(prompts, GREEDY).response_ids == [hf_greedy(model, p, 16) for p in prompts]


# ---------------------------------------------------------------- oneDNN pre-packed backend (bf16)
from turborlhf.engine.hardware import cpu_features  # noqa: E402
from turborlhf.rollout.backends import MKLDNN_BF16_FEATURES  # noqa: E402
from turborlhf.rollout.llama_ops import mkldnn_packing_available  # noqa: E402

MKLDNN_BF16 = mkldnn_packing_available() and set(MKLDNN_BF16_FEATURES) <= cpu_features()
needs_mkldnn = pytest.mark.skipif(not MKLDNN_BF16, reason="torch without oneDNN, or a CPU without avx512bw/vl/dq "
                                                          "(oneDNN cannot pack bf16 weights there)")
_KERN = __import__("turborlhf.rollout.kernels", fromlist=["load"]).load(warn=False)
HAS_KERNEL_LINEAR = _KERN is not None and _KERN.has_linear
HAS_F32_KERNEL = _KERN is not None and torch.float32 in _KERN.linear_dtypes
# the two packed bf16 backends: oneDNN's blocked layout, and our AVX-512-BF16 kernels
PACKED = pytest.mark.parametrize("backend", [
    pytest.param("mkldnn", marks=needs_mkldnn),
    pytest.param("kernel", marks=pytest.mark.skipif(not HAS_KERNEL_LINEAR, reason="no AVX-512-BF16 kernel linears"))])


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@PACKED
def test_packed_backend_matches_dense_bf16(model, prompts, backend):
    dense = FastEngine(model, dtype="bf16", linear_backend="dense")
    packed = FastEngine(model, dtype="bf16", linear_backend=backend)
    assert packed.linear_backend == backend and dense.linear_backend == "dense"
    resps = dense.generate(prompts, GREEDY).response_ids
    # fused post-ops round once instead of twice: bf16-level differences only
    assert _max_diff(dense.score_logprobs(prompts, resps), packed.score_logprobs(prompts, resps)) < 0.1
    # the decode step (packed, fused) and the full forward (packed) agree on sampled tokens
    out = packed.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=1, return_logprobs=True))
    assert _max_diff(out.logprobs, packed.score_logprobs(prompts, out.response_ids)) < 0.1


@PACKED
def test_packed_backend_sees_weight_updates(model, prompts, backend):
    """load_weights must re-pack: a full swap, then a single-tensor partial update."""
    eng = FastEngine(model, dtype="bf16", linear_backend=backend)
    other = tiny_llama(7)
    resps = FastEngine(other, dtype="fp32").generate(prompts, GREEDY).response_ids
    stale = eng.score_logprobs(prompts, resps)
    eng.load_weights(other.named_parameters())
    assert eng.last_weight_update["tensors"] == len(list(other.named_parameters()))
    ref = FastEngine(other, dtype="bf16", linear_backend="dense")
    # the old packed weights score far off (so the check below can fail); the re-packed ones match
    assert _max_diff(stale, ref.score_logprobs(prompts, resps)) > 1.0
    assert _max_diff(eng.score_logprobs(prompts, resps), ref.score_logprobs(prompts, resps)) < 0.1
    # partial: perturb one MLP matrix of layer 1 only
    with torch.no_grad():
        w = other.model.layers[1].mlp.down_proj.weight
        w.add_(torch.randn_like(w, generator=torch.Generator().manual_seed(0)) * 0.3)
    before = eng.score_logprobs(prompts, resps)
    eng.load_weights([("model.layers.1.mlp.down_proj.weight", w)])
    after = eng.score_logprobs(prompts, resps)
    ref = FastEngine(other, dtype="bf16", linear_backend="dense")
    assert _max_diff(before, after) > 0.1
    assert _max_diff(after, ref.score_logprobs(prompts, resps)) < 0.1
    # one of q/k/v, and one of gate/up, each a slice of a fused matrix
    with torch.no_grad():
        for w in (other.model.layers[0].self_attn.k_proj.weight, other.model.layers[1].mlp.up_proj.weight):
            w.add_(torch.randn_like(w, generator=torch.Generator().manual_seed(1)) * 0.3)
    eng.load_weights([("model.layers.0.self_attn.k_proj.weight", other.model.layers[0].self_attn.k_proj.weight),
                      ("model.layers.1.mlp.up_proj.weight", other.model.layers[1].mlp.up_proj.weight)])
    ref = FastEngine(other, dtype="bf16", linear_backend="dense")
    assert _max_diff(eng.score_logprobs(prompts, resps), ref.score_logprobs(prompts, resps)) < 0.1
    with pytest.raises(ValueError, match="shape"):
        eng.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 5))])


def test_default_linear_backends(model):
    """'auto' takes the fastest backend this CPU can run (decided by cpu_features(), see
    turborlhf.rollout.backends): never one that needs an instruction set it lacks."""
    bf16 = "kernel" if HAS_KERNEL_LINEAR else "mkldnn" if MKLDNN_BF16 else "dense"
    assert FastEngine(model, dtype="bf16").linear_backend == bf16
    assert FastEngine(model, dtype="bf16", int8_max_batch=4).linear_backend == ("mkldnn" if MKLDNN_BF16 else "dense")
    assert FastEngine(model, dtype="fp32").linear_backend == ("kernel" if HAS_F32_KERNEL else "dense")
    assert FastEngine(model, dtype="fp32", kernels=False).linear_backend == "dense"


def test_linear_backend_errors(model):
    with pytest.raises(ValueError, match="linear_backend"):
        FastEngine(model, linear_backend="nope")
    with pytest.raises(ValueError, match="linear_backend='kernel'"):
        FastEngine(model, dtype="fp16", linear_backend="kernel")             # bf16 and fp32 only
    with pytest.raises(ValueError, match="linear_backend='kernel'"):
        FastEngine(model, dtype="fp32", linear_backend="kernel", compile=True)


def test_compile_failure_falls_back_to_eager(model, prompts):
    eager = FastEngine(model, dtype="fp32").generate(prompts, GREEDY).response_ids
    eng = FastEngine(model, dtype="fp32", compile=True)

    def broken(*a, **k):
        raise RuntimeError("inductor exploded")
    eng._compiled_step = broken
    with pytest.warns(UserWarning, match="decoding eagerly"):
        out = eng.generate(prompts, GREEDY)
    assert out.response_ids == eager
    assert eng._compiled_step is None


@pytest.mark.slow
def test_compiled_step_matches_eager_fp32(model, prompts):
    """One cold compile (~25 s on a 2-core CPU): the compiled step gives HF's greedy tokens."""
    eng = FastEngine(model, dtype="fp32", compile=True)
    out = eng.generate(prompts, GREEDY)
    assert eng._compiled_step is not None and eng.compile_seconds
    assert out.response_ids == [hf_greedy(model, p, 16) for p in prompts]


def test_int8_small_batch_decode(model, prompts):
    """int8 weight-only decode for small batches: close to bf16, re-quantized by load_weights,
    larger batches and scoring untouched."""
    from turborlhf.rollout.llama_ops import _quantize_int8
    w = torch.randn(16, 32)
    q, s = _quantize_int8(w, torch.float32)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert (q.float() * s[:, None] - w).abs().max() <= s.max() / 2 + 1e-6   # rounding error <= half a step
    eng = FastEngine(model, dtype="bf16", int8_max_batch=2)
    ref = FastEngine(model, dtype="bf16", linear_backend=eng.linear_backend)   # (int8 rules out 'kernel')
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=2, return_logprobs=True)
    out = eng.generate(prompts[:1], sp)                                   # batch 1 → int8 steps
    d = _max_diff(out.logprobs, ref.score_logprobs(prompts[:1], out.response_ids))
    assert 1e-3 < d < 0.3                                                 # quantized, but close
    big = SamplingParams(max_new_tokens=10, temperature=1.0, seed=2)
    assert eng.generate(prompts, big).response_ids == ref.generate(prompts, big).response_ids  # batch 5: bf16
    other = tiny_llama(7)
    eng.load_weights(other.named_parameters())
    ref = FastEngine(other, dtype="bf16")
    out = eng.generate(prompts[:1], sp)
    assert _max_diff(out.logprobs, ref.score_logprobs(prompts[:1], out.response_ids)) < 0.3


def test_unpadded_small_batch_attention_path(model, prompts):
    """Rows without left padding and B <= 4 attend through SDPA over the used columns: same
    greedy tokens as HF, same log-probs as scoring."""
    fast = FastEngine(model, dtype="fp32")
    same_len = [prompts[2], prompts[2][::-1], [p + 1 for p in prompts[2]]]  # 3 rows, no padding
    for batch in ([prompts[4]], same_len):
        out = fast.generate(batch, GREEDY)
        assert out.response_ids == [hf_greedy(model, p, 16) for p in batch]
        sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, return_logprobs=True)
        s = fast.generate(batch, sp)
        assert _max_diff(s.logprobs, fast.score_logprobs(batch, s.response_ids)) < 1e-4


def test_chunks_are_batched_by_prompt_length(model, monkeypatch):
    """More requests than a batch: chunks hold prompts of similar length (less left padding), the
    samples of a prompt stay in one chunk, and results come back in request order."""
    g = torch.Generator().manual_seed(3)
    lens = [9, 2, 7, 3, 8, 2, 5, 4]
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in lens]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, n=2)
    whole = FastEngine(model, dtype="fp32").generate(prompts, sp)
    eng = FastEngine(model, dtype="fp32", max_batch_size=4)
    chunks = []
    real = eng._generate_chunk
    monkeypatch.setattr(eng, "_generate_chunk", lambda reqs, *a: (chunks.append([len(r) for r in reqs]),
                                                                  real(reqs, *a))[1])
    out = eng.generate(prompts, sp)
    assert out.response_ids == whole.response_ids and out.finished == whole.finished
    assert chunks == [[2, 2, 2, 2], [3, 3, 4, 4], [5, 5, 7, 7], [8, 8, 9, 9]]


def test_fast_engine_reads_the_weights_transformers_reads_and_refuses_longrope(tmp_path):
    """Every *.safetensors of a directory was read (Mistral repos ship consolidated.safetensors with
    other names: a KeyError); longrope switches to its long factors past
    original_max_position_embeddings, which FastEngine's one table ignored (8 nats off)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from turborlhf.models.tiny import save_tiny_causal_lm
    from turborlhf.rollout.llama_ops import _load_state_dict, unsupported_reason

    path = save_tiny_causal_lm(tmp_path / "m", seed=0)
    keys = set(_load_state_dict(str(path)))
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(path / "consolidated.safetensors"))
    assert set(_load_state_dict(str(path))) == keys
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, original_max_position_embeddings=32,
                      max_position_embeddings=128, rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                                 "long_factor": [2.0] * 8})
    assert "longrope" in unsupported_reason(cfg)


def test_fast_engine_builds_from_a_cached_hub_id(tmp_path):
    """`generate --model org/name` and PPO's rollout worker failed for a Llama hub id (FastEngine read
    the id as a folder); HF generate took it from the cache."""
    import os
    import subprocess
    import sys

    from turborlhf.models.tiny import save_tiny_causal_lm

    snap = tmp_path / "hf" / "hub" / "models--tinyorg--tinyllama" / "snapshots" / "abc123"
    save_tiny_causal_lm(snap, seed=0)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    code = ("from turborlhf.rollout import SamplingParams, make_engine\n"
            "e = make_engine('fast', 'tinyorg/tinyllama', dtype='fp32')\n"
            "print(e.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=0)).response_ids)\n")
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("[["), r.stderr[-2000:]
