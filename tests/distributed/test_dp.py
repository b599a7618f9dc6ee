"""Data parallelism inside a role: DP=2 (two processes, gloo) gives the same update as DP=1 on the
same global batch, for the actor and the critic, with an uneven split of micro-batches."""
from __future__ import annotations

import os
import socket

import pytest
import torch

from tests.e2e.helpers import REPO

PPO_YAML = REPO / "configs/tiny/ppo.yaml"


def _cfg(tiny_model, strategy: str, backend: str = "local", freeze: int = 0, offload: bool = False):
    from turborlhf.config import PPOConfig, load_config

    return load_config(PPOConfig, PPO_YAML, [
        f"actor.name_or_path={tiny_model}", f"critic.name_or_path={tiny_model}", "reward_model=unused",
        "data.prompts_file=unused", "train.micro_batch_size=2", "algo.num_mini_batches=2", "algo.ppo_epochs=2",
        "algo.entropy_coef=0.01", "algo.loss_reduction=seq_mean_token_mean", f"distributed.dp_strategy={strategy}",
        "distributed.device=cpu",       # gloo ranks on the CPU, also where a GPU is visible
        f"actor.freeze_layers={freeze}", f"critic.freeze_layers={freeze}", f"optim.offload={offload}"])


def _experience(tiny_model):
    """A fixed rollout batch of 6 rows (mini-batches of 3 rows = micro-batches of 2 and 1)."""
    from turborlhf.models.load import load_tokenizer
    from turborlhf.data.tokenize import assemble_prompt_response as assemble
    from turborlhf.trainers.ppo import score_and_advantages
    from turborlhf.config import PPOAlgoCfg

    tok = load_tokenizer(str(tiny_model))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in (3, 5, 4, 2, 6, 3)]
    responses = [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in (4, 2, 5, 3, 1, 5)]
    ids, attn, P, mask = assemble(prompts, responses, tok.pad_token_id)
    B, R = mask.shape
    old = -2.0 + 0.1 * torch.randn(B, R, generator=g)
    ref = -2.0 + 0.1 * torch.randn(B, R, generator=g)
    values = 0.1 * torch.randn(B, R, generator=g)
    raw = torch.randn(B, generator=g)
    return score_and_advantages(PPOAlgoCfg(), ids, attn, P, mask, [True] * B, old * mask, ref * mask, values * mask,
                                raw, {"rm": raw}, 0.05, None)


def _train(cfg, exp, out_file: str) -> None:
    from turborlhf.engine.parallel import dp_rank_world, full_state_dict
    from turborlhf.trainers.ppo import merge_rank_stats, minibatch_schedule
    from turborlhf.trainers.ppo.actor import ActorWorker
    from turborlhf.trainers.ppo.critic import CriticWorker

    schedule = minibatch_schedule(exp.mask_BR.shape[0], cfg.algo, torch.Generator().manual_seed(1))
    actor, critic = ActorWorker(cfg, None, 8, threads=1), CriticWorker(cfg, None, 8, threads=1)
    a_stats, c_stats = actor.train(exp, schedule, 0.05), critic.train(exp, schedule)
    weights = {f"actor.{k}": v for k, v in full_state_dict(actor.model).items()}
    weights.update({f"critic.{k}": v for k, v in full_state_dict(critic.model).items()})
    rank, world = dp_rank_world()
    if world > 1:   # every rank's stats, added as the driver does
        import torch.distributed as dist

        box = [None] * world
        dist.all_gather_object(box, (a_stats, c_stats))
        a_stats = merge_rank_stats([b[0] for b in box])
        c_stats = merge_rank_stats([b[1] for b in box])
    if rank == 0:
        torch.save({"weights": weights, "actor": a_stats[0], "critic": c_stats[0]}, out_file)


def _rank(rank: int, world: int, port: int, cfg, exp, out_file: str) -> None:
    os.environ["TURBORLHF_THREADS"] = "1"
    from turborlhf.engine.parallel import init_distributed

    init_distributed("gloo", "127.0.0.1", port, rank, world, timeout_s=120)
    _train(cfg, exp, out_file)
    _leave()


def _leave() -> None:
    """End a rank: a barrier (no rank tears its gloo pairs down while another still uses them),
    the group destroyed, then exit without the interpreter's finalization: with torch's huge-page
    allocations on (the commands set THP_MEM_ALLOC_ENABLE and the test process passes it on), a
    rank sometimes aborted there after its work ("terminate called without an active exception",
    no Python frame), failing a test whose results were already written."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy,freeze,offload", [("ddp", 0, False), ("fsdp", 0, False), ("fsdp", 1, False),
                                                     ("fsdp", 0, True)])
def test_dp2_update_equals_dp1(strategy, freeze, offload, tiny_model, tmp_path):
    """freeze = 1: `model.freeze_layers` (embeddings and layer 0 fixed) under FSDP2, whose root
    unit then holds frozen (embeddings) and trained (final norm, head) parameters together.
    offload: ``optim.offload`` under FSDP2 is its CPUOffloadPolicy (on the CPU mesh it moves
    nothing, but the policy's code path runs: the optimizer over its shards, the gather)."""
    import torch.multiprocessing as mp

    cfg, exp = _cfg(tiny_model, strategy, freeze=freeze, offload=offload), _experience(tiny_model)
    _train(cfg, exp, str(tmp_path / "dp1.pt"))                     # one process, all micro-batches
    mp.start_processes(_rank, args=(2, _port(), cfg, exp, str(tmp_path / "dp2.pt")), nprocs=2, join=True,
                       start_method="spawn")
    one, two = torch.load(tmp_path / "dp1.pt"), torch.load(tmp_path / "dp2.pt")


    assert one["weights"].keys() == two["weights"].keys()
    diff = max(float((one["weights"][k] - two["weights"][k]).abs().max()) for k in one["weights"])
    assert diff < 1e-5, diff
    from tests.e2e.helpers import weights
    init = weights(tiny_model)
    assert max(float((one["weights"][f"actor.{k}"] - v).abs().max()) for k, v in init.items()) > 1e-4  # it trained
    if freeze:
        for k, v in init.items():
            if k.startswith(("model.embed_tokens", "model.layers.0.")):
                assert torch.equal(two["weights"][f"actor.{k}"], v) and torch.equal(two["weights"][f"critic.{k}"], v), k
    assert one["actor"]["policy/grad_norm"] > 0 and one["critic"]["critic/grad_norm"] > 0
    for role in ("actor", "critic"):
        assert one[role].keys() == two[role].keys()
        for k in one[role]:
            assert two[role][k] == pytest.approx(one[role][k], rel=1e-4, abs=1e-6), (role, k)



def _resume_rank(rank: int, world: int, port: int, cfg, exp, ckpt: str, out_file: str) -> None:
    """Train the actor one mini-batch round, save (collective), build a resumed actor from that
    checkpoint and gather its optimizer state back (rank 0 writes both)."""
    os.environ["TURBORLHF_THREADS"] = "1"
    import torch.distributed as dist

    from turborlhf.engine.parallel import init_distributed
    from turborlhf.trainers.ppo import minibatch_schedule
    from turborlhf.trainers.ppo.actor import ActorWorker

    init_distributed("gloo", "127.0.0.1", port, rank, world, timeout_s=120)
    actor = ActorWorker(cfg, None, 8, threads=1)
    actor.train(exp, minibatch_schedule(exp.mask_BR.shape[0], cfg.algo, torch.Generator().manual_seed(1)), 0.05)
    os.makedirs(f"{ckpt}/actor", exist_ok=True)
    actor.save(f"{ckpt}/actor")
    dist.barrier()
    resumed = ActorWorker(cfg, ckpt, 8, threads=1)
    state = resumed._optim_state(resumed.opt)
    if rank == 0:
        torch.save(state, out_file)
    _leave()


def test_fsdp_resume_broadcasts_the_optimizer_state_from_rank_0(tiny_model, tmp_path):
    """Resuming under FSDP: rank 0 reads the saved full optimizer state and broadcasts it (the
    other ranks only map the file); gathered back, it equals what was saved."""
    import torch.multiprocessing as mp

    from turborlhf.trainers.ppo.roles import STATE_FILE

    cfg, exp = _cfg(tiny_model, "fsdp"), _experience(tiny_model)
    ckpt, out = tmp_path / "ckpt", tmp_path / "resumed_opt.pt"
    mp.start_processes(_resume_rank, args=(2, _port(), cfg, exp, str(ckpt), str(out)), nprocs=2, join=True,
                       start_method="spawn")
    saved = torch.load(ckpt / "actor" / STATE_FILE, weights_only=False)["opt"]["state"]
    got = torch.load(out, weights_only=False)["state"]
    assert saved.keys() == got.keys() and len(saved) > 0
    for name, st in saved.items():
        assert st.keys() == got[name].keys(), name
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(got[name][k])), (name, k)
    assert any(float(st["exp_avg"].abs().max()) > 0 for st in saved.values() if "exp_avg" in st)


def _allreduce_rank(rank: int, world: int, port: int, out_file: str, device: str = "cpu") -> None:
    from turborlhf.engine.parallel import allreduce_gradients, init_distributed

    init_distributed("gloo", "127.0.0.1", port, rank, world, timeout_s=120)
    got = {}
    for cap in (40, 1 << 20):                 # a bucket per few gradients / one bucket of all
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)).to(device)
        model[2].bias.requires_grad_(False)
        for i, p in enumerate(q for q in model.parameters() if q.requires_grad):
            if not (rank == 1 and i == 1):    # rank 1 has no gradient for the first bias
                p.grad = torch.full_like(p, float(10 * rank + i + 1))
        allreduce_gradients(model, bucket_bytes=cap)
        got[cap] = [p.grad.cpu() for p in model.parameters() if p.requires_grad]
    if rank == 0:
        torch.save(got, out_file)
    _leave()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_bucketed_allreduce_sums_every_gradient(device, tmp_path):
    """cuda: the asynchronous path (the next bucket packed while the last is reduced), with gloo's
    CUDA all-reduce so that two ranks can share one GPU (NCCL refuses that)."""
    import torch.multiprocessing as mp

    from turborlhf.engine.parallel import _buckets

    ps = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float64 if i == 3 else torch.float32))
          for i, n in enumerate((3, 3, 20, 2, 2))]
    for p in ps:
        p.grad = torch.zeros_like(p)
    assert [[int(p.numel()) for p in b] for b in _buckets(ps, 40)] == [[3, 3], [20], [2], [2]]
    out = tmp_path / "sums.pt"
    mp.start_processes(_allreduce_rank, args=(2, _port(), str(out), device), nprocs=2, join=True,
                       start_method="spawn")
    got = torch.load(out)
    want = [1 + 11, 2 + 0, 3 + 13, 4 + 14, 5 + 15]      # rank 0: i + 1; rank 1: 10 + i + 1, none for i = 1
    for cap, grads in got.items():
        assert [float(g.flatten()[0]) for g in grads] == want, cap
        assert all(bool((g == g.flatten()[0]).all()) for g in grads), cap
