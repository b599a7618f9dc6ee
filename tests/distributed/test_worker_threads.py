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
