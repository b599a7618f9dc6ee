"""The critic of `turborlhf ppo` (``algo.advantage_estimator: gae`` only): the value model's
worker and what it computes, read top to bottom in the order of the update.

- `critic_forward`: values ``B×R`` (column j: the value of the state in which response token j
  is chosen), also the fused update's experience pass;
- `critic_micro_step`: backward of the clipped value loss on one micro-batch, reduced with the
  mini-batch's global token count (`experience.minibatch_counts`);
- `CriticWorker`: ``values`` (with ``keep_as`` the fused update's kept forward), ``train`` (its
  mini-batch loop: micro-steps, optimizer step), ``save``.

Imports: `roles` (the trained roles' shared base) → `experience` → `turborlhf.algo`; never the
driver, never the actor. Shapes: B rows, P prompt columns, R response columns, S = P + R.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from turborlhf.algo import reduce_loss, value_clipfrac, value_loss
from turborlhf.config import ModelCfg, PPOConfig
from turborlhf.engine.checkpoint import _write_hf
from turborlhf.engine.parallel import dp_rank_world, root_forward
from turborlhf.engine.train import autocast, load_optimizer_and_schedule, make_optimizer, make_scheduler
from turborlhf.metrics import M
from turborlhf.models.forward import token_values
from turborlhf.models.load import load_tokenizer, load_trainable
from turborlhf.trainers.ppo.experience import Experience, minibatch_counts, rank_micro_batches
from turborlhf.trainers.ppo.roles import (STATE_FILE, KeptForward, Trainable, add_stats, in_chunks, setup_worker,
                                          stat_dtype, stats_as_floats, worker_device)

__all__ = ["CriticWorker", "critic_forward", "critic_micro_step"]


def critic_forward(critic: torch.nn.Module, cfg: PPOConfig, ids_BS, attn_BS, P: int, R: int):
    """The critic's forward: (values ``B×R``, None); column j is the value of the state in which
    response token j is chosen (the critic output at column P+j-1)."""
    with autocast((cfg.critic or cfg.actor).dtype, critic):      # a critic section's own precision
        return root_forward(critic, token_values, ids_BS, attn_BS)[:, P - 1:P - 1 + R], None


def critic_micro_step(critic: torch.nn.Module, cfg: PPOConfig, sub: Experience, counts: dict,
                      device: torch.device = torch.device("cpu"), kept: Optional[KeptForward] = None) -> dict:
    """Backward of the clipped value loss (token mean over the mini-batch) on one micro-batch
    (through the experience forward's graph with `kept`). `sub`: the micro-batch on the CPU (moved
    to `device` here). Returns the stats, weighted by the micro-batch's share, as detached 0-d
    tensors on `device`, as `actor.actor_micro_step` does (nothing here waits for the device)."""
    A, P = cfg.algo, sub.P
    host, sub = sub, sub.to(device)
    mask = sub.mask_BR
    sdt = stat_dtype(device)
    R = mask.shape[1]
    stats = {}
    if kept is not None:
        v, _ = kept.take(host)
    else:
        v, _ = critic_forward(critic, cfg, sub.ids_BS, sub.attn_BS, P, R)
    v_BR = value_loss(v, sub.values_BR, sub.returns_BR, mask, A.value_clip)
    vl = reduce_loss(v_BR, mask, "token_mean", num_tokens=counts["num_tokens"])
    vl.backward()
    stats[M.VALUE_LOSS] = vl.detach().to(sdt)
    if A.value_clip is not None:     # TRL's vf_clipfrac: where the clipped term is the active one
        w = mask.sum().to(sdt) / counts["num_tokens"]      # the micro-batch's share of the mini-batch's tokens
        clipfrac = value_clipfrac(v.detach(), sub.values_BR, sub.returns_BR, mask, A.value_clip)
        stats[M.VALUE_CLIPFRAC] = clipfrac.to(sdt) * w
    return stats


class CriticWorker(Trainable):
    """The value model (gae only) and its optimizer; initialised from `cfg.critic_init`."""

    def __init__(self, cfg, ckpt: Optional[str], total_updates: int, threads: int = 0) -> None:
        setup_worker(cfg, threads)
        self.cfg, self.device = cfg, worker_device(cfg)
        self.tok = load_tokenizer(cfg.actor.name_or_path)
        # without a critic section: full fine-tuning of the critic_init model on the worker's device, no
        # gradient checkpointing
        critic_cfg = cfg.critic or ModelCfg(name_or_path=cfg.critic_init, device=self.device.type)
        self.model = self._wrap(load_trainable("scalar", self._load_cfg(critic_cfg), self.tok, init=cfg.critic_init,
                                               ckpt_dir=Path(ckpt) / "critic" if ckpt else None))
        self.opt = make_optimizer(self.model, cfg.optim, lr=cfg.algo.critic_lr)
        self.sched = make_scheduler(self.opt, cfg.optim, total_updates)
        if ckpt:
            st = self._read_state(ckpt, "critic")
            load_optimizer_and_schedule(self.opt, self.sched, lambda: self._load_optim_state(self.opt, st["opt"]),
                                        st["sched"])
            self._restore_rng(st)

    def values(self, ids_BS: torch.Tensor, attn_BS: torch.Tensor, P: int, R: int,
               keep_as: Optional[str] = None) -> torch.Tensor:
        """Values ``B×R``: column j is the value of the state in which response token j is chosen.
        keep_as: as `ActorWorker.logprobs` (``train(..., kept=keep_as)`` backpropagates through them)."""
        ids, attn = ids_BS.to(self.device), attn_BS.to(self.device)
        fwd = lambda s: critic_forward(self.model, self.cfg, ids[s], attn[s], P, R)      # noqa: E731
        if keep_as is None:
            with torch.no_grad(), self._eval():
                return in_chunks(lambda s: fwd(s)[0].cpu(), ids.shape[0], self.cfg.train.micro_batch_size)
        return self._keep_forwards(keep_as, ids_BS, fwd)

    def train(self, exp: Experience, schedule: list, kept: Optional[str] = None) -> tuple[dict, int]:
        """Clipped value-loss updates over `schedule`: for each mini-batch, this rank's
        micro-batches (`experience.rank_micro_batches`), then the optimizer step (the gradients
        summed over the ranks). `kept`: as `ActorWorker.train`. Returns (stats summed over the
        steps as Python floats, number of optimizer steps)."""
        forwards = self._take_kept(kept)
        sums: dict = {}           # on the device until the end (`add_stats`)
        for mini in schedule:
            counts = minibatch_counts(exp.mask_BR[mini], self.cfg)
            for sub in rank_micro_batches(exp, mini, self.cfg.train.micro_batch_size):
                add_stats(sums, critic_micro_step(self.model, self.cfg, sub, counts, self.device,
                                                  forwards.next() if forwards is not None else None))
            add_stats(sums, {M.VALUE_GRAD_NORM: self._step(self.opt, self.sched)})
        return stats_as_floats(sums), len(schedule)

    def save(self, out_dir: str) -> None:
        """Write ``out_dir`` (HF dir + worker_state.pt) from rank 0; collective for FSDP."""
        model, opt_state, rngs = self._savable(), self._optim_state(self.opt), self._rank_rngs()
        if dp_rank_world()[0] != 0:
            return
        _write_hf(model, self.tok, Path(out_dir), merge=False)     # LoRA: the adapter directory
        torch.save({"opt": opt_state, "sched": self.sched.state_dict(), "rng": rngs}, Path(out_dir) / STATE_FILE)
