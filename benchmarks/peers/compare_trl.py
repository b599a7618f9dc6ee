"""Comparison cases against TRL 1.16.0 (and 1.12.0 for its PPO helpers), registered with `@case`
into `compare_core.CASES`; run by `compare_algo.py` (docstring there)."""
from __future__ import annotations

from compare_core import (SHAPES, _Acc, _BF16_LOGPROBS, _entropy_vs, _logprobs_bf16_vs, _logprobs_vs, _metrics,
                          _pairs, _TableModel, case, junk, rand, randn, rmask)

TRL = "trl-1.16.0"
TRL12 = "trl-1.12.0"


@case(TRL, "logprobs_from_logits", "trl.trainer.utils.selective_log_softmax (torch path)", "chunk_size 3 and default")
def trl_logprobs(P, dt, g, d, dd):
    _logprobs_vs(P.utils.selective_log_softmax, dt, g, d)


@case(TRL, "logprobs_from_logits (bf16 logits)", "trl.trainer.utils.selective_log_softmax (bf16 row loop)",
      **_BF16_LOGPROBS)
def trl_logprobs_bf16(P, dt, g, d, dd):
    _logprobs_bf16_vs(P.utils.selective_log_softmax, dt, g, d, dd)


@case(TRL, "entropy_from_logits", "trl.trainer.utils.entropy_from_logits (torch path)", "chunk_size 3; peer's 4")
def trl_entropy(P, dt, g, d, dd):
    _entropy_vs(lambda logits: P.utils.entropy_from_logits(logits, chunk_size=4), dt, g, d)


def _dpo_batch(g, B, L, dt):
    """2B rows [chosen; rejected]: prompt then completion, right-padded; table of per-token log-probs aligned
    with the shifted labels (0 outside the completion), as TRL's fused LM head returns them."""
    import torch

    rows = 2 * B
    p = torch.randint(1, L, (rows,), generator=g)
    c = torch.stack([torch.randint(1, int(L - pi) + 1, (1,), generator=g)[0] for pi in p])
    pos = torch.arange(L)[None, :]
    cmask = ((pos >= p[:, None]) & (pos < (p + c)[:, None])).long()
    zero = torch.zeros((), dtype=getattr(torch, dt))
    table = torch.where(cmask[:, 1:].bool(), -rand(g, rows, L - 1, dt=dt, scale=2), zero)
    input_ids = torch.randint(0, 50, (rows, L), generator=g)
    input_ids[:, 0] = torch.arange(rows)
    attn = (pos < (p + c)[:, None]).long()
    return table, cmask, input_ids, attn


def _trl_dpo(P, loss_type, beta, eps, table, cmask, input_ids, attn, ref_c, ref_r):
    from types import SimpleNamespace

    model = _TableModel(table)
    self = SimpleNamespace(model=model, accelerator=_Acc(), aux_loss_enabled=False, ld_alpha=None,
                           precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                           loss_weights=[1.0], beta=beta, label_smoothing=eps, use_weighting=False, _metrics=_metrics(),
                           _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    inputs = {"input_ids": input_ids, "attention_mask": attn, "completion_mask": cmask,
              "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    loss = P.DPOTrainer._compute_loss(self, model, inputs, return_outputs=False)
    return loss, self._metrics["train"]


def _dpo_vs_trl(P, dt, g, d, dd, loss_type, variant, eps_list, **ours_kw):
    from turborlhf.algo import dpo_loss, reduce_seq_loss

    for eps in eps_list:
        for beta in (0.1, 0.5):
            for B, L in [(1, 3), (3, 6), (6, 12)]:
                table, cmask, ids, attn = _dpo_batch(g, B, L, dt)
                ref_c, ref_r = -rand(g, B, dt=dt, scale=10) - 1, -rand(g, B, dt=dt, scale=10) - 1
                loss, met = _trl_dpo(P, loss_type, beta, eps, table, cmask, ids, attn, ref_c, ref_r)
                s = table.sum(1)
                lens = cmask.sum(1)
                kw = dict(ours_kw)
                if kw.pop("lengths", False):
                    kw.update(len_c_B=lens[:B], len_r_B=lens[B:])
                ours, st = dpo_loss(s[:B], s[B:], ref_c, ref_r, beta, variant, label_smoothing=eps, **kw)
                d.add(reduce_seq_loss(ours), loss)
                d.add(st["chosen_rewards"].mean(), met["rewards/chosen"][-1])
                d.add(st["rejected_rewards"].mean(), met["rewards/rejected"][-1])
                d.add(st["accuracy"], met["rewards/accuracies"][-1])
                d.add(st["margin"], met["rewards/margins"][-1])
                if dd is not None:
                    default, _ = dpo_loss(s[:B], s[B:], ref_c, ref_r, beta, variant)
                    dd.add(reduce_seq_loss(default), loss)


@case(TRL, "dpo_loss + reduce_seq_loss", "DPOTrainer._compute_loss (loss_type sigmoid; stand-in self and model, "
      "precomputed reference log-probs)", "variant sigmoid, beta 0.1, 0.5; loss, rewards/chosen|rejected|accuracies|"
      "margins", dtypes=("float64",))
def trl_dpo_sigmoid(P, dt, g, d, dd):
    _dpo_vs_trl(P, dt, g, d, None, "sigmoid", "sigmoid", [0.0])


@case(TRL, "dpo_loss + reduce_seq_loss", "DPOTrainer._compute_loss (loss_type robust)",
      "variant robust, label_smoothing 0.1, 0.3", dtypes=("float64",))
def trl_dpo_robust(P, dt, g, d, dd):
    _dpo_vs_trl(P, dt, g, d, None, "robust", "robust", [0.1, 0.3])


@case(TRL, "dpo_loss + reduce_seq_loss", "DPOTrainer._compute_loss (loss_type ipo)",
      "variant ipo, ipo_normalize_by_length=True, len_c_B/len_r_B = completion-token counts",
      doc="docs/algorithms/dpo.md", default_note="IPO on summed log-probs (author code, OpenRLHF)",
      dtypes=("float64",))
def trl_dpo_ipo(P, dt, g, d, dd):
    _dpo_vs_trl(P, dt, g, d, dd, "ipo", "ipo", [0.0], ipo_normalize_by_length=True, lengths=True)


@case(TRL, "dpo_loss(reference_free=True)", "trl.experimental.cpo.CPOTrainer.cpo_loss (alpha 0; stand-in self)",
      "variant sigmoid (label_smoothing 0, 0.1) / ipo; the reference log-probs passed are ignored; rewards "
      "compared with zero reference log-probs", dtypes=("float64",))
def trl_cpo(P, dt, g, d, dd):
    from types import SimpleNamespace

    import torch

    from turborlhf.algo import dpo_loss

    for loss_type, variant, eps in [("sigmoid", "sigmoid", 0.0), ("sigmoid", "cdpo", 0.1), ("ipo", "ipo", 0.0)]:
        for beta in (0.1, 0.5):
            self = SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=eps, loss_type=loss_type, simpo_gamma=0.5,
                                   accelerator=_Acc())
            for B in (1, 3, 8, 33):
                pc, pr, rc, rr = _pairs(g, B, dt)
                losses, cr, rj = P.CPOTrainer.cpo_loss(self, pc, pr)
                ours, _ = dpo_loss(pc, pr, rc, rr, beta, variant, label_smoothing=eps, reference_free=True)
                d.add(ours, losses)
                _, st = dpo_loss(pc, pr, torch.zeros_like(pc), torch.zeros_like(pr), beta, variant,
                                 label_smoothing=eps, reference_free=True)
                d.add(st["chosen_rewards"], cr)
                d.add(st["rejected_rewards"], rj)


@case(TRL, "kto_kl_estimate + kto_loss + reduce_seq_loss", "KTOTrainer._compute_loss (loss_type kto; stand-in "
      "self and model, precomputed reference log-probs)", "beta 0.1, 0.5; weights (1,1), (1.33,1); all-desirable "
      "batch; loss, kl, rewards/chosen|rejected", dtypes=("float64",))
def trl_kto(P, dt, g, d, dd):
    import functools
    from types import SimpleNamespace

    from turborlhf.algo import kto_kl_estimate, kto_loss, reduce_seq_loss

    for beta, wd, wu in [(0.1, 1.0, 1.0), (0.5, 1.33, 1.0)]:
        for k, (N, L) in enumerate([(2, 4), (5, 7), (8, 12), (3, 5)]):
            label = rand(g, N) < 0.5
            label[0] = True
            if k < 3 and N > 1:
                label[1] = False                        # the last batch may be all desirable
            table, cmask, ids, attn = _dpo_batch(g, N, L, dt)          # 2N rows: N main, N KL
            kl_shift = 0.3 if k % 2 else -0.3
            ref_all = table.sum(1) + randn(g, 2 * N, dt=dt, scale=0.5) + kl_shift
            model = _TableModel(table)
            self = SimpleNamespace(model=model, accelerator=_Acc(), calculate_KL=True, precompute_ref_logps=True,
                                   loss_type="kto", beta=beta, desirable_weight=wd, undesirable_weight=wu,
                                   aux_loss_enabled=False, _metrics=_metrics(), _total_train_tokens=0, _tp_size=1)
            self._compute_kl_logps = functools.partial(P.KTOTrainer._compute_kl_logps, self)
            inputs = {"input_ids": ids[:N], "attention_mask": attn[:N], "completion_mask": cmask[:N],
                      "KL_input_ids": ids[N:], "KL_attention_mask": attn[N:], "KL_completion_mask": cmask[N:],
                      "label": label, "ref_logps": ref_all[:N], "ref_KL_logps": ref_all[N:]}
            loss = P.KTOTrainer._compute_loss(self, model, inputs, return_outputs=False)
            met = self._metrics["train"]
            s = table.sum(1)
            pi, pkl = s[:N], s[N:]
            z0 = kto_kl_estimate(pkl, ref_all[N:])
            ours, st = kto_loss(pi[label], ref_all[:N][label], pi[~label], ref_all[:N][~label], z0, beta, wd, wu)
            d.add(reduce_seq_loss(ours), loss)
            d.add(z0, met["kl"][-1])
            d.add(st["chosen_rewards"].mean(), met["rewards/chosen"][-1])
            if (~label).any():
                d.add(st["rejected_rewards"].mean(), met["rewards/rejected"][-1])


@case(TRL, "pairwise_rm_loss + reduce_seq_loss", "RewardTrainer.compute_loss (stand-in self and model)",
      "margin none / given; center_coef None / 0.01; loss, accuracy, margin")
def trl_rm(P, dt, g, d, dd):
    from types import SimpleNamespace

    import torch

    from turborlhf.algo import pairwise_rm_loss, reduce_seq_loss

    for center in (None, 0.01):
        for with_margin in (False, True):
            for B in (1, 3, 8, 33):
                c, r = randn(g, B, dt=dt, scale=2), randn(g, B, dt=dt, scale=2)
                c[0] = r[0] if B > 1 else c[0]                 # a tie counts as wrong
                margin = randn(g, B, dt=dt).abs() if with_margin else None
                self = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_Acc(), _metrics=_metrics(),
                                       args=SimpleNamespace(center_rewards_coefficient=center),
                                       _total_train_tokens=0, _tp_size=1)
                inputs = {"input_ids": torch.zeros(2 * B, 3, dtype=torch.long),
                          "attention_mask": torch.ones(2 * B, 3, dtype=torch.long)}
                if margin is not None:
                    inputs["margin"] = margin
                model = lambda **kw: SimpleNamespace(logits=torch.cat([c, r])[:, None])  # noqa: E731
                loss = P.RewardTrainer.compute_loss(self, model, inputs)
                ours, st = pairwise_rm_loss(c, r, margin, center_coef=center)
                met = self._metrics["train"]
                d.add(reduce_seq_loss(ours), loss)
                d.add(st["accuracy"], met["accuracy"][-1])
                d.add(st["margin"], met["margin"][-1])


def _grpo_inputs(g, B, T, dt, empty=0):
    import torch

    m = rmask(g, B, T, empty=empty)
    old = -rand(g, B, T, dt=dt, scale=2.0)
    delta = randn(g, B, T, dt=dt, scale=0.3)
    big = rand(g, B, T) < 0.15
    delta = torch.where(big, delta + 1.5 * torch.sign(delta), delta)
    logp = old + delta
    ref = logp + randn(g, B, T, dt=dt, scale=0.3)
    adv = randn(g, B, dt=dt)
    js = 3.0   # TRL does not clamp the log-ratio: keep the padding junk small enough for exp()
    return m, junk(logp, m, g, js), junk(old, m, g, js), junk(ref, m, g, js), adv


def _trl_grpo(P, loss_type, beta, el, eh, delta, m, logp, old, ref, adv, max_len):
    from types import SimpleNamespace

    import torch

    B, T = logp.shape

    def per_token(model, input_ids, attention_mask, logits_to_keep, compute_entropy=True, compute_aux_loss=False, **kw):
        return logp, torch.zeros_like(logp), None

    self = SimpleNamespace(_get_per_token_logps_and_entropies=per_token, top_entropy_quantile=1.0,
                           off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
                           args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1),
                           loss_type=loss_type, epsilon_low=el, epsilon_high=eh, use_vllm=False,
                           vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
                           current_gradient_accumulation_steps=1, max_completion_length=max_len, accelerator=_Acc(),
                           _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=_metrics())
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": m.long(),
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": m.sum().to(logp.dtype)}
    if beta:
        inputs["ref_per_token_logps"] = ref
    loss = P.GRPOTrainer._compute_loss(self, None, inputs)
    return loss, self._metrics["train"]


def _grpo_vs_trl(P, dt, g, d, dd, loss_type, mode, empty=0):
    from turborlhf.algo import kl_estimate, masked_mean, ppo_policy_loss, reduce_loss, sequence_to_token

    for beta in (0.0, 0.04):
        for el, eh, delta in [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0)]:
            for B, T in [(1, 1), (4, 5), (8, 16)]:
                if empty and B < 3:
                    continue
                m, logp, old, ref, adv = _grpo_inputs(g, B, T, dt, empty=empty)
                loss, met = _trl_grpo(P, loss_type, beta, el, eh, delta, m, logp, old, ref, adv, T + 2)
                ours_BT, st = ppo_policy_loss(logp, old, sequence_to_token(adv, m), m, el, eh, dual_clip=delta)
                if beta:
                    kl_BT = kl_estimate(logp, ref, "k3")
                    ours_BT = ours_BT + beta * kl_BT
                    d.add(masked_mean(kl_BT, m), met["kl"][-1])
                kw = {"token_sum_norm": {"max_len": T + 2}, "token_mean": {"num_tokens": m.sum()},
                      "seq_mean_token_mean": {"num_seqs": B} if empty else {}}[mode]
                d.add(reduce_loss(ours_BT, m, mode, **kw), loss)
                d.add(st["clipfrac"], met["clip_ratio/region_mean"][-1])
                if dd is not None:
                    dd.add(reduce_loss(ours_BT, m, mode), loss)


_GRPO_COMMON = ("beta 0 / 0.04 (+beta*k3 kl_estimate); eps (0.2,0.2), (0.2,0.28); TRL delta=3 as dual_clip=3; "
                "loss, clip_ratio/region_mean=clipfrac, kl")


@case(TRL, "ppo_policy_loss + kl + reduce_loss(seq_mean_token_mean)", "GRPOTrainer._compute_loss (loss_type grpo; "
      "stand-in self)", _GRPO_COMMON)
def trl_grpo_grpo(P, dt, g, d, dd):
    _grpo_vs_trl(P, dt, g, d, None, "grpo", "seq_mean_token_mean")


@case(TRL, "ppo_policy_loss + kl + reduce_loss(token_mean)", "GRPOTrainer._compute_loss (loss_type bnpo)",
      _GRPO_COMMON)
def trl_grpo_bnpo(P, dt, g, d, dd):
    _grpo_vs_trl(P, dt, g, d, None, "bnpo", "token_mean")


@case(TRL, "ppo_policy_loss + kl + reduce_loss(token_mean, num_tokens)", "GRPOTrainer._compute_loss (loss_type "
      "dapo, the default; num_items_in_batch = tokens)", _GRPO_COMMON)
def trl_grpo_dapo(P, dt, g, d, dd):
    _grpo_vs_trl(P, dt, g, d, None, "dapo", "token_mean")


@case(TRL, "ppo_policy_loss + kl + reduce_loss(token_sum_norm, max_len)", "GRPOTrainer._compute_loss (loss_type "
      "dr_grpo; max_completion_length = T+2 = max_len)", _GRPO_COMMON)
def trl_grpo_dr(P, dt, g, d, dd):
    _grpo_vs_trl(P, dt, g, d, None, "dr_grpo", "token_sum_norm")


@case(TRL, "reduce_loss(seq_mean_token_mean) with an empty completion", "GRPOTrainer._compute_loss (loss_type grpo)",
      "num_seqs=B (TRL counts a fully masked completion as a 0-loss sequence)", doc="docs/algorithms/README.md",
      default_note="empty sequences are left out of the mean (OpenRLHF's aggregate_loss)")
def trl_grpo_empty(P, dt, g, d, dd):
    _grpo_vs_trl(P, dt, g, d, dd, "grpo", "seq_mean_token_mean", empty=1)


@case(TRL, "ppo_policy_loss on sequence sums (B, 1)", "RLOOTrainer._compute_loss (stand-in self)",
      "logp/old = masked_sum over tokens as (B,1), mask of ones, token_mean = mean over sequences; eps (0.2,0.2), "
      "(0.2,0.28)", doc="docs/algorithms/critic_free.md",
      default_note="token-level ratio per token (OpenRLHF), as our trainers use it")
def trl_rloo(P, dt, g, d, dd):
    from types import SimpleNamespace

    import torch

    from turborlhf.algo import masked_sum, ppo_policy_loss, reduce_loss, sequence_to_token

    for el, eh in [(0.2, 0.2), (0.2, 0.28)]:
        for B, T in [(1, 1), (4, 5), (8, 16)]:
            m, logp, old, _, adv = _grpo_inputs(g, B, T, dt)
            old_seq = masked_sum(old, m, dim=1)

            def per_token(model, *a, **kw):
                return logp, torch.zeros_like(logp), None

            self = SimpleNamespace(_get_per_token_logps_and_entropies=per_token, aux_loss_enabled=False,
                                   epsilon_low=el, epsilon_high=eh, model=SimpleNamespace(training=True),
                                   accelerator=_Acc(), _metrics=_metrics())
            inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long),
                      "prompt_mask": torch.ones(B, 2, dtype=torch.long),
                      "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": m.long(),
                      "old_logps": old_seq, "advantages": adv}
            loss = P.RLOOTrainer._compute_loss(self, None, inputs)
            ones = torch.ones(B, 1, dtype=torch.bool)
            seq, _ = ppo_policy_loss(masked_sum(logp, m, dim=1)[:, None], old_seq[:, None], adv[:, None], ones, el, eh)
            d.add(reduce_loss(seq, ones), loss)
            tok, _ = ppo_policy_loss(logp, old, sequence_to_token(adv, m), m, el, eh)
            dd.add(reduce_loss(tok, m), loss)


# ============================================================================== TRL 1.12.0 (PPO helpers)


@case(TRL12, "masked_mean", "trl.experimental.ppo.ppo_trainer.masked_mean", "axis None and 1 (non-empty rows)")
def trl12_masked_mean(P, dt, g, d, dd):
    from turborlhf.algo import masked_mean

    for B, T in SHAPES:
        m = rmask(g, B, T)
        x = junk(randn(g, B, T, dt=dt), m, g)
        d.add(masked_mean(x, m), P.ppo.masked_mean(x, m.to(x.dtype)))
        d.add(masked_mean(x, m, dim=1), P.ppo.masked_mean(x, m.to(x.dtype), axis=1))


_SHAPES2 = [(1, 2), (2, 3), (5, 8), (8, 33)]   # >= 2 valid tokens (unbiased variance)


@case(TRL12, "masked_var", "trl.experimental.ppo.ppo_trainer.masked_var", "unbiased=True (TRL's default); "
      "also both with unbiased=False", doc="docs/algorithms/ppo.md",
      default_note="unbiased=False (biased, as OpenRLHF and the Ziegler et al. author code)")
def trl12_masked_var(P, dt, g, d, dd):
    from turborlhf.algo import masked_var

    for B, T in _SHAPES2:
        m = rmask(g, B, T)
        x = junk(randn(g, B, T, dt=dt, scale=2), m, g)
        mf = m.to(x.dtype)
        d.add(masked_var(x, m, unbiased=True), P.ppo.masked_var(x, mf))
        d.add(masked_var(x, m, unbiased=False), P.ppo.masked_var(x, mf, unbiased=False))
        dd.add(masked_var(x, m), P.ppo.masked_var(x, mf))


@case(TRL12, "masked_whiten", "trl.experimental.ppo.ppo_trainer.masked_whiten", "unbiased=True; shift_mean True "
      "and False; valid positions (TRL's caller zero-fills the padding, ours does it itself)",
      doc="docs/algorithms/ppo.md", default_note="unbiased=False (biased variance, OpenRLHF)")
def trl12_masked_whiten(P, dt, g, d, dd):
    from turborlhf.algo import masked_whiten

    for shift in (True, False):
        for B, T in _SHAPES2:
            m = rmask(g, B, T)
            x = junk(randn(g, B, T, dt=dt, scale=2) + 0.5, m, g)
            peer = P.ppo.masked_whiten(x, m.to(x.dtype), shift_mean=shift)
            d.add(masked_whiten(x, m, shift_mean=shift, unbiased=True), peer, mask=m)
            dd.add(masked_whiten(x, m, shift_mean=shift), peer, mask=m)
