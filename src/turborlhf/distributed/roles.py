"""Role names and colocation: which roles share worker processes, and how FSDP roles must split
their batches. Pure Python (no torch, no Ray), so the config can validate a placement instantly.

A *role* is one of ``actor, critic, reward, reference, rollout``. Each role has ``world_size``
workers (``num_nodes × devices_per_node``, one device each). Colocated roles live in the *same*
worker processes (so they share devices and memory: verl's single-process colocation; OpenRLHF
instead starts one process per role on a shared GPU bundle). A colocation group therefore needs
all of its roles to have the same number of workers.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["ROLES", "colocation_groups", "check_colocation", "check_fsdp_batches", "unit_rows", "mini_batch_units"]

ROLES = ("actor", "critic", "reward", "reference", "rollout")


def colocation_groups(dist, active: Sequence[str]) -> list[tuple[str, ...]]:
    """Partition the active roles into groups that share workers.

    Args:
        dist: a `DistributedCfg` (``colocate_all_models``, ``colocate_actor_ref``,
            ``colocate_critic_reward``).
        active: the roles the run builds, e.g. ``("actor", "reward", "rollout")``.

    Returns:
        Tuples of role names in `ROLES` order; every active role in exactly one tuple.
    """
    active = [r for r in ROLES if r in active]
    if dist.colocate_all_models:
        return [tuple(active)]
    pairs = []
    if dist.colocate_actor_ref:
        pairs.append(("actor", "reference"))
    if dist.colocate_critic_reward:
        pairs.append(("critic", "reward"))
    groups: list[tuple[str, ...]] = []
    placed: set[str] = set()
    for pair in pairs:
        members = tuple(r for r in pair if r in active)
        if members:
            groups.append(members)
            placed.update(members)
    groups += [(r,) for r in active if r not in placed]
    return sorted(groups, key=lambda g: ROLES.index(g[0]))


def check_colocation(dist, active: Sequence[str]) -> None:
    """Raise ValueError naming the fields when colocated roles have different worker counts."""
    for group in colocation_groups(dist, active):
        sizes = {r: getattr(dist, r).world_size for r in group}
        if len(set(sizes.values())) > 1:
            flag = ("colocate_all_models" if dist.colocate_all_models else
                    "colocate_actor_ref" if "actor" in group else "colocate_critic_reward")
            detail = ", ".join(f"distributed.{r}: {n}" for r, n in sizes.items())
            raise ValueError(f"distributed.{flag}: colocated roles need the same number of workers "
                             f"(num_nodes × devices_per_node), got {detail}")


def unit_rows(B: int, algo) -> int:
    """Rows a PPO update shuffles together: a prompt's G samples where the forwards share prompts
    (``algo.share_prompts`` with G > 1), `B` holds whole groups and they are enough for
    ``algo.num_mini_batches`` (fewer groups than mini-batches capped the mini-batches at one
    group each, silently fewer updates than configured), else one row."""
    G = algo.n_samples_per_prompt
    return G if algo.share_prompts and G > 1 and B % G == 0 and B // G >= algo.num_mini_batches else 1


def mini_batch_units(B: int, algo) -> list[int]:
    """Units (`unit_rows`) of each mini-batch an update epoch cuts `B` rows into: exactly
    ``num_mini_batches``, at most one per unit, sizes differing by at most one (larger first, as
    ``torch.tensor_split``). Pure Python: the config checks use it without torch."""
    units = B // unit_rows(B, algo)
    n = min(algo.num_mini_batches, units)
    return [units // n + (i < units % n) for i in range(n)] if n else []


def check_fsdp_batches(dist, algo, micro_batch_size: int) -> None:
    """With ``dist.dp_strategy: fsdp``, raise ValueError naming the fields unless every rank of a
    trained role (actor; critic for gae) gets the same number of micro-batches of each batch.

    FSDP runs every forward and backward on all of a role's workers together (each gathers the
    sharded weights), so each batch scored (the step's rows, split by whole micro-batches as
    `turborlhf.trainers.ppo.experience.row_shards` splits them) and trained (each mini-batch, cut
    as `minibatch_schedule` cuts them) must make a multiple of the worker count in micro-batches,
    and a PPO-ptx micro-batch must give every worker a row. DDP sums its gradients at the
    optimizer step instead, so uneven splits are fine there. With dynamic sampling a step may
    train on fewer rows (``dynamic_sampling_fill: false``): refused, as those rows could not split
    evenly."""
    if dist.dp_strategy != "fsdp":
        return
    trained = [getattr(dist, r).world_size for r in (("actor", "critic") if algo.needs_critic else ("actor",))]
    if getattr(algo, "dynamic_sampling", False) and not getattr(algo, "dynamic_sampling_fill", True) \
            and max(trained) > 1:
        raise ValueError("distributed.dp_strategy: fsdp runs each forward and backward on all workers together; "
                         "algo.dynamic_sampling_fill=false trains a step on the kept groups alone, whose rows need "
                         "not split evenly over them: set it true (a short batch is filled) or use dp_strategy ddp")
    mb = micro_batch_size
    rows = algo.prompts_per_step * algo.n_samples_per_prompt
    batches = [rows] + [u * unit_rows(rows, algo) for u in mini_batch_units(rows, algo)]
    for role in ("actor", "critic") if algo.needs_critic else ("actor",):
        w = getattr(dist, role).world_size
        if w == 1:
            continue
        bad = next((b for b in batches if -(-b // mb) % w), None)
        if bad is not None:
            raise ValueError(
                f"distributed.dp_strategy: fsdp runs each forward and backward on all {w} {role} workers together, "
                f"so every batch must split into a multiple of {w} micro-batches (train.micro_batch_size {mb}); "
                f"{rows} rows per step (algo.prompts_per_step x algo.n_samples_per_prompt) in "
                f"algo.num_mini_batches {algo.num_mini_batches} give a batch of {bad} rows: {-(-bad // mb)} "
                "micro-batch(es)")
        if algo.ptx_coef > 0 and mb < w:
            raise ValueError(f"distributed.dp_strategy: fsdp with algo.ptx_coef > 0 needs train.micro_batch_size >= "
                             f"the {w} {role} workers (each runs a part of every PTX micro-batch)")
