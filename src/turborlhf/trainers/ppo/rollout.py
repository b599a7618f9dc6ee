"""The rollout side of the PPO driver: sampling parameters and seeded work items of a step
(`rollout_items`), generation on the rollout engines' work queue (`generate`), and row-sharded
calls into role workers, reward scoring among them (`score_rows`). Used by the driver
(`driver`), DAPO's dynamic sampling (`rlvr`) and the asynchronous rollouts (`async_rollout`);
it imports none of them, only `experience`."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from turborlhf.config import PPOConfig
from turborlhf.data.chat import stop_ids
from turborlhf.rollout.base import SamplingParams
from turborlhf.trainers.ppo.experience import logprobs_mode, row_shards

__all__ = ["rollout_items", "generate", "submit_rows", "score_rows"]


def _sampling(cfg: PPOConfig, tok, seed: int) -> SamplingParams:
    roll = cfg.rollout
    return SamplingParams(max_new_tokens=roll.max_new_tokens, min_new_tokens=roll.min_new_tokens,
                          temperature=roll.temperature, top_p=roll.top_p, top_k=roll.top_k,
                          stop_token_ids=stop_ids(tok), n=cfg.algo.n_samples_per_prompt, seed=seed,
                          return_logprobs=True, logprobs_mode=logprobs_mode(cfg))


def rollout_items(cfg: PPOConfig, tok, prompts: list[list[int]], step: int,
                  attempt: int = 0) -> list[tuple[list, SamplingParams]]:
    """Split a step's prompts into work items of `distributed.rollout_chunk` prompts (default: one
    engine batch, ``rollout.batch_size // n_samples_per_prompt``), each with its own seed derived from
    (train.seed, step, item). Which engine runs an item then changes nothing: the same items give
    the same responses on one engine or many. `attempt` ≥ 1: a further dynamic-sampling round."""
    n = cfg.distributed.rollout_chunk or max(1, cfg.rollout.batch_size // cfg.algo.n_samples_per_prompt)
    base = (cfg.train.seed * 100003 + step) * 1009 + attempt * 10**12
    return [(prompts[s:s + n], _sampling(cfg, tok, base + k)) for k, s in enumerate(range(0, len(prompts), n))]


def generate(cluster, cfg: PPOConfig, tok, prompts: list[list[int]], step: int, attempt: int = 0):
    """Responses for `prompts` (n samples each, consecutive), from the engines' work queue.
    Returns (response_ids, finished, items per engine rank, the engine's log-probs or None, the
    tool mask or None)."""
    items = rollout_items(cfg, tok, prompts, step, attempt)
    D = cfg.distributed
    outs, served = cluster["rollout"].map_dynamic("generate", items, timeout_s=D.rollout_timeout_s,
                                                  retries=D.rollout_retries)
    responses = [r for out in outs for r in out[0]]
    finished = [f for out in outs for f in out[1]]
    logprobs = None if any(out[2] is None for out in outs) else [lp for out in outs for lp in out[2]]
    tool_mask = None if any(out[3] is None for out in outs) else [m for out in outs for m in out[3]]
    return responses, finished, [served.count(r) for r in range(cluster["rollout"].world_size)], logprobs, tool_mask


def submit_rows(group, method: str, B: int, mb: int, row_args: Callable, *extra):
    """Send each rank its rows (`row_args(slice)` → positional args, then `extra`); returns a
    callable that waits and concatenates the per-rank results in row order."""
    shards = row_shards(B, mb, group.world_size)
    pending = group.submit_each(method, {r: ((*row_args(s), *extra), {}) for r, s in shards.items()})

    def get():
        parts = pending.get()
        if isinstance(parts[0], tuple):          # (scores_B, {source: scores_B}) from reward workers
            per = {k: torch.cat([p[1][k] for p in parts]) for k in parts[0][1]}
            return torch.cat([p[0] for p in parts]), per
        return torch.cat(parts)
    return get


def score_rows(cluster, cfg: PPOConfig, ids, attn, prompt_ids: list[list[int]], responses: list[list[int]],
               columns: Optional[list[dict]] = None):
    """Submit the rows to the reward workers; returns a callable giving (scores_B, {source: scores_B}).
    ``columns``: per row, the prompts file's other fields (reward functions get them by name)."""
    return submit_rows(cluster["reward"], "score", ids.shape[0], cfg.train.micro_batch_size,
                        lambda s: (ids[s], attn[s], prompt_ids[s], responses[s], columns[s] if columns else None))
