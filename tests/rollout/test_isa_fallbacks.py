"""FastEngine on a CPU without AVX-512: every ISA-bound path (oneDNN bf16 packing, the AVX-512-BF16
linears and sampler) is chosen only where `cpu_features()` allows it, the fallbacks warn once and
stay correct, and the fp32 kernel linears (AVX2 + FMA) match torch. An AVX2-only host is emulated
with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 in a subprocess, so these run on every host."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from turborlhf.engine import cbuild
from turborlhf.engine.hardware import cpu_features
from turborlhf.rollout.backends import choose_linear_backend

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
X86 = "avx2" in cpu_features() and cbuild.compiler() is not None
needs_avx2_host = pytest.mark.skipif(not X86, reason="needs an x86-64 Linux host with AVX2 and a C compiler")


def _run(code: str, env_extra: dict, tmp_path: Path) -> dict:
    """Run `code` in a fresh interpreter (the ISA switches are read at torch import) and return
    the JSON it prints last."""
    env = {**os.environ, **env_extra, "OMP_NUM_THREADS": "1", "TURBORLHF_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_isa_flags_follow_cpu_features(monkeypatch):
    """The kernels are compiled for what this process may use (and that is in the cache key): an
    AVX-512 CPU limited to AVX2 builds for the x86-64-v3 baseline, as an AVX2-only CPU would have
    it, not for itself less AVX-512."""
    from turborlhf.engine import hardware

    avx2 = frozenset({"avx2", "fma", "f16c"})
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    for host, allowed, want in ((avx512 | {"avx512_bf16", "amx_bf16"},) * 2 + (["-march=native"],),
                                (avx512 | {"avx512_bf16"}, avx512, ["-march=native", "-mno-avx512bf16"]),
                                (avx512 | {"avx512_bf16", "amx_bf16"}, avx512 | {"avx512_bf16"},   # AMX limited away
                                 ["-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]),
                                (avx512, avx2, ["-march=x86-64-v3", "-mtune=native"]),
                                (avx2, avx2, ["-march=native", "-mno-avx512f"])):
        monkeypatch.setattr(hardware, "host_cpu_features", lambda h=host: h)
        monkeypatch.setattr(hardware, "cpu_features", lambda a=allowed: a)
        assert cbuild.isa_flags() == want, (sorted(host), sorted(allowed))
    monkeypatch.undo()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")                    # this host, limited
    assert hardware.host_cpu_features() >= hardware.cpu_features()
    if {"avx2", "fma"} <= hardware.cpu_features():
        assert cbuild.isa_flags() == (["-march=x86-64-v3", "-mtune=native"] if "avx512f" in hardware.host_cpu_features()
                                      else ["-march=native", "-mno-avx512f"])


def test_backend_choice_per_isa(monkeypatch):
    """The decision table of `turborlhf.rollout.backends`, with the features given."""
    from turborlhf.rollout import backends
    monkeypatch.setattr(backends, "_WARNED", set())
    class K:                                          # a kernels object with the given linears
        def __init__(self, *dts):
            self.linear_dtypes = frozenset(dts)
    avx2 = frozenset({"avx2", "fma"})
    full = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    bf, f32 = torch.bfloat16, torch.float32
    assert choose_linear_backend("auto", bf, K(bf, f32), False, False, full) == "kernel"
    assert choose_linear_backend("auto", f32, K(f32), False, False, avx2) == "kernel"
    assert choose_linear_backend("auto", f32, K(f32), True, False, avx2) == "dense"      # compile
    assert choose_linear_backend("auto", f32, None, False, False, avx2) == "dense"
    with pytest.warns(UserWarning, match="avx512bw/avx512vl/avx512dq, this CPU has avx2 only"):
        assert choose_linear_backend("auto", bf, K(f32), False, True, avx2) == "dense"
    with pytest.raises(ValueError, match="linear_backend='mkldnn' in bf16 needs avx512bw"):
        choose_linear_backend("mkldnn", bf, K(f32), False, False, avx2)
    with pytest.raises(ValueError, match="bf16 kernel linears need avx512_bf16, this CPU has avx2 only"):
        choose_linear_backend("kernel", bf, K(f32), False, False, avx2)
    assert choose_linear_backend("mkldnn", f32, K(f32), False, False, avx2) == "mkldnn"  # fp32 packs anywhere
    # an odd input width (intermediate_size 129): the bf16 kernel linears cannot take it (a crash at the
    # first generate); fp32's can
    assert choose_linear_backend("auto", bf, K(bf, f32), False, False, full, odd_width=True) == "mkldnn"
    assert choose_linear_backend("auto", f32, K(f32), False, False, avx2, odd_width=True) == "kernel"
    with pytest.raises(ValueError, match="bf16 kernel linears need even input widths"):
        choose_linear_backend("kernel", bf, K(bf), False, False, full, odd_width=True)


@needs_avx2_host
def test_engine_on_emulated_avx2_host(tmp_path):
    """Under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 on any AVX2 host: the kernels build
    without AVX-512 (fp32 linears, no bf16 ones), a bf16 engine is built with one warning naming the
    missing instruction sets and agrees with fp32, an fp32 engine runs the AVX2 kernel linears and
    agrees with the dense (transformers-exact) backend, and asking for oneDNN bf16 is a ValueError."""
    out = _run("""
        import json, warnings, torch
        from rollout_helpers import tiny_llama
        from turborlhf.rollout import SamplingParams, kernels
        from turborlhf.rollout.fast import FastEngine
        torch.manual_seed(0)
        m = tiny_llama(0)
        prompts = [[5, 9, 13, 2, 7], [44], [3, 8, 100, 101, 102, 400, 9]]
        k = kernels.load()
        res = {"linear_dtypes": sorted(str(d) for d in k.linear_dtypes), "sampler": k.has_sampler}
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            bf = FastEngine(m, dtype="bf16")
            bf2 = FastEngine(m, dtype="bf16")                 # warned once per process only
        res["warnings"] = [str(x.message) for x in w]
        res["bf16_backend"] = bf.linear_backend
        f32 = FastEngine(m, dtype="fp32")
        dense = FastEngine(m, dtype="fp32", linear_backend="dense")
        res["fp32_backend"] = f32.linear_backend
        g = SamplingParams(max_new_tokens=12, temperature=0.0)
        resp = dense.generate(prompts, g).response_ids
        res["greedy_same"] = f32.generate(prompts, g).response_ids == resp
        diff = lambda a, b: max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
        ref = dense.score_logprobs(prompts, resp)
        res["fp32_diff"] = diff(f32.score_logprobs(prompts, resp), ref)
        res["bf16_diff"] = diff(bf.score_logprobs(prompts, resp), ref)
        s = f32.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, seed=1, return_logprobs=True))
        res["decode_vs_score"] = diff(s.logprobs, f32.score_logprobs(prompts, s.response_ids))
        res["bf16_generates"] = len(bf.generate(prompts, g).response_ids[0]) == 12
        try:
            FastEngine(m, dtype="bf16", linear_backend="mkldnn")
            res["mkldnn_error"] = None
        except ValueError as e:
            res["mkldnn_error"] = str(e)
        print(json.dumps(res))
    """, AVX2_ENV, tmp_path)
    assert out["linear_dtypes"] == ["torch.float32"] and out["sampler"]
    assert out["bf16_backend"] == "dense" and out["fp32_backend"] == "kernel"
    assert len(out["warnings"]) == 1 and "this CPU has avx2 only" in out["warnings"][0]      # one fallback, one line
    assert "avx512_bf16" in out["warnings"][0] and "avx512bw" in out["warnings"][0]
    assert out["greedy_same"] and out["fp32_diff"] < 1e-4 and out["decode_vs_score"] < 1e-4
    assert out["bf16_diff"] < 0.25 and out["bf16_generates"]
    assert "needs avx512bw" in out["mkldnn_error"] and "\n" not in out["mkldnn_error"]


def test_engine_fallback_names_the_architecture_and_the_reason(tmp_path, monkeypatch):
    """An architecture FastEngine cannot run goes to HFEngine with one warning saying which and why."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    from turborlhf.rollout import backends, make_engine

    monkeypatch.setattr(backends, "_WARNED", set())      # once per process: forget earlier tests' warnings

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng = make_engine("auto", model, dtype="fp32")
        make_engine("fast", model, dtype="fp32")
    msgs = [str(x.message) for x in w if "FastEngine cannot run" in str(x.message)]
    assert type(eng).__name__ == "HFEngine"
    assert len(msgs) == 1 and "cannot run gpt2 (model_type 'gpt2' is not one of" in msgs[0]


@needs_avx2_host
def test_kernel_unit_tests_pass_built_for_avx2(tmp_path):
    """The kernels' own tests (linears of every tile height and block tail, attention, RMSNorm,
    sampler) with the library built for AVX2/FMA: on an AVX-512 host the fp32 linears and attention
    otherwise only ever run their AVX-512 code."""
    env = {**os.environ, **AVX2_ENV, "OMP_NUM_THREADS": "2", "TURBORLHF_THREADS": "2"}
    test_file = Path(__file__).with_name("test_kernels.py")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1]


def test_an_explicit_precision_slower_than_fp32_warns_once_with_its_measured_slowdown(tiny_model, monkeypatch):
    """dtype=bf16 or fp16 given to the HF engine (`turborlhf generate`, `chat`) and fp16 to FastEngine
    ran 4-7x slower than fp32 on a CPU without native support, without a word."""
    import warnings

    from turborlhf.engine import hardware
    from turborlhf.rollout.fast import FastEngine
    from turborlhf.rollout.hf import HFEngine

    monkeypatch.setattr(hardware, "cpu_fp16_slowdown", lambda: 6.5)
    monkeypatch.setattr(hardware, "_warned", set())
    with pytest.warns(UserWarning, match=r"dtype=fp16 on this CPU: a linear measured 6.5x slower than fp32"):
        HFEngine(str(tiny_model), dtype="fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HFEngine(str(tiny_model), dtype="fp16")                          # once per process
    monkeypatch.setattr(hardware, "_warned", set())
    with pytest.warns(UserWarning, match=r"6.5x slower than fp32"):
        FastEngine(str(tiny_model), dtype="fp16", kernels=False)
    asked = []
    monkeypatch.setattr(hardware, "choose_precision", lambda req, dev="cpu": asked.append((req, dev)))
    HFEngine(str(tiny_model), dtype="bf16")
    assert asked == [("bf16", "cpu")]      # bf16 goes through the precision choice, which warns where emulated
    monkeypatch.setattr(hardware, "cpu_fp16_slowdown", lambda: 0.5)
    monkeypatch.setattr(hardware, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hardware.warn_if_slower_than_fp32(torch.float16)                 # faster: nothing to say
        hardware.warn_if_slower_than_fp32(torch.float32)


def test_mkldnn_linears_in_fp16_are_refused_in_one_line():
    """FastEngine(dtype='fp16', linear_backend='mkldnn') failed inside oneDNN's packing with a raw error."""
    with pytest.raises(ValueError, match="linear_backend='mkldnn' packs bf16 or fp32 weights, not fp16"):
        choose_linear_backend("mkldnn", torch.float16, None, False, False)
