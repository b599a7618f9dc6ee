"""`turborlhf ppo` (and `grpo`, `rloo`): PPO for language models, as a package read from the driver
down. The public API is `train` and `train_steps`; the other names below are re-exported for
the tests, `turborlhf plan` and the Python API.

Module map (imports run one way, top to bottom; no module imports one above it, none imports
another trainer):

    driver          the step, top to bottom: generate, experience, rewards and advantages,
                    update, weight sync; the run around it (resume, checkpoints, metrics)
      │
      ├─ async_rollout   rollouts generated ahead (``rollout.max_staleness``) → rlvr
      ├─ rlvr            DAPO dynamic sampling, score shaping, rollout correction → rollout
      ├─ rollout         sampling parameters, the engines' work queue, row-sharded calls
      ├─ actor           ActorWorker: forward, micro-step, mini-batch loop, policy losses, EMA, ptx → roles
      ├─ critic          CriticWorker: forward, micro-step, mini-batch loop → roles
      └─ roles           the trained roles' base (optimizer step, saving, the fused update's kept
      │                  forwards) and the frozen roles: reference, reward, rollout workers
      ▼
    experience      Experience, its layout, the mini-batch schedule, each rank's rows, the loss counts
      ▼
    turborlhf.algo  the maths (losses, advantages, KL)

One step's path (`driver._step`, steps numbered as in `driver`):
1. `driver` → `rlvr.collect_rollouts` → `rollout.generate` → the rollout workers (`roles`);
2. `driver.make_experience` → `rollout.submit_rows`, row-sharded calls to the workers:
   ``ActorWorker.logprobs`` (`actor.actor_forward`; kept under a name for a fused update),
   ``ReferenceWorker.logprobs`` / ``RewardWorker.score`` (`roles`), ``CriticWorker.values``;
3-4. `driver.score_and_advantages` → `driver.ADVANTAGE_ESTIMATORS` → `turborlhf.algo`;
5. to the loss, each module entered once: `driver.ppo_update` → ``ActorWorker.train`` (`actor`:
   its mini-batch loop over `experience.minibatch_schedule`'s mini-batches, this rank's
   micro-batches from `experience.rank_micro_batches`, `actor.actor_micro_step` →
   `actor.POLICY_LOSSES`) → `turborlhf.algo.losses`; the critic likewise (`critic.critic_micro_step`
   → `turborlhf.algo.value_loss`);
6. `driver.sync_weights` → the rollout workers' ``load_weights``.
"""
from turborlhf.engine.lifecycle import RunInterrupted
from turborlhf.trainers.ppo.driver import (ADVANTAGE_ESTIMATORS, build_roles, lora_reference, make_experience,
                                           merge_rank_stats, phases, ppo_update, score_and_advantages, sync_weights,
                                           train, train_steps)
from turborlhf.trainers.ppo.experience import Experience, assemble, minibatch_schedule, use_fused_update
from turborlhf.trainers.ppo.rollout import generate, rollout_items

__all__ = ["phases", "train", "train_steps", "Experience", "assemble", "make_experience", "score_and_advantages", "ppo_update",
           "minibatch_schedule", "merge_rank_stats", "rollout_items", "generate", "sync_weights", "build_roles",
           "ADVANTAGE_ESTIMATORS", "RunInterrupted", "lora_reference", "use_fused_update"]
