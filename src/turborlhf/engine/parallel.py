"""Data parallelism inside one role, with torch.distributed: process-group set-up, gradient
all-reduce (DDP's algorithm), FSDP2 sharding, and gathering full weights back.

Loss reduction contract (see `turborlhf.algo.reduce`): every rank reduces its micro-batches with
the *global* mini-batch denominators (tokens, sequences), so the global loss is the SUM of the
ranks' losses and the global gradient the SUM of their gradients. Hence gradients are all-reduced
with SUM, never averaged, and the update does not depend on the DP size.

Why not ``torch.nn.parallel.DistributedDataParallel``: our forward passes call the decoder stack
and the LM head separately (`turborlhf.models.forward`, so the B×T×V logits are never built),
which bypasses ``DDP.forward`` where the reducer prepares its bucketed hooks; and a rank may get no
micro-batch of a small mini-batch. `allreduce_gradients` is the same algorithm (replicas, SUM
all-reduces of the gradients in DDP's 25 MB buckets before the optimizer step) without those
constraints.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards each decoder layer and the root; its
forward hooks fire per layer, so the split forward still works. Gradients are reduce-scattered
as a SUM (divide factor 1).
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Optional

import torch
from torch import nn

__all__ = ["dp_rank_world", "init_distributed", "free_port", "allreduce_gradients", "shard_fsdp", "root_forward",
           "full_state_dict", "is_fsdp", "broadcast_object"]


def dp_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def free_port() -> tuple[str, int]:
    """This host's IP address (as others reach it) and a free TCP port on it."""
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:
        ip = "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        return ip, s.getsockname()[1]


def init_distributed(backend: str, addr: str, port: int, rank: int, world_size: int,
                     timeout_s: float = 300.0) -> None:
    """Join the default process group (``tcp://addr:port``).

    Args:
        backend: ``gloo`` (CPU), ``nccl`` (GPU; written, never run here) or ``auto``.
    Raises:
        RuntimeError: from torch when the peers do not all join within `timeout_s`.
    """
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":   # one GPU per worker (Ray sets CUDA_VISIBLE_DEVICES), so cuda:0
        torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


BUCKET_BYTES = 25 << 20     # DDP's default bucket_cap_mb


def allreduce_gradients(model: nn.Module, bucket_bytes: int = BUCKET_BYTES) -> None:
    """SUM the gradients of `model`'s trainable parameters over the default group (no-op without
    one). FSDP-sharded models were already reduce-scattered as a mean by FSDP: scaled by the world
    size to the sum.

    Parameters without a gradient on this rank (no micro-batch, unused branch) contribute zeros,
    so every rank takes part in the same collectives. Gradients go in buckets of about
    `bucket_bytes` per dtype/device (DDP's bucketing): a bucket of one gradient is reduced in
    place, several are flattened into one buffer; on a GPU the next bucket is packed while the
    previous one is on the wire, so at most two buffers exist at a time (not a copy of every
    gradient)."""
    import torch.distributed as dist

    rank, world = dp_rank_world()
    if world == 1:
        return
    if is_fsdp(model):   # FSDP reduce-scattered the mean (gloo has no PREMUL_SUM for a SUM): × world
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(world)
        return
    params = []
    seen = set()
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            params.append(p)

    def finish(bucket, flat, work) -> None:
        if work is not None:
            work.wait()
        if flat is not None:
            off = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
                off += n

    pending = None
    for bucket in _buckets(params, bucket_bytes):
        single = len(bucket) == 1 and bucket[0].grad.is_contiguous()
        flat = None if single else torch.cat([p.grad.reshape(-1) for p in bucket])
        # async only on a GPU (NCCL on its own stream): on the CPU gloo's reduce takes the cores
        # the packing would use
        work = dist.all_reduce(bucket[0].grad if single else flat, op=dist.ReduceOp.SUM,
                               async_op=bucket[0].grad.is_cuda)
        if pending is not None:
            finish(*pending)
        pending = (bucket, flat, work)
    if pending is not None:
        finish(*pending)


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """`params` in order, grouped by gradient dtype/device into runs of at most `bucket_bytes`
    (a larger gradient is a bucket of its own). Every rank builds the same buckets."""
    out: list[list[nn.Parameter]] = []
    open_: dict[tuple, tuple[list[nn.Parameter], int]] = {}    # (dtype, device) → open bucket, its bytes
    for p in params:
        key, size = (p.grad.dtype, p.grad.device), p.grad.numel() * p.grad.element_size()
        bucket, used = open_.get(key, ([], 0))
        if bucket and used + size > bucket_bytes:
            out.append(bucket)
            bucket, used = [], 0
        bucket.append(p)
        open_[key] = (bucket, used + size)
    out.extend(bucket for bucket, _ in open_.values())
    return out


def is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules())


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    from turborlhf.models.load import backbone_of

    layers = getattr(backbone_of(model), "layers", None)
    if layers is None:
        raise ValueError(f"FSDP: cannot find the decoder layers of {type(model).__name__} (expected .layers)")
    return list(layers)


def shard_fsdp(model: nn.Module, device: Optional[torch.device] = None, offload: bool = False) -> nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, then the whole model (embeddings, final norm,
    LM/score head; tied embeddings stay in one unit). `root_forward` runs our split forward
    passes through the root's hooks; `allreduce_gradients` turns FSDP's mean gradient into the sum.

    Args:
        model: the model, on the CPU (each unit moves to `device` as it is sharded) or on `device`.
        device: where the units compute; CUDA gives a CUDA mesh (NCCL), anything else the CPU's.
        offload: ``optim.offload`` under FSDP: FSDP2's ``CPUOffloadPolicy`` keeps the parameter
            and gradient shards in host memory (pinned on a GPU), gathers each unit onto the
            device for its forward and backward and moves its gradient shard back; the optimizer
            then steps on the CPU shards (DeepSpeed's ZeRO-3 offload, FSDP's ``cpu_offload``).
            On a CPU mesh it changes nothing but is applied all the same (tests run it there).

    Returns the same module (now sharded in place). Must be called on every rank of the group.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    _, world = dp_rank_world()
    dev_type = "cuda" if (device is not None and device.type == "cuda") else "cpu"
    mesh = init_device_mesh(dev_type, (world,))
    policy = CPUOffloadPolicy(pin_memory=dev_type == "cuda") if offload else OffloadPolicy()
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=policy)
    # under the offload policy the parameters seen outside a forward are host-memory shards:
    # `compute_device` (autocast, the forwards' input placement) reads where the units compute
    model._turborlhf_compute_device = torch.device(device) if dev_type == "cuda" else torch.device("cpu")
    hf_forward = model.forward

    def forward(*args, _turborlhf_fn=None, **kwargs):
        return _turborlhf_fn() if _turborlhf_fn is not None else hf_forward(*args, **kwargs)

    model.forward = forward      # see `root_forward`
    return model


def root_forward(model: nn.Module, fn, *args, **kwargs):
    """``fn(model, *args, **kwargs)``, run inside ``model.__call__`` when `model` is FSDP-sharded.

    Our forward functions call the decoder stack and the head separately; FSDP2's root unit
    (embeddings, final norm, head) gathers its parameters and schedules the gradient
    reduce-scatter in the root module's forward hooks, so the call must pass through them.
    For an unsharded model this is a plain call."""
    if is_fsdp(model):
        return model(_turborlhf_fn=lambda: fn(model, *args, **kwargs))
    return fn(model, *args, **kwargs)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict: plain ``state_dict`` for replicas (every rank); for an
    FSDP model a collective gather (call it on every rank) that lands on rank 0 only, the other
    ranks getting an empty dict (torch's ``full_state_dict`` with ``cpu_offload``)."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                    broadcast_from_rank0=False))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def broadcast_object(obj, src: int = 0):
    """Broadcast a picklable object from `src` to every rank (identity without a group)."""
    import torch.distributed as dist

    _, world = dp_rank_world()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
