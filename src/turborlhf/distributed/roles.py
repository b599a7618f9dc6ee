"""Role names and colocation: which roles share worker processes. Pure Python (no torch, no Ray),
so the config can validate a placement instantly.

A *role* is one of ``actor, critic, reward, reference, rollout``. Each role has ``world_size``
workers (``num_nodes × devices_per_node``, one device each). Colocated roles live in the *same*
worker processes (so they share devices and memory: verl's single-process colocation; OpenRLHF
instead starts one process per role on a shared GPU bundle). A colocation group therefore needs
all of its roles to have the same number of workers.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["ROLES", "colocation_groups", "check_colocation"]

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
