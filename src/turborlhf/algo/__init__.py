"""Pure RLHF maths over tensors; imports only torch (and the standard library).

Every equation a paper defines lives here once; trainers call these functions and never
re-derive them. Modules:

* :mod:`~turborlhf.algo.masked` — masked sum / mean / variance / whitening;
* :mod:`~turborlhf.algo.reduce` — :func:`reduce_loss`, the one loss reduction (global
  denominators for micro-batching and data parallel);
* :mod:`~turborlhf.algo.kl` — k1/k2/k3 KL estimators, fixed and adaptive KL controllers;
* :mod:`~turborlhf.algo.advantages` — KL-shaped rewards, GAE, discounted returns, GRPO /
  Dr. GRPO / RLOO / REINFORCE++-baseline group advantages, DAPO's group filter and overlong
  penalty;
* :mod:`~turborlhf.algo.logprobs` — chunked, memory-bounded log-probs and entropies;
* :mod:`~turborlhf.algo.losses` — SFT NLL, pairwise RM, DPO/cDPO/robust/IPO, KTO, PPO clip
  and dual clip, GSPO, CISPO, clipped value loss;
* :mod:`~turborlhf.algo.rollout_correction` — engine/trainer mismatch statistics and TIS/MIS
  importance weights.

Shape suffixes: ``B`` sequences (or pairs), ``T`` response tokens, ``G`` samples per prompt,
``V`` vocabulary. Masks are 0/1 with 1 = valid token. Peer formulas and golden vectors:
``docs/reference/formulas.md``.
"""

from turborlhf.algo.advantages import (
    discounted_returns,
    gae,
    group_mean_baseline,
    group_normalized_advantages,
    kept_groups_mask,
    kl_penalized_rewards,
    leave_one_out_advantages,
    overlong_penalty,
    sequence_to_token,
)
from turborlhf.algo.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_estimate
from turborlhf.algo.logprobs import entropy_from_logits, logprobs_from_logits
from turborlhf.algo.losses import (
    DPO_VARIANTS,
    cispo_policy_loss,
    dpo_loss,
    gspo_policy_loss,
    kto_kl_estimate,
    kto_loss,
    pairwise_rm_loss,
    ppo_policy_loss,
    sft_nll_loss,
    value_clipfrac,
    value_loss,
)
from turborlhf.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from turborlhf.algo.reduce import REDUCTION_MODES, reduce_loss, reduce_seq_loss
from turborlhf.algo.rollout_correction import ROLLOUT_IS_MODES, rollout_is_weights, rollout_mismatch_stats

__all__ = [
    "AdaptiveKLController",
    "DPO_VARIANTS",
    "FixedKLController",
    "KL_ESTIMATORS",
    "REDUCTION_MODES",
    "ROLLOUT_IS_MODES",
    "cispo_policy_loss",
    "discounted_returns",
    "dpo_loss",
    "entropy_from_logits",
    "gae",
    "group_mean_baseline",
    "gspo_policy_loss",
    "group_normalized_advantages",
    "kl_estimate",
    "kept_groups_mask",
    "kl_penalized_rewards",
    "kto_kl_estimate",
    "kto_loss",
    "leave_one_out_advantages",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "pairwise_rm_loss",
    "ppo_policy_loss",
    "reduce_loss",
    "reduce_seq_loss",
    "rollout_is_weights",
    "rollout_mismatch_stats",
    "sequence_to_token",
    "sft_nll_loss",
    "value_clipfrac",
    "value_loss",
]
