"""The actor of `turborlhf ppo`: the trained policy's worker and everything it computes, read top
to bottom in the order of the update.

- `POLICY_LOSSES` / `policy_mask`: the per-token policy loss (``algo.policy_loss`` = ppo | gspo |
  cispo) and the tokens it covers;
- `actor_forward`: the training forward (log-probs and entropies at the sampling temperature),
  also the fused update's experience pass;
- `actor_micro_step` / `ptx_step`: backward of one micro-batch's loss, reduced with the
  mini-batch's global counts (`experience.minibatch_counts`);
- `ActorWorker`: ``logprobs`` (old log-probs; with ``keep_as`` the fused update's kept forward),
  ``train`` (its mini-batch loop: micro-steps, PPO-ptx, optimizer step, EMA), ``weights``,
  ``save``/``export``; `EmaModel`, `PtxStream`.

Imports: `roles` (the trained roles' shared base) → `experience` → `turborlhf.algo`; never the
driver, never the critic. Shapes: B rows, P prompt columns, R response columns, S = P + R.
"""
from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Callable, Optional

import torch

from turborlhf.algo import cispo_policy_loss, gspo_policy_loss, kl_estimate, ppo_policy_loss, reduce_loss
from turborlhf.config import PPOConfig
from turborlhf.data.loaders import load_sft
from turborlhf.data.tokenize import encode_examples
from turborlhf.engine.checkpoint import _write_hf, plan_digest
from turborlhf.engine.parallel import dp_rank_world, full_state_dict, is_fsdp, root_forward
from turborlhf.engine.run import export_model
from turborlhf.engine.train import autocast, load_optimizer_and_schedule, make_optimizer, make_scheduler
from turborlhf.metrics import M
from turborlhf.models.attention import kernels_of_training
from turborlhf.models.forward import response_logprobs
from turborlhf.models.load import is_lora, load_tokenizer, load_trainable, merged_named_parameters
from turborlhf.models.reference import LoraReference, reference_view
from turborlhf.rollout.sync import trainer_logprobs
from turborlhf.trainers.common import sft_loss_on_batch
from turborlhf.trainers.ppo.experience import Experience, minibatch_counts, rank_micro_batches, shares_prompts
from turborlhf.trainers.ppo.roles import (STATE_FILE, KeptForward, Trainable, add_stats, in_chunks, plain_copy,
                                          sampling_temperature, setup_worker, stat_dtype, stats_as_floats,
                                          worker_device)

__all__ = ["ActorWorker", "POLICY_LOSSES", "policy_mask", "actor_forward", "actor_micro_step", "ptx_step", "EmaModel",
           "PtxStream"]


# ----------------------------------------------------------------------------------------------
# Policy losses: one function per variant, (logp_BR, old_logp_BR, adv_BR, mask_BR, algo cfg) →
# (per-token loss_BR, stats with clipfrac and approx_kl)
# ----------------------------------------------------------------------------------------------

def _ppo(logp, old, adv, mask, A):
    return ppo_policy_loss(logp, old, adv, mask, A.eps_clip, A.eps_clip_high, A.dual_clip)


def _gspo(logp, old, adv, mask, A):
    return gspo_policy_loss(logp, old, adv, mask, A.eps_clip, A.eps_clip_high)


def _cispo(logp, old, adv, mask, A):
    return cispo_policy_loss(logp, old, adv, mask, A.eps_clip if A.eps_clip_high is None else A.eps_clip_high)


POLICY_LOSSES: dict[str, Callable] = {"ppo": _ppo, "gspo": _gspo, "cispo": _cispo}


def policy_mask(exp: Experience) -> torch.Tensor:
    """The actor-loss mask: every response token, less those a rollout tool wrote and the overlong
    filter's rows (`rlvr.attach_rollout_fields`)."""
    return exp.mask_BR if exp.loss_mask_BR is None else exp.loss_mask_BR


# ----------------------------------------------------------------------------------------------
# Forward and micro-step
# ----------------------------------------------------------------------------------------------

def actor_forward(actor: torch.nn.Module, cfg: PPOConfig, ids_BS, attn_BS, target_BS, P: int):
    """The actor's training forward: (log-probs, entropies) of the response columns ``B×R`` at the
    sampling temperature (`roles.sampling_temperature`), with autograd (the entropy in the graph
    only with an entropy bonus). The update and the fused experience pass both call it."""
    with autocast(cfg.actor.dtype, actor):
        logp, ent = root_forward(actor, response_logprobs, ids_BS, attn_BS, target_BS, with_entropy=True,
                                 entropy_grad=cfg.algo.entropy_coef > 0, temperature=sampling_temperature(cfg),
                                 share_prompts=shares_prompts(cfg.algo))
    return logp[:, P:], ent[:, P:]


def actor_micro_step(actor: torch.nn.Module, cfg: PPOConfig, sub: Experience, counts: dict, kl_coef: float,
                     device: torch.device = torch.device("cpu"), kept: Optional[KeptForward] = None) -> dict:
    """Backward of the actor's loss on one micro-batch, reduced with the mini-batch's global
    `counts` (so accumulated micro-batches, on one rank or several, give the mini-batch's gradient).
    With `kept` (fused update) the loss is taken through the experience forward's graph instead of
    a new forward. `sub`: the micro-batch on the CPU (moved to `device` here).

    Returns the stats, already weighted by the micro-batch's share, as detached 0-d tensors on
    `device` (`roles.stat_dtype`): nothing here waits for the device; `roles.add_stats` sums them
    there and `roles.stats_as_floats` reads them once per update."""
    A, P = cfg.algo, sub.P
    host, sub = sub, sub.to(device)
    mask = policy_mask(sub)     # response tokens, less the overlong filter's rows
    sdt = stat_dtype(device)
    w = mask.sum().to(sdt) / counts["num_tokens"]      # the micro-batch's share of the mini-batch's tokens
    B = mask.shape[0]
    stats = {}
    if kept is not None:
        logp, ent = kept.take(host)
    else:
        target = torch.cat([torch.zeros(B, P, device=device), sub.mask_BR], dim=1)
        logp, ent = actor_forward(actor, cfg, sub.ids_BS, sub.attn_BS, target, P)
    pg_BR, pg_stats = POLICY_LOSSES[A.policy_loss](logp, sub.old_logp_BR, sub.adv_BR, mask, A)  # ppo|gspo|cispo
    pg_BR = pg_BR if sub.is_weight_BR is None else pg_BR * sub.is_weight_BR     # TIS/MIS (algo.rollout_is)
    pg = reduce_loss(pg_BR, mask, A.loss_reduction, **counts)
    ent_term = reduce_loss(ent, mask, A.loss_reduction, **counts)
    loss = pg - A.entropy_coef * ent_term
    if A.kl_use_loss and sub.ref_logp_BR is not None:
        kl_term = reduce_loss(kl_estimate(logp, sub.ref_logp_BR, A.kl_estimator), mask, A.loss_reduction, **counts)
        loss = loss + kl_coef * kl_term
        stats[M.KL_LOSS] = kl_term.detach().to(sdt)
    loss.backward()
    # the metric is the mean entropy per response token whatever the loss's reduction (Dr. GRPO's
    # constant normaliser would scale it by mean length / max_new_tokens)
    ent_mean = (ent.detach() * mask).sum().to(sdt) / counts["num_tokens"]
    stats.update({M.POLICY_LOSS: pg.detach().to(sdt), M.ENTROPY: ent_mean,
                  M.CLIPFRAC: pg_stats["clipfrac"].detach().to(sdt) * w,
                  M.APPROX_KL: pg_stats["approx_kl"].detach().to(sdt) * w})
    return stats


def ptx_step(actor: torch.nn.Module, tok, cfg: PPOConfig, batch: list[dict], n_tok: int) -> dict:
    """PPO-ptx (Ouyang et al. 2022 Eq. 2): backward of ptx_coef · SFT NLL summed over `batch` and
    divided by `n_tok` (the token count of the whole micro-batch, when ranks split it). Returns
    ``{ptx loss: detached 0-d tensor}``."""
    loss, _ = root_forward(actor, sft_loss_on_batch, tok, batch, n_tok, cfg.actor.dtype)
    (cfg.algo.ptx_coef * loss).backward()
    return {M.PTX_LOSS: loss.detach()}      # a 0-d tensor, as `actor_micro_step`'s stats


# ----------------------------------------------------------------------------------------------
# EMA and the PPO-ptx stream
# ----------------------------------------------------------------------------------------------

class EmaModel:
    """fp32 exponential moving average of the actor's trainable weights (``ema ← β·ema + (1-β)·θ``),
    an independent copy of the actor (LoRA adapters included) for export and checkpoints."""

    def __init__(self, actor: torch.nn.Module, beta: float) -> None:
        self.beta = beta
        self.model = copy.deepcopy(actor).float().eval().requires_grad_(False)
        ema_params = dict(self.model.named_parameters())
        tracked = [(n, p) for n, p in actor.named_parameters() if p.requires_grad]
        self._pairs = [(n, ema_params[n], p) for n, p in tracked]

    @torch.no_grad()
    def update(self) -> None:
        for _, ema_p, p in self._pairs:
            ema_p.lerp_(p.detach().float(), 1.0 - self.beta)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: ema_p.detach().clone() for n, ema_p, _ in self._pairs}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for n, ema_p, _ in self._pairs:
            ema_p.copy_(state[n])


class PtxStream:
    """PPO-ptx data: an endless stream of encoded SFT examples, reshuffled each pass with
    ``seed + pass``; its position is the whole state, so a resumed run continues the stream."""

    def __init__(self, examples: list[dict], seed: int) -> None:
        if not examples:
            raise ValueError("PPO-ptx: no SFT examples")
        self.examples, self.seed, self.pos = examples, seed, 0
        self._order: tuple[int, list[int]] = (-1, [])

    def next(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.pos, len(self.examples))
            if self._order[0] != epoch:
                order = list(range(len(self.examples)))
                random.Random(self.seed + epoch).shuffle(order)
                self._order = (epoch, order)
            out.append(self.examples[self._order[1][i]])
            self.pos += 1
        return out


# ----------------------------------------------------------------------------------------------
# The worker
# ----------------------------------------------------------------------------------------------

class ActorWorker(Trainable):
    """The trained policy, its optimizer, schedule, EMA and PPO-ptx stream.

    Args:
        cfg: the `PPOConfig`. ckpt: checkpoint directory to resume from (its ``actor/``).
        total_updates: optimizer steps of the whole run (for the schedule).
        threads: torch intra-op threads (0 = ``train.threads`` / $TURBORLHF_THREADS).
    """

    def __init__(self, cfg, ckpt: Optional[str], total_updates: int, threads: int = 0) -> None:
        setup_worker(cfg, threads)
        A = cfg.algo
        self.cfg, self.device = cfg, worker_device(cfg)
        self.tok = load_tokenizer(cfg.actor.name_or_path)
        # LoRA / QLoRA / gradient checkpointing as cfg.actor says; resumes from the checkpoint's actor
        self.model = self._wrap(load_trainable("causal", self._load_cfg(cfg.actor), self.tok,
                                               ckpt_dir=Path(ckpt) / "actor" if ckpt else None))
        if A.ema_beta is not None and is_fsdp(self.model):
            raise ValueError("algo.ema_beta with distributed.dp_strategy=fsdp is not supported; use ddp")
        self.opt = make_optimizer(self.model, cfg.optim)
        self.sched = make_scheduler(self.opt, cfg.optim, total_updates)
        self.ema = EmaModel(self.model, A.ema_beta) if A.ema_beta is not None else None
        self.ptx = None
        if A.ptx_coef > 0:
            self.ptx = PtxStream(encode_examples(self.tok, load_sft(cfg.data.ptx_file, self.tok, **cfg.data.loader_kwargs()), cfg.data.ptx_max_len),
                                 cfg.train.seed)
        if ckpt:
            st = self._read_state(ckpt, "actor")
            load_optimizer_and_schedule(self.opt, self.sched, lambda: self._load_optim_state(self.opt, st["opt"]),
                                        st["sched"])
            if self.ema is not None:
                self.ema.load_state_dict(st["ema"])
            if self.ptx is not None:
                self.ptx.pos = st["ptx_pos"]
            self._restore_rng(st)

    def info(self) -> dict:
        """Start-up facts for the driver: the PPO-ptx examples' count and digest (a resumed run
        compares it with the checkpoint's, as it does the prompts), the current learning rate."""
        ptx = self.ptx.examples if self.ptx else []
        return {"ptx_examples": len(ptx), "lr": self.sched.get_last_lr()[0],
                "ptx_sha256": plan_digest([list(range(len(ptx)))], ptx) if ptx else None}

    def logprobs(self, ids_BS: torch.Tensor, attn_BS: torch.Tensor, mask_BR: torch.Tensor, P: int,
                 keep_as: Optional[str] = None) -> torch.Tensor:
        """Log-probs ``B×R`` of the response tokens under the current actor (micro-batched).

        keep_as: fused update (`experience.use_fused_update`): run with autograd and keep each
        micro-batch's log-probs and entropies under this name; ``train(..., kept=keep_as)``
        backpropagates through them instead of a second forward. The returned tensor is detached
        either way."""
        B, mb = ids_BS.shape[0], self.cfg.train.micro_batch_size
        target = torch.cat([torch.zeros(B, P), mask_BR], dim=1).to(self.device)
        ids, attn = ids_BS.to(self.device), attn_BS.to(self.device)
        if keep_as is None:
            with torch.no_grad(), self._eval(), autocast(self.cfg.actor.dtype, self.device), kernels_of_training():
                return in_chunks(lambda s: root_forward(self.model, response_logprobs, ids[s], attn[s], target[s],
                                                        temperature=sampling_temperature(self.cfg),
                                                        share_prompts=shares_prompts(self.cfg.algo))[0][:, P:].cpu(),
                                 B, mb)
        return self._keep_forwards(keep_as, ids_BS,
                                   lambda s: actor_forward(self.model, self.cfg, ids[s], attn[s], target[s], P))

    @torch.no_grad()
    def ref_logprobs(self, ids_BS: torch.Tensor, attn_BS: torch.Tensor, mask_BR: torch.Tensor, P: int) -> torch.Tensor:
        """Reference log-probs ``B×R`` from the LoRA actor with its adapters disabled (the frozen base
        is the initial policy): PPO's reference without a second copy of the model."""
        with reference_view(LoraReference(self.model)):
            return self.logprobs(ids_BS, attn_BS, mask_BR, P)

    def train(self, exp: Experience, schedule: list, kl_coef: float, kept: Optional[str] = None) -> tuple[dict, int]:
        """Policy (+ KL, − entropy, + ptx) updates over `schedule` (mini-batches of row indices):
        for each mini-batch, this rank's micro-batches (`experience.rank_micro_batches`), each
        backpropagated with the mini-batch's global counts, then PPO-ptx, the optimizer step (the
        gradients summed over the ranks) and the EMA. `kept`: the name the experience's
        ``logprobs(keep_as=...)`` kept its forwards under (fused update), else None. Returns (stats
        summed over the steps as Python floats, number of optimizer steps)."""
        forwards = self._take_kept(kept)
        sums: dict = {}           # on the device until the end (`add_stats`)
        for mini in schedule:
            counts = minibatch_counts(policy_mask(exp)[mini], self.cfg)   # less the overlong filter's rows
            for sub in rank_micro_batches(exp, mini, self.cfg.train.micro_batch_size):
                add_stats(sums, actor_micro_step(self.model, self.cfg, sub, counts, kl_coef, self.device,
                                                 forwards.next() if forwards is not None else None))
            stats = self._ptx() if self.ptx is not None else {}
            stats[M.POLICY_GRAD_NORM] = self._step(self.opt, self.sched)
            if self.ema is not None:
                self.ema.update()
            add_stats(sums, stats)
        return stats_as_floats(sums), len(schedule)

    def _ptx(self) -> dict:
        """PPO-ptx on one micro-batch of SFT data, split over the ranks with the global token count."""
        batch = self.ptx.next(self.cfg.train.micro_batch_size)   # every rank advances the same stream
        n_tok = sum(sum(e["loss_mask"]) for e in batch)
        rank, world = dp_rank_world()
        mine = batch[rank::world]
        return ptx_step(self.model, self.tok, self.cfg, mine, n_tok) if mine else {M.PTX_LOSS: 0.0}

    def weights(self) -> Optional[dict[str, torch.Tensor]]:
        """The actor's parameters by HF name (rank 0; None elsewhere), for the rollout engines:
        CPU copies for Ray's object store; on the local backend the trainer's own tensors, which
        the engine copies (a GPU trainer's weights reach a GPU engine without a trip through the
        CPU). Collective for FSDP (every rank gathers)."""
        if is_fsdp(self.model):
            sd = full_state_dict(self.model)
            return sd if dp_rank_world()[0] == 0 else None
        if dp_rank_world()[0] != 0:
            return None
        if self.cfg.distributed.backend != "ray":   # in this process: the engine copies from the trainer's own
            return self.local_weights()             # tensors (LoRA merged)
        return {n: p.detach().cpu() for n, p in merged_named_parameters(self.model)}   # to the object store

    def local_weights(self):
        """This rank's own parameters by HF name (LoRA merged), for a rollout engine in the same
        process (`distributed.colocate_all_models` on Ray with DDP, where every rank holds them all):
        the engine copies them, nothing goes through the object store. Under LoRA the merged
        matrices are made one at a time as the engine reads them (`MergedWeights`): a whole merged
        model at once would sit beside the adapted one (a QLoRA base dequantized, on a small GPU)."""
        if is_lora(self.model):
            return MergedWeights(self.model)
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def canary_logprobs(self, canary) -> Optional[list[list[float]]]:
        """The trainer side of the weight-sync check (`turborlhf.rollout.sync.trainer_logprobs`),
        LoRA merged as the engines see it; rank 0's answer (None elsewhere). Collective for FSDP:
        every rank runs the sharded forward on the canary, or, where the trainer's matrices must
        be rounded to bf16 as the engine's are, gathers them into a plain copy on rank 0 (the
        rounding swaps parameters that FSDP itself swaps in and out)."""
        rank0 = dp_rank_world()[0] == 0
        if is_fsdp(self.model):
            if canary.bf16_weights:
                plain = plain_copy(self.model)
                return trainer_logprobs(plain, canary, self.cfg.rollout.dtype) if rank0 else None
            out = trainer_logprobs(self.model, canary, self.cfg.rollout.dtype)
            return out if rank0 else None
        return trainer_logprobs(self.model, canary, self.cfg.rollout.dtype) if rank0 else None

    def save(self, out_dir: str) -> None:
        """Write ``out_dir`` (HF dir + worker_state.pt) from rank 0; collective for FSDP."""
        model, opt_state, rngs = self._savable(), self._optim_state(self.opt), self._rank_rngs()
        if dp_rank_world()[0] != 0:
            return
        _write_hf(model, self.tok, Path(out_dir), merge=False)     # LoRA: the adapter directory
        torch.save({"opt": opt_state, "sched": self.sched.state_dict(),
                    "ema": self.ema.state_dict() if self.ema else None, "ptx_pos": self.ptx.pos if self.ptx else 0,
                    "rng": rngs}, Path(out_dir) / STATE_FILE)

    def export(self, out_dir: str) -> None:
        """The final actor (and its EMA under ``<out_dir>/ema``) as HF directories (rank 0)."""
        model = self._savable()
        if dp_rank_world()[0] != 0:
            return
        export_model(model, self.tok, out_dir)
        if self.ema is not None:
            export_model(self.ema.model, self.tok, Path(out_dir) / "ema")


class MergedWeights:
    """A LoRA model's merged weights for a rollout engine in the same process: each call of
    `items` yields (HF name, tensor) pairs from `turborlhf.models.load.merged_named_parameters`,
    each merged matrix made as it is read and dropped once the engine copied it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def items(self):
        return merged_named_parameters(self.model)
