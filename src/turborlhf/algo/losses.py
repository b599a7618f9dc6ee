"""Losses: SFT NLL, pairwise reward model, DPO family, KTO, PPO / GSPO / CISPO policy, value.

Every loss returns an **unreduced** tensor — per token (``_BT``, 0 at masked positions) or per
sequence/pair (``_B``) — and, where useful, a small dict of detached statistics. Reduce with
:func:`turborlhf.algo.reduce.reduce_loss` / :func:`turborlhf.algo.reduce.reduce_seq_loss` (the
one reduction used everywhere). Statistics are means over the *local* (micro-)batch.

Log-prob conventions: ``logp_BT`` are per-token natural-log probabilities of the sampled
tokens; sequence log-probs (``pi_c_B`` etc.) are **sums** over completion tokens (prompt
masked) unless a docstring says otherwise.

Sources: docs/reference/formulas.md §1–§4 (TRL, OpenRLHF, author code), cited per function.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from turborlhf.algo.logprobs import entropy_from_logits, logprobs_from_logits
from turborlhf.algo.masked import masked_mean

__all__ = [
    "sft_nll_loss",
    "pairwise_rm_loss",
    "DPO_VARIANTS",
    "dpo_loss",
    "kto_kl_estimate",
    "kto_loss",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "cispo_policy_loss",
    "value_loss",
    "value_clipfrac",
    "entropy_from_logits",
    "logprobs_from_logits",
]

Stats = dict[str, torch.Tensor]


def _zero_masked(x: torch.Tensor, mask_b: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_b, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _check_same(name: str, *tensors: torch.Tensor, ndim: int | None = None) -> None:
    shape = tensors[0].shape
    if any(t.shape != shape for t in tensors) or (ndim is not None and len(shape) != ndim):
        raise ValueError(f"{name}: expected tensors of equal shape (ndim={ndim}), got {[tuple(t.shape) for t in tensors]}")


# ---------------------------------------------------------------------------------------- SFT


def sft_nll_loss(logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood ``-logp`` (0 at masked positions).

    Args:
        logp_BT: per-token log-probs of the target tokens (from :func:`logprobs_from_logits`),
            shape (B, T).
        mask_BT: 0/1 loss mask (completion tokens only for prompt-masked SFT), shape (B, T).

    Returns:
        loss_BT (no stats dict: there is nothing to report). ``reduce_loss(loss_BT, mask_BT)``
        gives the usual token-mean cross-entropy (HF/TRL SFT convention).

    Raises:
        ValueError: shape mismatch.
    """
    _check_same("sft_nll_loss", logp_BT, mask_BT)
    return _zero_masked(-logp_BT, mask_BT.bool())


# ------------------------------------------------------------------------------ reward model


def pairwise_rm_loss(
    chosen_B: torch.Tensor,
    rejected_B: torch.Tensor,
    margin_B: torch.Tensor | None = None,
    center_coef: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Bradley–Terry pairwise reward-model loss ``-logσ(r_c - r_r - m)`` per pair.

    (Ouyang et al. 2203.02155 Eq. 1; margin as in Llama 2 2307.09288 Eq. 2 — subtracted, so
    chosen must win by at least ``m``; TRL ``RewardTrainer.compute_loss`` and OpenRLHF
    ``PairWiseLoss``, identical maths.) Optional reward centering (TRL
    ``center_rewards_coefficient``, Eisenstein et al. 2312.09244 Eq. 2) adds
    ``center_coef · (r_c + r_r)²`` per pair, so the mean over pairs equals TRL's
    ``loss + c·mean((r_c + r_r)²)``.

    Args:
        chosen_B: scalar reward of the chosen response per pair, shape (B,).
        rejected_B: same for the rejected response, shape (B,).
        margin_B: optional per-pair margin ≥ 0, shape (B,). Default: no margin.
        center_coef: optional centering coefficient (TRL suggests 0.01). Default ``None``.

    Returns:
        ``(loss_B, stats)``; stats (detached scalars): ``accuracy`` = mean 1(r_c > r_r)
        (strict: ties count as wrong, both peers), ``margin`` = mean(r_c - r_r),
        ``chosen_reward``/``rejected_reward`` means.

    Raises:
        ValueError: shape mismatch.
    """
    _check_same("pairwise_rm_loss", chosen_B, rejected_B, ndim=1)
    diff_B = chosen_B - rejected_B
    if margin_B is not None:
        _check_same("pairwise_rm_loss", chosen_B, margin_B)
        diff_B = diff_B - margin_B
    loss_B = -F.logsigmoid(diff_B)
    if center_coef is not None:
        loss_B = loss_B + center_coef * (chosen_B + rejected_B) ** 2
    with torch.no_grad():
        stats = {
            "accuracy": (chosen_B > rejected_B).to(chosen_B.dtype).mean(),
            "margin": (chosen_B - rejected_B).mean(),
            "chosen_reward": chosen_B.mean(),
            "rejected_reward": rejected_B.mean(),
        }
    return loss_B, stats


# -------------------------------------------------------------------------------- DPO family


def _sigmoid_loss(h_B: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    # DPO (Rafailov 2305.18290 Eq. 7); with eps > 0 the conservative cDPO of the author code.
    return -(1 - eps) * F.logsigmoid(beta * h_B) - eps * F.logsigmoid(-beta * h_B)


def _robust_loss(h_B: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    # Robust DPO (Chowdhury et al. 2403.00409 Eq. 9), TRL loss_type="robust".
    return (-(1 - eps) * F.logsigmoid(beta * h_B) + eps * F.logsigmoid(-beta * h_B)) / (1 - 2 * eps)


def _ipo_loss(h_B: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    # IPO (Azar et al. 2310.12036 Eq. 17), β plays the role of τ.
    return (h_B - 1 / (2 * beta)) ** 2


DPO_VARIANTS: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": _sigmoid_loss,
    "cdpo": _sigmoid_loss,
    "robust": _robust_loss,
    "ipo": _ipo_loss,
}


def dpo_loss(
    pi_c_B: torch.Tensor,
    pi_r_B: torch.Tensor,
    ref_c_B: torch.Tensor,
    ref_r_B: torch.Tensor,
    beta: float,
    variant: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    ipo_normalize_by_length: bool = False,
    len_c_B: torch.Tensor | None = None,
    len_r_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """DPO-family loss per preference pair.

    With ``h = (π_c - π_r) - (ρ_c - ρ_r)`` (summed log-probs; ``ρ`` = reference):

    * ``"sigmoid"`` — DPO, ``-logσ(βh)`` (Rafailov et al. 2305.18290 Eq. 7). With
      ``label_smoothing=ε > 0`` it is cDPO, exactly as in the author code and OpenRLHF
      ``DPOLoss(label_smoothing)`` (current TRL dropped smoothing from ``sigmoid``).
    * ``"cdpo"`` — conservative DPO ``-(1-ε)logσ(βh) - ε logσ(-βh)`` (Mitchell 2023, Eq. 3);
      the same function as ``"sigmoid"``, named for clarity.
    * ``"robust"`` — ``[-(1-ε)logσ(βh) + ε logσ(-βh)] / (1-2ε)`` (Chowdhury et al. 2403.00409;
      TRL ``loss_type="robust"``), requires ε < 0.5.
    * ``"ipo"`` — ``(h - 1/(2β))²`` (Azar et al. 2310.12036 Eq. 17). Default: on **summed**
      log-probs (author code, OpenRLHF). ``ipo_normalize_by_length=True`` uses TRL's
      length-normalised ``h = (π_c-ρ_c)/|y_w| - (π_r-ρ_r)/|y_l|`` (needs ``len_c_B``/``len_r_B``).

    ``reference_free=True`` sets the reference log-ratio to 0 in the loss (author code, TRL
    ≤ 0.28); the implicit-reward statistics still use the given reference log-probs.

    Args:
        pi_c_B, pi_r_B: policy summed log-probs of chosen / rejected completions, shape (B,).
        ref_c_B, ref_r_B: reference-model summed log-probs, shape (B,) (detached here).
        beta: β > 0 (TRL/OpenRLHF default 0.1).
        variant: key of :data:`DPO_VARIANTS`.
        label_smoothing: ε for ``sigmoid``/``cdpo`` (∈ [0, 0.5]) and ``robust`` (∈ [0, 0.5));
            must be 0 for ``ipo``.
        reference_free: ignore the reference in the loss.
        ipo_normalize_by_length: TRL-style length-normalised IPO (``variant="ipo"`` only).
        len_c_B, len_r_B: completion-token counts, shape (B,); clamped to ≥ 1.

    Returns:
        ``(loss_B, stats)``; stats are detached: ``chosen_rewards`` = β(π_c - ρ_c) and
        ``rejected_rewards`` = β(π_r - ρ_r), per pair, shape (B,), always from summed
        log-ratios (TRL/author convention, also for IPO); ``accuracy`` = mean 1(chosen_rewards >
        rejected_rewards) (strict); ``margin`` = mean(chosen_rewards - rejected_rewards).

    Raises:
        ValueError: unknown variant, β ≤ 0, ε out of range, shape mismatch, or length
            normalisation requested without lengths / for a non-IPO variant.
    """
    if variant not in DPO_VARIANTS:
        raise ValueError(f"dpo_loss: unknown variant {variant!r}; expected one of {sorted(DPO_VARIANTS)}")
    if beta <= 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    _check_same("dpo_loss", pi_c_B, pi_r_B, ref_c_B, ref_r_B, ndim=1)
    eps = float(label_smoothing)
    if variant == "ipo" and eps != 0.0:
        raise ValueError("dpo_loss: label_smoothing is not defined for variant='ipo'")
    if variant == "robust" and not 0.0 <= eps < 0.5:
        raise ValueError(f"dpo_loss: robust DPO needs 0 <= label_smoothing < 0.5, got {eps}")
    if not 0.0 <= eps <= 0.5:
        raise ValueError(f"dpo_loss: label_smoothing must be in [0, 0.5], got {eps}")
    if ipo_normalize_by_length and variant != "ipo":
        raise ValueError("dpo_loss: ipo_normalize_by_length requires variant='ipo'")

    ref_c_B, ref_r_B = ref_c_B.detach(), ref_r_B.detach()
    ref_weight = 0.0 if reference_free else 1.0
    chosen_logratio_B = pi_c_B - ref_weight * ref_c_B
    rejected_logratio_B = pi_r_B - ref_weight * ref_r_B
    if ipo_normalize_by_length:
        if len_c_B is None or len_r_B is None:
            raise ValueError("dpo_loss: ipo_normalize_by_length needs len_c_B and len_r_B")
        _check_same("dpo_loss", pi_c_B, len_c_B, len_r_B)
        chosen_logratio_B = chosen_logratio_B / len_c_B.clamp(min=1).to(pi_c_B.dtype)
        rejected_logratio_B = rejected_logratio_B / len_r_B.clamp(min=1).to(pi_r_B.dtype)
    h_B = chosen_logratio_B - rejected_logratio_B
    loss_B = DPO_VARIANTS[variant](h_B, beta, eps)

    with torch.no_grad():
        chosen_rewards_B = beta * (pi_c_B - ref_c_B)
        rejected_rewards_B = beta * (pi_r_B - ref_r_B)
        stats = {
            "chosen_rewards": chosen_rewards_B,
            "rejected_rewards": rejected_rewards_B,
            "accuracy": (chosen_rewards_B > rejected_rewards_B).to(pi_c_B.dtype).mean(),
            "margin": (chosen_rewards_B - rejected_rewards_B).mean(),
        }
    return loss_B, stats


# ------------------------------------------------------------------------------------- KTO


def kto_kl_estimate(pi_kl_B: torch.Tensor, ref_kl_B: torch.Tensor) -> torch.Tensor:
    """KTO reference point ``z0 = max(0, mean_j[logπθ(y'_j|x_j) - logπref(y'_j|x_j)])``, detached.

    (Ethayarajh et al. 2402.01306 §4.1; TRL ``KTOTrainer``, HALOs author code.) ``y'_j`` is a
    *mismatched* completion (from another example of the batch). Local mean; for data
    parallel, all-reduce the sum and count (HALOs: global sum / global count) before
    clamping, or average per-rank means (TRL).

    Args:
        pi_kl_B: policy summed log-probs of the mismatched completions, shape (B,).
        ref_kl_B: reference summed log-probs of the same, shape (B,).

    Returns:
        0-d detached tensor ≥ 0 (0 for empty inputs).

    Raises:
        ValueError: shape mismatch.
    """
    _check_same("kto_kl_estimate", pi_kl_B, ref_kl_B, ndim=1)
    with torch.no_grad():
        if pi_kl_B.numel() == 0:
            return pi_kl_B.new_zeros(())
        return (pi_kl_B - ref_kl_B).mean().clamp(min=0)


def kto_loss(
    pi_chosen_B1: torch.Tensor,
    ref_chosen_B1: torch.Tensor,
    pi_rejected_B2: torch.Tensor,
    ref_rejected_B2: torch.Tensor,
    kl_z0: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, Stats]:
    """KTO loss per example (Ethayarajh et al. 2402.01306 Eq. 8).

    With ``r = logπθ(y|x) - logπref(y|x)`` (summed log-probs):
    desirable ``λ_D (1 - σ(β(r - z0)))``, undesirable ``λ_U (1 - σ(β(z0 - r)))``. Same maths
    in TRL ``KTOTrainer`` (``loss_type="kto"``), HALOs and OpenRLHF ``KTOLoss``.

    Args:
        pi_chosen_B1, ref_chosen_B1: summed log-probs of the B1 desirable examples, shape (B1,).
        pi_rejected_B2, ref_rejected_B2: same for the B2 undesirable examples, shape (B2,).
            Either side may be empty (B1 = 0 or B2 = 0).
        kl_z0: 0-d reference point from :func:`kto_kl_estimate` (already detached and
            clamped; detached again here).
        beta: β > 0 (TRL/HALOs default 0.1, OpenRLHF 0.01).
        desirable_weight, undesirable_weight: λ_D, λ_U (TRL advises λ_D·B1/(λ_U·B2) ∈ [1, 4/3]).

    Returns:
        ``(loss_N, stats)`` with ``loss_N = cat(desirable losses, undesirable losses)``,
        N = B1 + B2; ``reduce_seq_loss(loss_N)`` gives the peers' batch mean. Stats
        (detached): ``chosen_rewards`` β·r per desirable example (B1,), ``rejected_rewards``
        (B2,), ``kl`` = z0.

    Raises:
        ValueError: β ≤ 0, shape mismatch, or non-scalar ``kl_z0``.
    """
    if beta <= 0:
        raise ValueError(f"kto_loss: beta must be > 0, got {beta}")
    _check_same("kto_loss", pi_chosen_B1, ref_chosen_B1, ndim=1)
    _check_same("kto_loss", pi_rejected_B2, ref_rejected_B2, ndim=1)
    if kl_z0.numel() != 1:
        raise ValueError(f"kto_loss: kl_z0 must be a scalar tensor, got shape {tuple(kl_z0.shape)}")
    z0 = kl_z0.detach().reshape(())
    chosen_logratio_B1 = pi_chosen_B1 - ref_chosen_B1.detach()
    rejected_logratio_B2 = pi_rejected_B2 - ref_rejected_B2.detach()
    chosen_loss_B1 = desirable_weight * (1 - torch.sigmoid(beta * (chosen_logratio_B1 - z0)))
    rejected_loss_B2 = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - rejected_logratio_B2)))
    dtype = torch.promote_types(chosen_loss_B1.dtype, rejected_loss_B2.dtype)
    loss_N = torch.cat([chosen_loss_B1.to(dtype), rejected_loss_B2.to(dtype)])
    stats = {
        "chosen_rewards": (beta * chosen_logratio_B1).detach(),
        "rejected_rewards": (beta * rejected_logratio_B2).detach(),
        "kl": z0,
    }
    return loss_N, stats


# ------------------------------------------------------------------------------------- PPO


def ppo_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """PPO clipped-surrogate policy loss per token (Schulman et al. 1707.06347 Eq. 7).

    ``ρ = exp(clamp(logp - old_logp, -20, 20))`` (clamp as OpenRLHF ``PolicyLoss``),
    ``loss = -min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A)``. Asymmetric ε ("clip-higher", DAPO
    2503.14476) via ``eps_high``. Dual clip (Ye et al. 1912.09729 Eq. 4, OpenRLHF): for
    ``A < 0`` the objective is ``max(min(ρA, clip(ρ)A), c·A)``, bounding the loss of a
    negative-advantage token whose ratio exploded by ``-c·A``.

    Args:
        logp_BT: current policy per-token log-probs (differentiable), shape (B, T).
        old_logp_BT: behaviour-policy log-probs from the rollout, shape (B, T) (detached here).
        adv_BT: advantages, shape (B, T) (detached here).
        mask_BT: 0/1 response-token mask, shape (B, T).
        eps_low: ε for the lower clip bound, in [0, 1) (default 0.2, all peers).
        eps_high: ε for the upper bound; ``None`` = ``eps_low``.
        dual_clip: c > 1 or ``None`` (off, default).

    Returns:
        ``(loss_BT, stats)``: loss_BT is 0 at masked positions; reduce it with
        :func:`turborlhf.algo.reduce.reduce_loss`. Stats (detached masked means over the
        local batch):

        * ``clipfrac`` — fraction of valid tokens where the clipped term is the active one,
          i.e. ``clip(ρ)A < ρA`` strictly (OpenRLHF ``clip_ratio``, TRL ``pg_clipfrac``;
          cleanrl's ``|ρ-1| > ε`` counts more tokens);
        * ``dual_clipfrac`` (only with ``dual_clip``) — fraction where ``c·A`` is active;
        * ``approx_kl`` — k3 of the ratio, ``(ρ - 1) - log ρ`` (cleanrl), with the clamped ratio;
        * ``ppo_kl`` — ``old_logp - logp`` (k1 of KL(old‖new), OpenRLHF), **not** clamped.

    Raises:
        ValueError: shape mismatch, ε out of range, or ``dual_clip <= 1``.
    """
    _check_same("ppo_policy_loss", logp_BT, old_logp_BT, adv_BT, mask_BT, ndim=2)
    eps_high = eps_low if eps_high is None else eps_high
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"ppo_policy_loss: need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"ppo_policy_loss: dual_clip must be > 1, got {dual_clip}")
    mask_b = mask_BT.bool()
    # Zero padded positions of every input first so that garbage (nan/inf) there can reach
    # neither the loss nor, through 0·nan in the backward pass, the gradient.
    logp_BT = _zero_masked(logp_BT, mask_b)
    old_logp_BT = _zero_masked(old_logp_BT.detach(), mask_b)
    adv_BT = _zero_masked(adv_BT.detach(), mask_b)
    log_ratio_BT = (logp_BT - old_logp_BT).clamp(-20.0, 20.0)
    ratio_BT = torch.exp(log_ratio_BT)
    surr1_BT = ratio_BT * adv_BT
    surr2_BT = ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_BT
    objective_BT = torch.minimum(surr1_BT, surr2_BT)
    if dual_clip is not None:
        clipped_obj_BT = objective_BT
        objective_BT = torch.where(adv_BT < 0, torch.maximum(objective_BT, dual_clip * adv_BT), objective_BT)
    loss_BT = _zero_masked(-objective_BT, mask_b)

    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((surr2_BT < surr1_BT).to(ratio_BT.dtype), mask_b),
            "approx_kl": masked_mean((ratio_BT - 1.0) - log_ratio_BT, mask_b),
            "ppo_kl": masked_mean(old_logp_BT - logp_BT, mask_b),
        }
        if dual_clip is not None:
            dual_active_BT = (adv_BT < 0) & (dual_clip * adv_BT > clipped_obj_BT)
            stats["dual_clipfrac"] = masked_mean(dual_active_BT.to(ratio_BT.dtype), mask_b)
    return loss_BT, stats


def gspo_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float | None = 4e-4,
) -> tuple[torch.Tensor, Stats]:
    """GSPO clipped policy loss with a sequence-level importance ratio (Zheng et al. 2507.18071).

    Eq. 5-7: ``s_i = (π_θ(y_i|x)/π_old(y_i|x))^(1/|y_i|) = exp((1/|y_i|) Σ_t (logp - old_logp))``
    (the length-normalised geometric mean of the token ratios), clipped per *sequence*:
    ``J = (1/G) Σ_i min(s_i A_i, clip(s_i, 1-ε_low, 1+ε_high) A_i)``. Written per token in the
    paper's GSPO-token form (Eq. 13-14, verl ``compute_policy_loss_gspo``, OpenRLHF
    ``policy_loss_type="gspo"``): ``s_it = sg[s_i] · π_θ(y_it)/sg[π_θ(y_it)]`` has the value
    ``s_i`` and the gradient ``s_i ∇log π_θ(y_it)``, so

        loss_it = -min(s_it A_it, clip(s_it, 1-ε_low, 1+ε_high) A_it).

    Reduced with ``reduce_loss(mode="seq_mean_token_mean")`` and an advantage that is constant
    over each response (GRPO's), this is exactly the GSPO objective and gradient; a per-token
    advantage gives GSPO-token. ``log s_i`` is clamped to [-20, 20] (inside the stop-gradient).

    Args:
        logp_BT: current policy per-token log-probs (differentiable), shape (B, T).
        old_logp_BT: behaviour-policy log-probs from the rollout, shape (B, T) (detached here).
        adv_BT: advantages, shape (B, T) (detached here).
        mask_BT: 0/1 response-token mask, shape (B, T).
        eps_low: ε of the lower bound on ``s_i``, in [0, 1). Default 3e-4 (the paper's; sequence
            ratios sit far closer to 1 than token ratios, so PPO's 0.2 rarely clips).
        eps_high: ε of the upper bound; ``None`` = ``eps_low``. Default 4e-4 (the paper's).

    Returns:
        ``(loss_BT, stats)``, loss_BT 0 at masked positions. Stats (detached masked means over
        the tokens of the local batch): ``clipfrac`` (tokens of responses whose clipped term is
        active, i.e. token-weighted fraction of clipped responses), ``approx_kl`` (k3 of the
        token ratios), ``ppo_kl`` (``old_logp - logp``), ``seq_ratio`` (mean ``s_i``).

    Raises:
        ValueError: shape mismatch or ε out of range.
    """
    _check_same("gspo_policy_loss", logp_BT, old_logp_BT, adv_BT, mask_BT, ndim=2)
    eps_high = eps_low if eps_high is None else eps_high
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"gspo_policy_loss: need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    mask_b = mask_BT.bool()
    logp_BT = _zero_masked(logp_BT, mask_b)
    old_logp_BT = _zero_masked(old_logp_BT.detach(), mask_b)
    adv_BT = _zero_masked(adv_BT.detach(), mask_b)
    n_B = mask_b.sum(dim=1).clamp(min=1).to(logp_BT.dtype)
    log_s_B = ((logp_BT.detach() - old_logp_BT).sum(dim=1) / n_B).clamp(-20.0, 20.0)
    log_s_BT = logp_BT - logp_BT.detach() + log_s_B[:, None]          # value log s_i, gradient ∇logp_it
    s_BT = torch.exp(log_s_BT)
    surr1_BT = s_BT * adv_BT
    surr2_BT = s_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_BT
    loss_BT = _zero_masked(-torch.minimum(surr1_BT, surr2_BT), mask_b)
    with torch.no_grad():
        log_ratio_BT = (logp_BT - old_logp_BT).clamp(-20.0, 20.0)
        stats = {
            "clipfrac": masked_mean((surr2_BT < surr1_BT).to(logp_BT.dtype), mask_b),
            "approx_kl": masked_mean(torch.expm1(log_ratio_BT) - log_ratio_BT, mask_b),
            "ppo_kl": masked_mean(old_logp_BT - logp_BT, mask_b),
            "seq_ratio": torch.exp(log_s_B).mean(),
        }
    return loss_BT, stats


def cispo_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    eps_high: float,
    eps_low: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight (MiniMax-M1, 2506.13585).

    Eq. 4-5: ``J = (1/Σ_i|o_i|) Σ_i Σ_t sg(r̂_it) Â_it log π_θ(o_it)`` with
    ``r̂ = clip(r, 1-ε_low, 1+ε_high)``, ``r = π_θ/π_old`` per token, so

        loss_it = -sg(clip(r_it, 1-ε_low, 1+ε_high)) · A_it · logp_it.

    Unlike the PPO clip, no token's gradient is dropped: a token whose ratio left the range
    keeps its gradient ``r̂ A ∇logp`` with the weight capped. The paper sets no lower bound
    (ε_low^IS large) and tunes ε_high only; ``eps_low=None`` does the same. Reduce with
    ``reduce_loss(mode="token_mean")`` for Eq. 4's ``1/Σ|o_i|``. At ``r = 1`` the gradient
    equals the PPO/GRPO one, but the loss *value* is ``-A·logp`` (not ``-A``), so it is not
    comparable to the PPO loss. ``log r`` is clamped to [-20, 20].

    Args:
        logp_BT: current policy per-token log-probs (differentiable), shape (B, T).
        old_logp_BT: behaviour-policy log-probs from the rollout, shape (B, T) (detached here).
        adv_BT: advantages, shape (B, T) (detached here).
        mask_BT: 0/1 response-token mask, shape (B, T).
        eps_high: ε_high^IS ≥ 0: the weight is at most ``1 + eps_high``.
        eps_low: ε_low^IS in [0, 1], or ``None`` (default, the paper's choice): no lower bound.

    Returns:
        ``(loss_BT, stats)``, loss_BT 0 at masked positions. Stats (detached masked means over
        the local batch): ``clipfrac`` (tokens whose weight was capped, ``r`` outside the
        range), ``approx_kl`` (k3 of the ratio), ``ppo_kl`` (``old_logp - logp``).

    Raises:
        ValueError: shape mismatch or ε out of range.
    """
    _check_same("cispo_policy_loss", logp_BT, old_logp_BT, adv_BT, mask_BT, ndim=2)
    if eps_high < 0.0 or (eps_low is not None and not 0.0 <= eps_low <= 1.0):
        raise ValueError(f"cispo_policy_loss: need eps_high >= 0 and eps_low in [0, 1] or None, "
                         f"got {eps_high}, {eps_low}")
    mask_b = mask_BT.bool()
    logp_BT = _zero_masked(logp_BT, mask_b)
    old_logp_BT = _zero_masked(old_logp_BT.detach(), mask_b)
    adv_BT = _zero_masked(adv_BT.detach(), mask_b)
    log_ratio_BT = (logp_BT.detach() - old_logp_BT).clamp(-20.0, 20.0)
    ratio_BT = torch.exp(log_ratio_BT)
    lo = 0.0 if eps_low is None else 1.0 - eps_low
    weight_BT = ratio_BT.clamp(lo, 1.0 + eps_high)
    loss_BT = _zero_masked(-weight_BT * adv_BT * logp_BT, mask_b)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((weight_BT != ratio_BT).to(logp_BT.dtype), mask_b),
            "approx_kl": masked_mean((ratio_BT - 1.0) - log_ratio_BT, mask_b),
            "ppo_kl": masked_mean(old_logp_BT - logp_BT, mask_b),
        }
    return loss_BT, stats


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip: float | None = None,
) -> torch.Tensor:
    """(Clipped) value loss per token, **including the ½**: ``½·max((V-R)², (V_clip-R)²)``.

    ``V_clip = V_old + clamp(V - V_old, -clip, clip)`` (PPO value clipping: OpenRLHF
    ``ValueLoss``, TRL PPO, cleanrl, Ziegler et al.). Without ``clip``: ``½(V-R)²``. The ½ is
    applied here and nowhere else: ``reduce_loss(loss_BT, mask_BT)`` equals OpenRLHF's
    ``0.5·aggregate_loss(...)`` and TRL's ``0.5·masked_mean(...)``; a shared-trunk trainer
    then multiplies by ``vf_coef`` (TRL 0.1, cleanrl 0.5; OpenRLHF has a separate critic and no
    coefficient).

    Args:
        values_BT: current critic values (differentiable), shape (B, T).
        old_values_BT: values from the rollout, shape (B, T) (detached here).
        returns_BT: value targets (``A + V_old`` from :func:`turborlhf.algo.advantages.gae`),
            shape (B, T) (detached here).
        mask_BT: 0/1 response-token mask, shape (B, T).
        clip: ε_v > 0, or ``None`` for no clipping (OpenRLHF CLI 0.5, TRL 0.2).

    Returns:
        loss_BT only (0 at masked positions; no stats dict — see :func:`value_clipfrac`).

    Raises:
        ValueError: shape mismatch or ``clip <= 0``.
    """
    _check_same("value_loss", values_BT, old_values_BT, returns_BT, mask_BT, ndim=2)
    if clip is not None and clip <= 0:
        raise ValueError(f"value_loss: clip must be > 0, got {clip}")
    mask_b = mask_BT.bool()
    values_BT = _zero_masked(values_BT, mask_b)  # padded garbage must not reach the gradient
    old_values_BT = _zero_masked(old_values_BT.detach(), mask_b)
    returns_BT = _zero_masked(returns_BT.detach(), mask_b)
    sq_BT = (values_BT - returns_BT) ** 2
    if clip is not None:
        values_clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
        sq_BT = torch.maximum(sq_BT, (values_clipped_BT - returns_BT) ** 2)
    return _zero_masked(0.5 * sq_BT, mask_b)


@torch.no_grad()
def value_clipfrac(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip: float | None,
) -> torch.Tensor:
    """Fraction of valid tokens where the clipped value term is the active (larger) one.

    TRL ``vf_clipfrac`` definition: ``(V_clip - R)² > (V - R)²`` (a token whose value moved by
    more than ``clip`` but towards the target is *not* counted, unlike ``|V - V_old| > clip``).

    Args:
        values_BT, old_values_BT, returns_BT, mask_BT: as in :func:`value_loss`, shape (B, T).
        clip: ε_v, or ``None`` (then the fraction is 0).

    Returns:
        Detached 0-d tensor (masked mean over the local batch).

    Raises:
        ValueError: shape mismatch or ``clip <= 0`` (as :func:`value_loss`).
    """
    _check_same("value_clipfrac", values_BT, old_values_BT, returns_BT, mask_BT, ndim=2)
    if clip is not None and clip <= 0:      # a negative clip would count every token as clipped
        raise ValueError(f"value_clipfrac: clip must be > 0, got {clip}")
    mask_b = mask_BT.bool()
    if clip is None:
        return values_BT.new_zeros(())
    values_BT, old_values_BT, returns_BT = (_zero_masked(x, mask_b) for x in (values_BT, old_values_BT, returns_BT))
    values_clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    # within the clip V_clip is V (old + (V − old) may round to another float: a coin flip on ties)
    moved_BT = (values_BT - old_values_BT).abs() > clip
    active_BT = moved_BT & ((values_clipped_BT - returns_BT) ** 2 > (values_BT - returns_BT) ** 2)
    return masked_mean(active_BT.to(values_BT.dtype), mask_b)
