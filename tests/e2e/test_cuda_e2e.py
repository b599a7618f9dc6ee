"""Every trainer on a CUDA device when one is visible (skipped on CPU-only machines, so CI never
runs it): with the shipped defaults (`device: auto`, `dtype: auto`) the models, the rollout
engine and the optimizer land on the GPU in bf16, the run finishes, and the GPU did the work.
Run it wherever a GPU is at hand: ``pytest tests/e2e/test_cuda_e2e.py``."""
from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.helpers import REPO, max_weight_diff, metrics, run_cli, weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _hardware(run_dir) -> dict:
    return {k: v["value"] for k, v in json.loads((run_dir / "hardware.json").read_text())["choices"].items()}


def _run_on_gpu(*args) -> None:
    """Run a CLI command in-process and check that the GPU did work (memory was allocated on it)."""
    torch.cuda.reset_peak_memory_stats()
    run_cli(*args)
    assert torch.cuda.max_memory_allocated() > 0, "nothing was allocated on the GPU"


def _finite(run_dir, key: str) -> None:
    vals = [r[key] for r in metrics(run_dir) if key in r]
    assert vals and all(v == v and abs(v) != float("inf") for v in vals), (key, vals)


def test_sft_rm_dpo_kto_on_cuda(tiny_model, tiny_data, tmp_path):
    pairs, test = tiny_data / "train_pairs.jsonl", tiny_data / "test_pairs.jsonl"
    # the tiny configs pin fp32 for exact CPU tests: back to the shipped default here
    common = [f"model.name_or_path={tiny_model}", "model.dtype=auto", "train.max_steps=2", "log.tensorboard=false"]
    runs = {"sft": ("sft.yaml", [f"data.train_file={pairs}", "data.max_samples=16"]),
            "rm": ("rm.yaml", [f"data.train_file={pairs}", "data.max_samples=16"]),
            "dpo": ("dpo.yaml", [f"data.train_file={pairs}", f"data.test_file={test}", "data.max_samples=8",
                                 "data.max_test_samples=8"]),
            "kto": ("kto.yaml", [f"data.train_file={tiny_data / 'train_kto.jsonl'}",
                                 f"data.test_file={tiny_data / 'test_kto.jsonl'}", "data.max_samples=16",
                                 "data.max_test_samples=8"])}
    for cmd, (yaml_name, extra) in runs.items():
        out = tmp_path / cmd
        _run_on_gpu(cmd, "--config", REPO / "configs/tiny" / yaml_name, *common, *extra, f"output_dir={out}")
        hw = _hardware(out)
        assert hw["model.device"] == "cuda" and hw["model.dtype"] == "bf16", (cmd, hw)
        assert (out / "model.safetensors").exists(), cmd
        _finite(out, "train/loss")


def test_ppo_grpo_on_cuda(tiny_model, tiny_data, tiny_rm, tmp_path):
    prompts = tiny_data / "train_prompts.jsonl"
    # ppo-fused: one epoch of one mini-batch in one micro-batch, so actor and critic backpropagate
    # through their experience forwards (algo.fused_update), in bf16 on the GPU
    fused = ["algo.ppo_epochs=1", "algo.num_mini_batches=1", "train.micro_batch_size=4", "algo.fused_update=both"]
    for name, extra in (("ppo", []), ("grpo", []), ("ppo-fused", fused)):
        out = tmp_path / name
        _run_on_gpu("ppo", "--config", REPO / f"configs/tiny/{name.removesuffix('-fused')}.yaml",
                    f"actor.name_or_path={tiny_model}", f"reward_model={tiny_rm}", f"data.prompts_file={prompts}",
                    "data.max_samples=16", "train.max_steps=2", f"output_dir={out}", "log.tensorboard=false",
                    "actor.dtype=auto", "rollout.dtype=auto", *extra)
        hw = _hardware(out)
        assert hw["distributed.device"] == "gpu", hw
        assert hw["actor.device"] == "cuda" and hw["actor.dtype"] == "bf16", hw
        assert hw["rollout.device"] == "cuda" and hw["rollout.dtype"] == "bf16", hw
        _finite(out, "rollout/reward_mean")
        # the weight sync into the engine on the GPU was verified after each update
        assert any("sync/" in k for r in metrics(out) for k in r), "no weight-sync check was logged"


def test_rejection_sampling_and_conditional_sft_on_cuda(tiny_model, tiny_data, tiny_rm, tmp_path):
    out = tmp_path / "rs"
    _run_on_gpu("rejection-sampling", "--config", REPO / "configs/tiny/rejection_sampling.yaml",
                f"model.name_or_path={tiny_model}", f"reward_model={tiny_rm}",
                f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}", "data.max_samples=8", f"output_dir={out}")
    hw = _hardware(out)
    assert hw["model.device"] == "cuda" and hw["rollout.device"] == "cuda", hw
    out = tmp_path / "csft"
    _run_on_gpu("conditional-sft", "--config", REPO / "configs/tiny/conditional_sft.yaml",
                f"model.name_or_path={tiny_model}", f"reward_model={tiny_rm}",
                f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"output_dir={out}",
                "data.policy_samples_per_prompt=2", "data.max_samples=8")
    assert _hardware(out)["model.device"] == "cuda"


def test_results_of_a_gpu_model_come_back_complete(tiny_model):
    """CPU batches through a model on the GPU (`models.forward`): the per-token log-probs that come
    back equal the CPU model's. A non-blocking copy back to the CPU once returned before the data
    arrived: cached DPO reference log-probs, PPO old log-probs and reward scores read stale memory."""
    from transformers import AutoModelForCausalLM

    from turborlhf.models.forward import response_logprobs

    torch.manual_seed(0)
    ids = torch.randint(3, 500, (64, 96))
    attn = torch.ones_like(ids)
    cpu = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    gpu = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).cuda().eval()
    target = torch.cat([torch.zeros(64, 32), torch.ones(64, 64)], 1)
    with torch.no_grad():
        for _ in range(3):
            a, _ = response_logprobs(cpu, ids, attn, target)
            b, _ = response_logprobs(gpu, ids, attn, target)
            assert b.device.type == "cpu" and torch.allclose(a, b, atol=1e-4), float((a - b).abs().max())


def test_hf_engine_on_cuda_matches_cpu_greedy(tiny_model):
    """The engine on the GPU decodes the same greedy tokens as on the CPU (fp32 both sides)."""
    from turborlhf.rollout import SamplingParams, make_engine

    params = SamplingParams(max_new_tokens=8, temperature=0.0, return_logprobs=True)
    prompts = [[5, 6, 7, 8], [9, 10]]
    gpu = make_engine("auto", str(tiny_model), dtype="fp32", device="cuda").generate(prompts, params)
    cpu = make_engine("hf", str(tiny_model), dtype="fp32", device="cpu").generate(prompts, params)
    assert gpu.response_ids == cpu.response_ids
    for a, b in zip(gpu.logprobs, cpu.logprobs):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3
    with pytest.raises(ValueError, match="CPU only"):
        make_engine("fast", str(tiny_model), device="cuda")


def test_grpo_through_ray_on_one_gpu_matches_local(tiny_model, tiny_data, tiny_rm, tmp_path, capsys):
    """The Ray backend with a GPU worker: every role colocated on the one GPU (one bundle of
    {GPU: 1, CPU: 1}) gives the local backend's metrics and weights on the same GPU (fp32, so
    both sides run the same kernels)."""
    pytest.importorskip("ray")

    def args(out, *extra):
        return ["ppo", "--config", REPO / "configs/tiny/grpo.yaml", f"actor.name_or_path={tiny_model}",
                f"reward_model={tiny_rm}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}",
                "data.max_samples=16", "train.max_steps=2", f"output_dir={out}", "log.tensorboard=false",
                "log.progress=false", "actor.dtype=fp32", "rollout.dtype=fp32", *extra]

    _run_on_gpu(*args(tmp_path / "local"))
    run_cli(*args(tmp_path / "ray", "distributed.backend=ray", "distributed.device=gpu",
                  "distributed.colocate_all_models=true", "distributed.timeout_s=300"))
    out = capsys.readouterr().out
    assert "GPUs ['0']" in out, out[-3000:]   # Ray gave the worker the GPU (worker_device requires CUDA)
    a, b = metrics(tmp_path / "local"), metrics(tmp_path / "ray")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        keys = [k for k in ra if not k.startswith("timing/") and k != "rollout/tokens_per_s"]
        assert "rollout/reward_mean" in keys and all(k in rb for k in keys)
        for k in keys:
            assert rb[k] == pytest.approx(ra[k], rel=1e-3, abs=1e-4), (ra.get("step"), k, ra[k], rb[k])
    assert max_weight_diff(weights(tmp_path / "local"), weights(tmp_path / "ray")) < 1e-4


def _fsdp_one_rank(rank: int, port: int, tiny_model: str, out_file: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from turborlhf.engine.parallel import full_state_dict, init_distributed, is_fsdp, root_forward, shard_fsdp
    from turborlhf.models.forward import response_logprobs
    from turborlhf.trainers.ppo.roles import Trainable

    init_distributed("nccl", "127.0.0.1", port, 0, 1, timeout_s=120)
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (4, 24), generator=g)
    attn = torch.ones_like(ids)
    target = torch.cat([torch.zeros(4, 8), torch.ones(4, 16)], 1)
    out = {"backend": dist.get_backend()}
    for mode in ("plain", "sharded", "offload"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()   # on the CPU
        if mode == "plain":
            model.to(dev)
        else:       # as `Trainable._wrap`: sharded from the CPU, each unit moved as it is sharded
            shard_fsdp(model, dev, offload=mode == "offload")
            out[f"{mode}_is_fsdp"] = is_fsdp(model)
            out[f"{mode}_param_devices"] = sorted({p.to_local().device.type for p in model.parameters()})
            out[f"{mode}_cuda_bytes_after_shard"] = torch.cuda.memory_allocated()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        for _ in range(2):
            logp, _ = root_forward(model, response_logprobs, ids, attn, target)
            loss = -logp.sum() / target[:, 1:].sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[mode] = full_state_dict(model)
        if mode != "plain":     # resume: the full optimizer state back into a fresh sharded model
            holder = SimpleNamespace(model=model)
            state = Trainable._optim_state(holder, opt)
            fresh = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
            shard_fsdp(fresh, dev, offload=mode == "offload")
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3, fused=True)
            Trainable._load_optim_state(SimpleNamespace(model=fresh), fresh_opt, state)
            out[f"{mode}_saved_opt"] = state["state"]
            out[f"{mode}_resumed_opt"] = Trainable._optim_state(SimpleNamespace(model=fresh), fresh_opt)["state"]
        del model, opt
        torch.cuda.empty_cache()
    torch.save(out, out_file)
    dist.destroy_process_group()


def test_fsdp2_over_nccl_on_one_gpu_equals_plain_training(tiny_model, tmp_path):
    """Our FSDP2 helpers over NCCL on the GPU (one rank: the machine has one GPU): `shard_fsdp` of a
    model on the CPU (as the trainers call it), with and without ``optim.offload``'s
    CPUOffloadPolicy, `root_forward` through the root unit's hooks, and `full_state_dict`'s gather
    give the weights of the same two AdamW steps on the unsharded model; the offloaded shards stay
    in host memory; the optimizer state saved in full and broadcast back from rank 0 is the same."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_file = str(tmp_path / "fsdp.pt")
    mp.start_processes(_fsdp_one_rank, args=(port, str(tiny_model), out_file), nprocs=1, join=True,
                       start_method="spawn")
    got = torch.load(out_file, weights_only=False)
    assert got["backend"] == "nccl" and got["sharded_is_fsdp"] and got["offload_is_fsdp"]
    assert got["sharded_param_devices"] == ["cuda"] and got["offload_param_devices"] == ["cpu"]
    assert got["offload_cuda_bytes_after_shard"] < got["sharded_cuda_bytes_after_shard"] / 10, got
    plain = got["plain"]
    init = weights(tiny_model)
    assert max(float((plain[k] - init[k]).abs().max()) for k in init) > 1e-4     # it trained
    for mode in ("sharded", "offload"):
        assert plain.keys() == got[mode].keys()
        diff = max(float((plain[k].float() - got[mode][k].float()).abs().max()) for k in plain)
        assert diff < 1e-5, (mode, diff)
        saved, resumed = got[f"{mode}_saved_opt"], got[f"{mode}_resumed_opt"]
        assert saved.keys() == resumed.keys() and len(saved) > 0
        for name, st in saved.items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(v).cpu(), torch.as_tensor(resumed[name][k]).cpu()), (mode, name, k)
