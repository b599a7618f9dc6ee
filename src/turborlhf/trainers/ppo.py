"""`turborlhf ppo`: PPO for language models (Ouyang et al. 2022; Ziegler et al. 2019), with GAE and a
critic, or critic-free with GRPO / Dr. GRPO / RLOO / REINFORCE++ advantages. Implementation details
after OpenRLHF and "The N+ Implementation Details of RLHF with PPO"; equations and the differences
from TRL/OpenRLHF in docs/algorithms/ppo.md and docs/algorithms/critic_free.md.

Per step (one rollout batch of `prompts_per_step × n_samples_per_prompt` responses, the samples of
a prompt consecutive):

1. generate: sample responses with the rollout engine (its own bf16 copy of the actor);
2. experience (no grad): old log-probs (actor), reference log-probs (only if a KL term is on),
   values (critic, only for GAE), scores = Σ weight·score over the reward sources
   (`turborlhf.rewards.combine`: reward models, Python rules, remote `serve-rm` servers);
3. rewards: score (normalised, EOS-penalised, clipped), for group estimators replaced by its
   group baseline (GRPO/Dr. GRPO/RLOO/REINFORCE++-baseline), placed at the last response token,
   minus β·KL(actor‖ref) at every token unless the KL is a loss term (`kl_use_loss`);
4. advantages: `ADVANTAGE_ESTIMATORS[algo.advantage_estimator]`: GAE(γ, λ) (whitened), or the
   reward-to-go of the token rewards (whitened only for REINFORCE++);
5. train: `ppo_epochs` passes over `num_mini_batches` mini-batches: clipped surrogate policy loss
   (+ β·KL loss, − entropy bonus, + ptx_coef · SFT loss on one PPO-ptx micro-batch) for the actor,
   reduced by `algo.loss_reduction` with the mini-batch's global counts; clipped value loss for
   the critic; the actor's EMA (`ema_beta`) follows each actor step;
6. sync the new actor weights into the rollout engine; log; checkpoint.

Tensor layout: prompts left-padded to P columns, responses right-padded to R columns, so
``ids_BT = [prompt_BP | response_BR]`` and response-coordinate tensors are slices ``[:, P:]``.
The value of the state in which response token j is chosen is the critic output at column P+j-1.
Shapes: B rows (prompts × samples), G samples per prompt, R response tokens.

    turborlhf ppo --config configs/tiny/ppo.yaml
    turborlhf ppo --config configs/tiny/grpo.yaml     # critic-free: no critic is built
"""
from __future__ import annotations

import copy
import json
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from turborlhf.algo import (AdaptiveKLController, FixedKLController, discounted_returns, gae,
                            group_mean_baseline, group_normalized_advantages, kl_estimate, kl_penalized_rewards,
                            leave_one_out_advantages, masked_mean, masked_whiten, ppo_policy_loss, reduce_loss,
                            value_loss)
from turborlhf.config import PPOAlgoCfg, PPOConfig
from turborlhf.data.loaders import load_prompts, load_sft
from turborlhf.data.tokenize import encode_prompt
from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from turborlhf.engine.run import export_model, plan_steps, print_batch_table, setup_run
from turborlhf.engine.train import (autocast, clip_and_step, make_optimizer, make_scheduler, rng_state,
                                    seed_everything, set_rng_state, set_threads)
from turborlhf.metrics import M, MetricsLogger
from turborlhf.models.forward import response_logprobs, token_values
from turborlhf.models.load import apply_lora, load_causal_lm, load_scalar_model, load_tokenizer
from turborlhf.rewards.combine import CombinedReward, RewardInputs, build_reward
from turborlhf.rewards.normalize import RunningMoments
from turborlhf.rollout import make_engine
from turborlhf.rollout.sync import push_weights, start_sync_check
from turborlhf.rollout.base import SamplingParams
from turborlhf.trainers.sft import encode_examples, sft_loss_on_batch

__all__ = ["train", "Experience", "assemble", "make_experience", "ppo_update", "ADVANTAGE_ESTIMATORS",
           "EmaModel", "PtxStream"]


# ----------------------------------------------------------------------------------------------
# Advantage estimators: one function per variant, (scores_B, kl_BR, values_BR, mask_BR, β, cfg)
# → (advantages_BR, returns_BR). β is the KL-in-reward coefficient (0 when KL is a loss term).
# ----------------------------------------------------------------------------------------------

def _gae_advantages(scores_B, kl_BR, values_BR, mask_BR, kl_coef: float, A: PPOAlgoCfg):
    """PPO: token rewards (score at EOS − β·kl), GAE(γ, λ), returns = A + V, optional whitening."""
    rewards_BR = kl_penalized_rewards(scores_B, kl_BR, mask_BR, kl_coef)
    adv_BR, ret_BR = gae(values_BR, rewards_BR, mask_BR, A.gamma, A.lam)
    return (masked_whiten(adv_BR, mask_BR) if A.whiten_advantages else adv_BR * mask_BR), ret_BR


def _critic_free(baseline_BG: Optional[Callable[[torch.Tensor], torch.Tensor]], whiten: bool):
    """OpenRLHF's recipe (formulas.md §7): baseline on the score of each (prompts, G) group, token
    rewards (baselined score at EOS − β·kl), advantages = discounted reward-to-go, optional global
    whitening."""

    def estimator(scores_B, kl_BR, values_BR, mask_BR, kl_coef: float, A: PPOAlgoCfg):
        if baseline_BG is not None:
            scores_B = baseline_BG(scores_B.view(-1, A.n_samples_per_prompt)).reshape(-1)   # (B/G, G) → B
        rewards_BR = kl_penalized_rewards(scores_B, kl_BR, mask_BR, kl_coef)
        ret_BR = discounted_returns(rewards_BR, mask_BR, A.gamma)
        return (masked_whiten(ret_BR, mask_BR) if whiten else ret_BR), ret_BR

    return estimator


ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": _gae_advantages,
    "grpo": _critic_free(group_normalized_advantages, whiten=False),        # (r - mean) / (std + 1e-4)
    "dr_grpo": _critic_free(group_mean_baseline, whiten=False),             # r - mean
    "rloo": _critic_free(leave_one_out_advantages, whiten=False),           # r - mean of the others
    "reinforce_pp": _critic_free(None, whiten=True),                        # r, global whitening
    "reinforce_pp_baseline": _critic_free(group_mean_baseline, whiten=True),  # r - mean, global whitening
}


# ----------------------------------------------------------------------------------------------
# Data structures
# ----------------------------------------------------------------------------------------------

@dataclass
class Experience:
    """One rollout batch. B = rows (prompts × samples), P prompt columns, R response columns."""

    ids_BT: torch.Tensor
    attn_BT: torch.Tensor
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

    def rows(self, idx: torch.Tensor) -> "Experience":
        """Sub-batch of rows (trimmed to its own longest response)."""
        sub = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        r = int(sub["mask_BR"].sum(-1).max().clamp(min=1))
        for k in ("mask_BR", "old_logp_BR", "ref_logp_BR", "values_BR", "kl_BR", "adv_BR", "returns_BR"):
            if sub[k] is not None:
                sub[k] = sub[k][:, :r]
        sub["ids_BT"] = sub["ids_BT"][:, :self.P + r]
        sub["attn_BT"] = sub["attn_BT"][:, :self.P + r]
        return Experience(**sub)


@dataclass
class Roles:
    tokenizer: object
    actor: torch.nn.Module
    critic: Optional[torch.nn.Module]       # None for critic-free estimators
    reward: CombinedReward
    reference: Optional[torch.nn.Module]    # None when no KL term is on
    engine: object


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


def assemble(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """``[left-padded prompt | right-padded response]`` → (ids_BT, attn_BT, P, mask_BR)."""
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    B = len(prompts)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    mask = torch.zeros((B, R), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P] = torch.tensor(p)
        attn[i, P - len(p):P] = 1
        if r:
            ids[i, P:P + len(r)] = torch.tensor(r)
            attn[i, P:P + len(r)] = 1
            mask[i, :len(r)] = 1
    return ids, attn, P, mask


# ----------------------------------------------------------------------------------------------
# 2-4. Experience, rewards, advantages
# ----------------------------------------------------------------------------------------------

def _in_chunks(fn, B: int, chunk: int) -> torch.Tensor:
    return torch.cat([fn(slice(s, s + chunk)) for s in range(0, B, chunk)])


def _kl_reward_coef(roles: Roles, A: PPOAlgoCfg, kl_coef: float) -> float:
    """β of the per-token reward penalty: 0 when the KL is a loss term or there is no reference."""
    return 0.0 if (A.kl_use_loss or roles.reference is None) else kl_coef


@torch.no_grad()
def make_experience(roles: Roles, cfg: PPOConfig, prompt_ids: list[list[int]], responses: list[list[int]],
                    finished: list[bool], kl_coef: float, reward_stats: Optional[RunningMoments]) -> Experience:
    """Forward passes of the models over the rollout batch, then rewards and advantages."""
    A, dtype, mb = cfg.algo, cfg.actor.dtype, cfg.train.micro_batch_size
    ids, attn, P, mask = assemble(prompt_ids, responses, roles.tokenizer.pad_token_id)
    B, R = mask.shape
    target = torch.cat([torch.zeros(B, P), mask], dim=1)
    ref_logp = values = None
    with autocast(dtype):
        old_logp = _in_chunks(lambda s: response_logprobs(roles.actor, ids[s], attn[s], target[s])[0][:, P:], B, mb)
        if roles.reference is not None:
            ref_logp = _in_chunks(lambda s: response_logprobs(roles.reference, ids[s], attn[s], target[s])[0][:, P:],
                                  B, mb) * mask
        if roles.critic is not None:
            values = _in_chunks(lambda s: token_values(roles.critic, ids[s], attn[s])[:, P - 1:P - 1 + R], B, mb) * mask
    raw_scores, per_source = roles.reward(RewardInputs(ids, attn, prompt_ids, responses, roles.tokenizer))
    eos = torch.tensor(finished, dtype=torch.bool)
    scores = raw_scores.clone()
    if A.normalize_reward and reward_stats is not None:
        reward_stats.update(raw_scores)
        scores = reward_stats.normalize(scores)
    if A.missing_eos_penalty is not None:
        scores = torch.where(eos, scores, scores - A.missing_eos_penalty)
    scores = scores.clamp(-A.reward_clip, A.reward_clip)
    kl = kl_estimate(old_logp, ref_logp, A.kl_estimator) * mask if ref_logp is not None else torch.zeros_like(mask)
    exp = Experience(ids, attn, P, mask, eos, old_logp * mask, ref_logp, values, raw_scores, scores, kl, per_source)
    exp.adv_BR, exp.returns_BR = ADVANTAGE_ESTIMATORS[A.advantage_estimator](
        scores, kl, values, mask, _kl_reward_coef(roles, A, kl_coef), A)
    return exp


# ----------------------------------------------------------------------------------------------
# 5. PPO update
# ----------------------------------------------------------------------------------------------

@dataclass
class Updaters:
    """Everything that changes weights or is consumed by updates: optimizers, schedules, EMA, PPO-ptx."""

    actor_opt: torch.optim.Optimizer
    actor_sched: object
    critic_opt: Optional[torch.optim.Optimizer] = None
    critic_sched: object = None
    ema: Optional[EmaModel] = None
    ptx: Optional[PtxStream] = None

    @classmethod
    def build(cls, roles: Roles, cfg: PPOConfig, total_updates: int, ptx: Optional[PtxStream]) -> "Updaters":
        opt = make_optimizer(roles.actor, cfg.optim)
        up = cls(opt, make_scheduler(opt, cfg.optim, total_updates), ptx=ptx,
                 ema=EmaModel(roles.actor, cfg.algo.ema_beta) if cfg.algo.ema_beta is not None else None)
        if roles.critic is not None:
            up.critic_opt = make_optimizer(roles.critic, cfg.optim, lr=cfg.algo.critic_lr)
            up.critic_sched = make_scheduler(up.critic_opt, cfg.optim, total_updates)
        return up

    def _stateful(self) -> dict:
        objs = {"actor_opt": self.actor_opt, "actor_sched": self.actor_sched}
        if self.critic_opt is not None:
            objs.update(critic_opt=self.critic_opt, critic_sched=self.critic_sched)
        return objs

    def state_dict(self) -> dict:
        return {**{k: v.state_dict() for k, v in self._stateful().items()},
                "ema": self.ema.state_dict() if self.ema else None, "ptx_pos": self.ptx.pos if self.ptx else 0}

    def load_state_dict(self, st: dict) -> None:
        for k, v in self._stateful().items():
            v.load_state_dict(st[k])
        if self.ema is not None:
            self.ema.load_state_dict(st["ema"])
        if self.ptx is not None:
            self.ptx.pos = st["ptx_pos"]


def ppo_update(roles: Roles, cfg: PPOConfig, exp: Experience, up: Updaters, train_actor: bool,
               generator: torch.Generator, kl_coef: float) -> dict:
    """`ppo_epochs` × `num_mini_batches` optimizer steps of actor and critic; returns mean stats."""
    A, mb = cfg.algo, cfg.train.micro_batch_size
    B = exp.mask_BR.shape[0]
    n_mini = min(A.num_mini_batches, B)
    sums: dict[str, float] = {}

    def add(stats: dict) -> None:
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v

    n_updates = 0
    for _ in range(A.ppo_epochs):
        perm = torch.randperm(B, generator=generator)
        for mini in perm.chunk(n_mini):
            mask = exp.mask_BR[mini]
            counts = {"num_tokens": float(mask.sum().clamp(min=1)), "max_len": cfg.rollout.max_new_tokens,
                      "num_seqs": float((mask.sum(-1) > 0).sum()) if A.loss_reduction == "seq_mean_token_mean"
                      else float(len(mini))}
            for micro in mini.split(mb):
                add(_micro_step(roles, cfg, exp.rows(micro), counts, train_actor, kl_coef))
            if train_actor:
                if up.ptx is not None:
                    add(_ptx_step(roles, cfg, up.ptx))
                add({"actor_grad_norm": clip_and_step(roles.actor, up.actor_opt, up.actor_sched,
                                                      cfg.optim.max_grad_norm)})
                if up.ema is not None:
                    up.ema.update()
            if roles.critic is not None:
                add({"critic_grad_norm": clip_and_step(roles.critic, up.critic_opt, up.critic_sched,
                                                       cfg.optim.max_grad_norm)})
            n_updates += 1
    return {k: v / n_updates for k, v in sums.items()}


def _micro_step(roles: Roles, cfg: PPOConfig, sub: Experience, counts: dict, train_actor: bool,
                kl_coef: float) -> dict:
    """Backward of one micro-batch; losses are reduced with the mini-batch's global `counts`, so the
    accumulated gradient equals the whole mini-batch's. Returned stats are already weighted."""
    A, P, dtype = cfg.algo, sub.P, cfg.actor.dtype
    mask = sub.mask_BR
    w = float(mask.sum()) / counts["num_tokens"]
    B, R = mask.shape
    stats = {}
    if train_actor:
        target = torch.cat([torch.zeros(B, P), mask], dim=1)
        with autocast(dtype):
            logp, ent = response_logprobs(roles.actor, sub.ids_BT, sub.attn_BT, target, with_entropy=True,
                                          entropy_grad=A.entropy_coef > 0)
        logp, ent = logp[:, P:], ent[:, P:]
        pg_BR, pg_stats = ppo_policy_loss(logp, sub.old_logp_BR, sub.adv_BR, mask, A.eps_clip, A.eps_clip_high,
                                          A.dual_clip)
        pg = reduce_loss(pg_BR, mask, A.loss_reduction, **counts)
        ent_term = reduce_loss(ent, mask, A.loss_reduction, **counts)
        loss = pg - A.entropy_coef * ent_term
        if A.kl_use_loss and sub.ref_logp_BR is not None:
            kl_term = reduce_loss(kl_estimate(logp, sub.ref_logp_BR, A.kl_estimator), mask, A.loss_reduction, **counts)
            loss = loss + kl_coef * kl_term
            stats["policy/kl_loss"] = float(kl_term.detach())
        loss.backward()
        stats.update({M.POLICY_LOSS: float(pg.detach()), M.ENTROPY: float(ent_term.detach()),
                      M.CLIPFRAC: float(pg_stats["clipfrac"]) * w, M.APPROX_KL: float(pg_stats["approx_kl"]) * w})
    if roles.critic is not None:
        with autocast(dtype):
            v = token_values(roles.critic, sub.ids_BT, sub.attn_BT)[:, P - 1:P - 1 + R]
        v_BR = value_loss(v, sub.values_BR, sub.returns_BR, mask, A.value_clip)
        vl = reduce_loss(v_BR, mask, "token_mean", num_tokens=counts["num_tokens"])
        vl.backward()
        stats[M.VALUE_LOSS] = float(vl.detach())
        if A.value_clip is not None:
            clipped = ((v - sub.values_BR).abs() > A.value_clip).float()
            stats[M.VALUE_CLIPFRAC] = float(masked_mean(clipped, mask)) * w
    return stats


def _ptx_step(roles: Roles, cfg: PPOConfig, ptx: PtxStream) -> dict:
    """PPO-ptx (Ouyang et al. 2022 Eq. 2): backward of ptx_coef · SFT token-mean NLL on one micro-batch."""
    batch = ptx.next(cfg.train.micro_batch_size)
    n_tok = sum(sum(e["loss_mask"]) for e in batch)
    loss, _ = sft_loss_on_batch(roles.actor, roles.tokenizer, batch, n_tok, cfg.actor.dtype)
    (cfg.algo.ptx_coef * loss).backward()
    return {"ptx/loss": float(loss.detach())}


# ----------------------------------------------------------------------------------------------
# Setup and the loop
# ----------------------------------------------------------------------------------------------

def build_roles(cfg: PPOConfig, ckpt: Optional[Path]) -> Roles:
    """Actor (trainable); critic (trainable, GAE only, from the RM by default); reward sources and
    reference (frozen; the reference only when a KL term is on)."""
    A = cfg.algo
    tok = load_tokenizer(cfg.actor.name_or_path)
    frozen_dtype = torch.bfloat16 if cfg.actor.dtype == "bf16" else torch.float32
    actor = load_causal_lm(str(ckpt / "actor") if ckpt else cfg.actor.name_or_path, tok,
                           gradient_checkpointing=cfg.actor.gradient_checkpointing)
    actor = apply_lora(actor, cfg.actor.lora)
    critic = None
    if A.needs_critic:
        critic = load_scalar_model(str(ckpt / "critic") if ckpt else cfg.critic_init, tok,
                                   gradient_checkpointing=bool(cfg.critic and cfg.critic.gradient_checkpointing))
        critic = apply_lora(critic, cfg.critic.lora) if cfg.critic else critic
        critic.train()
    reward = build_reward(cfg.rewards, cfg.reward_model, tok, cfg.actor.dtype, cfg.train.micro_batch_size)
    reference = None
    if A.needs_reference:
        reference = load_causal_lm(cfg.reference or cfg.actor.name_or_path, tok, dtype=frozen_dtype)
        reference.eval().requires_grad_(False)
    actor.train()
    engine = make_engine(cfg.rollout.engine, actor, dtype=cfg.rollout.dtype, max_batch_size=cfg.rollout.batch_size)
    return Roles(tok, actor, critic, reward, reference, engine)


def _sampling(cfg: PPOConfig, tok, seed: int) -> SamplingParams:
    R = cfg.rollout
    return SamplingParams(max_new_tokens=R.max_new_tokens, min_new_tokens=R.min_new_tokens, temperature=R.temperature,
                          top_p=R.top_p, top_k=R.top_k, stop_token_ids=(tok.eos_token_id,),
                          n=cfg.algo.n_samples_per_prompt, seed=seed)


def _explained_variance(values_BR, returns_BR, mask_BR) -> float:
    var_ret = masked_mean((returns_BR - masked_mean(returns_BR, mask_BR)) ** 2, mask_BR)
    resid = returns_BR - values_BR
    var_res = masked_mean((resid - masked_mean(resid, mask_BR)) ** 2, mask_BR)
    return float(1 - var_res / var_ret.clamp(min=1e-8))


def _rollout_metrics(exp: Experience, kl_coef: float) -> dict:
    lens = exp.mask_BR.sum(-1)
    out = {M.REWARD_MEAN: float(exp.raw_scores_B.mean()), M.REWARD_STD: float(exp.raw_scores_B.std()),
           M.SCORE_MEAN: float(exp.scores_B.mean()), M.RESPONSE_LEN: float(lens.mean()),
           M.EOS_FRAC: float(exp.eos_B.float().mean()), M.RETURN_MEAN: float(masked_mean(exp.returns_BR, exp.mask_BR)),
           M.ADV_MEAN: float(masked_mean(exp.adv_BR, exp.mask_BR))}
    if exp.ref_logp_BR is not None:
        out.update({M.KL: float(exp.kl_BR.sum(-1).mean()), M.KL_COEF: kl_coef,
                    "policy/kl_per_token": float(masked_mean(exp.kl_BR, exp.mask_BR))})
    if exp.values_BR is not None:
        out[M.EXPLAINED_VAR] = _explained_variance(exp.values_BR, exp.returns_BR, exp.mask_BR)
    if exp.source_scores and len(exp.source_scores) > 1:
        out.update({f"reward/{name}": float(s.mean()) for name, s in exp.source_scores.items()})
    return out


def train(cfg: PPOConfig, resume: bool = False) -> Path:
    # 0. run directory, threads, seed
    out = setup_run(cfg, cfg.output_dir)
    set_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    A = cfg.algo
    ckpt = latest_checkpoint(out) if resume else None
    if A.kl_use_loss and A.kl_estimator == "k1":
        warnings.warn("algo.kl_use_loss with kl_estimator=k1: the k1 loss's gradient is not the KL's; "
                      "use k3 (GRPO) or k2", stacklevel=2)

    # models, engine, prompts, PPO-ptx data
    roles = build_roles(cfg, ckpt)
    tok = roles.tokenizer
    prompts = load_prompts(cfg.data.prompts_file, tok)
    if cfg.data.max_samples:
        prompts = prompts[:cfg.data.max_samples]
    prompt_ids = [encode_prompt(tok, p, cfg.rollout.max_prompt_len) for p in prompts]
    plan = plan_steps([len(p) for p in prompt_ids], A.prompts_per_step, cfg.train.epochs, cfg.train.max_steps,
                      cfg.train.seed)
    ptx = None
    if A.ptx_coef > 0:
        ptx = PtxStream(encode_examples(tok, load_sft(cfg.data.ptx_file, tok), cfg.data.ptx_max_len), cfg.train.seed)
    print_batch_table("ppo", [("prompts", len(prompts)), ("prompts_per_step", A.prompts_per_step),
                              ("n_samples_per_prompt", A.n_samples_per_prompt),
                              ("rollout_batch (sequences)", A.prompts_per_step * A.n_samples_per_prompt),
                              ("num_mini_batches", A.num_mini_batches), ("ppo_epochs", A.ppo_epochs),
                              ("micro_batch_size", cfg.train.micro_batch_size), ("ppo_steps", len(plan)),
                              ("advantage_estimator", A.advantage_estimator), ("critic", roles.critic is not None),
                              ("reference", roles.reference is not None),
                              ("reward sources", ", ".join(f"{n}×{w:g}" for n, w, _ in roles.reward.sources)),
                              ("ptx examples", len(ptx.examples) if ptx else 0),
                              ("rollout_engine", type(roles.engine).__name__)])

    # optimizers, controllers, resume state
    up = Updaters.build(roles, cfg, len(plan) * A.ppo_epochs * A.num_mini_batches, ptx)
    kl_ctl = (AdaptiveKLController(A.kl_coef, A.kl_target, A.kl_horizon) if A.kl_target is not None
              else FixedKLController(A.kl_coef))
    reward_stats = RunningMoments() if A.normalize_reward else None
    gen = torch.Generator().manual_seed(cfg.train.seed)
    start = 0
    if ckpt:
        st = load_trainer_state(ckpt)
        up.load_state_dict(st)
        kl_ctl.value = st["kl_coef"]
        if reward_stats is not None and st.get("reward_stats"):
            reward_stats = RunningMoments(**st["reward_stats"])
        set_rng_state(st["rng"])
        gen.set_state(st["gen"])
        start = st["step"]
        print(f"[ppo] resumed from {ckpt} at step {start}", flush=True)
    log = MetricsLogger(out, "ppo", len(plan), show=(M.REWARD_MEAN, M.KL, M.RESPONSE_LEN, M.CLIPFRAC, M.VALUE_LOSS),
                        tensorboard=cfg.log.tensorboard, progress=cfg.log.progress, resume=bool(ckpt), start_step=start)
    samples_f = open(out / "samples.jsonl", "a" if ckpt else "w")
    canary = start_sync_check(roles.engine, roles.actor, prompt_ids, cfg.rollout.verify_sync, cfg.rollout.sync_tolerance)

    def checkpoint(step: int) -> None:
        models = {"actor": roles.actor, **({"critic": roles.critic} if roles.critic is not None else {})}
        save_checkpoint(out, step, models, tok, {
            **up.state_dict(), "kl_coef": kl_ctl.value, "reward_stats": reward_stats.__dict__ if reward_stats else None,
            "rng": rng_state(), "gen": gen.get_state(), "step": step}, keep=cfg.train.keep_checkpoints)

    for step in range(start, len(plan)):
        t_step = time.perf_counter()
        batch_prompts = [prompt_ids[i] for i in plan[step]]
        # 1. generate (the n samples of a prompt are consecutive rows)
        t0 = time.perf_counter()
        outs = roles.engine.generate(batch_prompts, _sampling(cfg, tok, cfg.train.seed * 100003 + step))
        rows_prompts = [p for p in batch_prompts for _ in range(A.n_samples_per_prompt)]
        t_gen = time.perf_counter() - t0
        # 2-4. experience, rewards, advantages
        t0 = time.perf_counter()
        exp = make_experience(roles, cfg, rows_prompts, outs.response_ids, outs.finished, kl_ctl.value, reward_stats)
        t_exp = time.perf_counter() - t0
        # 5. PPO epochs over mini-batches
        t0 = time.perf_counter()
        train_actor = step >= A.critic_warmup_steps
        stats = ppo_update(roles, cfg, exp, up, train_actor, gen, kl_ctl.value)
        t_train = time.perf_counter() - t0
        # 6. weight sync, KL controller, metrics, checkpoint
        t0 = time.perf_counter()
        sync_metrics = {}
        if train_actor:  # push + canary check; WeightSyncError if the engine disagrees with the actor
            sync_metrics = push_weights(roles.engine, roles.actor, canary, cfg.rollout.sync_tolerance).metrics()
        t_sync = time.perf_counter() - t0
        metrics = _rollout_metrics(exp, kl_ctl.value)
        if M.KL in metrics:
            kl_ctl.update(metrics[M.KL], len(exp.scores_B))
        metrics.update(stats)
        metrics.update(sync_metrics)
        metrics.update({M.T_GENERATE: t_gen, M.T_EXPERIENCE: t_exp, M.T_TRAIN: t_train, "timing/weight_sync": t_sync,
                        M.T_STEP: time.perf_counter() - t_step, "rollout/tokens_per_s":
                        float(exp.mask_BR.sum()) / max(t_gen, 1e-9), M.LR: up.actor_sched.get_last_lr()[0]})
        done = step + 1
        if done % cfg.log.every == 0 or done == len(plan):
            log.log(done, metrics)
        samples_f.write(json.dumps({"step": done, "prompt": tok.decode(rows_prompts[0][-200:]),
                                    "response": tok.decode(outs.response_ids[0]),
                                    "score": float(exp.raw_scores_B[0])}) + "\n")
        samples_f.flush()
        if cfg.train.save_every and done % cfg.train.save_every == 0 and done < len(plan):
            checkpoint(done)

    checkpoint(len(plan))
    export_model(roles.actor, tok, out)
    if up.ema is not None:
        export_model(up.ema.model, tok, out / "ema")
    samples_f.close()
    log.close()
    print(f"[ppo] saved actor to {out}" + (f" and its EMA to {out / 'ema'}" if up.ema else ""), flush=True)
    return out
