"""Torch threads of PPO workers (`turborlhf.trainers.ppo.roles.setup_worker`): every core on a CPU
slot, the node's cores shared among its GPUs in a Ray worker holding a GPU. Ray's API is faked:
no GPU here."""
import os
import sys
import types

import pytest
import torch

from turborlhf.config import PPOConfig, load_config
from turborlhf.trainers.ppo import roles


def _fake_ray(gpu_ids, node_gpus):
    ctx = types.SimpleNamespace(get_node_id=lambda: "n1")
    return types.SimpleNamespace(
        is_initialized=lambda: True, get_gpu_ids=lambda: gpu_ids, get_runtime_context=lambda: ctx,
        nodes=lambda: [{"NodeID": "n0", "Resources": {"GPU": 1.0}}, {"NodeID": "n1", "Resources": {"GPU": node_gpus}}])


@pytest.fixture
def threads_back():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_gpu_workers_share_their_nodes_cores(monkeypatch, threads_back):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.delenv("TURBORLHF_THREADS", raising=False)
    monkeypatch.setitem(sys.modules, "ray", _fake_ray([3], 8.0))
    assert roles.gpu_worker_threads() == 8
    cfg = load_config(PPOConfig, overrides=["data.prompts_file=p", "reward_model=rm", "actor.name_or_path=a"])
    roles.setup_worker(cfg, 0)
    assert torch.get_num_threads() == 8
    roles.setup_worker(cfg, 2)                                   # an explicit count wins
    assert torch.get_num_threads() == 2
    monkeypatch.setitem(sys.modules, "ray", _fake_ray([], 8.0))   # the driver / a CPU slot: every core
    assert roles.gpu_worker_threads() == 0
    monkeypatch.setitem(sys.modules, "ray", _fake_ray([0], 128.0))
    assert roles.gpu_worker_threads() == 1


def test_cpu_workers_keep_every_core(monkeypatch, threads_back):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "ray", _fake_ray([0], 8.0))
    assert roles.gpu_worker_threads() == 0


def test_bf16_on_ray_workers_that_emulate_it_is_named_in_one_warning():
    """A Ray run's precision is decided on the driver's host; CPU workers on hosts without native
    bf16 would compute it emulated (5-15x slower): one warning names the hosts and the fields."""
    from turborlhf.trainers.ppo.driver import warn_emulated_bf16

    def group(*bf16):
        return types.SimpleNamespace(infos=[{"host": f"h{i}", "bf16_cpu": b} for i, b in enumerate(bf16)])

    base = ["data.prompts_file=p", "reward_model=rm", "actor.name_or_path=a", "distributed.backend=ray",
            "distributed.device=cpu"]
    cfg = load_config(PPOConfig, overrides=base + ["actor.dtype=bf16", "rollout.dtype=fp32"])
    cluster = types.SimpleNamespace(backend="ray", groups={"actor": group(True, False), "rollout": group(False)})
    with pytest.warns(UserWarning, match=r"actor\.dtype=bf16 runs on Ray workers .*hosts h1\).*actor\.dtype=fp32"):
        msg = warn_emulated_bf16(cfg, cluster)
    assert "rollout" not in msg                                  # the engines compute in fp32
    assert warn_emulated_bf16(cfg, types.SimpleNamespace(backend="ray", groups={"actor": group(True, True)})) == ""
    assert warn_emulated_bf16(cfg, types.SimpleNamespace(backend="local", groups={})) == ""
    fp32 = load_config(PPOConfig, overrides=base + ["actor.dtype=fp32", "rollout.dtype=fp32"])
    assert warn_emulated_bf16(fp32, cluster) == ""


def test_host_info_says_whether_the_cpu_computes_bf16():
    from turborlhf.distributed.group import Host
    from turborlhf.engine.hardware import BF16_FEATURES, cpu_features

    info = Host().info()
    assert info["bf16_cpu"] == bool(cpu_features() & BF16_FEATURES) and info["pid"] > 0
