"""Placing role workers: `launch` turns a `DistributedCfg` and the trainer's role classes into one
group per role (`LocalGroup` or `RayGroup`), and `Cluster.shutdown` takes them down again.

Ray placement (``distributed.backend: ray``):

1. connect: ``distributed.ray_address`` or ``$RAY_ADDRESS`` joins an existing cluster; without
   either a local cluster is started with as many logical CPU slots as the placement needs
   (``local_num_cpus`` to override) and torn down at the end;
2. one placement group per colocation group (`turborlhf.distributed.roles.colocation_groups`)
   with ``num_nodes × devices_per_node`` bundles of ``{CPU: 1}`` (``device: cpu``, or a group whose
   roles need no GPU, `RoleSpec.cpu_only`) or ``{GPU: 1, CPU: 1}`` (``device: gpu``), strategy
   ``placement_strategy``;
3. one `Host` actor per bundle; rank i of every role of the group lives in host i;
4. a torch.distributed process group over the hosts of a group that trains (actor, critic) and
   has more than one worker (``tcp://`` rendezvous at rank 0's address);
5. each role object is built on every rank at once (FSDP sharding is collective).

Ray is imported only here, and only when ``backend: ray``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from turborlhf.distributed.group import LocalGroup, RayGroup, WorkerError, WorkerTimeoutError
from turborlhf.distributed.roles import colocation_groups

__all__ = ["RoleSpec", "Cluster", "launch", "bundle_of", "TRAINED_ROLES"]

TRAINED_ROLES = ("actor", "critic")


@dataclass
class RoleSpec:
    """How to build a role object on each of its ranks: ``cls(*args, **kwargs)``. ``cpu_only``: the
    role needs no GPU (reward functions only, an engine on the CPU), so with ``device: gpu`` its
    workers take a CPU slot unless a colocated role needs the GPU."""

    cls: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    cpu_only: bool = False


def bundle_of(dist, roles, specs: dict[str, RoleSpec]) -> dict[str, int]:
    """The Ray bundle of one worker of a colocation group: ``{GPU: 1, CPU: 1}`` with ``device: gpu``
    unless every role of the group is `cpu_only`, else ``{CPU: 1}``."""
    gpu = dist.device == "gpu" and not all(specs[r].cpu_only for r in roles)
    return {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}


@dataclass
class Cluster:
    """The groups of one run, by role, and what must be released at the end."""

    groups: dict[str, Any]
    backend: str = "local"
    hosts: list = field(default_factory=list)
    placement_groups: list = field(default_factory=list)
    started_ray: bool = False

    def __getitem__(self, role: str):
        return self.groups[role]

    def get(self, role: str):
        return self.groups.get(role)

    def shutdown(self) -> None:
        """Close role objects and kill worker processes; stop Ray if this run started it."""
        for g in self.groups.values():
            if isinstance(g, LocalGroup):
                g.shutdown()
        if self.backend != "ray":
            return
        import ray

        for h in self.hosts:
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                pass
        for pg in self.placement_groups:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:
                pass
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


def launch(dist, specs: dict[str, RoleSpec], threads: int = 0) -> Cluster:
    """Build every role of `specs` as the config `dist` (a `DistributedCfg`) places it.

    Args:
        specs: role name → `RoleSpec`; roles not in `specs` are not built.
        threads: torch intra-op threads of each Ray worker (0 = leave Ray's default of 1 per CPU).
    Raises:
        WorkerError: a worker failed to start or to build its role (named); ImportError with the
            install hint when Ray is missing.
    """
    if dist.backend == "local":
        groups = {}
        for role, spec in specs.items():
            try:
                groups[role] = LocalGroup.build(role, spec.cls, *spec.args, **spec.kwargs)
            except Exception:
                for g in groups.values():
                    g.shutdown()
                raise
        return Cluster(groups)
    return _launch_ray(dist, specs, threads)


# ----------------------------------------------------------------------------------------------
# Ray
# ----------------------------------------------------------------------------------------------

def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("distributed.backend=ray needs Ray: pip install 'turborlhf[ray]'") from e
    return ray


def _worker_env(threads: int) -> dict[str, str]:
    """Environment of locally started workers: this checkout on PYTHONPATH (so workers import the
    same turborlhf as the driver) and the driver's thread settings."""
    src = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": os.pathsep.join([src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                   if p]),
           "TOKENIZERS_PARALLELISM": "false"}
    for k in ("TURBORLHF_THREADS", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TURBORLHF_CACHE"):
        if k in os.environ:
            env[k] = os.environ[k]
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _connect(ray, dist, slots: int, env: dict) -> bool:
    """Join or start a cluster; True when this call started it (and so must stop it)."""
    if ray.is_initialized():
        return False
    address = dist.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        print(f"[distributed] joining the Ray cluster at {address}", flush=True)
        ray.init(address=address, runtime_env={"env_vars": {k: v for k, v in env.items() if k != "PYTHONPATH"}},
                 log_to_driver=True)
        return False
    if dist.local_num_cpus and dist.local_num_cpus < slots:     # it waited for placement, then blamed a role
        from turborlhf.config_base import ConfigError

        raise ConfigError(f"distributed.local_num_cpus: {dist.local_num_cpus} CPU slots, but the roles need {slots} "
                          "(one per worker); raise it or leave it unset")
    n = dist.local_num_cpus or slots
    gpus = None if dist.device == "gpu" else 0
    print(f"[distributed] starting a local Ray cluster with {n} CPU slots", flush=True)
    ray.init(num_cpus=n, num_gpus=gpus, include_dashboard=False, runtime_env={"env_vars": env},
             log_to_driver=True, configure_logging=False)
    return True


def _launch_ray(dist, specs: dict[str, RoleSpec], threads: int) -> Cluster:
    ray = _import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from turborlhf.distributed.group import Host

    groups_of_roles = colocation_groups(dist, list(specs))
    slots = sum(getattr(dist, g[0]).world_size for g in groups_of_roles)
    env = _worker_env(threads)
    started = _connect(ray, dist, slots, env)
    cluster = Cluster({}, backend="ray", started_ray=started)
    try:
        _launch_all(ray, dist, groups_of_roles, specs, cluster, env, threads, placement_group,
                    PlacementGroupSchedulingStrategy, Host)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def _launch_all(ray, dist, groups_of_roles, specs, cluster, env, threads, placement_group, pg_strategy, Host) -> None:
    """Start every worker at once (their imports overlap), then rendezvous, then build the roles."""
    remote_host = ray.remote(Host)
    wait_pg = min(dist.timeout_s, 120.0)
    started = []                                    # (roles, hosts)
    for roles in groups_of_roles:
        n, names = getattr(dist, roles[0]).world_size, "+".join(roles)
        bundle = bundle_of(dist, roles, specs)
        res = {"num_gpus": 1, "num_cpus": 1} if "GPU" in bundle else {"num_cpus": 1}
        pg = placement_group([dict(bundle) for _ in range(n)], strategy=dist.placement_strategy,
                             name=f"turborlhf-{names}")
        cluster.placement_groups.append(pg)
        ready, _ = ray.wait([pg.ready()], timeout=wait_pg)
        if not ready:
            raise WorkerTimeoutError(f"{names}: the cluster cannot place {n} × {bundle} (placement group not "
                                     f"ready after {wait_pg:g} s); check distributed.{roles[0]}.num_nodes/"
                                     "devices_per_node and the cluster's free resources", roles[0])
        hosts = [remote_host.options(scheduling_strategy=pg_strategy(placement_group=pg,
                                                                     placement_group_bundle_index=i),
                                     max_concurrency=1, **res).remote(env, threads) for i in range(n)]
        cluster.hosts += hosts
        started.append((roles, hosts, [h.info.remote() for h in hosts]))
    infos_of = {}
    for roles, hosts, refs in started:
        infos_of[roles] = _wait(ray, refs, "+".join(roles), "start", dist.timeout_s)
        gpus = [",".join(i.get("gpus", [])) for i in infos_of[roles]]
        print(f"[distributed] {'+'.join(roles)}: {len(hosts)} worker(s), pids "
              f"{[i['pid'] for i in infos_of[roles]]}" + (f", GPUs {gpus}" if any(gpus) else ""), flush=True)
    rendezvous = []
    for roles, hosts, _ in started:
        if len(hosts) > 1 and any(r in TRAINED_ROLES for r in roles):
            addr, port = _wait(ray, [hosts[0].free_port.remote()], "+".join(roles), "free_port", dist.timeout_s)[0]
            backend = dist.dist_backend if dist.dist_backend != "auto" else "nccl" if dist.device == "gpu" else "gloo"
            rendezvous.append(("+".join(roles), [h.init_dist.remote(backend, addr, port, i, len(hosts),
                                                                     dist.timeout_s) for i, h in enumerate(hosts)]))
    for names, refs in rendezvous:
        _wait(ray, refs, names, "init_dist", dist.timeout_s)
    builds = []
    for roles, hosts, _ in started:
        for role in roles:
            spec = specs[role]
            builds.append((role, [h.build.remote(role, spec.cls, *spec.args, **spec.kwargs) for h in hosts]))
            cluster.groups[role] = RayGroup(role, hosts, infos_of[roles], dist.timeout_s,
                                            shared_with=[r for r in roles if r != role])
    for role, refs in builds:
        _wait(ray, refs, role, "build", dist.timeout_s, cluster.groups[role].infos)


def _wait(ray, refs: list, role: str, what: str, timeout_s: float, infos: Optional[list] = None) -> list:
    group = RayGroup(role, [None] * len(refs), infos or [{} for _ in refs], timeout_s)
    try:
        return group._wait_all(refs, what)
    except WorkerError:
        raise
