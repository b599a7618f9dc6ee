"""HFEngine samples with its own generator: torch's process-global CPU/CUDA generators, shared
with a trainer that may run on another thread (PPO's async rollout), are never reseeded nor
restored; seeded calls stay reproducible and the log-probs keep their meaning."""
import threading

import pytest
import torch

from turborlhf.rollout import SamplingParams
from turborlhf.rollout.hf import HFEngine

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="no CUDA device"))]


def _global_state(device):
    return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()


def _forward_logits(eng, prompt, resp):
    """fp32 logits predicting each response token, from one unpadded forward."""
    ids = torch.tensor([prompt + resp], device=eng.device)
    with torch.inference_mode():
        return eng.model(ids).logits[0, len(prompt) - 1: -1].float().cpu()


def _gather(lp_TV, resp):
    return lp_TV.gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [5, None])
def test_global_generator_untouched(model, prompts, device, seed):
    eng = HFEngine(model, dtype="fp32", device=device)
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=seed)
    before = _global_state(device)
    eng.generate(prompts, sp)
    assert torch.equal(_global_state(device), before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [5, None])
def test_draws_of_another_thread_are_not_reseeded_nor_rewound(model, prompts, device, seed):
    """The engine generates on a background thread; the main thread (the trainer) draws while it
    runs and after it ends: its draws must be exactly the global stream, unaffected."""
    eng = HFEngine(model, dtype="fp32", device=device)
    started, drawn = threading.Event(), threading.Event()

    def hold_first_forward(module, args):         # generation is under way: let the trainer draw
        if not started.is_set():
            started.set()
            assert drawn.wait(60)

    hook = eng.model.register_forward_pre_hook(hold_first_forward)
    torch.manual_seed(1234)
    if device == "cuda":
        torch.cuda.manual_seed(1234)
    expected = torch.rand(10, device=device).cpu()
    torch.manual_seed(1234)
    if device == "cuda":
        torch.cuda.manual_seed(1234)
    errors = []

    def rollout():
        try:
            eng.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed))
        except BaseException as e:                   # surfaced below
            errors.append(e)
            started.set()

    t = threading.Thread(target=rollout)
    try:
        t.start()
        assert started.wait(60)
        draws = [torch.rand(5, device=device).cpu()]  # during generation
        drawn.set()
        t.join(120)
    finally:
        drawn.set()
        hook.remove()
    assert not t.is_alive() and not errors, errors
    draws.append(torch.rand(5, device=device).cpu())  # after it
    assert torch.equal(torch.cat(draws), expected)


def test_seeded_reproducible_unseeded_random(model, prompts):
    eng = HFEngine(model, dtype="fp32", max_batch_size=2)   # several generate calls, one stream
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=50, top_p=0.95, seed=5)
    torch.manual_seed(0)
    a = eng.generate(prompts, sp).response_ids
    torch.manual_seed(1)                                     # the global state plays no part
    assert eng.generate(prompts, sp).response_ids == a
    assert eng.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, top_k=50,
                                                top_p=0.95, seed=6)).response_ids != a
    free = SamplingParams(max_new_tokens=10, temperature=1.0)
    torch.manual_seed(0)
    u = eng.generate(prompts, free).response_ids
    torch.manual_seed(0)                                     # same global state, fresh draws
    assert eng.generate(prompts, free).response_ids != u


def test_logprobs_match_a_forward(model, prompts):
    """processed: log-softmax of logits / T (top-k, top-p off; then with top-k, renormalised over
    the k best); raw: log-softmax of the raw logits. Both modes draw the same tokens."""
    eng = HFEngine(model, dtype="fp32")
    T = 0.7
    kw = dict(max_new_tokens=10, temperature=T, seed=3, return_logprobs=True)
    proc = eng.generate(prompts, SamplingParams(**kw))
    raw = eng.generate(prompts, SamplingParams(logprobs_mode="raw_logprobs", **kw))
    assert raw.response_ids == proc.response_ids
    for p, r, lp, rlp in zip(prompts, proc.response_ids, proc.logprobs, raw.logprobs):
        logits = _forward_logits(eng, p, r)
        assert torch.allclose(torch.tensor(lp), _gather((logits / T).log_softmax(-1), r), atol=1e-4)
        assert torch.allclose(torch.tensor(rlp), _gather(logits.log_softmax(-1), r), atol=1e-4)

    k = 5
    out = eng.generate(prompts, SamplingParams(top_k=k, **kw))
    for p, r, lp in zip(prompts, out.response_ids, out.logprobs):
        logits = _forward_logits(eng, p, r) / T
        kth = logits.topk(k, -1).values[:, -1:]
        assert (_gather(logits, r)[:, None] >= kth).all()   # never outside the top k
        ref = _gather(logits.masked_fill(logits < kth, float("-inf")).log_softmax(-1), r)
        assert torch.allclose(torch.tensor(lp), ref, atol=1e-4)


def test_first_token_distribution(model):
    """Chi-square of 3000 first tokens against softmax(logits / T) restricted to the top k."""
    p, N, T, k = [7, 8, 9], 3000, 0.7, 40
    eng = HFEngine(model, dtype="fp32", max_batch_size=N)
    out = eng.generate([p], SamplingParams(max_new_tokens=1, temperature=T, top_k=k, n=N, seed=0))
    logits = _forward_logits(eng, p, [0])[0] / T
    kth = logits.topk(k).values[-1]
    probs = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
    f = torch.bincount(torch.tensor([r[0] for r in out.response_ids]), minlength=512).float() / N
    assert f[probs == 0].sum() == 0
    top = probs > 0.01
    chi2 = (N * (f[top] - probs[top]) ** 2 / probs[top]).sum().item()
    assert chi2 < 3 * int(top.sum()) + 30


class _EveryTokenTool:
    """Triggers after every sampled token and writes FORCED."""

    FORCED = [7, 8, 9]
    trigger_ids = frozenset(range(512))

    def __call__(self, response_ids):
        return list(self.FORCED)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_sampling_with_tool_forcing(model, prompts, mode):
    """A tool's tokens get log-prob 0 in either mode (raw gave them the model's where a stop token
    made `generate` process the logits before the tool's processor saw them)."""
    eng = HFEngine(model, dtype="fp32")
    T = 0.8
    out = eng.generate(prompts, SamplingParams(max_new_tokens=9, temperature=T, seed=1, return_logprobs=True,
                                               logprobs_mode=mode, stop_token_ids=(1,)), tool=_EveryTokenTool())
    for p, r, m, lp in zip(prompts, out.response_ids, out.tool_mask, out.logprobs):
        assert m == [False, True, True, True] * 2 + [False]
        assert [t for t, f in zip(r, m) if f] == _EveryTokenTool.FORCED * 2
        ref = _gather((_forward_logits(eng, p, r) / (T if mode == "processed_logprobs" else 1)).log_softmax(-1), r)
        for x, y, f in zip(lp, ref.tolist(), m):
            assert x == 0.0 if f else abs(x - y) < 1e-4


def test_the_checkpoints_generation_config_does_not_reach_sampling(model, prompts):
    """`generate` fills what its config leaves unset from the model's generation_config: a
    checkpoint's repetition penalty, n-gram ban or suppressed tokens changed what HFEngine
    sampled and the log-probs it returned (Qwen2.5-Instruct ships a repetition penalty)."""
    import copy

    from transformers import GenerationConfig

    shipped = copy.deepcopy(model)
    shipped.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=0, repetition_penalty=1.5,
                                                 no_repeat_ngram_size=1, suppress_tokens=list(range(10, 300)))
    plain, eng = HFEngine(model, dtype="fp32"), HFEngine(shipped, dtype="fp32")
    for T in (0.0, 1.0):
        sp = SamplingParams(max_new_tokens=10, temperature=T, seed=4, return_logprobs=True)
        got, want = eng.generate(prompts, sp), plain.generate(prompts, sp)
        assert got.response_ids == want.response_ids
        for p, r, lp in zip(prompts, got.response_ids, got.logprobs):
            ref = _gather(_forward_logits(plain, p, r).log_softmax(-1), r)
            assert torch.allclose(torch.tensor(lp), ref, atol=1e-4)
    assert shipped.generation_config.repetition_penalty == 1.5     # the caller's model is left alone


@pytest.mark.parametrize("seed", [5, None])
def test_fast_engine_leaves_the_global_generator_alone(model, prompts, seed):
    """An unseeded FastEngine call seeded its stream from torch's global generator, shifting the
    draws of a trainer on another thread (HFEngine never did)."""
    from turborlhf.rollout.fast import FastEngine

    eng = FastEngine(model, dtype="fp32")
    before = torch.get_rng_state()
    a = eng.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed))
    b = eng.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed))
    assert torch.equal(torch.get_rng_state(), before)
    assert (a.response_ids == b.response_ids) == (seed is not None)


def test_no_stop_tokens_means_no_stop(model, prompts):
    """Without stop tokens, the checkpoint's EOS (2 here) is an ordinary token, as in FastEngine:
    `generate` must not stop there and pad the row."""
    assert model.generation_config.eos_token_id == 2
    out = HFEngine(model, dtype="fp32").generate([prompts[3]], SamplingParams(max_new_tokens=12, temperature=0.7,
                                                                              n=40, seed=3))
    assert any(2 in r[:-1] for r in out.response_ids)
    assert all(len(r) == 12 for r in out.response_ids) and not any(out.finished)
    assert model.generation_config.eos_token_id == 2          # the caller's model is left alone
