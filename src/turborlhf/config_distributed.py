"""The ``distributed`` section of `ppo`: where its roles run (local or Ray), on how many devices,
which share workers (docs/distributed.md). Kept in its own file to keep config.py short;
`turborlhf.config` re-exports both classes. Imports neither torch nor transformers."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from turborlhf.config_base import Cfg

__all__ = ["DistributedCfg", "RoleResourcesCfg"]


class RoleResourcesCfg(Cfg):
    """Devices of one role: ``num_nodes × devices_per_node`` workers, one device each."""

    num_nodes: int = Field(1, ge=1, description="nodes this role spans")
    devices_per_node: int = Field(1, ge=1, description="workers per node, one device each (a GPU, or a CPU slot "
                                                       "with distributed.device=cpu); >1 = data parallel")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node


class DistributedCfg(Cfg):
    """Where the PPO roles (actor, critic, reward, reference, rollout) run; docs/distributed.md.

    Names follow OpenRLHF (colocate_actor_ref, colocate_critic_reward, colocate_all_models,
    ref_reward_offload, vLLM's sleep mode as rollout_sleep)."""

    backend: Literal["local", "ray"] = Field(
        "local", description="local = every role in this process, one device each; ray = role workers placed "
                             "on a Ray cluster ($RAY_ADDRESS / ray_address, else a local cluster is started)")
    ray_address: Optional[str] = Field(None, description="Ray cluster to join (ray://... or host:port); default "
                                                         "$RAY_ADDRESS, and without it a local cluster is started")
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="what a worker's device is: a CPU slot or one GPU; auto = gpu where torch sees CUDA "
                            "(and actor.device allows it), else cpu")
    local_num_cpus: int = Field(0, ge=0, description="CPU slots of a locally started cluster (logical, may exceed "
                                                     "the cores); 0 = exactly what the placement needs")
    actor: RoleResourcesCfg = Field(default_factory=RoleResourcesCfg, description="actor (trained policy)")
    critic: RoleResourcesCfg = Field(default_factory=RoleResourcesCfg, description="critic (gae only)")
    reward: RoleResourcesCfg = Field(default_factory=RoleResourcesCfg, description="reward sources")
    reference: RoleResourcesCfg = Field(default_factory=RoleResourcesCfg, description="reference policy")
    rollout: RoleResourcesCfg = Field(default_factory=RoleResourcesCfg,
                                      description="rollout engines: one engine per device")
    colocate_actor_ref: bool = Field(False, description="actor and reference share workers (needs equal sizes)")
    colocate_critic_reward: bool = Field(False, description="critic and reward share workers (needs equal sizes)")
    colocate_all_models: bool = Field(False, description="every role, rollout engines included, shares the same "
                                                         "workers (needs equal sizes)")
    ref_reward_offload: bool = Field(False, description="keep reference and reward models on the CPU between uses "
                                                        "(moved to the device only for their forward passes)")
    share_frozen_trunk: bool = Field(
        True, description="roles of this process whose input embeddings and lower decoder layers are frozen and "
                          "bit-for-bit equal (the reference, a reward model and a critic with freeze_layers, all from "
                          "one SFT model) run those layers once per sequence and only their upper layers each "
                          "(turborlhf.models.trunk; same results). local backend, without ref_reward_offload")
    rollout_sleep: bool = Field(False, description="rollout engines free their memory while the actor trains: vLLM's "
                                                   "sleep mode on its GPU build, else closed and rebuilt at the next "
                                                   "weight sync")
    dp_strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="data parallelism of trained roles with >1 worker: ddp = replicas + gradient "
                           "all-reduce; fsdp = FSDP2 fully_shard (parameters, gradients and optimizer sharded)")
    dist_backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend; "
                                                                              "auto = nccl on GPU, gloo on CPU")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for each role's bundles")
    timeout_s: float = Field(900.0, gt=0, description="seconds any worker call may take before the run stops "
                                                      "with an error naming the role")
    rollout_timeout_s: float = Field(300.0, gt=0, description="seconds one rollout work item may take; a slower "
                                                              "engine is dropped and its item retried on another")
    rollout_retries: int = Field(1, ge=0, description="how often a failed rollout work item is retried on another "
                                                      "engine (safe: items are seeded, so results do not change)")
    rollout_chunk: int = Field(0, ge=0, description="prompts per rollout work item handed to the next free engine; "
                                                    "0 = rollout.batch_size // n_samples_per_prompt")

    def roles(self) -> dict[str, "RoleResourcesCfg"]:
        return {"actor": self.actor, "critic": self.critic, "reward": self.reward, "reference": self.reference,
                "rollout": self.rollout}

    def model_post_init(self, context: Any) -> None:
        if self.backend == "local":
            big = [f"distributed.{r}" for r, c in self.roles().items() if c.world_size > 1]
            if big:
                raise ValueError(f"{', '.join(big)}: more than one worker needs distributed.backend=ray "
                                 "(the local backend runs each role in this process on one device)")
