"""Rewards and advantages: KL-shaped token rewards, GAE, discounted returns, group baselines,
DAPO's dynamic-sampling group filter and overlong reward shaping.

Shapes: ``B`` sequences, ``T`` response tokens (right padding assumed by the peers, but every
function here treats masked positions as *absent*: they are skipped by the recursions and
their values, which may be garbage, are never read), ``G`` samples per prompt.

Rewards, scores, values and KL given as integer or bool tensors (a 0/1 verifier's
``torch.tensor([1, 0, 1, 1])``) are computed in the default float dtype: torch's integer
arithmetic would refuse them (``mean``) or truncate discounted sums silently.

Sources: docs/reference/formulas.md §5–§7; OpenRLHF ``openrlhf/models/utils.py::compute_reward``,
``experience_maker.py::get_advantages_and_returns / get_cumulative_returns /
compute_advantages_and_returns``; TRL ``grpo_trainer.py``, ``rloo_trainer.py``; GAE:
Schulman et al. 1506.02438 Eq. 16; GRPO: Shao et al. 2402.03300 §4.1.2; Dr. GRPO: Liu et al.
2503.20783; RLOO: Ahmadian et al. 2402.14740 Eq. 5 (Kool et al. 2019); REINFORCE++: Hu
2501.03262; DAPO: Yu et al. 2503.14476 §3.2 (dynamic sampling) and §3.4 Eq. 13 (overlong shaping).
"""

from __future__ import annotations

import torch

__all__ = [
    "kl_penalized_rewards",
    "gae",
    "discounted_returns",
    "group_normalized_advantages",
    "group_mean_baseline",
    "leave_one_out_advantages",
    "sequence_to_token",
    "kept_groups_mask",
    "overlong_penalty",
]


def _check_BT(name: str, *tensors: torch.Tensor) -> None:
    shape = tensors[0].shape
    if len(shape) != 2 or any(t.shape != shape for t in tensors):
        raise ValueError(f"{name}: expected 2-D (B, T) tensors of equal shape, got {[tuple(t.shape) for t in tensors]}")


def _zero_masked(x: torch.Tensor, mask_b: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_b, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """`x` itself if floating point (or complex), else `x` in the default float dtype (int and bool rewards)."""
    return x if x.is_floating_point() or x.is_complex() else x.to(torch.get_default_dtype())


def kl_penalized_rewards(
    scores_B: torch.Tensor,
    kl_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_coef: float,
    clip: float | tuple[float, float] | None = None,
) -> torch.Tensor:
    """Per-token rewards: ``-kl_coef · kl_t`` everywhere, plus the score at the last valid token.

    ``rewards_t = -β·kl_t·M_t + score·1(t == last valid index)`` (Ziegler et al. 1909.08593
    Eq. 2 spread over tokens; OpenRLHF ``compute_reward`` and TRL-legacy ``compute_rewards``
    convention: the score lands on the **last valid response token**, i.e. the EOS token if
    generated, else the last token of a truncated response. Current TRL PPO puts it one token
    later, see docs/reference/formulas.md §6 caveat; that is not reproduced).

    Args:
        scores_B: scalar reward per sequence (reward model / rule), shape (B,).
        kl_BT: per-token KL estimate (see :func:`turborlhf.algo.kl.kl_estimate`), shape (B, T).
        mask_BT: 0/1 response-token mask, shape (B, T).
        kl_coef: β ≥ 0 (a float; use ``controller.value``). β = 0 gives score-only rewards.
        clip: optional clipping of the *scores* before they are placed: a float ``c`` means
            ``[-c, c]``, a tuple ``(lo, hi)`` a range (OpenRLHF ``--reward.clip_range``
            (-10, 10)). Default ``None`` = no clipping.

    Returns:
        rewards_BT with 0 at masked positions. A sequence with no valid token gets no reward
        at all (its score is dropped).

    Raises:
        ValueError: shape mismatch, ``kl_coef < 0``, a negative ``clip`` or a ``(lo, hi)`` with
            ``lo > hi``.
    """
    _check_BT("kl_penalized_rewards", kl_BT, mask_BT)
    if scores_B.shape != kl_BT.shape[:1]:
        raise ValueError(f"kl_penalized_rewards: scores_B shape {tuple(scores_B.shape)} != ({kl_BT.shape[0]},)")
    if kl_coef < 0:
        raise ValueError(f"kl_penalized_rewards: kl_coef must be >= 0, got {kl_coef}")
    scores_B, kl_BT = _as_float(scores_B), _as_float(kl_BT)
    if clip is not None:
        lo, hi = (-clip, clip) if isinstance(clip, (int, float)) else clip
        if lo > hi:        # torch's clamp would set every score to hi
            raise ValueError(f"kl_penalized_rewards: clip must be >= 0 or a range (lo, hi) with lo <= hi, got {clip}")
        scores_B = scores_B.clamp(lo, hi)
    mask_b = mask_BT.bool()
    dtype = torch.promote_types(kl_BT.dtype, scores_B.dtype)
    rewards_BT = -kl_coef * _zero_masked(kl_BT.to(dtype), mask_b)
    T = mask_b.shape[1]
    positions_T = torch.arange(T, device=mask_b.device)
    last_B = torch.where(mask_b, positions_T, -1).amax(dim=1)  # -1 if no valid token
    at_last_BT = (positions_T[None, :] == last_B[:, None]) & mask_b
    return rewards_BT + torch.where(at_last_BT, scores_B.to(dtype)[:, None], torch.zeros((), dtype=dtype, device=mask_b.device))


def gae(
    values_BT: torch.Tensor,
    rewards_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (Schulman et al. 1506.02438 Eq. 16).

    ``δ_t = r_t + γ V_{t+1} - V_t``, ``A_t = δ_t + γλ A_{t+1}``, with ``V = A = 0`` after the
    last valid token (the response is always treated as terminal, even if truncated: OpenRLHF
    and TRL convention), and ``returns_t = A_t + V_t`` computed **before** any whitening (the
    value target). ``t+1`` means the next *valid* token: masked positions are skipped, which
    for right-padded masks is identical to OpenRLHF/TRL's "mask values and rewards, then loop
    over the padded length".

    Args:
        values_BT: critic values V(s_t) at each response token, shape (B, T).
        rewards_BT: per-token rewards (e.g. from :func:`kl_penalized_rewards`), shape (B, T).
        mask_BT: 0/1 response-token mask, shape (B, T).
        gamma: discount γ ∈ [0, 1] (OpenRLHF and TRL default 1).
        lam: GAE λ ∈ [0, 1] (TRL default 0.95; OpenRLHF default 1).

    Returns:
        ``(advantages_BT, returns_BT)``, both detached, 0 at masked positions. Whiten the
        advantages afterwards with :func:`turborlhf.algo.masked.masked_whiten` if desired.

    Raises:
        ValueError: shape mismatch, or γ/λ outside [0, 1].
    """
    _check_BT("gae", values_BT, rewards_BT, mask_BT)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: gamma and lam must be in [0, 1], got {gamma}, {lam}")
    mask_b = mask_BT.bool()
    values_BT, rewards_BT = _as_float(values_BT), _as_float(rewards_BT)
    dtype = torch.promote_types(values_BT.dtype, rewards_BT.dtype)
    values_BT = _zero_masked(values_BT.detach().to(dtype), mask_b)
    rewards_BT = _zero_masked(rewards_BT.detach().to(dtype), mask_b)
    B, T = values_BT.shape
    adv_BT = torch.zeros_like(values_BT)
    next_value_B = values_BT.new_zeros(B)
    next_adv_B = values_BT.new_zeros(B)
    for t in reversed(range(T)):
        valid_B = mask_b[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        adv_BT[:, t] = torch.where(valid_B, adv_B, 0.0)
        next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
        next_adv_B = torch.where(valid_B, adv_B, next_adv_B)
    return adv_BT, adv_BT + values_BT


def discounted_returns(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + γ G_{t+1}`` over valid tokens (REINFORCE++, Hu 2501.03262).

    OpenRLHF ``get_cumulative_returns``: rewards are masked first and the reverse discounted
    sum runs over the response; masked positions are skipped (identical for right padding).
    For the REINFORCE++/RLOO/GRPO estimators OpenRLHF uses ``advantages = returns`` (γ forced
    to 1 for the group estimators).

    Args:
        rewards_BT: per-token rewards, shape (B, T).
        mask_BT: 0/1 response-token mask, shape (B, T).
        gamma: discount γ ∈ [0, 1].

    Returns:
        returns_BT, detached, 0 at masked positions.

    Raises:
        ValueError: shape mismatch or γ outside [0, 1].
    """
    _check_BT("discounted_returns", rewards_BT, mask_BT)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"discounted_returns: gamma must be in [0, 1], got {gamma}")
    mask_b = mask_BT.bool()
    rewards_BT = _zero_masked(_as_float(rewards_BT.detach()), mask_b)
    returns_BT = torch.zeros_like(rewards_BT)
    running_B = rewards_BT.new_zeros(rewards_BT.shape[0])
    for t in reversed(range(rewards_BT.shape[1])):
        valid_B = mask_b[:, t]
        running_B = torch.where(valid_B, rewards_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = torch.where(valid_B, running_B, 0.0)
    return returns_BT


def _check_BG(name: str, scores_BG: torch.Tensor) -> None:
    if scores_BG.dim() != 2:
        raise ValueError(f"{name}: expected scores_BG of shape (prompts, samples_per_prompt), got {tuple(scores_BG.shape)}")
    if scores_BG.shape[1] < 2:
        raise ValueError(f"{name}: a group baseline needs at least 2 samples per prompt, got G={scores_BG.shape[1]}")


def group_normalized_advantages(
    scores_BG: torch.Tensor,
    eps: float = 1e-4,
    std: bool = True,
    unbiased: bool = True,
) -> torch.Tensor:
    """GRPO group-normalised advantage ``A_i = (r_i - mean_g r) / (std_g r + eps)``.

    (Shao et al. 2402.03300 §4.1.2 "outcome supervision".) With ``std=False`` this is the
    Dr. GRPO advantage ``r_i - mean_g r`` (Liu et al. 2503.20783 Eq. 3); pair it with
    ``reduce_loss(mode="token_sum_norm")`` for the full Dr. GRPO objective.

    Args:
        scores_BG: scalar rewards of ``B`` prompts × ``G`` samples; reshape a flat rollout of
            consecutive samples per prompt with ``scores.view(-1, G)``.
        eps: added to the std (not the variance). Default ``1e-4`` = TRL GRPO; OpenRLHF
            ``group_norm`` uses ``1e-9``. With identical rewards in a group both give A = 0;
            the larger eps avoids huge advantages when rewards differ only by rounding.
        std: divide by the group std (GRPO, default) or not (Dr. GRPO).
        unbiased: Bessel-corrected std (default ``True``; both TRL and OpenRLHF).

    Returns:
        adv_BG (same shape); broadcast to tokens with :func:`sequence_to_token`.

    Raises:
        ValueError: if ``scores_BG`` is not 2-D, ``G < 2`` or ``eps < 0``.
    """
    _check_BG("group_normalized_advantages", scores_BG)
    if eps < 0:        # std + eps could reach 0 or flip the advantages' sign
        raise ValueError(f"group_normalized_advantages: eps must be >= 0, got {eps}")
    scores_BG = _as_float(scores_BG)
    adv_BG = scores_BG - scores_BG.mean(dim=1, keepdim=True)
    if std:
        adv_BG = adv_BG / (scores_BG.std(dim=1, keepdim=True, unbiased=unbiased) + eps)
    return adv_BG


def group_mean_baseline(scores_BG: torch.Tensor) -> torch.Tensor:
    """``r_i - mean_g r``: REINFORCE++-baseline's pre-normalisation reward and Dr. GRPO's advantage.

    (Hu 2501.03262 REINFORCE++-baseline; OpenRLHF estimators ``reinforce_baseline`` and
    ``dr_grpo``.) OpenRLHF then spreads it over tokens (:func:`kl_penalized_rewards`,
    :func:`discounted_returns`) and whitens globally over the rollout batch
    (:func:`turborlhf.algo.masked.masked_whiten`).

    Args:
        scores_BG: rewards, ``B`` prompts × ``G`` samples.

    Returns:
        Tensor of shape (B, G).

    Raises:
        ValueError: if ``scores_BG`` is not 2-D or ``G < 2``.
    """
    _check_BG("group_mean_baseline", scores_BG)
    scores_BG = _as_float(scores_BG)
    return scores_BG - scores_BG.mean(dim=1, keepdim=True)


def leave_one_out_advantages(scores_BG: torch.Tensor) -> torch.Tensor:
    """RLOO advantage ``A_i = r_i - (Σ_{j≠i} r_j) / (G - 1) = G/(G-1) · (r_i - mean r)``.

    (Ahmadian et al. 2402.14740 Eq. 5; OpenRLHF ``rloo`` and TRL ``RLOOTrainer``. TRL
    subtracts the sequence-summed KL from the reward *before* the baseline; OpenRLHF applies
    the baseline to the raw score and adds per-token KL afterwards. Either order is the
    caller's choice: pass KL-adjusted scores for TRL's convention.)

    Args:
        scores_BG: rewards, ``B`` prompts × ``G`` samples.

    Returns:
        Tensor of shape (B, G).

    Raises:
        ValueError: if ``scores_BG`` is not 2-D or ``G < 2``.
    """
    _check_BG("leave_one_out_advantages", scores_BG)
    scores_BG = _as_float(scores_BG)
    G = scores_BG.shape[1]
    baseline_BG = (scores_BG.sum(dim=1, keepdim=True) - scores_BG) / (G - 1)
    return scores_BG - baseline_BG


def sequence_to_token(x_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sequence value (e.g. a GRPO advantage) to every valid token.

    Args:
        x_B: shape (B,) (flatten ``adv_BG`` first with ``.reshape(-1)``).
        mask_BT: 0/1 response-token mask, shape (B, T).

    Returns:
        x_BT = ``x_B[:, None]`` at valid positions, 0 elsewhere.

    Raises:
        ValueError: if ``x_B`` does not have shape (B,).
    """
    if x_B.shape != mask_BT.shape[:1]:
        raise ValueError(f"sequence_to_token: x_B shape {tuple(x_B.shape)} != ({mask_BT.shape[0]},)")
    return _zero_masked(x_B[:, None].expand(mask_BT.shape), mask_BT.bool())


def kept_groups_mask(scores_B: torch.Tensor, group_size: int, atol: float = 0.0) -> torch.Tensor:
    """DAPO dynamic sampling: which groups have rewards that are not all equal.

    (Yu et al. 2503.14476 §3.2, Eq. 11's constraint ``0 < |{o_i : is_equivalent(a, o_i)}| < G``;
    verl ``filter_groups``, which keeps a prompt when the std of its group's metric is > 0.) A
    group whose G scores are all equal gets zero advantage under every group baseline, so it
    adds no policy gradient, only dilutes the batch; the trainer drops it and samples more prompts.

    Args:
        scores_B: one scalar score per response, shape (N·G,), the G samples of a prompt
            consecutive (the rollout layout).
        group_size: G ≥ 1, samples per prompt.
        atol: a group is kept when ``max - min > atol`` over its scores (default 0: exactly
            equal scores are dropped, as verl's ``std > 0``).

    Returns:
        keep_N: bool tensor of shape (N,), True for groups to keep.

    Raises:
        ValueError: ``scores_B`` not 1-D, its length not a multiple of ``group_size``,
            ``group_size < 1`` or ``atol < 0``.
    """
    if group_size < 1 or atol < 0:
        raise ValueError(f"kept_groups_mask: need group_size >= 1 and atol >= 0, got {group_size}, {atol}")
    if scores_B.dim() != 1 or scores_B.shape[0] % group_size:
        raise ValueError(f"kept_groups_mask: expected scores of shape (N*{group_size},), got {tuple(scores_B.shape)}")
    scores_NG = _as_float(scores_B).view(-1, group_size)
    return (scores_NG.amax(dim=1) - scores_NG.amin(dim=1)) > atol


def overlong_penalty(
    lengths_B: torch.Tensor,
    max_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2503.14476 §3.4, Eq. 13), added to the score.

    With ``L_max = max_len`` and ``L_cache = buffer_len``::

        R_length(y) = 0                                  if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                                 if |y| > L_max

    times ``penalty_factor`` (verl ``overlong_buffer.penalty_factor``; the paper's is 1). The
    penalty falls linearly from 0 to ``-penalty_factor`` over the last ``buffer_len`` tokens.

    Args:
        lengths_B: response lengths in tokens (the stop token counted, as verl's
            ``valid_response_length``), shape (B,).
        max_len: L_max ≥ 1, the generation limit (``rollout.max_new_tokens``).
        buffer_len: L_cache, 1 ≤ L_cache ≤ L_max.
        penalty_factor: scale ≥ 0 of the penalty.

    Returns:
        penalty_B ≤ 0 (float), shape (B,).

    Raises:
        ValueError: ``lengths_B`` not 1-D, ``buffer_len`` outside [1, max_len] or
            ``penalty_factor < 0``.
    """
    if lengths_B.dim() != 1:
        raise ValueError(f"overlong_penalty: expected lengths of shape (B,), got {tuple(lengths_B.shape)}")
    if not 1 <= buffer_len <= max_len or penalty_factor < 0:
        raise ValueError(f"overlong_penalty: need 1 <= buffer_len <= max_len and penalty_factor >= 0, got "
                         f"buffer_len={buffer_len}, max_len={max_len}, penalty_factor={penalty_factor}")
    expected = max_len - buffer_len
    r_B = ((expected - lengths_B.double()) / buffer_len).clamp(-1.0, 0.0)
    return (penalty_factor * r_B).to(torch.get_default_dtype())
