"""The worker side of `turborlhf ppo`: what the actor and critic workers compute on their rows
(`turborlhf.trainers.ppo_workers` calls it; the driver `turborlhf.trainers.ppo` only builds the
`Experience` and plans the mini-batches). Imports flow one way: ``ppo`` (driver) → ``ppo_workers``
(roles) → this module; nothing here imports the driver or the workers.

- `Experience`: one rollout batch (the tensors every role reads);
- `actor_forward` / `critic_forward`: the training forwards (also the fused update's experience pass);
- `actor_micro_step` / `critic_micro_step` / `ptx_step`: backward of one micro-batch's loss,
  reduced with the mini-batch's global counts (`minibatch_counts`);
- `row_shards`: which rows each data-parallel rank takes (the driver splits the experience
  forwards and the workers the updates with it, so both see the same micro-batches);
- `use_fused_update` / `KeptForward`: whether a role backpropagates through its experience
  forward, and that kept forward; `EmaModel`; `PtxStream`.

Shapes: B rows (prompts × samples), P prompt columns, R response columns (the response tokens; T
in `turborlhf.algo`), S = P + R columns of ``ids_BS = [prompt_BP | response_BR]``.
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from turborlhf.algo import (cispo_policy_loss, gspo_policy_loss, kl_estimate, masked_mean, ppo_policy_loss, reduce_loss,
                            value_loss)
from turborlhf.config import PPOConfig
from turborlhf.engine.parallel import root_forward
from turborlhf.engine.train import autocast
from turborlhf.metrics import M
from turborlhf.models.forward import response_logprobs, token_values
from turborlhf.trainers.common import sft_loss_on_batch

__all__ = ["Experience", "KeptForward", "EmaModel", "PtxStream", "row_shards", "use_fused_update", "minibatch_counts",
           "actor_forward", "critic_forward", "actor_micro_step", "critic_micro_step", "ptx_step", "POLICY_LOSSES",
           "policy_mask", "sampling_temperature"]


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


def policy_mask(exp) -> torch.Tensor:
    """The actor-loss mask: the overlong filter's when set, else every response token."""
    return exp.mask_BR if exp.loss_mask_BR is None else exp.loss_mask_BR


@dataclass
class Experience:
    """One rollout batch: B rows (prompts × samples), P prompt columns, R response columns,
    ``ids_BS = [prompt_BP | response_BR]`` (S = P + R). Built by the driver
    (`turborlhf.trainers.ppo.score_and_advantages`), sent whole to the actor and critic workers."""

    ids_BS: torch.Tensor
    attn_BS: torch.Tensor
    P: int
    mask_BR: torch.Tensor          # 1 on response tokens (EOS included when sampled)
    eos_B: torch.Tensor            # bool: response ended with a stop token
    old_logp_BR: torch.Tensor
    ref_logp_BR: Optional[torch.Tensor]   # None without a reference model
    values_BR: Optional[torch.Tensor]     # None without a critic
    raw_scores_B: torch.Tensor     # combined reward Σ w·s
    scores_B: torch.Tensor         # after normalisation, EOS penalty and clipping
    kl_BR: torch.Tensor            # k-estimate of KL(actor‖ref) per token (0 without a reference)
    source_scores: Optional[dict] = None   # reward source name → scores_B
    adv_BR: Optional[torch.Tensor] = None
    returns_BR: Optional[torch.Tensor] = None
    rollout_logp_BR: Optional[torch.Tensor] = None   # the rollout engine's log-probs of the sampled tokens
    is_weight_BR: Optional[torch.Tensor] = None      # TIS/MIS weights of the policy loss (algo.rollout_is)
    loss_mask_BR: Optional[torch.Tensor] = None      # actor-loss mask (algo.overlong_filter); None = mask_BR

    def rows(self, idx: torch.Tensor) -> "Experience":
        """Sub-batch of rows (trimmed to its own longest response)."""
        sub = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        r = int(sub["mask_BR"].sum(-1).max().clamp(min=1))
        for k in ("mask_BR", "old_logp_BR", "ref_logp_BR", "values_BR", "kl_BR", "adv_BR", "returns_BR",
                  "rollout_logp_BR", "is_weight_BR", "loss_mask_BR"):
            if sub[k] is not None:
                sub[k] = sub[k][:, :r]
        sub["ids_BS"] = sub["ids_BS"][:, :self.P + r]
        sub["attn_BS"] = sub["attn_BS"][:, :self.P + r]
        return Experience(**sub)

    def to(self, device: torch.device) -> "Experience":
        """The same experience with its tensors on `device` (itself on the CPU)."""
        if torch.device(device).type == "cpu":
            return self
        return Experience(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})


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


def row_shards(B: int, micro_batch_size: int, world: int) -> dict[int, slice]:
    """Rows of a batch per rank: contiguous blocks of whole micro-batches, so every rank chunks
    its rows exactly as one rank would (same micro-batch boundaries, same numbers). Ranks without
    rows are left out."""
    n_micro = -(-B // micro_batch_size)
    per = -(-n_micro // world)
    out = {}
    for r in range(world):
        lo, hi = r * per * micro_batch_size, min(B, (r + 1) * per * micro_batch_size)
        if lo < hi:
            out[r] = slice(lo, hi)
    return out


def use_fused_update(cfg: PPOConfig, B: int, group) -> bool:
    """Whether `group` (actor or critic) backpropagates through its experience forward.

    With one PPO epoch of one mini-batch the update starts from the weights that produced the
    experience, so the old log-probs (values) are exactly what the training forward computes
    (ratio 1, value clip inactive): keeping that forward's graph saves one forward pass per role
    and step. ``algo.fused_update``:
    - ``auto`` (= ``actor``): the actor's graph, when each rank's rows fit one micro-batch; the
      critic's never, because it would be held at the same time as the actor's (peak memory +
      the critic's activations; measured on the PPO bench: 5.82 → 4.82 GiB for one more critic
      forward), so auto holds no more than an unfused step;
    - ``both``: as auto for the actor and the critic;
    - ``always``: both, whenever the schedule allows (a rank's whole share of activations at once);
    - ``never``.
    Never under FSDP (its parameters are resharded between the calls)."""
    A = cfg.algo
    if A.fused_update == "never" or A.ppo_epochs != 1 or A.num_mini_batches != 1:
        return False
    if A.fused_update in ("auto", "actor") and getattr(group, "role", None) != "actor":
        return False
    if group.world_size > 1 and cfg.distributed.dp_strategy == "fsdp":
        return False
    return A.fused_update == "always" or B <= cfg.train.micro_batch_size * group.world_size


def minibatch_counts(mask_BR: torch.Tensor, cfg: PPOConfig) -> dict:
    """Global denominators of one mini-batch for `reduce_loss` (tokens, sequences, max length)."""
    A = cfg.algo
    return {"num_tokens": float(mask_BR.sum().clamp(min=1)), "max_len": cfg.rollout.max_new_tokens,
            "num_seqs": float((mask_BR.sum(-1) > 0).sum()) if A.loss_reduction == "seq_mean_token_mean"
            else float(mask_BR.shape[0])}


@dataclass
class KeptForward:
    """A micro-batch's experience forward kept with its graph for the fused update: the input ids
    (CPU, to check the update sees the same rows) and the outputs over all R response columns
    (actor: log-probs and entropies; critic: values), on the worker's device.

    Why a worker keeps state between two calls: with one PPO epoch of one mini-batch
    (`use_fused_update`) the update's forward would recompute exactly the
    experience forward, so the worker's ``logprobs``/``values(keep_graph=True)`` keeps these
    objects and its next ``train`` backpropagates through them (and frees them). An autograd
    graph cannot travel through the driver with the rest of the experience (under Ray it lives in
    another process, on that worker's device), so it stays where it was built; `take` checks the
    rows, so a different micro-batch grouping fails loudly instead of training on wrong rows."""

    ids_BS: torch.Tensor
    out_BR: torch.Tensor
    ent_BR: Optional[torch.Tensor] = None

    def take(self, sub: "Experience") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The outputs trimmed to `sub`'s response width; RuntimeError if `sub` has other rows."""
        S = sub.ids_BS.shape[1]
        if self.ids_BS.shape[0] != sub.ids_BS.shape[0] or not torch.equal(self.ids_BS[:, :S], sub.ids_BS.cpu()):
            raise RuntimeError("fused update: the micro-batch differs from the experience forward's rows "
                               "(set algo.fused_update=never and report this)")
        r = sub.mask_BR.shape[1]
        return self.out_BR[:, :r], (self.ent_BR[:, :r] if self.ent_BR is not None else None)


def sampling_temperature(cfg: PPOConfig) -> float:
    """The temperature the policy's log-probs are taken at: the rollout's sampling temperature (1
    for greedy rollouts), so the trainer's π(a|s) is the distribution the samples came from and
    the engine's own log-probs (rollout correction) compare like with like."""
    t = cfg.rollout.temperature
    return t if t > 0 else 1.0


def actor_forward(actor: torch.nn.Module, cfg: PPOConfig, ids_BS, attn_BS, target_BS, P: int):
    """The actor's training forward: (log-probs, entropies) of the response columns ``B×R`` at the
    sampling temperature (`sampling_temperature`), with autograd (the entropy in the graph only with
    an entropy bonus). The update and the fused experience pass both call it."""
    with autocast(cfg.actor.dtype):
        logp, ent = root_forward(actor, response_logprobs, ids_BS, attn_BS, target_BS, with_entropy=True,
                                 entropy_grad=cfg.algo.entropy_coef > 0, temperature=sampling_temperature(cfg))
    return logp[:, P:], ent[:, P:]


def critic_forward(critic: torch.nn.Module, cfg: PPOConfig, ids_BS, attn_BS, P: int, R: int):
    """The critic's forward: (values ``B×R``, None); column j is the value of the state in which
    response token j is chosen."""
    with autocast(cfg.actor.dtype):
        return root_forward(critic, token_values, ids_BS, attn_BS)[:, P - 1:P - 1 + R], None


def actor_micro_step(actor: torch.nn.Module, cfg: PPOConfig, sub: Experience, counts: dict, kl_coef: float,
                     device: torch.device = torch.device("cpu"), kept: Optional[KeptForward] = None) -> dict:
    """Backward of the actor's loss on one micro-batch, reduced with the mini-batch's global
    `counts` (so accumulated micro-batches, on one rank or several, give the mini-batch's gradient).
    Returned stats are already weighted by the micro-batch's share. With `kept` (fused update) the
    loss is taken through the experience forward's graph instead of a new forward."""
    A, P = cfg.algo, sub.P
    sub = sub.to(device)
    mask = policy_mask(sub)     # response tokens, less the overlong filter's rows
    w = float(mask.sum()) / counts["num_tokens"]
    B = mask.shape[0]
    stats = {}
    if kept is not None:
        logp, ent = kept.take(sub)
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
        stats[M.KL_LOSS] = float(kl_term.detach())
    loss.backward()
    stats.update({M.POLICY_LOSS: float(pg.detach()), M.ENTROPY: float(ent_term.detach()),
                  M.CLIPFRAC: float(pg_stats["clipfrac"]) * w, M.APPROX_KL: float(pg_stats["approx_kl"]) * w})
    return stats


def critic_micro_step(critic: torch.nn.Module, cfg: PPOConfig, sub: Experience, counts: dict,
                      device: torch.device = torch.device("cpu"), kept: Optional[KeptForward] = None) -> dict:
    """Backward of the clipped value loss (token mean over the mini-batch) on one micro-batch
    (through the experience forward's graph with `kept`)."""
    A, P = cfg.algo, sub.P
    sub = sub.to(device)
    mask = sub.mask_BR
    w = float(mask.sum()) / counts["num_tokens"]
    R = mask.shape[1]
    stats = {}
    if kept is not None:
        v, _ = kept.take(sub)
    else:
        v, _ = critic_forward(critic, cfg, sub.ids_BS, sub.attn_BS, P, R)
    v_BR = value_loss(v, sub.values_BR, sub.returns_BR, mask, A.value_clip)
    vl = reduce_loss(v_BR, mask, "token_mean", num_tokens=counts["num_tokens"])
    vl.backward()
    stats[M.VALUE_LOSS] = float(vl.detach())
    if A.value_clip is not None:
        clipped = ((v - sub.values_BR).abs() > A.value_clip).float()
        stats[M.VALUE_CLIPFRAC] = float(masked_mean(clipped, mask)) * w
    return stats


def ptx_step(actor: torch.nn.Module, tok, cfg: PPOConfig, batch: list[dict], n_tok: int) -> dict:
    """PPO-ptx (Ouyang et al. 2022 Eq. 2): backward of ptx_coef · SFT NLL summed over `batch` and
    divided by `n_tok` (the token count of the whole micro-batch, when ranks split it)."""
    loss, _ = root_forward(actor, sft_loss_on_batch, tok, batch, n_tok, cfg.actor.dtype)
    (cfg.algo.ptx_coef * loss).backward()
    return {M.PTX_LOSS: float(loss.detach())}
