"""Role groups: colocation rules, the local group, and on a small local Ray cluster the work
queue (fast ranks take more, results in order, a hung engine is dropped and its item retried),
named errors for a dead worker and a failing remote call."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.distributed.toy_workers import Toy
from tests.e2e.helpers import REPO


def _dist(**kw):
    from turborlhf.config import DistributedCfg

    return DistributedCfg(**kw)


def test_colocation_groups_and_errors():
    from turborlhf.config import ConfigError, PPOConfig, load_config
    from turborlhf.distributed.roles import colocation_groups

    roles = ("actor", "critic", "reward", "reference", "rollout")
    assert colocation_groups(_dist(), roles) == [(r,) for r in roles]
    assert colocation_groups(_dist(colocate_actor_ref=True, colocate_critic_reward=True), roles) == [
        ("actor", "reference"), ("critic", "reward"), ("rollout",)]
    assert colocation_groups(_dist(colocate_all_models=True), ("actor", "reward", "rollout")) == [
        ("actor", "reward", "rollout")]
    base = ["actor.name_or_path=x", "reward_model=y", "data.prompts_file=z"]
    with pytest.raises(ConfigError, match=r"distributed.colocate_actor_ref: .*distributed.actor: 2, "
                                          r"distributed.reference: 1"):
        load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", base + [
            "distributed.backend=ray", "distributed.colocate_actor_ref=true", "distributed.actor.devices_per_node=2"])
    with pytest.raises(ConfigError, match=r"distributed.rollout: more than one worker needs distributed.backend=ray"):
        load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", base + ["distributed.rollout.num_nodes=2"])
    # GRPO builds no critic: a critic size that differs does not matter even when everything is colocated
    load_config(PPOConfig, REPO / "configs/tiny/grpo.yaml", base + [
        "distributed.backend=ray", "distributed.colocate_all_models=true", "distributed.critic.devices_per_node=3"])
    # a LoRA actor is its own reference (adapters off): no reference worker to size like the actor
    load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", base + [
        "distributed.backend=ray", "distributed.colocate_actor_ref=true", "distributed.actor.devices_per_node=2",
        "actor.lora.rank=4"])


def test_a_local_cluster_too_small_for_the_roles_is_refused_naming_the_field():
    """local_num_cpus below the workers' slots waited 120 s for placement, then blamed a role."""
    from turborlhf.config import ConfigError
    from turborlhf.distributed.placement import _connect

    ray = SimpleNamespace(is_initialized=lambda: False, init=lambda **kw: pytest.fail("started Ray"))
    with pytest.raises(ConfigError, match=r"distributed.local_num_cpus: 1 CPU slots, but the roles need 5"):
        _connect(ray, _dist(local_num_cpus=1), 5, {})


def test_fsdp_config_errors_name_the_fields():
    """FSDP runs every forward and backward on all of a role's workers together: a step whose rows
    do not split evenly or LoRA (whose gathered state is not a plain model) is refused up front."""
    from turborlhf.config import ConfigError, PPOConfig, load_config

    base = ["actor.name_or_path=x", "reward_model=y", "data.prompts_file=z", "distributed.backend=ray",
            "distributed.dp_strategy=fsdp", "distributed.actor.devices_per_node=2", "train.micro_batch_size=2"]
    with pytest.raises(ConfigError, match=r"distributed.dp_strategy: .* multiple of 2 micro-batches .* 4 rows per "
                                          r"step .* a batch of 2 rows: 1 micro-batch"):
        load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", base)            # 4 prompts, 2 mini-batches
    load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", base + ["algo.num_mini_batches=1"])
    # 6 rows in micro-batches of 4: 4 + 2 rows, one micro-batch on each worker
    load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", base + ["algo.num_mini_batches=1", "algo.prompts_per_step=6",
                                                                   "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"distributed.dp_strategy: fsdp does not shard LoRA .*actor.lora.rank"):
        load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", base + ["algo.num_mini_batches=1", "actor.lora.rank=4"])
    # optim.offload under FSDP is FSDP2's CPUOffloadPolicy (tests/distributed/test_dp.py)
    load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", base + ["algo.num_mini_batches=1", "optim.offload=true"])
    # dynamic sampling that trains on the kept groups alone: a step's rows need not split evenly (it hung)
    grpo = [*base, "algo.num_mini_batches=1", "algo.advantage_estimator=grpo", "algo.n_samples_per_prompt=2",
            "algo.kl_use_loss=true", "algo.dynamic_sampling=true"]
    load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", grpo)
    with pytest.raises(ConfigError, match=r"fsdp .* algo.dynamic_sampling_fill=false"):
        load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", grpo + ["algo.dynamic_sampling_fill=false"])
    # 4 groups of 2 in 3 mini-batches: 4 + 2 + 2 rows (whole groups), even on 2 workers; torch.chunk's
    # 3 + 3 + 2 split groups and was refused
    load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml", [*grpo[:-1], "algo.prompts_per_step=4",
                                                            "algo.num_mini_batches=3", "train.micro_batch_size=1"])


def test_local_group_runs_in_process_and_names_role():
    from turborlhf.distributed.group import LocalGroup, WorkerError

    g = LocalGroup.build("reward", Toy)
    assert g.run("work", 3) == [(9, 0)]
    assert g.map_dynamic("work", [(i,) for i in range(4)]) == ([(i * i, 0) for i in range(4)], [0] * 4)
    with pytest.raises(WorkerError, match=r"^reward failed in fail: TimeoutError: reward model at http"):
        g.run("fail")


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{REPO / 'src'}:{REPO}", "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


def _ray_group(ray, role: str, n: int, timeout_s: float = 60.0, **kw):
    from turborlhf.distributed.group import Host, RayGroup

    hosts = [ray.remote(Host).options(num_cpus=1).remote() for _ in range(n)]
    ray.get([h.build.remote(role, Toy, **kw) for h in hosts])
    ray.get([h.call.remote(role, "set_rank", r) for r, h in enumerate(hosts)])
    return RayGroup(role, hosts, ray.get([h.info.remote() for h in hosts]), timeout_s), hosts


def test_ray_work_queue_balances_and_survives_a_hung_engine(ray_cluster):
    ray = ray_cluster
    g, hosts = _ray_group(ray, "rollout", 2, delays=(0.0, 0.4))
    out, served = g.map_dynamic("work", [(i,) for i in range(12)])
    assert [o[0] for o in out] == [i * i for i in range(12)]           # item order, whoever served it
    assert [o[1] for o in out] == served
    assert served.count(0) > served.count(1) >= 1                      # the fast engine took more
    # rank 1 stops answering: it is stopped after the item timeout and its item retried on rank 0
    g2, hosts2 = _ray_group(ray, "rollout", 2, hang_rank=1)
    out, served = g2.map_dynamic("work", [(i,) for i in range(4)], timeout_s=2.0, retries=1)
    assert [o[0] for o in out] == [0, 1, 4, 9] and set(served) == {0}
    assert g2.dead == {1} and g2.alive_ranks() == [0]
    assert g2.run_alive("work", 5) == [(25, 0)]
    for h in hosts + hosts2:
        ray.kill(h)
    # processes that hold other roles too (colocate_all_models): never stopped, the call raises
    from turborlhf.distributed.group import RayGroup, WorkerTimeoutError

    g3, hosts3 = _ray_group(ray, "rollout", 2, hang_rank=1)
    g3 = RayGroup("rollout", hosts3, g3.infos, g3.timeout_s, shared_with=("actor",))
    try:
        with pytest.raises(WorkerTimeoutError, match=r"rollout worker rank 1 .*shared with actor.* not stopped"):
            g3.map_dynamic("work", [(i,) for i in range(4)], timeout_s=2.0, retries=1)
        assert not g3.dead                                          # nothing was stopped
    finally:
        for h in hosts3:
            ray.kill(h)


def test_ray_dead_worker_and_remote_failure_are_named(ray_cluster):
    from turborlhf.distributed.group import WorkerDiedError, WorkerError, WorkerTimeoutError

    ray = ray_cluster
    g, hosts = _ray_group(ray, "critic", 2, timeout_s=5.0, hang_rank=1)
    with pytest.raises(WorkerError, match=r"critic worker rank \d \(pid \d+ on .*\) failed in fail: TimeoutError: "
                                          r"reward model at http"):
        g.run("fail")
    with pytest.raises(WorkerTimeoutError, match=r"critic worker rank 1 .* did not answer work within 5 s"):
        g.run("work", 2)
    pid1 = g.infos[1]["pid"]
    ray.kill(hosts[1])
    with pytest.raises(WorkerDiedError, match=rf"critic worker rank 1 \(pid {pid1} .*\) died during pid"):
        g.run("pid")
    with pytest.raises(WorkerDiedError, match=r"critic worker rank 1 .* is dead; cannot run pid"):
        g.run("pid")
    ray.kill(hosts[0])


def test_ray_death_is_reported_over_the_peer_error_it_caused(ray_cluster):
    """A rank killed inside a collective makes its peers fail with "connection reset" before Ray
    reports the death: the dead rank is named, not the peer."""
    from turborlhf.distributed.group import WorkerDiedError

    ray = ray_cluster
    g, hosts = _ray_group(ray, "actor", 2)
    pid1 = g.infos[1]["pid"]
    with pytest.raises(WorkerDiedError, match=rf"actor worker rank 1 \(pid {pid1} .*\) died during peer_dies"):
        g.run("peer_dies")
    ray.kill(hosts[0])


def test_roles_that_need_no_gpu_take_a_cpu_slot():
    """With ``distributed.device: gpu`` a colocation group takes GPU bundles unless every role in it
    is `cpu_only` (reward functions alone, an engine on the CPU)."""
    from turborlhf.distributed.placement import RoleSpec, bundle_of

    specs = {"actor": RoleSpec(object), "reward": RoleSpec(object, cpu_only=True),
             "rollout": RoleSpec(object, cpu_only=True)}
    gpu, cpu = _dist(device="gpu"), _dist(device="cpu")
    assert bundle_of(gpu, ("actor",), specs) == {"GPU": 1, "CPU": 1}
    assert bundle_of(gpu, ("reward",), specs) == bundle_of(gpu, ("reward", "rollout"), specs) == {"CPU": 1}
    assert bundle_of(gpu, ("actor", "reward", "rollout"), specs) == {"GPU": 1, "CPU": 1}
    assert bundle_of(cpu, ("actor",), specs) == {"CPU": 1}


def test_ppo_marks_the_roles_that_need_no_gpu(monkeypatch):
    """GSM8K GRPO scores with a function: its reward workers need no GPU; an engine on the CPU
    neither; the actor always does."""
    from turborlhf.config import PPOConfig, load_config
    from turborlhf.trainers.ppo import driver

    seen = {}
    monkeypatch.setattr(driver, "launch", lambda dist, specs, threads: seen.update(specs) or
                        SimpleNamespace(backend="local", groups={}))
    cfg = load_config(PPOConfig, REPO / "configs/gsm8k_smollm2/grpo.yaml", ["rollout.device=cpu"])
    driver.build_roles(cfg, None)
    assert seen["reward"].cpu_only and seen["rollout"].cpu_only and not seen["actor"].cpu_only
    cfg = load_config(PPOConfig, REPO / "configs/tiny/grpo.yaml", ["actor.name_or_path=x", "reward_model=y",
                                                                  "data.prompts_file=z", "rollout.device=cuda"])
    driver.build_roles(cfg, None)
    assert not seen["reward"].cpu_only and not seen["rollout"].cpu_only


def test_a_sibling_argument_is_computed_by_the_colocated_role_in_the_same_process():
    """`Sibling(role, method)` reaches the called role as the result of the other role's method in
    the same worker: the colocated weight push hands each engine its own process's actor weights."""
    from turborlhf.config import load_config, PPOConfig
    from turborlhf.distributed.group import Host, Sibling
    from turborlhf.trainers.ppo.driver import colocated_push

    class Actor:
        def __init__(self):
            self.w = {"x": object()}

        def local_weights(self):
            return self.w

    class Engine:
        def load_weights(self, state, tag=None):
            self.got = (state, tag)

    h = Host()
    h.build("actor", Actor)
    h.build("rollout", Engine)
    h.call("rollout", "load_weights", Sibling("actor", "local_weights"), tag=Sibling("actor", "local_weights"))
    assert h.objs["rollout"].got == (h.objs["actor"].w, h.objs["actor"].w)      # the very objects: no copy

    base = ["data.prompts_file=p.jsonl", "reward_model=rm", "distributed.backend=ray"]
    assert colocated_push(load_config(PPOConfig, overrides=base + ["distributed.colocate_all_models=true"]))
    assert not colocated_push(load_config(PPOConfig, overrides=base))
    assert not colocated_push(load_config(PPOConfig, overrides=base + ["distributed.colocate_all_models=true",
                                                                       "distributed.dp_strategy=fsdp"]))
