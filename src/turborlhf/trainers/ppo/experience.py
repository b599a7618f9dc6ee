"""The experience of one PPO step: the `Experience` a rollout batch becomes, its tensor layout
(`assemble`), and the plan that cuts it for the update: the mini-batch schedule
(`minibatch_schedule`, shared by actor and critic), each rank's rows (`row_shards`,
`rank_micro_batches`), the global loss denominators of a mini-batch (`minibatch_counts`) and
whether a role backpropagates through its experience forward (`use_fused_update`).

Tensor layout (`turborlhf.data.tokenize.assemble_prompt_response`): prompts left-padded to P
columns, responses right-padded to R columns, so ``ids_BS = [prompt_BP | response_BR]`` (S = P + R
columns) and response-coordinate tensors are slices ``[:, P:]``. Shapes: B rows (prompts ×
samples), G samples per prompt, R response tokens (T in `turborlhf.algo`).

Imports no other PPO module (only the config, the data layout and the data-parallel rank); every
PPO module may import this one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from turborlhf.config import PPOAlgoCfg, PPOConfig
from turborlhf.distributed.roles import mini_batch_units, unit_rows
from turborlhf.data.tokenize import assemble_prompt_response
from turborlhf.engine.hardware import state_dtype_for
from turborlhf.engine.parallel import dp_rank_world

__all__ = ["Experience", "assemble", "shares_prompts", "logprobs_mode", "minibatch_schedule", "row_shards",
           "rank_micro_batches", "minibatch_counts", "use_fused_update"]

assemble = assemble_prompt_response     # the batch layout of the module docstring


@dataclass
class Experience:
    """One rollout batch: B rows (prompts × samples), P prompt columns, R response columns,
    ``ids_BS = [prompt_BP | response_BR]`` (S = P + R). Built by the driver
    (`turborlhf.trainers.ppo.driver.score_and_advantages`), sent whole to the actor and critic workers."""

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
    loss_mask_BR: Optional[torch.Tensor] = None      # actor-loss mask (no tool tokens, overlong filter); None = mask_BR
    tool_mask_BR: Optional[torch.Tensor] = None      # bool: written by rollout.tool, not sampled (None: no tool)

    def rows(self, idx: torch.Tensor) -> "Experience":
        """Sub-batch of rows (trimmed to its own longest response)."""
        sub = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        r = int(sub["mask_BR"].sum(-1).max().clamp(min=1))
        for k in ("mask_BR", "old_logp_BR", "ref_logp_BR", "values_BR", "kl_BR", "adv_BR", "returns_BR",
                  "rollout_logp_BR", "is_weight_BR", "loss_mask_BR", "tool_mask_BR"):
            if sub[k] is not None:
                sub[k] = sub[k][:, :r]
        sub["ids_BS"] = sub["ids_BS"][:, :self.P + r]
        sub["attn_BS"] = sub["attn_BS"][:, :self.P + r]
        return Experience(**sub)

    def to(self, device: torch.device) -> "Experience":
        """The same experience with its tensors on `device` (itself on the CPU). The copies are
        queued without waiting for the device (a blocking copy to a GPU first waits, tensor by
        tensor, for all the work queued before it); their CPU sources are not written afterwards."""
        if torch.device(device).type == "cpu":
            return self
        return Experience(**{k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                             for k, v in self.__dict__.items()})


def logprobs_mode(cfg: PPOConfig) -> str:
    """The engines' `SamplingParams.logprobs_mode`: ``raw_logprobs`` when they stand in for the
    trainer's old log-probs (``algo.old_logprobs: rollout``), else ``processed_logprobs`` (the
    sampling distribution's, for the mismatch metrics and TIS/MIS)."""
    return "raw_logprobs" if cfg.algo.old_logprobs == "rollout" else "processed_logprobs"


def shares_prompts(A: PPOAlgoCfg) -> bool:
    """Whether the actor and reference forwards compute each prompt once for its G samples
    (``algo.share_prompts`` with G > 1; `turborlhf.models.forward.shared_prompt_hidden_states`)."""
    return A.share_prompts and A.n_samples_per_prompt > 1


def minibatch_schedule(B: int, A: PPOAlgoCfg, generator: torch.Generator) -> list[torch.Tensor]:
    """Row indices of every mini-batch of the update: `ppo_epochs` shuffles of the B rows, each cut
    into exactly `updates_per_batch` mini-batches (`num_mini_batches`, at most one per unit; sizes
    differ by at most one unit). Actor and critic share it. With shared prompts (`shares_prompts`)
    the units are whole groups of G rows, so a micro-batch holds whole groups and computes each
    prompt once. A single pass over a single mini-batch keeps the rows in order (a shuffle would
    change nothing but the micro-batch grouping, and the fused update needs the experience's
    grouping)."""
    G, sizes = unit_rows(B, A), mini_batch_units(B, A)
    if A.ppo_epochs == 1 and len(sizes) == 1:
        return [torch.arange(B)]
    return [(units[:, None] * G + torch.arange(G)).reshape(-1) for _ in range(A.ppo_epochs)
            for units in torch.randperm(B // G, generator=generator).split(sizes)]


def updates_per_batch(B: int, A: PPOAlgoCfg) -> int:
    """Optimizer steps of an update on `B` rows: ``ppo_epochs`` × ``num_mini_batches``, the
    mini-batches capped at one per unit (`turborlhf.distributed.roles.mini_batch_units`)."""
    return A.ppo_epochs * len(mini_batch_units(B, A))


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
    - ``auto``: the actor's graph when each rank's rows fit one micro-batch, and the critic's too
      where the roles train on the CPU in bf16 or with bf16 AdamW moments (``optim.state_dtype``,
      bf16 on the CPU by default). In bf16 the projections keep no weight casts and the MLPs no
      product (`turborlhf.models.fused`), so holding both graphs is cheap: on the PPO bench
      (2-core AMX Xeon) peak RSS 4.94 → 5.20 GiB against the actor's graph alone before those
      savings, and 0.38 s less per step (experience +0.14 s, update −0.52 s). In fp32 (the same
      Xeon limited to AVX2) the critic's graph costs about what bf16 moments save (1.1 GiB):
      both together, 10.47 against 11.24 s per step at 6.55 against 6.51 GiB. With fp32 moments
      in fp32, or on a GPU (never measured), auto keeps the actor's only (``both`` opts in);
    - ``actor``: the actor's graph only;
    - ``both``: as auto for the actor and the critic;
    - ``always``: both, whenever the schedule allows (a rank's whole share of activations at once);
    - ``never``.
    Never under FSDP (its parameters are resharded between the calls), nor where a data-parallel
    rank gets no rows (a batch of fewer micro-batches than ranks), nor for a model with LoRA
    dropout (a forward in training mode is a dropout sample, not the policy's log-probs: the
    experience runs in eval mode, the update in training mode)."""
    A = cfg.algo
    if A.fused_update == "never" or A.ppo_epochs != 1 or A.num_mini_batches != 1:
        return False
    model = cfg.actor if getattr(group, "role", None) == "actor" else cfg.critic
    if model is not None and model.lora.rank > 0 and model.lora.dropout > 0:
        return False
    critic_too = A.fused_update in ("both", "always") or (
        A.fused_update == "auto" and cfg.distributed.device == "cpu"
        and (cfg.actor.dtype == "bf16" or _bf16_moments(cfg)))
    if getattr(group, "role", None) != "actor" and not critic_too:
        return False
    if group.world_size > 1 and cfg.distributed.dp_strategy == "fsdp":
        return False
    if len(row_shards(B, cfg.train.micro_batch_size, group.world_size)) < group.world_size:
        return False       # a rank given no rows keeps no experience graph for its update to take
    return A.fused_update == "always" or B <= cfg.train.micro_batch_size * group.world_size


def _bf16_moments(cfg: PPOConfig) -> bool:
    """Whether the CPU roles' AdamW keeps bf16 moments (``optim.state_dtype``, auto as
    `turborlhf.engine.hardware.choose_state_dtype` resolves it on the CPU)."""
    return state_dtype_for(cfg.optim.state_dtype, "cpu", cfg.actor.dtype) == "bf16"


def rank_micro_batches(exp: Experience, mini: torch.Tensor, micro_batch_size: int) -> Iterator[Experience]:
    """This data-parallel rank's micro-batches of mini-batch `mini` (row indices of `exp`): a
    contiguous block of whole micro-batches (`row_shards`, as the experience forwards were split),
    each a sub-`Experience` trimmed to its longest response; none for a rank without rows."""
    rank, world = dp_rank_world()
    shard = row_shards(len(mini), micro_batch_size, world).get(rank)     # the rows the experience gave this rank
    for micro in (mini[shard].split(micro_batch_size) if shard is not None else []):
        yield exp.rows(micro)


def minibatch_counts(mask_BR: torch.Tensor, cfg: PPOConfig) -> dict:
    """Global denominators of one mini-batch for `reduce_loss` (tokens, sequences, max length)."""
    A = cfg.algo
    return {"num_tokens": float(mask_BR.sum().clamp(min=1)), "max_len": cfg.rollout.max_new_tokens,
            "num_seqs": float((mask_BR.sum(-1) > 0).sum()) if A.loss_reduction == "seq_mean_token_mean"
            else float(mask_BR.shape[0])}
