"""The RLVR parts of `turborlhf ppo` (reinforcement learning with verifiable rewards), as helpers
the PPO driver calls; the maths is in `turborlhf.algo`, the equations and the peers' names in
docs/algorithms/critic_free.md.

- `collect_rollouts`: step 1 of the PPO step, generation, with DAPO dynamic sampling
  (``algo.dynamic_sampling``): groups whose scores are all equal are dropped and more prompts
  sampled, at most ``dynamic_sampling_max_tries`` rounds;
- `score_shaping`: DAPO's overlong penalty added to the score (``algo.overlong_buffer_len``);
- `attach_rollout_fields`: the engine's log-probs, the TIS/MIS weights (``algo.rollout_is``) and the
  overlong-filter loss mask (``algo.overlong_filter``) on the `Experience`;
- `rlvr_metrics` / `mismatch_alarm`: the engine/trainer mismatch, always logged
  (``rollout/mismatch_kl``, ``rollout/mismatch_max_ratio``), with an optional alarm.
"""
from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from turborlhf.errors import RunError
from turborlhf.algo import kept_groups_mask, overlong_penalty, rollout_is_weights, rollout_mismatch_stats
from turborlhf.data.tokenize import assemble_prompt_response
from turborlhf.trainers.ppo.rollout import generate, score_rows

__all__ = ["Rollouts", "collect_rollouts", "refill_prompts", "filter_scores", "kept_groups", "score_shaping",
           "pad_logprobs", "attach_rollout_fields", "rlvr_metrics", "mismatch_alarm", "mismatch_mask",
           "RolloutMismatchError", "RolloutMismatchWarning"]


# ----------------------------------------------------------------------------------------------
# Step 1 with DAPO dynamic sampling
# ----------------------------------------------------------------------------------------------

@dataclass
class Rollouts:
    """One step's responses, row by row (the G samples of a prompt consecutive)."""

    prompt_index: list[int]                  # index into the run's prompts, per row
    prompts: list[list[int]]
    responses: list[list[int]]
    finished: list[bool]
    logprobs: Optional[list[list[float]]]    # the engine's log-probs of the sampled tokens (None: not returned)
    per_engine: list[int]                    # work items served per rollout engine
    scores: Optional[tuple] = None           # (raw_scores_B, {source: scores_B}) when already scored
    metrics: dict = field(default_factory=dict)
    tool_mask: Optional[list[list[bool]]] = None   # per token, True where rollout.tool wrote it (None: no tool)
    # dynamic sampling: (raw_scores_G, {source: scores_G}) of all G rows generated this step, every
    # round's, dropped groups' too, for the logged rewards and the running normaliser (None: every
    # generated row is in the batch)
    generated_scores: Optional[tuple] = None

    def rows(self, idx: list[int]) -> "Rollouts":
        pick = lambda xs: [xs[i] for i in idx]                                  # noqa: E731
        scores = None if self.scores is None else (self.scores[0][idx], {k: v[idx] for k, v in self.scores[1].items()})
        return Rollouts(pick(self.prompt_index), pick(self.prompts), pick(self.responses), pick(self.finished),
                        None if self.logprobs is None else pick(self.logprobs), self.per_engine, scores,
                        tool_mask=None if self.tool_mask is None else pick(self.tool_mask))


def _concat(parts: list[Rollouts]) -> Rollouts:
    cat = lambda name: [x for p in parts for x in getattr(p, name)]             # noqa: E731
    logprobs = None if any(p.logprobs is None for p in parts) else cat("logprobs")
    raw = torch.cat([p.scores[0] for p in parts])
    per = {k: torch.cat([p.scores[1][k] for p in parts]) for k in parts[0].scores[1]}
    per_engine = [sum(n) for n in zip(*(p.per_engine for p in parts))]
    tool_mask = None if any(p.tool_mask is None for p in parts) else cat("tool_mask")
    return Rollouts(cat("prompt_index"), cat("prompts"), cat("responses"), cat("finished"), logprobs, per_engine,
                    (raw, per), tool_mask=tool_mask)


def _round(cluster, cfg, tok, prompt_ids: list[list[int]], index: list[int], step: int, attempt: int) -> Rollouts:
    G = cfg.algo.n_samples_per_prompt
    responses, finished, per_engine, logprobs, tool_mask = generate(cluster, cfg, tok, [prompt_ids[i] for i in index],
                                                                    step, attempt)
    rows = [i for i in index for _ in range(G)]
    return Rollouts(rows, [prompt_ids[i] for i in rows], responses, finished, logprobs, per_engine,
                    tool_mask=tool_mask)


def refill_prompts(n_prompts: int, n: int, seed: int, step: int, attempt: int) -> list[int]:
    """The prompts of dynamic-sampling round `attempt` ≥ 1 of `step`: `n` indices drawn without
    replacement (with, when fewer prompts exist) by a generator seeded from (seed, step, attempt),
    so a resumed run draws the same ones."""
    rng = random.Random(f"dynamic-sampling:{seed}:{step}:{attempt}")
    return rng.sample(range(n_prompts), n) if n <= n_prompts else rng.choices(range(n_prompts), k=n)


def _score_terms(cfg, ro: Rollouts) -> torch.Tensor:
    """Per row, what step 3 adds to the (normalised) score: overlong penalty − missing-EOS penalty."""
    A = cfg.algo
    s = torch.zeros(len(ro.responses))
    shaping = score_shaping(cfg, torch.tensor([len(r) for r in ro.responses]))
    if shaping is not None:
        s = s + shaping
    if A.missing_eos_penalty is not None:
        s = s - A.missing_eos_penalty * (~torch.tensor(ro.finished, dtype=torch.bool)).float()
    return s


def filter_scores(cfg, raw_B: torch.Tensor, ro: Rollouts) -> torch.Tensor:
    """The score the group filter compares: raw score + overlong penalty − missing-EOS penalty,
    clipped (the score step 3 computes without ``algo.normalize_reward``)."""
    return (raw_B + _score_terms(cfg, ro)).clamp(-cfg.algo.reward_clip, cfg.algo.reward_clip)


def kept_groups(cfg, raw_B: torch.Tensor, ro: Rollouts) -> list[bool]:
    """Per group of ``n_samples_per_prompt`` rows: whether its scores differ (DAPO's filter).
    Without ``normalize_reward`` that is `filter_scores` not all equal, the trainer's own score.
    With it the trainer scores ``(raw − μ)/σ + penalties``, σ from running statistics this batch
    updates, so no score computed here equals it; a group is dropped when its raw scores and its
    penalties are each all equal (then the trainer's are equal for every σ), and kept otherwise
    (raw = [2, 0] with the first response lacking EOS reads [1, 0] raw + penalty, but ties at
    σ = 2: kept, as it is signal for any other σ). With ``algo.overlong_filter`` a group none of
    whose responses ended (each masked out of the loss) is dropped too: it would train nothing."""
    G = cfg.algo.n_samples_per_prompt
    if not cfg.algo.normalize_reward:
        keep = kept_groups_mask(filter_scores(cfg, raw_B, ro), G)
    else:
        keep = kept_groups_mask(raw_B.float(), G) | kept_groups_mask(_score_terms(cfg, ro), G)
    if cfg.algo.overlong_filter:      # every response cut at max_new_tokens: all masked out of the loss
        keep &= torch.tensor(ro.finished, dtype=torch.bool).view(-1, G).any(dim=1)
    return keep.tolist()


def collect_rollouts(cluster, cfg, tok, prompt_ids: list[list[int]], index: list[int], step: int,
                     columns: Optional[list[dict]] = None) -> Rollouts:
    """Step 1: responses for the step's prompts `index`. With ``algo.dynamic_sampling`` (DAPO
    2503.14476 §3.2), each round's rows are scored, groups whose scores are all equal (`kept_groups`)
    (`turborlhf.algo.kept_groups_mask`) are dropped, and further rounds of ``len(index)`` prompts
    (`refill_prompts`) are sampled until that many groups are kept or
    ``dynamic_sampling_max_tries`` rounds are done; a batch still short is filled with the last
    dropped groups, so every step trains on the same number of rows (``dynamic_sampling_fill``;
    when false it keeps only the kept groups, and fills only when none was kept). Returns the kept
    rows (with their scores), the scores of every generated row, every round's, dropped groups' too
    (``generated_scores``: the logged rewards and the running normaliser describe the policy's
    samples, not the filter's choice of them; the advantages see the kept rows only), and the
    metrics ``rollout/groups_dropped``, ``rollout/sampling_rounds``, ``rollout/groups_filled``,
    ``rollout/groups_trained`` and ``rollout/tokens_generated`` (every round's response tokens,
    trained or dropped)."""

    A = cfg.algo
    G, N = A.n_samples_per_prompt, len(index)
    ro = _round(cluster, cfg, tok, prompt_ids, index, step, 0)
    if not A.dynamic_sampling:
        return ro
    kept: list[Rollouts] = []
    dropped: list[Rollouts] = []
    scored: list[tuple] = []                 # every round's scores, dropped groups' too
    n_dropped = n_kept = rounds = generated = 0
    served = [0] * len(ro.per_engine)        # work items per engine over all rounds
    while True:
        served = [a + b for a, b in zip(served, ro.per_engine)]
        generated += sum(len(r) for r in ro.responses)
        ids, attn, _, _ = assemble_prompt_response(ro.prompts, ro.responses, tok.pad_token_id)
        ro.scores = score_rows(cluster, cfg, ids, attn, ro.prompts, ro.responses,
                               [columns[i] for i in ro.prompt_index] if columns else None)()
        scored.append(ro.scores)
        keep = kept_groups(cfg, ro.scores[0], ro)
        rounds += 1
        for g, k in enumerate(keep):
            group = ro.rows(list(range(g * G, (g + 1) * G)))
            (kept if k else dropped).append(group)
        n_kept += sum(keep)
        n_dropped += len(keep) - sum(keep)
        if n_kept >= N or rounds >= A.dynamic_sampling_max_tries:
            break
        ro = _round(cluster, cfg, tok, prompt_ids, refill_prompts(len(prompt_ids), N, cfg.train.seed, step, rounds),
                    step, rounds)
    short = max(0, N - n_kept)
    filled = short if (A.dynamic_sampling_fill or n_kept == 0) else 0
    if filled:
        warnings.warn(f"dynamic sampling: {n_kept}/{N} groups with distinct scores after {rounds} rounds "
                      f"(algo.dynamic_sampling_max_tries); filling the batch with {filled} dropped groups",
                      RuntimeWarning, stacklevel=2)
    out = _concat(kept[:N] + (dropped[-filled:] if filled else []))
    out.per_engine = served      # (each group carried its round's counts: summed per kept group, none for the rest)
    out.generated_scores = (torch.cat([r for r, _ in scored]),
                            {k: torch.cat([per[k] for _, per in scored]) for k in scored[0][1]})
    out.metrics = {"rollout/groups_dropped": float(n_dropped), "rollout/sampling_rounds": float(rounds),
                   "rollout/groups_filled": float(filled), "rollout/groups_trained": float(min(n_kept, N) + filled),
                   "rollout/tokens_generated": float(generated)}
    return out


# ----------------------------------------------------------------------------------------------
# Steps 2-4: overlong shaping, engine log-probs, IS weights, overlong filter
# ----------------------------------------------------------------------------------------------

def score_shaping(cfg, lengths_B: torch.Tensor) -> Optional[torch.Tensor]:
    """DAPO overlong penalty (Eq. 13) per response from its token count, or None when off."""
    A = cfg.algo
    if not A.overlong_buffer_len:
        return None
    return overlong_penalty(lengths_B, cfg.rollout.max_new_tokens, A.overlong_buffer_len, A.overlong_penalty_factor)


def pad_logprobs(logprobs: list[list[float]], R: int) -> torch.Tensor:
    """Per-row engine log-probs → ``B×R`` (0 after each response)."""
    out = torch.zeros(len(logprobs), R)
    for i, lp in enumerate(logprobs):
        if lp:
            out[i, :len(lp)] = torch.tensor(lp[:R])
    return out


def pad_tool_mask(tool_mask: list[list[bool]], R: int) -> torch.Tensor:
    """Per-row tool masks → bool ``B×R`` (False after each response)."""
    out = torch.zeros(len(tool_mask), R, dtype=torch.bool)
    for i, m in enumerate(tool_mask):
        if m:
            out[i, :len(m)] = torch.tensor(m[:R], dtype=torch.bool)
    return out


def sampled_mask(exp) -> torch.Tensor:
    """The response tokens the policy sampled (those a rollout tool wrote out). Engine-vs-trainer
    statistics read these only: a tool token's engine log-prob is a placeholder 0."""
    return exp.mask_BR if exp.tool_mask_BR is None else exp.mask_BR * (~exp.tool_mask_BR).to(exp.mask_BR.dtype)


def mismatch_mask(exp, min_new_tokens: int) -> torch.Tensor:
    """`sampled_mask` without the first `min_new_tokens` response positions: the engine samples
    those with EOS masked out (``rollout.min_new_tokens``, vLLM's ``min_tokens``), so its log-probs
    there are of a renormalised distribution, ``log π − log(1 − π(EOS))``, by design. Compared with
    the trainer's, they read as a mismatch that grows with the policy's wish to stop (seen: KL 0.3
    and a ratio of 6e-4 in an fp32 run whose weight sync agreed to 1e-6). The TIS/MIS weights keep
    these positions: for importance sampling the masked distribution is the one that sampled."""
    m = sampled_mask(exp)
    if min_new_tokens > 0:
        m = m.clone()
        m[:, :min_new_tokens] = 0
    return m


def attach_rollout_fields(exp, A, rollout_logp_BR: Optional[torch.Tensor],
                          tool_mask_BR: Optional[torch.Tensor] = None) -> None:
    """Set the experience's loss mask (tokens written by a rollout tool out, ``tool_mask_BR``; with
    ``algo.overlong_filter`` rows without EOS out too), engine log-probs and TIS/MIS weights
    (``algo.rollout_is``)."""
    if tool_mask_BR is not None:
        exp.tool_mask_BR = tool_mask_BR & exp.mask_BR.bool()
        if bool(exp.tool_mask_BR.any()):
            exp.loss_mask_BR = sampled_mask(exp)
    if A.overlong_filter:
        exp.loss_mask_BR = sampled_mask(exp) * exp.eos_B[:, None].to(exp.mask_BR.dtype)
    if rollout_logp_BR is not None:
        exp.rollout_logp_BR = rollout_logp_BR * exp.mask_BR
    if A.rollout_is != "none":
        if rollout_logp_BR is None:
            raise RuntimeError(f"algo.rollout_is={A.rollout_is} needs the rollout engine's log-probs, and this "
                               "engine returned none")
        exp.is_weight_BR, _ = rollout_is_weights(exp.old_logp_BR, exp.rollout_logp_BR, sampled_mask(exp),
                                                 A.rollout_is, A.rollout_is_threshold, A.rollout_is_level)


# ----------------------------------------------------------------------------------------------
# Metrics and the mismatch alarm
# ----------------------------------------------------------------------------------------------

class RolloutMismatchError(RunError):
    """The engine's and the trainer's log-probs disagree beyond ``algo.mismatch_kl_alarm``."""


class RolloutMismatchWarning(RuntimeWarning):
    """As `RolloutMismatchError`, with ``algo.mismatch_kl_action: warn``."""


def rlvr_metrics(exp, cfg) -> dict:
    """Mismatch (``rollout/mismatch_kl``: k3 KL(engine‖trainer) per token, ``_k1``,
    ``rollout/mismatch_max_ratio``/``_min_ratio`` of π_old/π_engine), IS weight statistics,
    overlong penalty and filtered fraction, each only where it applies."""
    A, out = cfg.algo, {}
    if exp.rollout_logp_BR is not None:
        m = rollout_mismatch_stats(exp.old_logp_BR, exp.rollout_logp_BR, mismatch_mask(exp, cfg.rollout.min_new_tokens))
        out.update({"rollout/mismatch_kl": m["kl"], "rollout/mismatch_k1": m["k1"],
                    "rollout/mismatch_max_ratio": m["max_ratio"], "rollout/mismatch_min_ratio": m["min_ratio"]})
    if exp.is_weight_BR is not None:
        _, s = rollout_is_weights(exp.old_logp_BR, exp.rollout_logp_BR, sampled_mask(exp), A.rollout_is,
                                  A.rollout_is_threshold, A.rollout_is_level)
        out.update({"rollout/is_weight_mean": float(s["is_weight_mean"]),
                    "rollout/is_clipfrac": float(s["is_clipfrac"])})
    shaping = score_shaping(cfg, exp.mask_BR.sum(-1))
    if shaping is not None:
        out["rollout/overlong_penalty"] = float(shaping.mean())
    if A.overlong_filter:
        out["rollout/overlong_filtered_frac"] = float((~exp.eos_B).float().mean())
    if exp.tool_mask_BR is not None:
        out["rollout/tool_tokens_mean"] = float(exp.tool_mask_BR.sum(-1).float().mean())
    return out


def mismatch_alarm(exp, cfg, step: int) -> Optional[float]:
    """With ``algo.mismatch_kl_alarm`` set: warn (`RolloutMismatchWarning`) or raise
    `RolloutMismatchError` (before the step's update) when the per-token KL between the engine's
    and the trainer's log-probs (`mismatch_mask`'s tokens) exceeds it, or is NaN (a NaN log-prob
    from either side, which no comparison would catch). Returns the KL (None without engine
    log-probs)."""
    A = cfg.algo
    if exp.rollout_logp_BR is None:
        return None
    mask = mismatch_mask(exp, cfg.rollout.min_new_tokens)
    kl = rollout_mismatch_stats(exp.old_logp_BR, exp.rollout_logp_BR, mask)["kl"]
    if A.mismatch_kl_alarm is not None and (math.isnan(kl) or kl > A.mismatch_kl_alarm):
        if math.isnan(kl):
            msg = (f"step {step + 1}: rollout/mismatch_kl is NaN (algo.mismatch_kl_alarm = {A.mismatch_kl_alarm:g}): "
                   "the engine's or the trainer's log-probs of the sampled tokens hold NaN (overflow in low "
                   "precision, NaN weights or a broken kernel); consider rollout.dtype=fp32")
        else:
            msg = (f"step {step + 1}: rollout/mismatch_kl = {kl:.3g} > algo.mismatch_kl_alarm = "
                   f"{A.mismatch_kl_alarm:g}: the rollout engine samples from a policy that differs from the "
                   "trainer's (precision, kernels, stale weights); see rollout/mismatch_max_ratio, consider "
                   "algo.rollout_is=tis or rollout.dtype=fp32")
        if A.mismatch_kl_action == "error":
            raise RolloutMismatchError(msg)
        warnings.warn(msg, RolloutMismatchWarning, stacklevel=2)
    return kl
