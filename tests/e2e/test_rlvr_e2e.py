"""RLVR options of `turborlhf ppo` on the tiny GRPO config: GSPO / CISPO policy losses, DAPO dynamic
sampling and overlong shaping / filtering, the engine/trainer mismatch metrics, TIS/MIS and the alarm."""
import math
import warnings

import pytest
import torch

from tests.e2e.helpers import REPO, max_weight_diff, metrics, run_cli, weights
from turborlhf.cli import main
from turborlhf.config import ConfigError, PPOConfig, load_config
from turborlhf.trainers.ppo.rlvr import RolloutMismatchError, RolloutMismatchWarning

GRPO_YAML = REPO / "configs/tiny/grpo.yaml"


def _args(tiny_model, tiny_data, out, *extra):
    return [f"actor.name_or_path={tiny_model}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}",
            "data.max_samples=32", f"output_dir={out}", "log.tensorboard=false", "train.threads=1", *extra]


def _run(tiny_model, tiny_data, out, *extra):
    run_cli("ppo", "--config", GRPO_YAML, *_args(tiny_model, tiny_data, out, *extra))
    return [r for r in metrics(out) if "rollout/reward_mean" in r]


def _rule(tmp_path, body: str) -> str:
    f = tmp_path / "rule.py"
    f.write_text(f"def score(prompts, responses):\n    return {body}\n")
    return f"rewards=[{{kind: function, path: {f}:score}}]"


# ----------------------------------------------------------------------------------------------
# Config: every bad combination is a one-line error naming the field
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (["algo.dynamic_sampling=true", "algo.advantage_estimator=reinforce_pp"], "algo.dynamic_sampling"),
    (["algo.policy_loss=gspo", "algo.loss_reduction=token_mean"], "algo.loss_reduction"),
    (["algo.policy_loss=cispo", "algo.dual_clip=3.0"], "algo.dual_clip"),
    (["algo.overlong_buffer_len=8"], "algo.overlong_buffer_len"),                 # = rollout.max_new_tokens
    (["algo.rollout_is=tis", "rollout.top_k=5"], "algo.rollout_is"),
    (["algo.mismatch_kl_alarm=0.01", "rollout.top_p=0.9"], "algo.mismatch_kl_alarm"),
    (["algo.rollout_is_threshold=0.5"], "algo.rollout_is_threshold"),
    (["algo.dynamic_sampling_max_tries=0"], "algo.dynamic_sampling_max_tries"),
    (["algo.policy_loss=reinforce"], "algo.policy_loss"),
    (["algo.old_logprobs=rollout", "rollout.temperature=0.7"], "algo.old_logprobs"),
    (["algo.old_logprobs=rollout", "algo.rollout_is=tis"], "algo.old_logprobs"),
    (["algo.old_logprobs=rollout", "algo.mismatch_kl_alarm=0.1"], "algo.old_logprobs"),
    (["algo.old_logprobs=rollout", "rollout.tool=calculator"], "algo.old_logprobs"),
])
def test_bad_combinations_name_the_field(overrides, field, tmp_path):
    args = _args("m", tmp_path, tmp_path / "x", "reward_model=rm", *overrides)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(PPOConfig, GRPO_YAML, args)


def test_defaults_keep_the_old_behaviour():
    A = PPOConfig.model_fields["algo"].default_factory()
    assert (A.policy_loss, A.dynamic_sampling, A.overlong_buffer_len, A.overlong_filter, A.rollout_is,
            A.mismatch_kl_alarm) == ("ppo", False, 0, False, "none", None)


# ----------------------------------------------------------------------------------------------
# GSPO and CISPO: they run, log, and train differently from the PPO clip
# ----------------------------------------------------------------------------------------------

def test_gspo_and_cispo_run_and_differ_from_ppo(tiny_model, tiny_rm, tiny_data, tmp_path):
    # a clip range small enough that the second mini-batch's ratios leave it: inside it CISPO's
    # gradient sg(r)·A·∇log π equals the PPO clip's r·A·∇log π exactly
    rm, clip = f"reward_model={tiny_rm}", "algo.eps_clip=0.0001"
    _run(tiny_model, tiny_data, tmp_path / "ppo", rm, clip)
    base = weights(tmp_path / "ppo")
    for loss in ("gspo", "cispo"):
        rows = _run(tiny_model, tiny_data, tmp_path / loss, rm, clip, f"algo.policy_loss={loss}")
        assert len(rows) == 2
        for r in rows:
            for k in ("policy/loss", "policy/clipfrac", "policy/approx_kl", "policy/grad_norm", "rollout/mismatch_kl"):
                assert math.isfinite(r[k]), (loss, k, r)
        # the first of the two mini-batches is on-policy (same gradient for all three); the second is not
        assert max_weight_diff(base, weights(tmp_path / loss)) > 1e-7, loss


# ----------------------------------------------------------------------------------------------
# Engine/trainer mismatch: always logged; TIS/MIS weights; the alarm
# ----------------------------------------------------------------------------------------------

def test_mismatch_metrics_and_rollout_is(tiny_model, tiny_rm, tiny_data, tmp_path):
    rm = f"reward_model={tiny_rm}"
    same = _run(tiny_model, tiny_data, tmp_path / "fp32", rm)         # fp32 engine, fp32 actor: they agree
    assert all(r["rollout/mismatch_kl"] < 1e-6 and abs(r["rollout/mismatch_max_ratio"] - 1) < 1e-3 for r in same)
    assert "rollout/is_weight_mean" not in same[0]
    bf16 = _run(tiny_model, tiny_data, tmp_path / "bf16", rm, "rollout.dtype=bf16")   # a bf16 engine does not
    for a, b in zip(same, bf16):         # measured: ~3e-7 nats/token and ratios up to 1.002 vs ~5e-14 and 1 + 5e-7
        assert b["rollout/mismatch_kl"] > 1000 * a["rollout/mismatch_kl"] and b["rollout/mismatch_max_ratio"] > 1.0002
    for mode, level in (("tis", "token"), ("mis", "sequence")):
        out = tmp_path / mode
        rows = _run(tiny_model, tiny_data, out, rm, "rollout.dtype=bf16", f"algo.rollout_is={mode}",
                    f"algo.rollout_is_level={level}", "algo.rollout_is_threshold=1.0")
        for r in rows:
            assert 0 < r["rollout/is_clipfrac"] < 1 and 0 < r["rollout/is_weight_mean"] < 1, (mode, r)
        # same rollouts as the uncorrected bf16 run (same seeds), different update
        assert rows[0]["rollout/mismatch_kl"] == pytest.approx(bf16[0]["rollout/mismatch_kl"])
        assert max_weight_diff(weights(tmp_path / "bf16"), weights(out)) > 1e-7


def test_fp32_engine_on_bf16_weights(tiny_model, tiny_rm, tiny_data, tmp_path):
    """``rollout.weight_dtype`` auto (or bf16) with an fp32 engine: the run records the choice,
    every push passes fp32's 0.001 sync tolerance (the trainer's side rounds alike), and the
    mismatch metrics see the rounding: far above the exact engine's, far below a bf16 engine's."""
    import json

    from turborlhf.rollout import kernels
    k = kernels.load(warn=False)
    if k is None or torch.float32 not in k.linear_dtypes:
        pytest.skip("no fp32 kernel linears here: auto keeps fp32 weights")
    rm = f"reward_model={tiny_rm}", "actor.device=cpu"           # FastEngine's kernels: the CPU's
    exact = _run(tiny_model, tiny_data, tmp_path / "fp32", *rm)
    rows = _run(tiny_model, tiny_data, tmp_path / "w16", *rm, "rollout.weight_dtype=auto")
    hw = json.loads((tmp_path / "w16" / "hardware.json").read_text())["choices"]
    assert hw["rollout.weight_dtype"]["value"] == "bf16" and hw["rollout.dtype"]["value"] == "fp32"
    bf16 = _run(tiny_model, tiny_data, tmp_path / "bf16", *rm, "rollout.dtype=bf16")
    for a, b, c in zip(exact, rows, bf16):
        assert b["sync/logprob_mean_diff"] < 1e-4 and b["sync/logprob_mean_diff"] <= 1e-3
        assert 100 * a["rollout/mismatch_kl"] < b["rollout/mismatch_kl"] < c["rollout/mismatch_kl"]


def test_trainer_scores_at_the_sampling_temperature(tiny_model, tiny_rm, tiny_data, tmp_path):
    """At temperature 0.6 the fp32 engine's log-probs of its samples equal the trainer's (both of
    the tempered distribution); the trainer once scored at temperature 1, a mismatch KL of ~0.1
    nats/token here that TIS would have "corrected"."""
    rows = _run(tiny_model, tiny_data, tmp_path / "t06", f"reward_model={tiny_rm}", "rollout.temperature=0.6",
                "algo.rollout_is=tis", "train.max_steps=1")
    assert rows[0]["rollout/mismatch_kl"] < 1e-6 and abs(rows[0]["rollout/mismatch_max_ratio"] - 1) < 1e-3, rows[0]
    assert abs(rows[0]["rollout/is_weight_mean"] - 1) < 1e-4


def test_old_logprobs_from_the_engine(tiny_model, tiny_rm, tiny_data, tmp_path, monkeypatch):
    """``algo.old_logprobs: rollout`` skips the actor's experience forward: with an fp32 engine its
    temperature-1 log-probs are the trainer's (the run trains to the same weights), and no
    engine-vs-itself mismatch is logged. Its rollouts sample with min_new_tokens, whose masked
    processed log-probs would be wrong here."""
    from turborlhf.trainers.ppo.actor import ActorWorker

    calls = []
    forward = ActorWorker.logprobs
    monkeypatch.setattr(ActorWorker, "logprobs", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    rm, eos = f"reward_model={tiny_rm}", "rollout.min_new_tokens=3"
    base = _run(tiny_model, tiny_data, tmp_path / "trainer", rm, eos)
    assert len(calls) == 2 and "rollout/mismatch_kl" in base[0]           # one forward per step
    calls.clear()
    rows = _run(tiny_model, tiny_data, tmp_path / "rollout", rm, eos, "algo.old_logprobs=rollout")
    assert not calls and "rollout/mismatch_kl" not in rows[0]
    for a, b in zip(base, rows):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]          # same samples
        assert b["policy/kl"] == pytest.approx(a["policy/kl"], abs=1e-5)
    assert max_weight_diff(weights(tmp_path / "trainer"), weights(tmp_path / "rollout")) < 1e-5


def test_mismatch_alarm_warns_or_stops(tiny_model, tiny_rm, tiny_data, tmp_path):
    common = [f"reward_model={tiny_rm}", "rollout.dtype=bf16", "algo.mismatch_kl_alarm=1e-9", "train.max_steps=1"]
    with pytest.warns(RolloutMismatchWarning, match="algo.mismatch_kl_alarm"):
        _run(tiny_model, tiny_data, tmp_path / "warn", *common)
    with pytest.raises(RolloutMismatchError, match=r"rollout/mismatch_kl = .* > algo.mismatch_kl_alarm"):
        main(["ppo", "--config", str(GRPO_YAML), *_args(tiny_model, tiny_data, tmp_path / "err", *common,
                                                         "algo.mismatch_kl_action=error"), "--debug"])
    assert not (tmp_path / "err" / "checkpoints").exists() or not any((tmp_path / "err" / "checkpoints").iterdir())
    # without --debug the CLI says it in one line with exit code 1 (a RunError)
    assert main(["ppo", "--config", str(GRPO_YAML), *_args(tiny_model, tiny_data, tmp_path / "err1", *common,
                                                           "algo.mismatch_kl_action=error")]) == 1


# ----------------------------------------------------------------------------------------------
# DAPO dynamic sampling
# ----------------------------------------------------------------------------------------------

# prompts whose rendered text has even length always score 0 (their groups are dropped); others
# score by their response text
HALF_CONSTANT = "[0.0 if len(p) % 2 == 0 else float(sum(map(ord, r)) % 7) for p, r in zip(prompts, responses)]"


def _collect_two_constant_two_live(tiny_model, tiny_data, tmp_path, *extra):
    """One step's `collect_rollouts` under HALF_CONSTANT for two prompts whose groups are constant
    (dropped) and two with signal → (rollouts, G, parity of every prompt, the odd prompts)."""
    from turborlhf.data.loaders import load_prompts
    from turborlhf.data.tokenize import encode_prompt
    from turborlhf.models.load import load_tokenizer
    from turborlhf.trainers.ppo import build_roles
    from turborlhf.trainers.ppo.rlvr import collect_rollouts

    cfg = load_config(PPOConfig, GRPO_YAML, _args(tiny_model, tiny_data, tmp_path / "x", _rule(tmp_path, HALF_CONSTANT),
                                                  "reward_model=null", "algo.dynamic_sampling=true",
                                                  "algo.prompts_per_step=4", *extra))
    tok = load_tokenizer(str(tiny_model))
    texts = load_prompts(tiny_data / "train_prompts.jsonl", tok)[:32]
    prompt_ids = [encode_prompt(tok, p, cfg.rollout.max_prompt_len) for p in texts]
    parity = [len(tok.decode(p)) % 2 for p in prompt_ids]             # the rule sees the rendered prompt
    even = [i for i, p in enumerate(parity) if p == 0]
    odd = [i for i, p in enumerate(parity) if p == 1]
    assert len(even) >= 2 and len(odd) >= 6
    cluster = build_roles(cfg, None)
    try:
        ro = collect_rollouts(cluster, cfg, tok, prompt_ids, even[:2] + odd[:2], step=0)
    finally:
        cluster.shutdown()
    return cfg, ro, parity, odd


def test_dynamic_sampling_keeps_only_groups_with_signal(tiny_model, tiny_data, tmp_path):
    from turborlhf.trainers.ppo.rlvr import filter_scores

    cfg, ro, parity, odd = _collect_two_constant_two_live(tiny_model, tiny_data, tmp_path)
    G = cfg.algo.n_samples_per_prompt
    assert len(ro.responses) == 4 * G and len(ro.scores[0]) == 4 * G
    assert ro.metrics["rollout/groups_dropped"] >= 2 and ro.metrics["rollout/groups_filled"] == 0
    assert ro.metrics["rollout/sampling_rounds"] >= 2 and ro.metrics["rollout/groups_trained"] == 4
    s = filter_scores(cfg, ro.scores[0], ro).view(4, G)
    assert bool(((s.amax(1) - s.amin(1)) > 0).all())                      # every kept group has signal
    assert all(parity[i] == 1 for i in ro.prompt_index)                   # no constant (even) prompt survived
    assert ro.prompt_index[:2 * G] == [i for i in odd[:2] for _ in range(G)]   # the step's own first


@pytest.mark.parametrize("fill", [True, False])
def test_dynamic_sampling_short_batch_filled_or_not(tiny_model, tiny_data, tmp_path, fill):
    """One round only: two of the four groups are kept; the batch is filled with the two dropped
    ones (zero advantage) or, with dynamic_sampling_fill=false, trains on the two kept alone."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg, ro, parity, odd = _collect_two_constant_two_live(
            tiny_model, tiny_data, tmp_path, "algo.dynamic_sampling_max_tries=1", f"algo.dynamic_sampling_fill={fill}")
    G = cfg.algo.n_samples_per_prompt
    assert ro.metrics["rollout/groups_dropped"] == 2 and ro.metrics["rollout/sampling_rounds"] == 1
    assert ro.metrics["rollout/groups_filled"] == (2 if fill else 0)
    assert ro.metrics["rollout/groups_trained"] == len(ro.responses) / G == (4 if fill else 2)
    assert ro.prompt_index[:2 * G] == [i for i in odd[:2] for _ in range(G)]
    assert all(parity[i] == 0 for i in ro.prompt_index[2 * G:])          # the fillers: constant groups
    assert any("filling the batch" in str(w.message) for w in caught) == fill


def test_dynamic_sampling_end_to_end_and_cap(tiny_model, tiny_data, tmp_path):
    rows = _run(tiny_model, tiny_data, tmp_path / "ds", _rule(tmp_path, HALF_CONSTANT), "reward_model=null",
                "algo.dynamic_sampling=true", "algo.kl_coef=0")
    assert len(rows) == 2 and all(r["rollout/groups_filled"] == 0 for r in rows)
    assert all(r["rollout/sampling_rounds"] >= 1 for r in rows) and all(math.isfinite(r["policy/loss"]) for r in rows)
    # every score equal (no missing-EOS penalty to tell them apart): every round drops everything, the cap
    # fills the batch (and warns)
    with pytest.warns(RuntimeWarning, match="dynamic sampling"):
        capped = _run(tiny_model, tiny_data, tmp_path / "cap", _rule(tmp_path, "[1.0] * len(responses)"),
                      "reward_model=null", "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_tries=3",
                      "algo.kl_coef=0", "algo.missing_eos_penalty=null")
    for r in capped:
        assert (r["rollout/groups_dropped"], r["rollout/sampling_rounds"], r["rollout/groups_filled"]) == (6, 3, 2)
    # dynamic_sampling_fill=false trains on the kept groups alone; with none kept it still fills
    with pytest.warns(RuntimeWarning, match="dynamic sampling"):
        unfilled = _run(tiny_model, tiny_data, tmp_path / "nofill", _rule(tmp_path, "[1.0] * len(responses)"),
                        "reward_model=null", "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_tries=1",
                        "algo.dynamic_sampling_fill=false", "algo.kl_coef=0", "algo.missing_eos_penalty=null")
    assert all((r["rollout/groups_filled"], r["rollout/groups_trained"]) == (2, 2) for r in unfilled)
    # some groups constant, one round: a step whose batch is short trains on fewer rows
    short = _run(tiny_model, tiny_data, tmp_path / "short", _rule(tmp_path, HALF_CONSTANT), "reward_model=null",
                 "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_tries=1", "algo.dynamic_sampling_fill=false",
                 "train.max_steps=4")
    trained = [r["rollout/groups_trained"] for r in short]
    assert trained == [2 - r["rollout/groups_dropped"] or 2 for r in short] and 1 in trained
    assert all(math.isfinite(r["policy/loss"]) for r in short)


def test_dynamic_sampling_logs_and_normalises_over_every_generated_row(tiny_model, tiny_data, tmp_path):
    """The logged rewards and the running normaliser (algo.normalize_reward) saw the kept rows
    alone: a step that dropped a group of its 2 (one round, no fill) counted 4 rows of its 8."""
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    out = tmp_path / "ds"
    rows = _run(tiny_model, tiny_data, out, _rule(tmp_path, HALF_CONSTANT), "reward_model=null",
                "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_tries=1", "algo.dynamic_sampling_fill=false",
                "algo.normalize_reward=true", "train.max_steps=4", "train.save_every=4")
    n = 2 * 4                                             # rows generated per step: 2 prompts × G
    assert len(rows) == 4 and 1 in [r["rollout/groups_trained"] for r in rows]
    stats = load_trainer_state(latest_checkpoint(out))["reward_stats"]
    assert stats["count"] == 4 * n
    assert stats["mean"] == pytest.approx(sum(r["rollout/reward_mean"] for r in rows) / 4, abs=1e-6)
    for r in rows:                                        # nothing dropped: one batch, one mean
        if r["rollout/groups_dropped"] == 0:
            assert r["rollout/reward_mean_trained"] == pytest.approx(r["rollout/reward_mean"])


# ----------------------------------------------------------------------------------------------
# DAPO overlong shaping and filtering
# ----------------------------------------------------------------------------------------------

def test_overlong_penalty_is_in_the_score(tiny_model, tiny_rm, tiny_data, tmp_path):
    rows = _run(tiny_model, tiny_data, tmp_path / "ol", f"reward_model={tiny_rm}", "algo.overlong_buffer_len=4",
                "algo.overlong_penalty_factor=2.0", "algo.missing_eos_penalty=0.5")
    for r in rows:
        assert r["rollout/overlong_penalty"] < 0
        # score = raw + overlong penalty − missing-EOS penalty (no clipping at these magnitudes)
        expected = r["rollout/reward_mean"] + r["rollout/overlong_penalty"] - 0.5 * (1 - r["rollout/eos_fraction"])
        assert r["rollout/score_mean"] == pytest.approx(expected, abs=1e-5)


def test_overlong_filter_masks_truncated_responses(tiny_model, tiny_rm, tiny_data, tmp_path):
    # min_new_tokens = max_new_tokens: EOS is never sampled, every response is truncated → no actor loss
    out = tmp_path / "filt"
    rows = _run(tiny_model, tiny_data, out, f"reward_model={tiny_rm}", "algo.overlong_filter=true",
                "rollout.min_new_tokens=8")
    for r in rows:
        assert r["rollout/overlong_filtered_frac"] == 1.0 and r["policy/loss"] == 0.0 and r["policy/grad_norm"] == 0.0
    assert max_weight_diff(weights(tiny_model), weights(out)) == 0.0
    # without the filter the same rollouts do train
    plain = tmp_path / "plain"
    _run(tiny_model, tiny_data, plain, f"reward_model={tiny_rm}", "rollout.min_new_tokens=8")
    assert max_weight_diff(weights(tiny_model), weights(plain)) > 1e-7


# ----------------------------------------------------------------------------------------------
# Resume: with dynamic sampling (refill prompts and seeds per step and round) and the rest on,
# a run stopped after step 1 and resumed ends with the same actor
# ----------------------------------------------------------------------------------------------

def test_rlvr_options_resume_exactly(tiny_model, tiny_data, tmp_path):
    from tests.e2e.helpers import rewind_to

    out = tmp_path / "resume"
    extra = [_rule(tmp_path, HALF_CONSTANT), "reward_model=null", "algo.dynamic_sampling=true",
             "algo.overlong_buffer_len=3", "algo.rollout_is=tis",
             "algo.policy_loss=gspo", "rollout.dtype=bf16", "train.max_steps=3", "train.save_every=1",
             "train.keep_checkpoints=3"]
    rows = _run(tiny_model, tiny_data, out, *extra)
    assert len(rows) == 3 and sum(r["rollout/groups_dropped"] for r in rows[1:]) > 0     # refills after step 1
    final = weights(out)
    assert max_weight_diff(weights(tiny_model), final) > 1e-7
    rewind_to(out, 1)
    _run(tiny_model, tiny_data, out, *extra, "--resume")
    assert max_weight_diff(final, weights(out)) < 1e-6


# ----------------------------------------------------------------------------------------------
# Rollout tools (rollout.tool): the tokens a tool writes get no actor loss and stay out of the
# engine-vs-trainer statistics
# ----------------------------------------------------------------------------------------------

def test_tool_tokens_leave_the_loss_and_the_mismatch_statistics():
    from turborlhf.config import PPOAlgoCfg, RolloutCfg
    from turborlhf.trainers.ppo.actor import policy_mask
    from turborlhf.trainers.ppo.experience import Experience
    from turborlhf.trainers.ppo.rlvr import attach_rollout_fields, pad_tool_mask, rlvr_metrics

    mask = torch.tensor([[1., 1., 1., 1.], [1., 1., 0., 0.]])
    old = torch.full((2, 4), -1.0) * mask
    engine = old.clone()
    engine[0, 1:3] = 0.0                                  # the tool's tokens: placeholder log-prob 0
    tool = pad_tool_mask([[False, True, True, False], [False]], 4)
    exp = Experience(torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6), 2, mask, torch.tensor([True, False]),
                     old, None, None, torch.zeros(2), torch.zeros(2), torch.zeros(2, 4))
    A = PPOAlgoCfg(rollout_is="tis", overlong_filter=True)
    attach_rollout_fields(exp, A, engine, tool)
    # row 0 loses its tool tokens, row 1 (no EOS) the whole row
    assert policy_mask(exp).tolist() == [[1., 0., 0., 1.], [0., 0., 0., 0.]]
    assert exp.tool_mask_BR.sum(-1).tolist() == [2, 0]

    class Cfg:          # rlvr_metrics reads cfg.algo and cfg.rollout (min_new_tokens; the overlong penalty)
        algo = A
        rollout = RolloutCfg()
    m = rlvr_metrics(exp, Cfg)
    assert m["rollout/mismatch_kl"] == 0.0 and m["rollout/mismatch_max_ratio"] == 1.0
    assert m["rollout/overlong_filtered_frac"] == 0.5
    assert m["rollout/is_weight_mean"] == 1.0 and m["rollout/tool_tokens_mean"] == 1.0


def test_min_new_tokens_positions_are_not_a_mismatch_but_keep_their_is_weight():
    """The engine samples the first min_new_tokens tokens with EOS masked: its log-prob there is
    log π − log(1 − π(EOS)) by design, which must not read as engine/trainer drift."""
    from types import SimpleNamespace

    from turborlhf.config import PPOAlgoCfg
    from turborlhf.trainers.ppo.experience import Experience
    from turborlhf.trainers.ppo.rlvr import attach_rollout_fields, mismatch_alarm, rlvr_metrics

    mask = torch.ones(2, 5)
    old = torch.full((2, 5), -1.0)
    engine = old.clone()
    engine[:, :2] -= math.log(1 - 0.9)                    # π(EOS) = 0.9 masked out at positions 0, 1
    exp = Experience(torch.zeros(2, 7, dtype=torch.long), torch.ones(2, 7), 2, mask, torch.tensor([True, True]),
                     old, None, None, torch.zeros(2), torch.zeros(2), torch.zeros(2, 5))
    A = PPOAlgoCfg(rollout_is="tis", rollout_is_threshold=2.0, mismatch_kl_alarm=1e-6, mismatch_kl_action="error")
    attach_rollout_fields(exp, A, engine)
    masked = SimpleNamespace(algo=A, rollout=SimpleNamespace(min_new_tokens=2))
    m = rlvr_metrics(exp, masked)
    assert m["rollout/mismatch_kl"] == 0.0 and m["rollout/mismatch_min_ratio"] == 1.0
    assert mismatch_alarm(exp, masked, 0) == 0.0
    # the IS weights still see the masked positions (ρ = 0.1 there): the sampling distribution was μ
    assert exp.is_weight_BR[:, :2] == pytest.approx(torch.full((2, 2), 0.1), rel=1e-5)
    unmasked = SimpleNamespace(algo=A, rollout=SimpleNamespace(min_new_tokens=0))
    assert rlvr_metrics(exp, unmasked)["rollout/mismatch_min_ratio"] == pytest.approx(0.1, rel=1e-5)
    with pytest.raises(RolloutMismatchError):
        mismatch_alarm(exp, unmasked, 0)


@pytest.mark.parametrize("side", ["engine", "trainer"])
def test_a_nan_mismatch_trips_the_alarm(side):
    """A NaN log-prob on either side makes the mismatch KL NaN, which `kl > alarm` never catches:
    the alarm must warn or stop as configured rather than let the run go on silently."""
    from types import SimpleNamespace

    from turborlhf.config import PPOAlgoCfg
    from turborlhf.trainers.ppo.experience import Experience
    from turborlhf.trainers.ppo.rlvr import mismatch_alarm

    old, engine = torch.full((2, 5), -1.0), torch.full((2, 5), -1.0)
    (engine if side == "engine" else old)[1, 3] = float("nan")
    exp = Experience(torch.zeros(2, 7, dtype=torch.long), torch.ones(2, 7), 2, torch.ones(2, 5),
                     torch.tensor([True, True]), old, None, None, torch.zeros(2), torch.zeros(2), torch.zeros(2, 5))
    exp.rollout_logp_BR = engine

    def cfg(action):
        A = PPOAlgoCfg(mismatch_kl_alarm=1.0, mismatch_kl_action=action)
        return SimpleNamespace(algo=A, rollout=SimpleNamespace(min_new_tokens=0))
    with pytest.raises(RolloutMismatchError, match="NaN"):
        mismatch_alarm(exp, cfg("error"), 0)
    with pytest.warns(RolloutMismatchWarning, match="NaN"):
        assert math.isnan(mismatch_alarm(exp, cfg("warn"), 0))
    no_alarm = SimpleNamespace(algo=PPOAlgoCfg(), rollout=SimpleNamespace(min_new_tokens=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(mismatch_alarm(exp, no_alarm, 0))       # no alarm set: only logged


class _FirstTokenTool:
    """Writes [7, 8] after each response's first sampled token."""

    def __init__(self, tokenizer):
        self.trigger_ids = frozenset(range(tokenizer.vocab_size + 64))

    def __call__(self, response_ids):
        return [7, 8] if len(response_ids) == 1 else None


def test_grpo_with_a_rollout_tool(tiny_model, tiny_data, tmp_path, monkeypatch):
    from turborlhf.trainers.ppo import roles

    monkeypatch.setattr(roles, "make_tool", lambda name, tok: _FirstTokenTool(tok))
    out = tmp_path / "tool"
    rows = _run(tiny_model, tiny_data, out, _rule(tmp_path, "[float(len(r) % 2) for r in responses]"),
                "reward_model=null", "rollout.tool=calculator", "algo.mismatch_kl_alarm=0.001",
                "algo.mismatch_kl_action=error")
    assert len(rows) == 2
    for r in rows:
        # 2 tool tokens a row (fewer only where EOS came first); the engine's placeholder log-prob 0
        # of those would read as a KL of several nats if they were compared
        assert 1.0 < r["rollout/tool_tokens_mean"] <= 2.0
        assert r["rollout/mismatch_kl"] < 1e-4
    assert max_weight_diff(weights(tiny_model), weights(out)) > 1e-7


def test_rollout_tool_needs_an_engine_with_a_hook(tmp_path):
    args = _args("m", tmp_path, tmp_path / "x", "reward_model=rm", "rollout.tool=calculator", "rollout.engine=vllm")
    with pytest.raises(ConfigError, match=r"rollout\.tool"):
        load_config(PPOConfig, GRPO_YAML, args)


def test_a_reward_function_that_scores_no_row_of_a_step(tiny_model, tiny_data, tmp_path, capsys):
    """TRL's None ("not scored") for every response of a step: that source's mean is left out of the
    step's metrics (no NaN, no null in metrics.jsonl) and the combined reward is the other sources';
    as the only source, its rows have no reward at all: the run stops with a one-line error naming the
    rows and the source (it named neither the source nor how many rows of the batch)."""
    f = tmp_path / "rules.py"
    f.write_text("def one(prompts, responses):\n    return [1.0 for r in responses]\n"
                 "def never(prompts, responses):\n    return [None for r in responses]\n")
    one, never = (f"{{kind: function, path: {f}:{n}, name: {n}}}" for n in ("one", "never"))
    rows = _run(tiny_model, tiny_data, tmp_path / "both", "reward_model=null", f"rewards=[{one}, {never}]",
                "train.max_steps=1")
    assert rows[0]["rollout/reward_one_mean"] == rows[0]["rollout/reward_mean"] == 1.0
    assert "rollout/reward_never_mean" not in rows[0]
    assert "null" not in (tmp_path / "both" / "metrics.jsonl").read_text()
    capsys.readouterr()
    args = _args(tiny_model, tiny_data, tmp_path / "alone", "reward_model=null", f"rewards=[{never}]",
                 "train.max_steps=1")
    assert main(["ppo", "--config", str(GRPO_YAML), *args]) == 1               # the reward worker's error
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "no reward source scored row(s) [0, 1, 2" in err[0] and " of 8 " in err[0]
    assert "('never' returned None there)" in err[0]
