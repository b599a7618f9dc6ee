"""Role groups: the workers of one role behind one small interface, in-process (`LocalGroup`) or
on Ray (`RayGroup`), so a trainer has one code path for a laptop and a cluster. This package
knows nothing of PPO: a role object is any class the trainer hands over; a group fans method
calls out to its ranks (OpenRLHF's ``RayActorGroup``).

Methods of both groups:

- ``run(method, *args)``: call on every rank with the same arguments, wait, results per rank;
- ``run_each(method, [(args, kwargs), ...])``: one argument set per rank;
- ``submit(...)`` / ``submit_each(...)``: the same without waiting (`Pending.get()` waits), so
  two roles can work at once;
- ``ref0(method, *args)``: rank 0's result left where it is (a Ray object reference, or the value
  locally), to hand to another group without passing through the driver (weight broadcast);
- ``map_dynamic(method, items)``: a work queue: each free rank takes the next item, so a fast
  rank takes more (NeMo-Aligner's rank-0 work queue); results come back in item order.

Failures become a `WorkerError` naming the role, the rank, the process and the method:
`WorkerDiedError` (the process is gone), `WorkerTimeoutError` (no answer within the timeout), or
`WorkerError` carrying the worker's own exception. ``map_dynamic`` retries an item on another
rank when its rank died or stopped answering (only safe for idempotent, seeded work).
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)

# seconds a failed call waits for its other ranks, to report a rank that died rather than a peer's
# collective error caused by that death (Ray notices a killed process within about a second)
DEATH_GRACE_S = 10.0

__all__ = ["WorkerError", "WorkerDiedError", "WorkerTimeoutError", "Host", "LocalGroup", "RayGroup", "Pending",
           "Sibling"]


class WorkerError(RuntimeError):
    """A role worker failed; ``role``, ``rank`` and ``method`` say which and where."""

    def __init__(self, message: str, role: str = "", rank: Optional[int] = None, method: str = "") -> None:
        super().__init__(message)
        self.role, self.rank, self.method = role, rank, method


class WorkerDiedError(WorkerError):
    """The worker process is gone (killed, crashed, out of memory, node lost)."""


class WorkerTimeoutError(WorkerError):
    """The worker did not answer within the configured timeout."""


# ----------------------------------------------------------------------------------------------
# One worker process
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sibling:
    """An argument that the receiving worker's own process computes: the result of ``method()`` of
    the ``role`` object it holds beside the called one (colocated roles). Nothing crosses between
    processes: ``rollout.run_alive("load_weights", Sibling("actor", "local_weights"))`` hands each
    engine its own process's actor weights (verl's hybrid-engine handoff). Resolved by `Host.call`;
    the roles must share their workers."""
    role: str
    method: str


class Host:
    """One worker process holding the role objects placed on it (several when roles are
    colocated), by role name. Under Ray it is the remote actor class; locally it is not used."""

    def __init__(self, env: Optional[dict[str, str]] = None, threads: int = 0) -> None:
        os.environ.update(env or {})
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.objs: dict[str, Any] = {}

    def info(self) -> dict:
        """``{"pid", "host", "gpus", "bf16_cpu"}``: gpus are the GPU ids Ray assigned to this
        worker (empty on a CPU slot, and outside Ray); bf16_cpu whether this host's CPU computes
        bf16 natively (AVX-512-BF16 or AMX; the driver chose precisions on its own CPU)."""
        import socket

        from turborlhf.engine.hardware import BF16_FEATURES, cpu_features

        try:
            import ray

            gpus = [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
        except ImportError:
            gpus = []
        return {"pid": os.getpid(), "host": socket.gethostname(), "gpus": gpus,
                "bf16_cpu": bool(cpu_features() & BF16_FEATURES)}

    def free_port(self) -> tuple[str, int]:
        from turborlhf.engine.parallel import free_port

        return free_port()

    def init_dist(self, backend: str, addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        from turborlhf.engine.parallel import init_distributed

        init_distributed(backend, addr, port, rank, world_size, timeout_s)

    def build(self, name: str, cls: type, *args, **kwargs) -> None:
        self.objs[name] = cls(*args, **kwargs)

    def call(self, name: str, method: str, *args, **kwargs):
        args = tuple(self._resolve(a) for a in args)
        kwargs = {k: self._resolve(v) for k, v in kwargs.items()}
        return getattr(self.objs[name], method)(*args, **kwargs)

    def _resolve(self, arg):
        return getattr(self.objs[arg.role], arg.method)() if isinstance(arg, Sibling) else arg

    def call_put(self, name: str, method: str, *args, **kwargs):
        """`call`, with the result put in the object store here; returns ``[ref]`` (a list, so the
        caller receives the reference and not the value)."""
        import ray

        out = self.call(name, method, *args, **kwargs)
        return [ray.put(out)] if out is not None else [None]

    def close(self) -> None:
        for obj in self.objs.values():
            if hasattr(obj, "close"):
                obj.close()
        self.objs.clear()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


class Pending:
    """Results of a submitted call; ``get()`` waits (Ray) or returns them (local)."""

    def __init__(self, getter: Callable[[], list]) -> None:
        self._get = getter

    def get(self) -> list:
        return self._get()


# ----------------------------------------------------------------------------------------------
# In-process group: one rank, calls run here and now
# ----------------------------------------------------------------------------------------------

class LocalGroup:
    """A role in this process: one rank, no timeouts (there is no second process to watch)."""

    backend = "local"

    def __init__(self, role: str, obj: Any) -> None:
        self.role, self.obj, self.world_size = role, obj, 1

    @classmethod
    def build(cls, role: str, role_cls: type, *args, **kwargs) -> "LocalGroup":
        return cls(role, role_cls(*args, **kwargs))

    def _call(self, method: str, args: tuple, kwargs: dict):
        try:
            return getattr(self.obj, method)(*args, **kwargs)
        except WorkerError:
            raise
        except Exception as e:
            raise WorkerError(f"{self.role} failed in {method}: {type(e).__name__}: {e}", self.role, 0,
                              method) from e

    def run(self, method: str, *args, **kwargs) -> list:
        return [self._call(method, args, kwargs)]

    run_alive = run

    def run_each(self, method: str, per_rank) -> list:
        items = per_rank.values() if isinstance(per_rank, dict) else per_rank
        return [self._call(method, a, k) for a, k in items]

    def submit(self, method: str, *args, **kwargs) -> Pending:
        out = self.run(method, *args, **kwargs)
        return Pending(lambda: out)

    def submit_each(self, method: str, per_rank) -> Pending:
        out = self.run_each(method, per_rank)
        return Pending(lambda: out)

    def ref0(self, method: str, *args, **kwargs):
        return self._call(method, args, kwargs)

    def map_dynamic(self, method: str, items: Sequence[tuple], timeout_s: float = 0, retries: int = 0
                    ) -> tuple[list, list[int]]:
        return [self._call(method, tuple(it), {}) for it in items], [0] * len(items)

    def alive_ranks(self) -> list[int]:
        return [0]

    def shutdown(self) -> None:
        if hasattr(self.obj, "close"):
            self.obj.close()


# ----------------------------------------------------------------------------------------------
# Ray group: ranks are `Host` actors, one per device bundle
# ----------------------------------------------------------------------------------------------

class RayGroup:
    """A role on Ray: rank i is the role object inside ``hosts[i]`` (a `Host` actor).

    Args:
        role: role name (errors name it).
        hosts: Ray actor handles of `Host`, in rank order (shared with colocated roles).
        infos: per rank ``{"pid", "host", "gpus"}`` for error messages.
        timeout_s: longest wait for any call.
        shared_with: other roles living in the same processes (named when a process dies).
    """

    backend = "ray"

    def __init__(self, role: str, hosts: list, infos: list[dict], timeout_s: float,
                 shared_with: Sequence[str] = ()) -> None:
        self.role, self.hosts, self.infos, self.timeout_s = role, list(hosts), infos, timeout_s
        self.shared_with = tuple(shared_with)
        self.world_size = len(hosts)
        self.dead: set[int] = set()

    # -- errors ---------------------------------------------------------------------------------
    def _where(self, rank: int) -> str:
        info = self.infos[rank] if rank < len(self.infos) else {}
        shared = f", shared with {', '.join(self.shared_with)}" if self.shared_with else ""
        return f"{self.role} worker rank {rank} (pid {info.get('pid', '?')} on {info.get('host', '?')}{shared})"

    def _convert(self, exc: BaseException, rank: int, method: str) -> WorkerError:
        import ray.exceptions as rex

        if isinstance(exc, WorkerError):
            return exc
        if isinstance(exc, rex.RayActorError):
            self.dead.add(rank)
            return WorkerDiedError(f"{self._where(rank)} died during {method}: {str(exc).splitlines()[0]}",
                                   self.role, rank, method)
        if isinstance(exc, rex.RayTaskError):
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, WorkerError):
                return cause
            return WorkerError(f"{self._where(rank)} failed in {method}: {type(cause).__name__}: {cause}",
                               self.role, rank, method)
        return WorkerError(f"{self._where(rank)} failed in {method}: {type(exc).__name__}: {exc}",
                           self.role, rank, method)

    def _wait_all(self, refs: list, method: str, ranks: Optional[list[int]] = None) -> list:
        """Wait for every ref (``refs[i]`` runs on rank ``ranks[i]``, default i); the first failure or
        the timeout raises a `WorkerError` naming the rank."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        deadline = time.monotonic() + self.timeout_s
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, left))
            if not ready:
                late = [ranks[refs.index(r)] for r in pending]
                raise WorkerTimeoutError(
                    f"{' and '.join(self._where(r) for r in late)} did not answer {method} within "
                    f"{self.timeout_s:g} s (distributed.timeout_s)", self.role, late[0], method)
            for r in ready:
                try:
                    ray.get(r)
                except Exception as e:
                    raise self._root_cause(e, ranks[refs.index(r)], method, refs, ranks, pending) from None
        return ray.get(refs)

    def _root_cause(self, exc: BaseException, rank: int, method: str, refs: list, ranks: list[int],
                    pending: list) -> WorkerError:
        """The error to report for a call in which `rank` failed with `exc`.

        When a rank dies inside a collective (a gloo or NCCL all-reduce), its peers fail at once
        with "connection reset by peer", often before Ray has noticed the death. The dead rank is
        the cause, so for up to `DEATH_GRACE_S` the ranks still pending are watched, and a death
        among them is reported instead of the peer's error."""
        import ray
        import ray.exceptions as rex

        if isinstance(exc, rex.RayActorError) or not pending:
            return self._convert(exc, rank, method)
        deadline = time.monotonic() + DEATH_GRACE_S
        pending = list(pending)
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for r in ready:
                try:
                    ray.get(r)
                except rex.RayActorError as died:
                    return self._convert(died, ranks[refs.index(r)], method)
                except Exception:
                    pass
        return self._convert(exc, rank, method)

    # -- calls ----------------------------------------------------------------------------------
    @staticmethod
    def _shared_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Put large arguments in the object store once, so every rank reads the same copy."""
        import ray

        def put(v):
            return v if isinstance(v, (int, float, str, bool, type(None), ray.ObjectRef)) else ray.put(v)

        return tuple(put(a) for a in args), {k: put(v) for k, v in kwargs.items()}

    def _check_alive(self, method: str) -> None:
        if self.dead:
            r = min(self.dead)
            raise WorkerDiedError(f"{self._where(r)} is dead; cannot run {method}", self.role, r, method)

    def submit(self, method: str, *args, **kwargs) -> Pending:
        self._check_alive(method)
        args, kwargs = self._shared_args(args, kwargs)
        refs = [h.call.remote(self.role, method, *args, **kwargs) for h in self.hosts]
        return Pending(lambda: self._wait_all(refs, method))

    def submit_each(self, method: str, per_rank) -> Pending:
        """`per_rank`: one ``(args, kwargs)`` per rank, or a dict rank → ``(args, kwargs)`` for
        some ranks only; results in rank order of the ranks called."""
        self._check_alive(method)
        if not isinstance(per_rank, dict):
            if len(per_rank) != self.world_size:
                raise ValueError(f"{self.role}: {len(per_rank)} argument sets for {self.world_size} ranks")
            per_rank = dict(enumerate(per_rank))
        ranks = sorted(per_rank)
        refs = [self.hosts[r].call.remote(self.role, method, *per_rank[r][0], **per_rank[r][1]) for r in ranks]
        return Pending(lambda: self._wait_all(refs, method, ranks))

    def run(self, method: str, *args, **kwargs) -> list:
        return self.submit(method, *args, **kwargs).get()

    def run_each(self, method: str, per_rank) -> list:
        return self.submit_each(method, per_rank).get()

    def ref0(self, method: str, *args, **kwargs):
        """Call on every rank (the method may be collective, e.g. an FSDP gather) and return rank
        0's result as an object reference: it stays in rank 0's object store until a consumer
        reads it, never passing through the driver."""
        self._check_alive(method)
        args, kwargs = self._shared_args(args, kwargs)
        refs = [h.call_put.remote(self.role, method, *args, **kwargs) for h in self.hosts]
        return self._wait_all(refs, method)[0][0]

    def alive_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.dead]

    def run_alive(self, method: str, *args, **kwargs) -> list:
        """Like `run` but only on ranks still alive (rollout engines may be dropped)."""
        import ray

        alive = self.alive_ranks()
        if not alive:
            raise WorkerDiedError(f"every {self.role} worker is dead; cannot run {method}", self.role, None, method)
        args, kwargs = self._shared_args(args, kwargs)
        refs = [self.hosts[r].call.remote(self.role, method, *args, **kwargs) for r in alive]
        deadline = time.monotonic() + self.timeout_s
        out = []
        for r, ref in zip(alive, refs):
            try:
                out.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                raise WorkerTimeoutError(f"{self._where(r)} did not answer {method} within {self.timeout_s:g} s "
                                         "(distributed.timeout_s)", self.role, r, method) from None
            except Exception as e:
                raise self._convert(e, r, method) from None
        return out

    def map_dynamic(self, method: str, items: Sequence[tuple], timeout_s: float = 0, retries: int = 0
                    ) -> tuple[list, list[int]]:
        """Work queue over the live ranks: each free rank takes the next item.

        Args:
            items: one argument tuple per item.
            timeout_s: longest time one item may take; a rank exceeding it is killed and dropped, or
                where its processes hold other roles too (`shared_with`), the call raises instead.
            retries: how often an item may be retried on another rank after its rank died or
                timed out (an exception raised by the work itself is never retried).
        Returns:
            ``(results in item order, rank that produced each item)``.
        Raises:
            WorkerDiedError / WorkerTimeoutError: no rank left, or an item failed `retries + 1` times.
            WorkerError: the work raised.
        """
        import ray

        timeout_s = timeout_s or self.timeout_s
        results: list = [None] * len(items)
        served_by = [-1] * len(items)
        queue = deque(range(len(items)))
        free = deque(self.alive_ranks())
        tries = [0] * len(items)
        inflight: dict = {}          # ref → (rank, item, start time)
        while queue or inflight:
            while queue and free:
                rank, i = free.popleft(), queue.popleft()
                ref = self.hosts[rank].call.remote(self.role, method, *items[i])
                inflight[ref] = (rank, i, time.monotonic())
            if not inflight:
                raise WorkerDiedError(f"every {self.role} worker is dead; {len(queue)} {method} items left",
                                      self.role, None, method)
            oldest = min(t for _, _, t in inflight.values())
            ready, _ = ray.wait(list(inflight), num_returns=1,
                                timeout=max(0.05, oldest + timeout_s - time.monotonic()))
            failed: list[tuple[int, int, WorkerError]] = []
            for ref in ready:
                rank, i, _ = inflight.pop(ref)
                try:
                    results[i], served_by[i] = ray.get(ref), rank
                    free.append(rank)
                except Exception as e:
                    err = self._convert(e, rank, method)
                    if not isinstance(err, WorkerDiedError):
                        raise err from None
                    failed.append((rank, i, err))
            now = time.monotonic()
            for ref, (rank, i, t0) in list(inflight.items()):
                if now - t0 <= timeout_s:
                    continue
                if self.shared_with:
                    # stopping the process would take the roles it shares (the actor's rank with
                    # `colocate_all_models`): the run stops instead, its checkpoint intact
                    raise WorkerTimeoutError(
                        f"{self._where(rank)} did not finish a {method} item within {timeout_s:g} s "
                        "(distributed.rollout_timeout_s, counted from submission, so it includes the process's "
                        "other roles' calls); not stopped, since that would stop those roles too: raise the "
                        "timeout or place the rollout workers in their own processes", self.role, rank, method)
                del inflight[ref]
                self.dead.add(rank)
                try:
                    ray.kill(self.hosts[rank], no_restart=True)
                except Exception:
                    pass
                failed.append((rank, i, WorkerTimeoutError(
                    f"{self._where(rank)} did not finish a {method} item within {timeout_s:g} s "
                    "(distributed.rollout_timeout_s); it was stopped", self.role, rank, method)))
            for rank, i, err in failed:
                tries[i] += 1
                if tries[i] > retries or not self.alive_ranks():
                    raise err
                logger.info(f"[distributed] {err}; retrying the item on another {self.role} worker")
                queue.appendleft(i)
        return results, served_by

    def shutdown(self) -> None:
        pass  # hosts are owned (and killed) by the Cluster, which may share them between roles
