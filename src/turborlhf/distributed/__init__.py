"""Placing the roles of a run (actor, critic, reward, reference, rollout) on workers: in this
process or on a Ray cluster, behind one interface (`group.LocalGroup`, `group.RayGroup`).
Knows nothing of PPO. Importing this package imports neither torch nor Ray."""
from turborlhf.distributed.group import (LocalGroup, Pending, RayGroup, WorkerDiedError, WorkerError,
                                         WorkerTimeoutError)
from turborlhf.distributed.roles import ROLES, check_colocation, colocation_groups

__all__ = ["LocalGroup", "RayGroup", "Pending", "WorkerError", "WorkerDiedError", "WorkerTimeoutError", "ROLES",
           "colocation_groups", "check_colocation"]
