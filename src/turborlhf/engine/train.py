"""One rank's training mechanics: precision, optimizer, schedule, seeding, gradient steps.

Precision: parameters stay fp32 (AdamW's moments are bf16 beside bf16 compute, `turborlhf.engine.optim`);
forward/backward run under bf16 autocast where ``dtype`` resolves to bf16 (`turborlhf.engine.hardware`:
native bf16 only, ~2-4× faster matmuls on AVX-512-BF16/AMX CPUs and on GPUs), else in fp32.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random

import numpy as np
import torch
from torch import nn

from turborlhf.errors import RunError

logger = logging.getLogger(__name__)

__all__ = ["autocast", "compute_device", "seed_everything", "set_threads", "make_optimizer", "CPUOffloadAdamW", "make_scheduler",
           "clip_and_step", "NonFiniteError", "trainable_parameters", "rng_state", "set_rng_state",
           "count_parameters"]


def compute_device(model: nn.Module) -> torch.device:
    """Where `model` computes: its parameters' device, except for a model `shard_fsdp` sharded with
    CPU offload, whose parameters (the shards) stay in host memory while each unit is gathered onto
    the device for its forward and backward: the device it recorded."""
    dev = getattr(model, "_turborlhf_compute_device", None)
    return dev if dev is not None else next(model.parameters()).device


def autocast(dtype: str, device: torch.device | str | nn.Module | None = None):
    """Context manager for the configured compute dtype (``auto``, ``bf16`` or ``fp32``).

    bf16 autocast is entered for `device`'s type (the model's device: pass the model, whose
    `compute_device` is taken); with no `device`, for the CPU and, where torch sees
    CUDA, for CUDA too, so a model on either runs as configured (and a CPU that emulates bf16
    warns about it, though the model may be on the GPU: pass the model). ``auto`` is resolved per device
    type by `turborlhf.engine.hardware.compute_dtype` (bf16 only where it is native and fast)."""
    from turborlhf.engine.hardware import compute_dtype

    if isinstance(device, nn.Module):
        device = compute_device(device)
    types = [torch.device(device).type] if device is not None else \
        ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    stack = contextlib.ExitStack()
    for t in types:
        if t in ("cpu", "cuda", "mps") and compute_dtype(dtype, t) == "bf16":
            stack.enter_context(torch.autocast(device_type=t, dtype=torch.bfloat16))
    return stack


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def set_threads(n: int = 0) -> int:
    """Set torch intra-op threads (0 = all cores, or $TURBORLHF_THREADS)."""
    n = n or int(os.environ.get("TURBORLHF_THREADS", "0")) or (os.cpu_count() or 1)
    torch.set_num_threads(n)
    return n


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        n += p.numel()
    return n


class CPUOffloadAdamW(torch.optim.AdamW):
    """AdamW whose states live in CPU memory (``optim.offload``; DeepSpeed's offload_optimizer and
    OpenRLHF's ``--adam_offload`` do the same on GPUs).

    The optimizer owns fp32 CPU copies of the model's parameters (pinned when the model is on a
    GPU); `step` copies the gradients to them, runs plain AdamW on the CPU (its exp_avg and
    exp_avg_sq stay there) and copies the new values back into the model's parameters. The
    device then holds weights and gradients only: 8 bytes per trainable parameter less, 12 more
    in CPU memory. The update is exactly AdamW's (same ops on the same fp32 values), the state
    dict has AdamW's layout, so checkpoints move freely between offloaded and plain runs.

    Args:
        param_groups: AdamW parameter groups over the model's parameters.
        **kw: AdamW arguments (lr, betas, eps, foreach, ...).
    """

    def __init__(self, param_groups: list[dict], **kw) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        cpu_groups = []
        for g in param_groups:
            copies = []
            for p in g["params"]:
                c = torch.empty(p.shape, dtype=torch.float32, pin_memory=p.is_cuda)
                c.copy_(p.detach())
                c.requires_grad_(True)
                self._pairs.append((p, c))
                copies.append(c)
            cpu_groups.append({**g, "params": copies})
        super().__init__(cpu_groups, **kw)

    @torch.no_grad()
    def step(self, closure=None):
        # asynchronous copies from CUDA only, then one synchronize: from MPS a non-blocking copy
        # to the CPU can return before its data lands (the step would read stale gradients)
        for p, c in self._pairs:
            c.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32, non_blocking=p.is_cuda)
        if any(p.is_cuda for p, _ in self._pairs[:1]):
            torch.cuda.synchronize()
        loss = super().step(closure)
        for p, c in self._pairs:
            p.copy_(c, non_blocking=True)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p, _ in self._pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def make_optimizer(model: nn.Module, cfg, lr: float | None = None, force_offload: bool = False) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; no weight decay on biases, norms and embeddings.

    ``cfg.state_dtype`` = bf16 (what ``auto`` gives on the CPU where the C kernel builds) stores the
    moments in bf16 (`BF16StateAdamW`: 4 B per parameter instead of 8, fp32 update); fp32 (what
    ``auto`` gives on a GPU) uses torch's fused AdamW. Non-fp32 parameters always get torch's AdamW.

    ``cfg.offload`` (or `force_offload`) keeps the states in CPU memory (`CPUOffloadAdamW`). When
    every trainable parameter is on the CPU already that saves nothing, so plain AdamW is used
    and a note says so; `force_offload` builds the offloaded optimizer anyway (tests compare the
    two updates on the CPU)."""
    decay, no_decay = [], []
    seen = set()
    # embeddings by type as well as by name: GPT-2's are wte/wpe (a name test gave them decay)
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim < 2 or "norm" in name or "embed" in name or id(p) in embeddings:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    # torch's fused AdamW kernel (CPU since torch 2.4, and CUDA): one pass over each tensor. Measured
    # on SmolLM2-135M fp32, 2 threads: 0.088 s per step vs 0.399 s foreach (0.377 s the plain loop)
    kw = dict(lr=lr if lr is not None else cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    params = [p for g in groups for p in g["params"]]
    if force_offload or getattr(cfg, "offload", False):
        if force_offload or any(p.device.type != "cpu" for p in params):
            return CPUOffloadAdamW(groups, **kw)          # its fp32 copies are CPU tensors: fused works
        from turborlhf.engine.parallel import is_fsdp

        logger.info("[optim] offload: " + ("FSDP keeps the parameter shards in CPU memory (CPUOffloadPolicy); "
                                           "the optimizer steps there" if is_fsdp(model) else
                                           "the parameters are in CPU memory already, nothing to offload"))
    from turborlhf.engine.hardware import state_dtype_for

    # auto: a config that did not go through resolve_hardware, resolved as it would be
    state_dtype = state_dtype_for(getattr(cfg, "state_dtype", "fp32"), params[0].device if params else "cpu")
    if state_dtype == "bf16" and all(p.dtype == torch.float32 for p in params):
        from turborlhf.engine.optim import BF16StateAdamW

        return BF16StateAdamW(groups, lr=kw["lr"], betas=kw["betas"], eps=kw["eps"])
    if not all(p.dtype.is_floating_point for p in params) or {p.device.type for p in params} not in ({"cpu"}, {"cuda"}):
        kw = {**kw, "fused": None, "foreach": True}
    return torch.optim.AdamW(groups, **kw)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int):
    """Linear warm-up then constant / cosine / linear decay to ``min_lr_ratio · lr``."""
    warm = cfg.warmup_steps
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if cfg.schedule == "cosine":
            shape = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            shape = 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def load_optimizer_and_schedule(optimizer: torch.optim.Optimizer, scheduler, load_optimizer,
                                scheduler_state: dict) -> None:
    """Resume `optimizer` (`load_optimizer()` loads its checkpoint state) and `scheduler` (a
    `make_scheduler` one: `scheduler_state`) at the checkpoint's step, with the hyperparameters
    of the config they were built from: torch's ``load_state_dict`` brings back the saved param
    groups (lr, weight decay, betas, eps) and the schedule's base learning rates, so a changed
    ``optim.lr`` under ``--resume-changed`` was logged as taken and then ignored. The moments and
    step counts are the checkpoint's; the learning rate is the new schedule's at that step."""
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    load_optimizer()
    scheduler.load_state_dict(scheduler_state)
    scheduler.base_lrs = base_lrs
    for group, config, factor in zip(optimizer.param_groups, fresh, scheduler.lr_lambdas):
        group.update(config)
        group["lr"] = config["initial_lr"] * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


class NonFiniteError(RunError):
    """A loss, gradient or parameter of a training step is NaN or infinite. Raised by
    `clip_and_step` at the step that produced it, before anything of that step is saved, so the
    last checkpoint stays the last good state. The message is one line naming the role and the
    first offending tensor."""


def _named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen, out = set(), []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _first_non_finite(named: list[tuple[str, torch.Tensor]], overflow_ok: bool = False) -> str | None:
    """'<name> (<count> of <numel> values non-finite, e.g. nan)' for the first tensor holding a
    NaN/inf. When none does (a norm that overflowed fp32): None if `overflow_ok`, else the tensor
    of largest magnitude."""
    biggest, big_name = -1.0, "?"
    for name, t in named:
        t = _local(t.detach())
        bad = ~torch.isfinite(t)
        if bad.any():
            return f"{name} ({int(bad.sum())} of {t.numel()} values non-finite, e.g. {float(t[bad].flatten()[0])})"
        m = float(t.abs().max()) if t.numel() else 0.0
        if m > biggest:
            biggest, big_name = m, name
    if overflow_ok:
        return None
    return f"{big_name} (all values finite, largest magnitude {biggest:.3g}: the norm overflows fp32)"


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, max_grad_norm: float,
                  role: str = "policy", loss: torch.Tensor | float | None = None) -> float:
    """Clip gradients by global norm (if > 0), step optimizer and schedule, zero grads.

    Args:
        role: the trained model's role (``policy``, ``actor``, ``critic``, ``reward_model``...),
            named in errors.
        loss: this step's loss, checked for NaN/inf when given (a non-finite loss also shows up
            as non-finite gradients, which are always checked).

    Returns the pre-clip gradient norm.

    Raises:
        NonFiniteError: the loss or a gradient is NaN/inf (the optimizer has not stepped, the
            weights are unchanged), or a parameter is NaN/inf after the optimizer step. One line
            naming `role` and the first offending tensor by parameter name. The run stops at the
            step that made the value, before it is logged as a good step or saved.
    """
    if loss is not None and not math.isfinite(float(loss)):
        raise NonFiniteError(f"{role}: the loss is {float(loss)} at this step; no update was applied")
    from turborlhf.engine.optim import BF16StateAdamW, count_nonfinite, sum_of_squares

    named = _named_trainable(model)
    params = [p for _, p in named]
    grads = [p.grad for p in params if p.grad is not None]
    # the global 2-norm: one C pass per gradient where they are plain fp32 CPU tensors (about 2.5x
    # torch's per-tensor norms there), else torch's (DTensors all-reduce their shards' norms)
    sq = sum_of_squares(grads)
    total = torch.nn.utils.get_total_norm(grads) if sq is None else None
    norm = float(total) if sq is None else math.sqrt(sq)
    if not math.isfinite(norm):      # checked before clipping, which would spread the NaN to every gradient
        what = _first_non_finite([(n, p.grad) for n, p in named if p.grad is not None])
        raise NonFiniteError(f"{role}: gradient norm {norm} at this step, first offending gradient: {what}; "
                             "no update was applied")
    bad = None
    if isinstance(optimizer, BF16StateAdamW):
        # torch's clip_grads_with_norm_ coefficient, applied inside the update (no pass writing the
        # gradients); the C kernel also counts the NaN/inf weights it writes
        scale = min(1.0, max_grad_norm / (norm + 1e-6)) if max_grad_norm > 0 else 1.0
        optimizer.step(grad_scale=scale)
        bad = optimizer.last_nonfinite
    else:
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, torch.tensor(norm) if total is None else total)
        optimizer.step()
    if bad is None:
        bad = count_nonfinite([p.detach() for p in params])
    if bad is None:
        # one fused pass over the new weights (torch's foreach 2-norm: ~0.06 s for 161M fp32 parameters
        # on 2 threads, Zen 4); a NaN/inf anywhere makes the sum non-finite. Only then are the tensors
        # searched one by one (a sum that merely overflows, with every value finite, is let through)
        bad = params and not math.isfinite(float(torch.stack(torch._foreach_norm([_local(p.detach()) for p in params])).sum()))
    if bad:
        what = _first_non_finite(named, overflow_ok=True)
        if what is not None:
            raise NonFiniteError(f"{role}: non-finite parameter after the optimizer step (gradient norm {norm:.4g}): "
                                 f"{what}")
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def rng_state() -> dict:
    """Python's, numpy's and torch's random states, with each visible CUDA device's and the MPS
    device's (dropout in a LoRA adapter on a GPU draws from it), for a checkpoint."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():             # Apple silicon: dropout on the MPS device draws from it
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state`'s states. The CUDA ones only where the run resumes with as many visible
    devices as it saved, the MPS one where MPS is available (elsewhere `seed_everything`'s seeding
    stands)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if state.get("mps") is not None and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])
