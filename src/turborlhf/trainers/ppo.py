"""`turborlhf ppo`: PPO for language models with four models (Ouyang et al. 2022; Ziegler et al.
2019; implementation details after OpenRLHF and "The N+ Implementation Details of RLHF with PPO").

Per step (one rollout batch of `prompts_per_step × n_samples_per_prompt` responses):

1. generate: sample responses with the rollout engine (its own bf16 copy of the actor);
2. experience (no grad): old log-probs (actor), reference log-probs, values (critic), scores (RM);
3. rewards: score (normalised, EOS-penalised, clipped) at the last response token, minus
   β·KL(actor‖ref) at every token (k1/k2/k3, fixed or adaptive β);
4. advantages: GAE(γ, λ) over response tokens, returns = A + V, advantages whitened over the batch;
5. train: `ppo_epochs` passes over `num_mini_batches` mini-batches, clipped surrogate policy loss
   (+ entropy bonus) for the actor and clipped value loss for the critic, token-mean reduction with
   the mini-batch's global token count;
6. sync the new actor weights into the rollout engine; log; checkpoint.

Tensor layout: prompts left-padded to P columns, responses right-padded to R columns, so
``ids_BT = [prompt_BP | response_BR]`` and response-coordinate tensors are slices ``[:, P:]``.
The value of the state in which response token j is chosen is the critic output at column P+j-1.

    turborlhf ppo --config configs/tiny/ppo.yaml
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from turborlhf.algo import (AdaptiveKLController, FixedKLController, gae, kl_estimate, kl_penalized_rewards,
                            masked_mean, masked_whiten, ppo_policy_loss, reduce_loss, value_loss)
from turborlhf.config import PPOConfig
from turborlhf.data.loaders import load_prompts
from turborlhf.data.tokenize import encode_prompt
from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from turborlhf.engine.run import export_model, plan_steps, print_batch_table, setup_run
from turborlhf.engine.train import (autocast, clip_and_step, make_optimizer, make_scheduler, rng_state,
                                    seed_everything, set_rng_state, set_threads)
from turborlhf.metrics import M, MetricsLogger
from turborlhf.models.forward import last_token_scores, response_logprobs, token_values
from turborlhf.models.load import apply_lora, load_causal_lm, load_scalar_model, load_tokenizer
from turborlhf.rewards.normalize import RunningMoments
from turborlhf.rollout import make_engine
from turborlhf.rollout.base import SamplingParams

__all__ = ["train", "Experience", "assemble", "make_experience", "ppo_update"]


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
    ref_logp_BR: torch.Tensor
    values_BR: torch.Tensor
    raw_scores_B: torch.Tensor     # reward-model output
    scores_B: torch.Tensor         # after normalisation, EOS penalty and clipping
    kl_BR: torch.Tensor
    rewards_BR: Optional[torch.Tensor] = None
    adv_BR: Optional[torch.Tensor] = None
    returns_BR: Optional[torch.Tensor] = None

    def rows(self, idx: torch.Tensor) -> "Experience":
        """Sub-batch of rows (trimmed to its own longest response)."""
        sub = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        r = int(sub["mask_BR"].sum(-1).max().clamp(min=1))
        for k in ("mask_BR", "old_logp_BR", "ref_logp_BR", "values_BR", "kl_BR", "rewards_BR", "adv_BR", "returns_BR"):
            if sub[k] is not None:
                sub[k] = sub[k][:, :r]
        sub["ids_BT"] = sub["ids_BT"][:, :self.P + r]
        sub["attn_BT"] = sub["attn_BT"][:, :self.P + r]
        return Experience(**sub)


@dataclass
class Roles:
    tokenizer: object
    actor: torch.nn.Module
    critic: torch.nn.Module
    reward_model: torch.nn.Module
    reference: torch.nn.Module
    engine: object


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
# 1-4. Rollout and experience
# ----------------------------------------------------------------------------------------------

def _in_chunks(fn, B: int, chunk: int) -> torch.Tensor:
    return torch.cat([fn(slice(s, s + chunk)) for s in range(0, B, chunk)])


@torch.no_grad()
def make_experience(roles: Roles, cfg: PPOConfig, prompt_ids: list[list[int]], responses: list[list[int]],
                    finished: list[bool], kl_coef: float, reward_stats: Optional[RunningMoments]) -> Experience:
    """Forward passes of all four models over the rollout batch, then rewards and advantages."""
    A, dtype, mb = cfg.algo, cfg.actor.dtype, cfg.train.micro_batch_size
    ids, attn, P, mask = assemble(prompt_ids, responses, roles.tokenizer.pad_token_id)
    B, R = mask.shape
    target = torch.cat([torch.zeros(B, P), mask], dim=1)
    with autocast(dtype):
        old_logp = _in_chunks(lambda s: response_logprobs(roles.actor, ids[s], attn[s], target[s])[0][:, P:], B, mb)
        ref_logp = _in_chunks(lambda s: response_logprobs(roles.reference, ids[s], attn[s], target[s])[0][:, P:], B, mb)
        values = _in_chunks(lambda s: token_values(roles.critic, ids[s], attn[s])[:, P - 1:P - 1 + R], B, mb)
        raw_scores = _in_chunks(lambda s: last_token_scores(roles.reward_model, ids[s], attn[s]), B, mb)
    eos = torch.tensor(finished, dtype=torch.bool)
    scores = raw_scores.clone()
    if A.normalize_reward and reward_stats is not None:
        reward_stats.update(raw_scores)
        scores = reward_stats.normalize(scores)
    if A.missing_eos_penalty is not None:
        scores = torch.where(eos, scores, scores - A.missing_eos_penalty)
    scores = scores.clamp(-A.reward_clip, A.reward_clip)
    kl = kl_estimate(old_logp, ref_logp, A.kl_estimator) * mask
    exp = Experience(ids, attn, P, mask, eos, old_logp * mask, ref_logp * mask, values * mask, raw_scores, scores, kl)
    exp.rewards_BR = kl_penalized_rewards(scores, kl, mask, kl_coef)
    adv, ret = gae(exp.values_BR, exp.rewards_BR, mask, A.gamma, A.lam)
    exp.returns_BR = ret
    exp.adv_BR = masked_whiten(adv, mask) if A.whiten_advantages else adv * mask
    return exp


# ----------------------------------------------------------------------------------------------
# 5. PPO update
# ----------------------------------------------------------------------------------------------

def ppo_update(roles: Roles, cfg: PPOConfig, exp: Experience, actor_opt, critic_opt, actor_sched, critic_sched,
               train_actor: bool, generator: torch.Generator) -> dict:
    """`ppo_epochs` × `num_mini_batches` optimizer steps of actor and critic; returns mean stats."""
    A, dtype, mb = cfg.algo, cfg.actor.dtype, cfg.train.micro_batch_size
    B = exp.mask_BR.shape[0]
    n_mini = min(A.num_mini_batches, B)
    sums: dict[str, float] = {}
    n_updates = 0
    for _ in range(A.ppo_epochs):
        perm = torch.randperm(B, generator=generator)
        for mini in perm.chunk(n_mini):
            n_tok = float(exp.mask_BR[mini].sum().clamp(min=1))
            for micro in mini.split(mb):
                sub = exp.rows(micro)
                stats = _micro_step(roles, cfg, sub, n_tok, train_actor, dtype)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
            if train_actor:
                sums["actor_grad_norm"] = sums.get("actor_grad_norm", 0.0) + clip_and_step(
                    roles.actor, actor_opt, actor_sched, cfg.optim.max_grad_norm)
            sums["critic_grad_norm"] = sums.get("critic_grad_norm", 0.0) + clip_and_step(
                roles.critic, critic_opt, critic_sched, cfg.optim.max_grad_norm)
            n_updates += 1
    return {k: v / n_updates for k, v in sums.items()}


def _micro_step(roles: Roles, cfg: PPOConfig, sub: Experience, n_tok: float, train_actor: bool, dtype: str) -> dict:
    """Backward of one micro-batch; losses are token sums over the mini-batch's token count, so the
    accumulated gradient equals the mini-batch token mean. Returned stats are already weighted."""
    A, P = cfg.algo, sub.P
    mask = sub.mask_BR
    w = float(mask.sum()) / n_tok
    B, R = mask.shape
    target = torch.cat([torch.zeros(B, P), mask], dim=1)
    stats = {}
    if train_actor:
        with autocast(dtype):
            logp, ent = response_logprobs(roles.actor, sub.ids_BT, sub.attn_BT, target, with_entropy=True,
                                          entropy_grad=A.entropy_coef > 0)
        logp, ent = logp[:, P:], ent[:, P:]
        pg_BR, pg_stats = ppo_policy_loss(logp, sub.old_logp_BR, sub.adv_BR, mask, A.eps_clip, A.eps_clip_high,
                                          A.dual_clip)
        pg = reduce_loss(pg_BR, mask, "token_mean", num_tokens=n_tok)
        ent_term = reduce_loss(ent, mask, "token_mean", num_tokens=n_tok)
        (pg - A.entropy_coef * ent_term).backward()
        stats.update({M.POLICY_LOSS: float(pg), M.ENTROPY: float(ent_term),
                      M.CLIPFRAC: float(pg_stats["clipfrac"]) * w, M.APPROX_KL: float(pg_stats["approx_kl"]) * w})
    with autocast(dtype):
        v = token_values(roles.critic, sub.ids_BT, sub.attn_BT)[:, P - 1:P - 1 + R]
    v_BR = value_loss(v, sub.values_BR, sub.returns_BR, mask, A.value_clip)
    vl = reduce_loss(v_BR, mask, "token_mean", num_tokens=n_tok)
    vl.backward()
    stats[M.VALUE_LOSS] = float(vl)
    if A.value_clip is not None:
        clipped = ((v - sub.values_BR).abs() > A.value_clip).float()
        stats[M.VALUE_CLIPFRAC] = float(masked_mean(clipped, mask)) * w
    return stats


# ----------------------------------------------------------------------------------------------
# Setup and the loop
# ----------------------------------------------------------------------------------------------

def build_roles(cfg: PPOConfig, ckpt: Optional[Path]) -> Roles:
    """Actor (trainable), critic (trainable, from the RM by default), RM and reference (frozen)."""
    tok = load_tokenizer(cfg.actor.name_or_path)
    frozen_dtype = torch.bfloat16 if cfg.actor.dtype == "bf16" else torch.float32
    actor = load_causal_lm(str(ckpt / "actor") if ckpt else cfg.actor.name_or_path, tok,
                           gradient_checkpointing=cfg.actor.gradient_checkpointing)
    actor = apply_lora(actor, cfg.actor.lora)
    critic_cfg = cfg.critic
    critic_src = str(ckpt / "critic") if ckpt else (critic_cfg.name_or_path if critic_cfg else cfg.reward_model)
    critic = load_scalar_model(critic_src, tok, gradient_checkpointing=bool(critic_cfg and critic_cfg.gradient_checkpointing))
    if critic_cfg:
        critic = apply_lora(critic, critic_cfg.lora)
    reward_model = load_scalar_model(cfg.reward_model, tok, dtype=frozen_dtype).eval().requires_grad_(False)
    reference = load_causal_lm(cfg.reference or cfg.actor.name_or_path, tok, dtype=frozen_dtype)
    reference.eval().requires_grad_(False)
    actor.train()
    critic.train()
    engine = make_engine(cfg.rollout.engine, actor, dtype=cfg.rollout.dtype, max_batch_size=cfg.rollout.batch_size)
    return Roles(tok, actor, critic, reward_model, reference, engine)


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
    return {M.REWARD_MEAN: float(exp.raw_scores_B.mean()), M.REWARD_STD: float(exp.raw_scores_B.std()),
            M.SCORE_MEAN: float(exp.scores_B.mean()),
            M.KL: float(exp.kl_BR.sum(-1).mean()), "policy/kl_per_token": float(masked_mean(exp.kl_BR, exp.mask_BR)),
            M.KL_COEF: kl_coef, M.RESPONSE_LEN: float(lens.mean()), M.EOS_FRAC: float(exp.eos_B.float().mean()),
            M.EXPLAINED_VAR: _explained_variance(exp.values_BR, exp.returns_BR, exp.mask_BR),
            M.RETURN_MEAN: float(masked_mean(exp.returns_BR, exp.mask_BR))}


def train(cfg: PPOConfig, resume: bool = False) -> Path:
    # 0. run directory, threads, seed
    out = setup_run(cfg, cfg.output_dir)
    set_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    A = cfg.algo
    ckpt = latest_checkpoint(out) if resume else None

    # models and engine
    roles = build_roles(cfg, ckpt)
    tok = roles.tokenizer
    prompts = load_prompts(cfg.data.prompts_file, tok)
    if cfg.data.max_samples:
        prompts = prompts[:cfg.data.max_samples]
    prompt_ids = [encode_prompt(tok, p, cfg.rollout.max_prompt_len) for p in prompts]
    plan = plan_steps([len(p) for p in prompt_ids], A.prompts_per_step, cfg.train.epochs, cfg.train.max_steps,
                      cfg.train.seed)
    print_batch_table("ppo", [("prompts", len(prompts)), ("prompts_per_step", A.prompts_per_step),
                              ("n_samples_per_prompt", A.n_samples_per_prompt),
                              ("rollout_batch (sequences)", A.prompts_per_step * A.n_samples_per_prompt),
                              ("num_mini_batches", A.num_mini_batches), ("ppo_epochs", A.ppo_epochs),
                              ("micro_batch_size", cfg.train.micro_batch_size), ("ppo_steps", len(plan)),
                              ("rollout_engine", type(roles.engine).__name__)])

    updates = len(plan) * A.ppo_epochs * A.num_mini_batches
    actor_opt = make_optimizer(roles.actor, cfg.optim)
    critic_opt = make_optimizer(roles.critic, cfg.optim, lr=A.critic_lr)
    actor_sched = make_scheduler(actor_opt, cfg.optim, updates)
    critic_sched = make_scheduler(critic_opt, cfg.optim, updates)
    kl_ctl = (AdaptiveKLController(A.kl_coef, A.kl_target, A.kl_horizon) if A.kl_target is not None
              else FixedKLController(A.kl_coef))
    reward_stats = RunningMoments() if A.normalize_reward else None
    gen = torch.Generator().manual_seed(cfg.train.seed)
    start = 0
    if ckpt:
        st = load_trainer_state(ckpt)
        for obj, key in ((actor_opt, "actor_opt"), (critic_opt, "critic_opt"), (actor_sched, "actor_sched"),
                         (critic_sched, "critic_sched")):
            obj.load_state_dict(st[key])
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

    def checkpoint(step: int) -> None:
        save_checkpoint(out, step, {"actor": roles.actor, "critic": roles.critic}, tok, {
            "actor_opt": actor_opt.state_dict(), "critic_opt": critic_opt.state_dict(),
            "actor_sched": actor_sched.state_dict(), "critic_sched": critic_sched.state_dict(),
            "kl_coef": kl_ctl.value, "reward_stats": reward_stats.__dict__ if reward_stats else None,
            "rng": rng_state(), "gen": gen.get_state(), "step": step}, keep=cfg.train.keep_checkpoints)

    for step in range(start, len(plan)):
        t_step = time.perf_counter()
        batch_prompts = [prompt_ids[i] for i in plan[step]]
        # 1. generate
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
        stats = ppo_update(roles, cfg, exp, actor_opt, critic_opt, actor_sched, critic_sched, train_actor, gen)
        t_train = time.perf_counter() - t0
        # 6. weight sync, KL controller, metrics, checkpoint
        t0 = time.perf_counter()
        if train_actor:
            roles.engine.load_weights(roles.actor.named_parameters())
        t_sync = time.perf_counter() - t0
        metrics = _rollout_metrics(exp, kl_ctl.value)
        kl_ctl.update(metrics[M.KL], len(exp.scores_B))
        metrics.update(stats)
        metrics.update({M.T_GENERATE: t_gen, M.T_EXPERIENCE: t_exp, M.T_TRAIN: t_train, "timing/weight_sync": t_sync,
                        M.T_STEP: time.perf_counter() - t_step, "rollout/tokens_per_s":
                        float(exp.mask_BR.sum()) / max(t_gen, 1e-9), M.LR: actor_sched.get_last_lr()[0]})
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
    samples_f.close()
    log.close()
    print(f"[ppo] saved actor to {out}", flush=True)
    return out
