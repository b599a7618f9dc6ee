"""The PPO driver: one step, top to bottom (`_step`), and the run around it (`train_steps`).
PPO for language models (Ouyang et al. 2022; Ziegler et al. 2019), with GAE and a critic, or
critic-free with GRPO / Dr. GRPO / RLOO / REINFORCE++ advantages. Implementation details after
OpenRLHF and "The N+ Implementation Details of RLHF with PPO"; equations and the differences from
TRL/OpenRLHF in docs/algorithms/ppo.md and docs/algorithms/critic_free.md.

Per step (one rollout batch of `prompts_per_step × n_samples_per_prompt` responses, the samples of
a prompt consecutive):

1. generate with the rollout engines (their actor copy; + DAPO dynamic sampling:
   `rlvr.collect_rollouts`; ahead of time with ``rollout.max_staleness``: `async_rollout`);
2. experience (`make_experience`): old log-probs (actor), reference log-probs (only if a KL term
   is on), values (critic, only for GAE), scores = Σ weight·score over the reward sources
   (`turborlhf.rewards.combine`: reward models, Python rules, remote `serve-rm` servers);
3. rewards (`score_and_advantages`): score (normalised, EOS-penalised, clipped), for group
   estimators replaced by its group baseline (GRPO/Dr. GRPO/RLOO/REINFORCE++-baseline), placed at
   the last response token, minus β·KL(actor‖ref) at every token unless the KL is a loss term
   (`kl_use_loss`);
4. advantages: `ADVANTAGE_ESTIMATORS[algo.advantage_estimator]`: GAE(γ, λ) (whitened), or the
   reward-to-go of the token rewards (whitened only for REINFORCE++);
5. train (`ppo_update`): `ppo_epochs` passes over `num_mini_batches` mini-batches
   (`experience.minibatch_schedule`); the actor (`actor.ActorWorker.train`: policy loss
   `algo.policy_loss` + β·KL loss − entropy bonus + ptx_coef · SFT loss on one PPO-ptx
   micro-batch, reduced by `algo.loss_reduction` with the mini-batch's global counts; its EMA
   follows each step) and the critic (`critic.CriticWorker.train`: clipped value loss) at once;
   with a single pass over a single mini-batch (``algo.fused_update``) a role backpropagates
   through its step-2 forward instead of running it again: step 2 asks it to keep that forward
   under a name (``keep_as``), step 5 passes the name back (``kept``);
6. sync the new actor weights (actor rank 0) into every rollout engine; log; checkpoint.

Who does what: the models live in role workers (`actor`, `critic`, and `roles` for reward,
reference and rollout), placed by `turborlhf.distributed` in this process (``distributed.backend:
local``) or on a Ray cluster (``ray``; several workers per role = data parallel, several rollout
engines fed by a work queue). This driver sends them batches and computes rewards, advantages and
the mini-batch plan with pure functions (docs/distributed.md). Tensor layout and shapes:
`experience`.

Imports flow one way (the package docstring draws the map): this driver → the workers and step-1
helpers → `experience` → `turborlhf.algo`; nothing imports this driver back.

    turborlhf ppo --config configs/tiny/ppo.yaml
    turborlhf ppo --config configs/tiny/grpo.yaml     # critic-free: no critic is built
"""
from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, Optional

import torch

from turborlhf.algo import (AdaptiveKLController, FixedKLController, discounted_returns, gae,
                            group_mean_baseline, group_normalized_advantages, kl_estimate, kl_penalized_rewards,
                            leave_one_out_advantages, masked_mean, masked_whiten)
from turborlhf.config import ConfigError, PPOAlgoCfg, PPOConfig
from turborlhf.data.loaders import load_prompt_records
from turborlhf.data.tokenize import encode_prompts
from turborlhf.distributed.group import Sibling, WorkerError
from turborlhf.distributed.roles import check_fsdp_batches
from turborlhf.distributed.placement import RoleSpec, launch
from turborlhf.engine.checkpoint import (PlanDigest, check_plan, latest_checkpoint, load_trainer_state,
                                         save_checkpoint)
from turborlhf.engine.lifecycle import checkpointed_steps, run_to_end, start_run
from turborlhf.engine.run import plan_steps, print_batch_table, resolve_hardware
from turborlhf.engine.train import rng_state, seed_everything, set_rng_state, set_threads
from turborlhf.metrics import M, MetricsLogger, tracker_kwargs, trim_jsonl
from turborlhf.models.load import load_tokenizer
from turborlhf.models.reference import check_reference_vocabulary, same_model
from turborlhf.models.zoo import resolve_model_path
from turborlhf.models.trunk import clear_trunk_caches, share_frozen_trunk
from turborlhf.rewards.model import check_reward_model
from turborlhf.rewards.normalize import RunningMoments
import turborlhf.trainers.ppo.rlvr as rlvr     # dynamic sampling, score shaping, rollout correction
from turborlhf.trainers.ppo.actor import ActorWorker
from turborlhf.trainers.ppo.async_rollout import RolloutPipeline, rollout_pipeline
from turborlhf.trainers.ppo.critic import CriticWorker
from turborlhf.trainers.ppo.experience import (Experience, assemble, minibatch_schedule, updates_per_batch,
                                               use_fused_update)
from turborlhf.trainers.ppo.roles import ReferenceWorker, RewardWorker, RolloutWorker, has_model_rewards, role_models
from turborlhf.trainers.ppo.rollout import score_rows, submit_rows

__all__ = ["phases", "train", "train_steps", "share_trunks", "make_experience", "score_and_advantages", "ppo_update",
           "merge_rank_stats", "sync_weights", "build_roles", "warn_emulated_bf16", "lora_reference",
           "ADVANTAGE_ESTIMATORS"]

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# Advantage estimators: one function per variant, (scores_B, kl_BR, values_BR, mask_BR, β, cfg,
# sampled_BR) → (advantages_BR, returns_BR). β is the KL-in-reward coefficient (0 when KL is a loss
# term); sampled_BR (None: mask_BR) the tokens the policy sampled, which whitening reads.
# ----------------------------------------------------------------------------------------------

def _gae_advantages(scores_B, kl_BR, values_BR, mask_BR, kl_coef: float, A: PPOAlgoCfg, sampled_BR=None):
    """PPO: token rewards (score at EOS − β·kl), GAE(γ, λ), returns = A + V, optional whitening
    (over `sampled_BR`, the tokens the policy sampled, when a rollout tool wrote others)."""
    rewards_BR = kl_penalized_rewards(scores_B, kl_BR, mask_BR, kl_coef)
    adv_BR, ret_BR = gae(values_BR, rewards_BR, mask_BR, A.gamma, A.lam)
    return (masked_whiten(adv_BR, mask_BR if sampled_BR is None else sampled_BR) if A.whiten_advantages
            else adv_BR * mask_BR), ret_BR


def _critic_free(baseline_BG: Optional[Callable[[torch.Tensor], torch.Tensor]], whiten: bool):
    """OpenRLHF's recipe (docs/reference/formulas.md §7): baseline on the score of each (prompts, G) group, token
    rewards (baselined score at EOS − β·kl), advantages = discounted reward-to-go, optional global
    whitening."""

    def estimator(scores_B, kl_BR, values_BR, mask_BR, kl_coef: float, A: PPOAlgoCfg, sampled_BR=None):
        if baseline_BG is not None:
            scores_B = baseline_BG(scores_B.view(-1, A.n_samples_per_prompt)).reshape(-1)   # (B/G, G) → B
        rewards_BR = kl_penalized_rewards(scores_B, kl_BR, mask_BR, kl_coef)
        ret_BR = discounted_returns(rewards_BR, mask_BR, A.gamma)
        return (masked_whiten(ret_BR, mask_BR if sampled_BR is None else sampled_BR) if whiten else ret_BR), ret_BR

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
# 1. Rollouts: seeded work items spread over the rollout engines
# ----------------------------------------------------------------------------------------------

def sync_weights(cluster, canary=None, tol: float = 0.05, colocated: bool = False) -> dict:
    """Weight sync: actor rank 0's parameters reach every live rollout engine (one object-store
    copy read by all engines under Ray; a plain dict locally), or with `colocated` (`colocated_push`)
    each engine takes those of the actor rank in its own process. With a `canary`, every engine's
    log-probs on it are checked against the actor's (`turborlhf.rollout.sync`): WeightSyncError,
    naming the rollout worker, when one disagrees by more than `tol`. Returns the sync metrics of
    the worst engine (empty without a canary)."""
    t0 = time.perf_counter()
    weights = Sibling("actor", "local_weights") if colocated else cluster["actor"].ref0("weights")
    cluster["rollout"].run_alive("load_weights", weights)
    if canary is None:
        return {}
    t_push = time.perf_counter() - t0
    return _check_engines(cluster, canary, tol) | {M.T_WEIGHT_PUSH: t_push}


def colocated_push(cfg: PPOConfig) -> bool:
    """Whether each rollout engine takes its weights from the actor rank in its own process: on Ray
    with every role on the same workers (`distributed.colocate_all_models`) and DDP, where every
    actor rank holds the whole model (FSDP shards it: rank 0 gathers and the object store carries)."""
    d = cfg.distributed
    return d.backend == "ray" and d.colocate_all_models and d.dp_strategy == "ddp"


def start_sync_check(cluster, cfg: PPOConfig, prompt_ids: list[list[int]]):
    """At start-up (`rollout.verify_sync`): build the canary on rollout worker 0 and check every
    engine against the actor as built; returns the canary for the later checks (None when off)."""
    if not cfg.rollout.verify_sync:
        return None
    canary = cluster["rollout"].run_alive("make_canary", prompt_ids)[0]
    m = _check_engines(cluster, canary, cfg.rollout.sync_tolerance)
    logger.info(f"[sync] the rollout engines match the actor on {len(canary.prompts)} canary rows: "
                f"mean |Δ mean log-prob| "
                f"{m[M.SYNC_LOGP_DIFF]:.4f} <= {cfg.rollout.sync_tolerance:g} (worst row {m[M.SYNC_ROW_DIFF]:.4f})")
    return canary


def _check_engines(cluster, canary, tol: float) -> dict:
    ref = next(r for r in cluster["actor"].run("canary_logprobs", canary) if r is not None)
    reports = cluster["rollout"].run_alive("check_sync", canary, ref, tol)
    return max(reports, key=lambda m: m.get(M.SYNC_LOGP_DIFF, 0.0))


# ----------------------------------------------------------------------------------------------
# 2-4. Experience, rewards, advantages
# ----------------------------------------------------------------------------------------------

def _kl_reward_coef(has_reference: bool, A: PPOAlgoCfg, kl_coef: float) -> float:
    """β of the per-token reward penalty: 0 when the KL is a loss term or there is no reference."""
    return 0.0 if (A.kl_use_loss or not has_reference) else kl_coef


def make_experience(cluster, cfg: PPOConfig, tok, prompt_ids: list[list[int]], responses: list[list[int]],
                    finished: list[bool], kl_coef: float, reward_stats: Optional[RunningMoments],
                    keep_as: tuple[Optional[str], Optional[str]] = (None, None),
                    rollout_logps: Optional[list[list[float]]] = None,
                    scores: Optional[tuple] = None, columns: Optional[list[dict]] = None,
                    tool_mask: Optional[list[list[bool]]] = None,
                    generated_scores: Optional[tuple] = None) -> Experience:
    """Forward passes of the roles over the rollout batch (all roles at once, each over its ranks),
    then rewards and advantages on the driver (`score_and_advantages`). ``keep_as`` = (actor,
    critic): the name under which a role keeps its forward's graph for the coming update (the
    fused update's handle, `experience.use_fused_update`; None: not kept); the driver passes the
    same names to `ppo_update`. `rollout_logps`: the engine's, per row (with ``algo.old_logprobs:
    rollout`` and no fused actor update, the old log-probs themselves); `scores`: (raw, per
    source) if already scored (dynamic sampling); ``columns``: per row, the prompts file's other
    fields, for reward functions (`turborlhf.rewards.functions`); ``tool_mask``: per row, the tokens
    ``rollout.tool`` wrote (no actor loss); ``generated_scores``: (raw, per source) of every row
    generated this step, dropped groups' too (dynamic sampling; `rlvr.Rollouts`), which the running
    reward normaliser updates with (`score_and_advantages`)."""
    mb = cfg.train.micro_batch_size
    clear_trunk_caches()                     # shared trunks (`share_trunks`): a new batch of sequences
    ids, attn, P, mask = assemble(prompt_ids, responses, tok.pad_token_id)
    B, R = mask.shape
    rows = lambda s: (ids[s], attn[s])                                              # noqa: E731
    rows_mask = lambda s: (ids[s], attn[s], mask[s])                                # noqa: E731
    from_engine = cfg.algo.old_logprobs == "rollout" and keep_as[0] is None   # a fused update runs the forward anyway
    if from_engine:
        if rollout_logps is None:
            raise RuntimeError("algo.old_logprobs=rollout needs the rollout engine's log-probs, and none came back")
        old_BR = rlvr.pad_logprobs(rollout_logps, R)
        old, rollout_logps = (lambda: old_BR), None    # no mismatch to measure against itself
    else:
        old = submit_rows(cluster["actor"], "logprobs", B, mb, rows_mask, P, keep_as[0])
    ref = None
    if cluster.get("reference"):
        ref = submit_rows(cluster["reference"], "logprobs", B, mb, rows_mask, P)
    elif cfg.algo.needs_reference and lora_reference(cfg):
        ref = submit_rows(cluster["actor"], "ref_logprobs", B, mb, rows_mask, P)
    val = submit_rows(cluster["critic"], "values", B, mb, rows, P, R, keep_as[1]) if cluster.get("critic") else None
    raw_scores, per_source = scores or score_rows(cluster, cfg, ids, attn, prompt_ids, responses, columns)()
    return score_and_advantages(cfg.algo, ids, attn, P, mask, finished, old(), ref() * mask if ref else None,
                                val() * mask if val else None, raw_scores, per_source, kl_coef, reward_stats,
                                None if rollout_logps is None else rlvr.pad_logprobs(rollout_logps, R),
                                rlvr.score_shaping(cfg, mask.sum(-1)),
                                None if tool_mask is None else rlvr.pad_tool_mask(tool_mask, R),
                                None if generated_scores is None else generated_scores[0])


def score_and_advantages(A: PPOAlgoCfg, ids, attn, P: int, mask, finished: list[bool], old_logp_BR,
                         ref_logp_BR, values_BR, raw_scores_B, per_source: dict, kl_coef: float,
                         reward_stats: Optional[RunningMoments], rollout_logp_BR=None, shaping_B=None,
                         tool_mask_BR=None, stats_scores_B=None) -> Experience:
    """Scores (normalised, + `shaping_B` (overlong penalty), EOS-penalised, clipped), per-token KL,
    the advantage estimator's advantages and returns, and `rlvr.attach_rollout_fields`: pure tensor maths.

    With ``normalize_reward`` the running moments `reward_stats` are updated with `stats_scores_B`
    (raw scores, any length; None: `raw_scores_B`), then the B rows are standardised by them. With
    dynamic sampling that is every row generated this step, the dropped groups' too: the moments
    estimate the distribution of the scores the policy's samples get (TRL's legacy PPOTrainer
    ``use_score_scaling`` updates its running moments with every score of the batch), while DAPO's
    filter (2503.14476 §3.2) only chooses which samples enter the gradient. Fed the kept rows alone
    they would follow the filter, which drops the all-correct and all-wrong groups: with 0/1 rewards
    the mean is pulled toward 0.5 and σ toward its largest, 0.5, whatever the policy's accuracy.

    Tokens a rollout tool wrote (`tool_mask_BR`) are not the policy's actions: they carry no KL
    (neither the KL-in-reward penalty, nor the KL metrics and the adaptive controller) and are
    left out of the advantage whitening, as they are out of the actor's loss. They remain steps of
    the return/GAE recursions (reward 0 there; the critic values them), as verl treats them."""
    eos = torch.tensor(finished, dtype=torch.bool)
    scores = raw_scores_B.clone()
    if A.normalize_reward and reward_stats is not None:
        reward_stats.update(raw_scores_B if stats_scores_B is None else stats_scores_B)
        scores = reward_stats.normalize(scores)
    scores = scores if shaping_B is None else scores + shaping_B
    if A.missing_eos_penalty is not None:
        scores = torch.where(eos, scores, scores - A.missing_eos_penalty)
    scores = scores.clamp(-A.reward_clip, A.reward_clip)
    sampled = None
    if tool_mask_BR is not None and bool((tool_mask_BR & mask.bool()).any()):
        sampled = mask * (~tool_mask_BR).to(mask.dtype)
    kl = (kl_estimate(old_logp_BR, ref_logp_BR, A.kl_estimator) * (mask if sampled is None else sampled)
          if ref_logp_BR is not None else torch.zeros_like(mask))
    exp = Experience(ids, attn, P, mask, eos, old_logp_BR * mask, ref_logp_BR, values_BR, raw_scores_B, scores, kl,
                     per_source)
    exp.adv_BR, exp.returns_BR = ADVANTAGE_ESTIMATORS[A.advantage_estimator](
        scores, kl, values_BR, mask, _kl_reward_coef(ref_logp_BR is not None, A, kl_coef), A, sampled)
    rlvr.attach_rollout_fields(exp, A, rollout_logp_BR, tool_mask_BR)
    return exp


# ----------------------------------------------------------------------------------------------
# 5. PPO update: the driver plans the mini-batches, actor and critic workers train at once
# ----------------------------------------------------------------------------------------------

def merge_rank_stats(results: list[tuple[dict, int]]) -> tuple[dict, int]:
    """Per-rank (stat sums, optimizer steps) → one: losses and fractions are already weighted by
    the global counts, so ranks add; gradient norms are the same on every rank (rank 0's)."""
    sums: dict[str, float] = {}
    for rank, (stats, _) in enumerate(results):
        for k, v in stats.items():
            if k.endswith("grad_norm"):
                if rank == 0:
                    sums[k] = v
            else:
                sums[k] = sums.get(k, 0.0) + v
    return sums, results[0][1]


def ppo_update(cluster, cfg: PPOConfig, exp: Experience, train_actor: bool, generator: torch.Generator,
               kl_coef: float, kept: tuple[Optional[str], Optional[str]] = (None, None)) -> dict:
    """`ppo_epochs` × `num_mini_batches` optimizer steps of actor and critic (each runs its own
    mini-batch loop over the shared `minibatch_schedule`); returns mean stats. `kept` = (actor,
    critic): the names their experience forwards were kept under (`make_experience`'s
    ``keep_as``), or None."""
    schedule = minibatch_schedule(exp.mask_BR.shape[0], cfg.algo, generator)
    pending = []
    if train_actor:
        pending.append(cluster["actor"].submit("train", exp, schedule, kl_coef, kept[0]))
    if cluster.get("critic") is not None:
        pending.append(cluster["critic"].submit("train", exp, schedule, kept[1]))
    sums: dict[str, float] = {}
    for p in pending:
        stats, _ = merge_rank_stats(p.get())
        sums.update(stats)
    return {k: v / len(schedule) for k, v in sums.items()}


# ----------------------------------------------------------------------------------------------
# Setup and the loop
# ----------------------------------------------------------------------------------------------

def phases(cfg: PPOConfig) -> tuple[str, ...]:
    """The memory phases of one PPO step, in order (`turborlhf plan` sizes each one and refuses a
    config whose phases it does not model): step 1's generation; step 2's forwards (with autograd
    when a role keeps its graph for a fused update, `use_fused_update`); step 5's updates. In one
    process (``distributed.backend: local``) the actor trains and steps before the critic trains;
    on Ray both train at once and step together."""
    A, D = cfg.algo, cfg.distributed
    rows = A.prompts_per_step * A.n_samples_per_prompt
    trained = ("actor", "critic") if A.needs_critic else ("actor",)
    fused = any(use_fused_update(cfg, rows, SimpleNamespace(role=r, world_size=getattr(D, r).world_size))
                for r in trained)
    out = ("generate", "experience" if fused else "experience (no grad)", "train actor")
    if not A.needs_critic:
        return out + ("optimizer step",)
    if D.backend == "local":
        return out + ("actor step", "train critic", "critic step")
    return out + ("train critic", "optimizer step")


def lora_reference(cfg: PPOConfig) -> bool:
    """With a LoRA actor whose reference is its own starting model, the reference is the actor with
    its adapters disabled (`ActorWorker.ref_logprobs`): no reference worker, no second copy."""
    return cfg.actor.lora.rank > 0 and same_model(cfg.reference or cfg.actor.name_or_path, cfg.actor.name_or_path)


def build_roles(cfg: PPOConfig, ckpt: Optional[Path], steps: int = 1, reward_callables=None):
    """Place the roles (`turborlhf.distributed.placement.launch`): actor (trainable); critic
    (trainable, gae only, from the RM by default); reward sources (`reward_callables`: the Python
    API's functions, `turborlhf.rewards.callables.RewardCallables`); reference (frozen, only when a
    KL term is on); rollout engines. `steps`: the run's PPO steps, which size the learning-rate
    schedules (the optimizer steps each role takes: the actor none in the critic's warm-up).
    Returns the `Cluster` (``cluster["actor"]`` etc.)."""
    A, c = cfg.algo, str(ckpt) if ckpt else None
    threads = cfg.train.threads or int(os.environ.get("TURBORLHF_THREADS", "0"))
    per_step = updates_per_batch(A.prompts_per_step * A.n_samples_per_prompt, A)
    actor_updates = max(1, (steps - A.critic_warmup_steps) * per_step)
    specs = {"actor": RoleSpec(ActorWorker, (cfg, c, actor_updates, threads))}
    if A.needs_critic:
        specs["critic"] = RoleSpec(CriticWorker, (cfg, c, max(1, steps * per_step), threads))
    # with distributed.device gpu, reward functions alone and an engine on the CPU take no GPU
    specs["reward"] = RoleSpec(RewardWorker, (cfg, threads, reward_callables), cpu_only=not has_model_rewards(cfg))
    if A.needs_reference and not lora_reference(cfg):
        specs["reference"] = RoleSpec(ReferenceWorker, (cfg, threads))
    specs["rollout"] = RoleSpec(RolloutWorker, (cfg, c, threads), cpu_only=cfg.rollout.device == "cpu")
    cluster = launch(cfg.distributed, specs, threads=threads)
    warn_emulated_bf16(cfg, cluster)
    return cluster


def warn_emulated_bf16(cfg: PPOConfig, cluster) -> str:
    """One warning when bf16 compute, chosen or set on the driver's host, runs on Ray CPU workers
    whose hosts emulate it (no AVX-512-BF16 or AMX: 5-15× slower than fp32 there); returns it
    ("" when there is none). A heterogeneous cluster's precision is decided once, where the
    command runs, so every rank computes alike; the message names the hosts and the fields."""
    if cluster.backend != "ray" or cfg.distributed.device != "cpu":
        return ""
    # the config section whose dtype each role computes in (reference and reward models: the actor's)
    section_of = {"actor": "actor", "reference": "actor", "rollout": "rollout",
                  "critic": "critic" if cfg.critic is not None else None,
                  "reward": "actor" if has_model_rewards(cfg) else None}
    fields, hosts = set(), set()
    for role, group in cluster.groups.items():
        section = section_of.get(role)
        slow = [i["host"] for i in group.infos if i.get("bf16_cpu") is False]
        if slow and section and getattr(cfg, section).dtype == "bf16":
            fields.add(f"{section}.dtype")
            hosts.update(slow)
    if not fields:
        return ""
    msg = (f"{', '.join(sorted(fields))}=bf16 runs on Ray workers whose CPUs emulate bf16 (no avx512_bf16 or "
           f"amx_bf16; hosts {', '.join(sorted(hosts))}): 5-15x slower than fp32 there; the precision was "
           f"decided on this host, so set {', '.join(f'{f}=fp32' for f in sorted(fields))}")
    warnings.warn(msg, stacklevel=2)
    return msg


def _explained_variance(values_BR, returns_BR, mask_BR) -> float:
    var_ret = masked_mean((returns_BR - masked_mean(returns_BR, mask_BR)) ** 2, mask_BR)
    resid = returns_BR - values_BR
    var_res = masked_mean((resid - masked_mean(resid, mask_BR)) ** 2, mask_BR)
    return float(1 - var_res / var_ret.clamp(min=1e-8))


def _rollout_metrics(exp: Experience, kl_coef: float, generated_scores: Optional[tuple] = None) -> dict:
    """The ``rollout/`` metrics of one step's experience (docs/algorithms/ppo.md, Metrics).

    ``rollout/reward_mean|std`` and the per-source means are over the rows the step generated:
    `generated_scores` (raw_G, {source: scores_G}) when given (dynamic sampling: every round's rows,
    the dropped groups' too; `rlvr.Rollouts`), else the experience's rows. DAPO's filter drops the
    all-correct and all-wrong groups, so a mean over the trained rows alone is not the policy's
    accuracy; that mean is logged as ``rollout/reward_mean_trained`` (verl's DAPO recipe logs it as
    ``critic/score/mean``). ``rollout/score_mean``, the advantages and returns are the trained rows'. With
    several reward sources, ``rollout/reward_<name>_mean`` is each source's mean over the rows it
    scored; a source that scored no row of the step (a function returning None for every response,
    as a code checker on a batch of math prompts) has no mean, and the key is left out of that step
    (TRL logs NaN there, which trackers show as a broken run). The combined ``rollout/reward_mean``
    is over every row (`turborlhf.rewards.combine.combine_scores`: a row no source scores is an
    error)."""
    lens = exp.mask_BR.sum(-1)
    raw, per_source = (exp.raw_scores_B, exp.source_scores) if generated_scores is None else generated_scores
    out = {M.REWARD_MEAN: float(raw.mean()),
           M.REWARD_STD: float(raw.std()) if len(raw) > 1 else 0.0,                           # NaN for one row
           M.SCORE_MEAN: float(exp.scores_B.mean()), M.RESPONSE_LEN: float(lens.mean()),
           M.EOS_FRAC: float(exp.eos_B.float().mean()), M.RETURN_MEAN: float(masked_mean(exp.returns_BR, exp.mask_BR)),
           M.ADV_MEAN: float(masked_mean(exp.adv_BR, exp.mask_BR))}
    if exp.ref_logp_BR is not None:
        out.update({M.KL: float(exp.kl_BR.sum(-1).mean()), M.KL_COEF: kl_coef,
                    M.KL_PER_TOKEN: float(masked_mean(exp.kl_BR, rlvr.sampled_mask(exp)))})
    if exp.values_BR is not None:
        out[M.EXPLAINED_VAR] = _explained_variance(exp.values_BR, exp.returns_BR, exp.mask_BR)
    if generated_scores is not None:
        out[M.REWARD_MEAN_TRAINED] = float(exp.raw_scores_B.mean())
    if per_source and len(per_source) > 1:
        out.update({f"rollout/reward_{name}_mean": float(s.nanmean())     # over the rows it scored;
                    for name, s in per_source.items() if not bool(s.isnan().all())})  # none: no row
    return out


def train(cfg: PPOConfig, resume: bool = False, reward_callables=None) -> Path:
    """`turborlhf ppo` (and grpo, rloo): the whole run (`train_steps` to its end); returns the output
    directory. `reward_callables`: the ``kind: callable`` reward sources' functions (Python API)."""
    return run_to_end(train_steps(cfg, resume, reward_callables))


def train_steps(cfg: PPOConfig, resume: bool = False, reward_callables=None) -> Iterator[tuple[int, int, dict]]:
    """`train` as a generator: yields ``(done, total, metrics)`` after each PPO step; the final checkpoint
    and export run when it is resumed after the last one; returns the output directory. The roles'
    workers are shut down when it ends or is closed."""
    # 0. run directory, threads, seed, prompts and the step plan
    cfg = resolve_hardware(cfg, "ppo")      # device and precision: auto → this host's choice
    out, ckpt = start_run(cfg, resume, "ppo")
    set_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    A = cfg.algo
    if A.kl_use_loss and A.kl_estimator == "k1":
        warnings.warn("algo.kl_use_loss with kl_estimator=k1: the k1 loss's gradient is not the KL's; "
                      "use k3 (GRPO) or k2", stacklevel=2)
    tok = load_tokenizer(cfg.actor.name_or_path)
    records = load_prompt_records(cfg.data.prompts_file, tok, **cfg.data.loader_kwargs())  # + columns for rewards
    if cfg.data.max_samples:
        records = records[:cfg.data.max_samples]
    prompt_ids = encode_prompts(tok, [r["prompt"] for r in records], cfg.rollout.max_prompt_len)
    _check_context(cfg, max(map(len, prompt_ids)))
    plan = plan_steps([len(p) for p in prompt_ids], A.prompts_per_step, cfg.train.epochs, cfg.train.max_steps,
                      cfg.train.seed)
    _check_short_steps(cfg, len(plan[0]))
    for rm_path in [cfg.reward_model or ""] + [r.path for r in cfg.rewards if r.kind == "model"]:
        if rm_path:
            check_reward_model(rm_path)     # a causal LM would score with a random head; before any load
    if A.needs_reference and cfg.reference:
        check_reference_vocabulary(cfg.reference, tok)     # it scores the actor's token ids
    if A.needs_critic:                                      # so does the critic, whatever it starts from
        field = ("critic.name_or_path" if cfg.critic is not None else
                 "critic.name_or_path (unset: the critic starts from the reward model)")
        check_reference_vocabulary(cfg.critic_init, tok, field, role="the critic")

    # roles on their workers (this process, or Ray), controllers, resume state
    cluster = build_roles(cfg, ckpt, len(plan), reward_callables)
    try:
        return (yield from _run(cfg, cluster, tok, prompt_ids, plan, out, ckpt, [r["columns"] for r in records]))
    finally:
        cluster.shutdown()


def _check_short_steps(cfg: PPOConfig, prompts: int) -> None:
    """Fewer prompts than ``algo.prompts_per_step`` make short steps (`plan_steps`), whose rows FSDP
    must still split evenly over its workers (`check_fsdp_batches` checked the full step only):
    ConfigError naming the fields, where uneven splits left the workers' collectives mismatched."""
    if prompts >= cfg.algo.prompts_per_step:
        return
    try:
        check_fsdp_batches(cfg.distributed, cfg.algo.model_copy(update={"prompts_per_step": prompts}),
                           cfg.train.micro_batch_size)
    except ValueError as e:
        raise ConfigError(f"data.prompts_file: {prompts} prompts (after data.max_samples) are fewer than "
                          f"algo.prompts_per_step {cfg.algo.prompts_per_step}, so every step trains those {prompts}: "
                          f"{e}") from None


def share_trunks(cluster, cfg: PPOConfig) -> str:
    """``distributed.share_frozen_trunk``: the roles in this process (local backend) whose frozen
    lower layers are equal compute them once per sequence (`turborlhf.models.trunk`). Returns
    what is shared, for the batch table ("no" when nothing is)."""
    D = cfg.distributed
    if not D.share_frozen_trunk or D.backend != "local" or D.ref_reward_offload:
        return "no"
    named = []
    for role in ("actor", "reference", "reward", "critic"):
        obj = getattr(cluster.get(role), "obj", None)
        if obj is not None:
            named += [(role, m) for m in role_models(obj)]
    groups = share_frozen_trunk([m for _, m in named])
    return "; ".join(f"{', '.join(named[i][0] for i in idx)}: lower {n} layers" for idx, n in groups) or "no"


def _check_context(cfg: PPOConfig, longest: int) -> None:
    """Refuse, before any model loads, prompts that cannot take ``rollout.max_new_tokens`` within
    the actor's context (``max_position_embeddings``): the engine would refuse them mid-run."""
    from transformers import AutoConfig

    ctx = getattr(AutoConfig.from_pretrained(resolve_model_path(cfg.actor.name_or_path)), "max_position_embeddings",
                  None)
    if ctx and longest + cfg.rollout.max_new_tokens > ctx:
        raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: the longest prompt ({longest} tokens, "
                          f"rollout.max_prompt_len={cfg.rollout.max_prompt_len}) + the new tokens exceed the actor's "
                          f"context ({ctx} positions); lower either")


def _run(cfg: PPOConfig, cluster, tok, prompt_ids, plan, out: Path, ckpt: Optional[Path],
         columns: Optional[list[dict]] = None) -> Iterator[tuple[int, int, dict]]:
    A, D = cfg.algo, cfg.distributed
    info = cluster["actor"].run("info")[0]
    shared = share_trunks(cluster, cfg)
    rollout_rows = A.prompts_per_step * A.n_samples_per_prompt
    print_batch_table("ppo", [("prompts", len(prompt_ids)), ("prompts_per_step", A.prompts_per_step),
                              ("n_samples_per_prompt", A.n_samples_per_prompt),
                              ("rollout_batch (sequences)", A.prompts_per_step * A.n_samples_per_prompt),
                              ("num_mini_batches", A.num_mini_batches), ("ppo_epochs", A.ppo_epochs),
                              ("fused_update (actor, critic)", ", ".join(
                                  str(cluster.get(r) is not None and use_fused_update(cfg, rollout_rows, cluster[r]))
                                  for r in ("actor", "critic"))),
                              ("micro_batch_size", cfg.train.micro_batch_size), ("ppo_steps", len(plan)),
                              ("advantage_estimator", A.advantage_estimator), ("critic", cluster.get("critic") is not None),
                              ("reference", "actor, adapters off (LoRA)" if A.needs_reference and lora_reference(cfg)
                               else cluster.get("reference") is not None),
                              ("reward sources", ", ".join(f"{n}×{w:g}" for n, w in cluster["reward"].run("sources")[0])),
                              ("ptx examples", info["ptx_examples"]),
                              ("rollout_engine", cluster["rollout"].run("engine_name")[0]),
                              ("shared frozen trunk", shared),
                              ("backend", D.backend),
                              ("workers", ", ".join(f"{r}×{g.world_size}" for r, g in cluster.groups.items()))])
    kl_ctl = (AdaptiveKLController(A.kl_coef, A.kl_target, A.kl_horizon) if A.kl_target is not None
              else FixedKLController(A.kl_coef))
    reward_stats = RunningMoments() if A.normalize_reward else None
    gen = torch.Generator().manual_seed(cfg.train.seed)
    start, st = 0, {}
    # the prompts of each step and their reward columns (and the PPO-ptx examples): an edited prompts
    # or ptx file is refused on resume
    steps_digest = PlanDigest(plan, list(zip(prompt_ids, columns or [None] * len(prompt_ids))),
                              info.get("ptx_sha256"))
    if ckpt:
        st = load_trainer_state(ckpt)
        check_plan(st, steps_digest, ckpt, "ppo")
        if A.kl_target is not None:       # the adapted coefficient; a fixed one is the config's (--resume-changed)
            kl_ctl.value = st["kl_coef"]
        if reward_stats is not None and st.get("reward_stats"):
            reward_stats = RunningMoments(**st["reward_stats"])
        set_rng_state(st["rng"])
        gen.set_state(st["gen"])
        start = st["step"]
        # the engines hold the checkpoint's actor (a LoRA checkpoint: they started from the base)
        sync_weights(cluster, colocated=colocated_push(cfg))
        logger.info(f"[ppo] resumed from {ckpt} at step {start}")
    canary = start_sync_check(cluster, cfg, prompt_ids)       # every engine vs the actor as built
    log = MetricsLogger(out, "ppo", len(plan), show=(M.REWARD_MEAN, M.KL, M.RESPONSE_LEN, M.CLIPFRAC, M.VALUE_LOSS),
                        **tracker_kwargs(cfg), progress=cfg.log.progress, resume=bool(ckpt), start_step=start)
    if ckpt:
        trim_jsonl(out / "samples.jsonl", start)       # the steps after the checkpoint come again
    samples_f = open(out / "samples.jsonl", "a" if ckpt else "w")
    # the step's rollouts: generated now, or (rollout.max_staleness > 0) while earlier steps train
    pipe = rollout_pipeline(cfg, cluster, tok, prompt_ids, plan, columns, start, st)

    def checkpoint(step: int) -> Path:
        writers = {role: (lambda d, g=cluster[role]: g.run("save", str(d)))
                   for role in ("actor", "critic") if cluster.get(role) is not None}
        state = {"kl_coef": kl_ctl.value, "reward_stats": reward_stats.__dict__ if reward_stats else None,
                 "rng": rng_state(), "gen": gen.get_state(), "step": step,
                 "plan_done_sha256": steps_digest.done(step)}
        pipe.wait()
        pending = pipe.state()              # the generated, untrained rollouts go with the checkpoint
        if pending is not None:
            state[RolloutPipeline.STATE_KEY] = pending
        return save_checkpoint(out, step, writers, tok, state, keep=cfg.train.keep_checkpoints)

    try:
        for step in checkpointed_steps(start, len(plan), checkpoint, cfg.train.save_every, "ppo"):
            done, metrics = _step(cfg, cluster, tok, prompt_ids, plan, step, kl_ctl, reward_stats, gen, log,
                                  samples_f, canary, columns, pipe)
            if pipe.failed is not None:     # a background generation failed or timed out: keep this step, stop
                checkpoint(done)
                raise pipe.failed
            yield done, len(plan), metrics
        cluster["actor"].run("export", str(out))      # after the last step's checkpoint (the loop's)
    except WorkerError as e:
        last = latest_checkpoint(out)
        raise WorkerError(f"{e}\n[ppo] run stopped; last complete checkpoint: "
                          f"{last if last else 'none'}" + (" (continue with --resume)" if last else ""),
                          e.role, e.rank, e.method) from e
    finally:
        pipe.close()
        samples_f.close()
        log.close()
    logger.info(f"[ppo] saved actor to {out}" + (f" and its EMA to {out / 'ema'}" if A.ema_beta is not None else ""))
    return out


def _step(cfg: PPOConfig, cluster, tok, prompt_ids, plan, step: int, kl_ctl, reward_stats, gen, log,
          samples_f, canary, columns: Optional[list[dict]], pipe) -> tuple[int, dict]:
    """One PPO step (numbered as in the module docstring); returns the number of steps done and its metrics.
    ``columns``: per prompt of the run, the prompts file's other fields (for reward functions); ``pipe``:
    where the step's rollouts come from (`async_rollout.rollout_pipeline`)."""
    A = cfg.algo
    t_step = time.perf_counter()
    # 1. generate (the n samples of a prompt consecutive) on the engines' work queue (+ dynamic
    #    sampling): now, or earlier in the background (then step + max_staleness is launched)
    batch = pipe.take(step)
    ro = batch.rollouts
    rows_prompts, responses, finished, per_engine = ro.prompts, ro.responses, ro.finished, ro.per_engine
    rows_columns = [columns[i] for i in ro.prompt_index] if columns else None
    t_gen = batch.seconds
    # 2-4. experience, rewards, advantages
    t0 = time.perf_counter()
    train_actor = step >= A.critic_warmup_steps
    fused = (train_actor and use_fused_update(cfg, len(rows_prompts), cluster["actor"]),
             cluster.get("critic") is not None and use_fused_update(cfg, len(rows_prompts), cluster["critic"]))
    kept = tuple(f"step {step}" if f else None for f in fused)   # the fused update's handles (actor, critic)
    exp = make_experience(cluster, cfg, tok, rows_prompts, responses, finished, kl_ctl.value, reward_stats, kept,
                          ro.logprobs, ro.scores, rows_columns, ro.tool_mask, ro.generated_scores)
    t_exp = time.perf_counter() - t0
    rlvr.mismatch_alarm(exp, cfg, step)     # engine vs trainer log-probs: warn, or stop before the update
    # 5. PPO epochs over mini-batches (actor and critic workers at once)
    lr = cluster["actor"].run("info")[0]["lr"]      # the rate of this step's first update
    t0 = time.perf_counter()
    stats = ppo_update(cluster, cfg, exp, train_actor, gen, kl_ctl.value, kept)
    t_train = time.perf_counter() - t0
    # 6. weight sync, KL controller, metrics
    pipe.wait()     # the engines finish the pending rollouts before they take new weights (see can_push)
    t0 = time.perf_counter()
    sync_metrics = {}
    if train_actor and pipe.can_push():  # push, then the canary check on every engine (WeightSyncError: one disagrees)
        sync_metrics = sync_weights(cluster, canary, cfg.rollout.sync_tolerance, colocated_push(cfg))
        pipe.pushed(step)
    t_sync = time.perf_counter() - t0
    metrics = _rollout_metrics(exp, kl_ctl.value, ro.generated_scores)
    if M.KL in metrics:
        kl_ctl.update(metrics[M.KL], len(exp.scores_B))
    metrics.update(stats)
    metrics.update(sync_metrics)
    metrics.update(rlvr.rlvr_metrics(exp, cfg) | ro.metrics)
    # the tokens the engines generated in t_gen: with dynamic sampling, every round's, dropped groups' too
    generated = ro.metrics.get("rollout/tokens_generated", float(exp.mask_BR.sum()))
    metrics.update({M.T_GENERATE: t_gen, M.T_EXPERIENCE: t_exp, M.T_TRAIN: t_train, "timing/weight_sync": t_sync,
                    M.T_STEP: time.perf_counter() - t_step, "rollout/tokens_per_s": generated / max(t_gen, 1e-9),
                    M.LR: lr})
    metrics.update(pipe.metrics(batch))
    if len(per_engine) > 1:
        metrics.update({f"rollout/engine{r}_items": float(n) for r, n in enumerate(per_engine)})
    done = step + 1
    if done % cfg.log.every == 0 or done == len(plan):
        log.log(done, metrics)
    samples_f.write(json.dumps({"step": done, "prompt": tok.decode(rows_prompts[0][-200:]),
                                "response": tok.decode(responses[0]), "score": float(exp.raw_scores_B[0])}) + "\n")
    samples_f.flush()
    return done, metrics
