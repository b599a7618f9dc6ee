"""`turborlhf ppo` variants on the tiny model: critic-free estimators, KL as a loss, PPO-ptx, EMA,
combined reward sources, and a remote reward model served by `turborlhf serve-rm`."""
import math
import re
import subprocess
import sys
import threading

import pytest
import torch

from tests.e2e.helpers import REPO, max_weight_diff, metrics, rewind_to, run_cli, weights
from turborlhf.cli import main
from turborlhf.config import ConfigError, PPOAlgoCfg, PPOConfig, load_config
from turborlhf.trainers.ppo import ADVANTAGE_ESTIMATORS
from turborlhf.trainers.ppo.actor import EmaModel

GRPO_YAML = REPO / "configs/tiny/grpo.yaml"


def _args(tiny_model, tiny_data, out, reward):
    return [f"actor.name_or_path={tiny_model}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}",
            "data.max_samples=32", f"output_dir={out}", "log.tensorboard=false", "train.threads=1", *reward]


def _run(config, tiny_model, tiny_data, out, reward, *extra):
    run_cli("ppo", "--config", config, *_args(tiny_model, tiny_data, out, reward), *extra)
    return [r for r in metrics(out) if "rollout/reward_mean" in r]


# ----------------------------------------------------------------------------------------------
# Advantage estimators on hand-derived numbers (no model)
# ----------------------------------------------------------------------------------------------

def test_estimators_hand_values():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0])                       # 2 prompts × G=2
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    zero_kl = torch.zeros(4, 3)

    def adv(est, kl=zero_kl, beta=0.0, **kw):
        A = PPOAlgoCfg(advantage_estimator=est, n_samples_per_prompt=2, **kw)
        return ADVANTAGE_ESTIMATORS[est](scores, kl, None, mask, beta, A)[0]

    s = 1 / (math.sqrt(2) + 1e-4)                                     # unbiased std of {1, 3} is √2
    assert torch.allclose(adv("grpo"), torch.tensor([-s, s, 0.0, 0.0])[:, None] * mask)
    assert torch.allclose(adv("dr_grpo"), torch.tensor([-1.0, 1.0, 0.0, 0.0])[:, None] * mask)
    assert torch.allclose(adv("rloo"), torch.tensor([-2.0, 2.0, 0.0, 0.0])[:, None] * mask)
    # KL in the reward: A_t = baselined score − β Σ_{i≥t} kl_i (reward-to-go, γ = 1)
    a = adv("rloo", kl=torch.full((4, 3), 0.1), beta=0.5)
    assert torch.allclose(a[0], torch.tensor([-2.15, -2.10, -2.05])) and torch.allclose(a[1], torch.tensor([1.9, 1.95, 0]))
    # REINFORCE++(-baseline): whitened over all valid tokens of the batch
    for est in ("reinforce_pp", "reinforce_pp_baseline"):
        a = adv(est)
        valid = a[mask.bool()]
        assert abs(float(valid.mean())) < 1e-6 and abs(float(valid.std(unbiased=False)) - 1) < 1e-3, est


def test_ema_update_formula():
    lin = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    ema = EmaModel(lin, beta=0.75)
    with torch.no_grad():
        lin.weight.fill_(3.0)
    ema.update()
    assert torch.allclose(ema.model.weight, torch.full((1, 2), 0.75 * 1 + 0.25 * 3))
    state = ema.state_dict()
    ema.update()
    ema.load_state_dict(state)
    assert torch.allclose(ema.model.weight, torch.full((1, 2), 1.5))


def test_config_errors_are_clear(capsys):
    base = ["ppo", "--config", str(GRPO_YAML)]
    assert main(base + ["algo.n_samples_per_prompt=1"]) == 2
    assert "n_samples_per_prompt > 1" in capsys.readouterr().err
    assert main(base + ["algo.n_samples_per_prompt=4", "critic.name_or_path=x"]) == 2
    assert "trains no critic" in capsys.readouterr().err
    assert main(base + ["algo.ptx_coef=0.1"]) == 2
    assert "data.ptx_file" in capsys.readouterr().err
    assert main(base + ["reward_model=null"]) == 2
    assert "no reward" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Roles and experience in-process: no reference without KL, KL-as-loss leaves the rewards alone
# ----------------------------------------------------------------------------------------------

def test_kl_options_roles_and_rewards(tiny_model, tiny_rm, tiny_data, tmp_path):
    from turborlhf.models.tiny import save_tiny_causal_lm
    from turborlhf.models.load import load_tokenizer
    from turborlhf.trainers.ppo import build_roles, make_experience

    other = save_tiny_causal_lm(tmp_path / "ref", seed=1)  # a reference that differs: KL ≠ 0
    common = _args(tiny_model, tiny_data, tmp_path / "x", [f"reward_model={tiny_rm}", f"reference={other}"])
    no_kl = _args(tiny_model, tiny_data, tmp_path / "x", [f"reward_model={tiny_rm}", "algo.kl_coef=0"])
    cluster = build_roles(load_config(PPOConfig, GRPO_YAML, no_kl), None)
    assert cluster.get("reference") is None and cluster.get("critic") is None
    cluster.shutdown()
    with pytest.raises(ConfigError, match="is unused with algo.kl_coef=0"):       # a reference it would not load
        load_config(PPOConfig, GRPO_YAML, common + ["algo.kl_coef=0"])
    tok = load_tokenizer(str(tiny_model))
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    responses = [[10, 11, 12], [13, 14], [15, 16, 17], [18]]
    for use_loss in (True, False):
        cfg = load_config(PPOConfig, GRPO_YAML, common + [f"algo.kl_use_loss={use_loss}", "algo.kl_coef=0.5"])
        cluster = build_roles(cfg, None)
        exp = make_experience(cluster, cfg, tok, prompts, responses, [True] * 4, 0.5, None)
        cluster.shutdown()
        assert float(exp.kl_BR.abs().sum()) > 0
        pad = 1e9 * (1 - exp.mask_BR)
        spread = float(((exp.adv_BR - pad).max(-1).values - (exp.adv_BR + pad).min(-1).values).max())
        if use_loss:
            assert spread < 1e-6      # one advantage per response: no per-token KL in the rewards
        else:
            assert spread > 1e-4      # − β Σ kl over the remaining tokens


# ----------------------------------------------------------------------------------------------
# Critic-free estimators end to end
# ----------------------------------------------------------------------------------------------

VARIANTS = {
    "grpo": [],                                                                  # k3 KL loss, seq-mean-token-mean
    "dr_grpo": ["algo.loss_reduction=token_sum_norm", "algo.kl_use_loss=false"],
    "rloo": ["algo.kl_use_loss=false", "algo.kl_estimator=k1"],
    "reinforce_pp": ["algo.n_samples_per_prompt=1", "algo.prompts_per_step=4", "algo.kl_coef=0"],
    "reinforce_pp_baseline": ["algo.loss_reduction=token_mean"],
}


@pytest.mark.parametrize("estimator", list(VARIANTS))
def test_critic_free_estimators(estimator, tiny_model, tiny_rm, tiny_data, tmp_path):
    out = tmp_path / estimator
    rows = _run(GRPO_YAML, tiny_model, tiny_data, out, [f"reward_model={tiny_rm}"],
                f"algo.advantage_estimator={estimator}", *VARIANTS[estimator])
    assert len(rows) == 2
    for r in rows:
        for k in ("rollout/reward_mean", "policy/loss", "policy/entropy", "policy/clipfrac", "policy/grad_norm"):
            assert math.isfinite(r[k]), (k, r)
        assert not any(k.startswith("critic/") or k.startswith("value/") for k in r)
    assert sorted(p.name for p in (out / "checkpoints" / "step-000002").iterdir()) == ["actor", "run_id",
                                                                                      "trainer_state.pt"]
    assert max_weight_diff(weights(tiny_model), weights(out)) > 1e-6
    assert ("policy/kl_loss" in rows[-1]) == (estimator in ("grpo", "reinforce_pp_baseline"))
    assert ("policy/kl" in rows[-1]) == (estimator != "reinforce_pp")  # kl_coef 0: no reference model


def test_shared_prompts_train_the_same_and_shuffle_whole_groups(tiny_model, tiny_rm, tiny_data, tmp_path,
                                                                monkeypatch):
    """algo.share_prompts (default on for G > 1) computes each prompt once in the actor's and the
    reference's forwards; with the same schedule the step equals the unshared one. With several
    mini-batches the shuffle moves whole groups."""
    import turborlhf.models.forward as F
    from turborlhf.trainers.ppo.experience import minibatch_schedule

    packed = []
    real = F.SegmentPlan.__init__
    monkeypatch.setattr(F.SegmentPlan, "__init__", lambda self, q, k, pos: packed.append(pos.shape[0]) or real(self, q, k, pos))
    one_mini = ["algo.num_mini_batches=1", "train.max_steps=1", "actor.device=cpu"]   # the CPU's packed forward
    a = _run(GRPO_YAML, tiny_model, tiny_data, tmp_path / "shared", [f"reward_model={tiny_rm}"], *one_mini)
    n_shared = len(packed)
    b = _run(GRPO_YAML, tiny_model, tiny_data, tmp_path / "plain", [f"reward_model={tiny_rm}"], *one_mini,
             "algo.share_prompts=false")
    assert n_shared >= 3 and len(packed) == n_shared     # actor, reference and update forwards; none unshared
    assert a[0]["rollout/reward_mean"] == b[0]["rollout/reward_mean"]
    assert abs(a[0]["policy/loss"] - b[0]["policy/loss"]) < 1e-5
    assert max_weight_diff(weights(tmp_path / "shared"), weights(tmp_path / "plain")) < 1e-6
    assert max_weight_diff(weights(tiny_model), weights(tmp_path / "shared")) > 1e-6

    A = PPOAlgoCfg(n_samples_per_prompt=4, num_mini_batches=2, ppo_epochs=2)
    for mini in minibatch_schedule(16, A, torch.Generator().manual_seed(0)):
        assert len(mini) == 8 and sorted(set((mini // 4).tolist())) == sorted((mini // 4).tolist()[::4])
        assert ((mini.view(2, 4) % 4) == torch.arange(4)).all()
    rows = minibatch_schedule(16, A.model_copy(update={"share_prompts": False}), torch.Generator().manual_seed(0))
    assert any(((m.view(2, 4) // 4) != (m.view(2, 4)[:, :1] // 4)).any() for m in rows)


@pytest.mark.parametrize("B, G, n_mini, sizes", [(6, 1, 4, [2, 2, 1, 1]), (10, 2, 4, [4, 2, 2, 2]),
                                                 (4, 2, 4, [1, 1, 1, 1]), (8, 4, 3, [3, 3, 2])])
def test_a_batch_is_cut_into_exactly_the_mini_batches_it_can_hold(B, G, n_mini, sizes):
    """torch.chunk gave 3 mini-batches of 6 rows for 4 asked, and cut 5 groups of 2 as 3/3/3/1
    rows (a group split): the schedulers, sized for num_mini_batches steps, never finished. Fewer
    groups than mini-batches (shared prompts) capped the mini-batches at one group each, silently
    fewer updates than configured: they are cut row by row then."""
    from turborlhf.trainers.ppo.experience import minibatch_schedule, updates_per_batch

    A = PPOAlgoCfg(advantage_estimator="grpo" if G > 1 else "gae", n_samples_per_prompt=G, num_mini_batches=n_mini,
                   ppo_epochs=2)
    minis = minibatch_schedule(B, A, torch.Generator().manual_seed(0))
    assert len(minis) == updates_per_batch(B, A) == 2 * len(sizes)
    assert [len(m) for m in minis[:len(sizes)]] == sizes
    whole = B // G >= n_mini
    for epoch in (minis[:len(sizes)], minis[len(sizes):]):
        rows = torch.cat(epoch)
        assert sorted(rows.tolist()) == list(range(B))
        for m in epoch if whole else ():                         # whole groups
            assert sorted(set((m // G).tolist())) == sorted((m // G).tolist()[::G])


def test_more_mini_batches_than_rows_is_a_config_error():
    """A mini-batch holds at least one row: 16 asked of 8 rows ran 8 updates, silently."""
    with pytest.raises(ValueError, match=r"num_mini_batches=16 is more than the 8 rows"):
        PPOAlgoCfg(prompts_per_step=8, num_mini_batches=16)
    assert PPOAlgoCfg(prompts_per_step=4, advantage_estimator="rloo", n_samples_per_prompt=2,
                      num_mini_batches=8).num_mini_batches == 8


# ----------------------------------------------------------------------------------------------
# PPO-ptx + EMA with a critic, and exact resume of both
# ----------------------------------------------------------------------------------------------

def test_ptx_and_ema_export_and_resume(tiny_model, tiny_rm, tiny_data, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ptx_ema"
    ptx = tmp_path / "ptx.jsonl"
    ptx.write_text((tiny_data / "train_pairs.jsonl").read_text())
    extra = [f"reward_model={tiny_rm}", "algo.ptx_coef=0.5", f"data.ptx_file={ptx}",
             "data.ptx_max_len=64", "algo.ema_beta=0.5", "train.keep_checkpoints=3", "train.max_steps=2",
             "train.save_every=1"]
    rows = _run(REPO / "configs/tiny/ppo.yaml", tiny_model, tiny_data, out, extra)
    assert len(rows) == 2 and all(math.isfinite(r["policy/ptx_loss"]) for r in rows)
    AutoModelForCausalLM.from_pretrained(out / "ema")
    init, actor, ema = weights(tiny_model), weights(out), weights(out / "ema")
    assert max_weight_diff(ema, actor) > 1e-7 and max_weight_diff(ema, init) > 1e-7
    assert (out / "checkpoints" / "step-000002" / "critic").is_dir()
    # crash after step 1, resume: same actor and same EMA (EMA weights and the ptx position are checkpointed)
    rewind_to(out, 1)
    (out / "ema" / "model.safetensors").unlink()
    _run(REPO / "configs/tiny/ppo.yaml", tiny_model, tiny_data, out, extra, "--resume")
    assert max_weight_diff(actor, weights(out)) < 1e-5
    assert max_weight_diff(ema, weights(out / "ema")) < 1e-5
    # the ptx file edited in place (same path, same config) was resumed silently with another example stream
    ptx.write_text("".join(reversed(ptx.read_text().splitlines(True))))
    rewind_to(out, 1)
    capsys.readouterr()
    assert main(["ppo", "--config", str(REPO / "configs/tiny/ppo.yaml"), *map(str, _args(tiny_model, tiny_data, out,
                                                                                         extra)), "--resume"]) == 2
    assert "the examples of the steps done differ" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Several reward sources: an RM and a rule from a .py file, weighted
# ----------------------------------------------------------------------------------------------

def test_weighted_reward_sources(tiny_model, tiny_rm, tiny_data, tmp_path):
    from turborlhf.models.forward import last_token_scores
    from turborlhf.models.load import load_scalar_model, load_tokenizer
    from turborlhf.rewards.combine import RewardInputs, build_reward
    from turborlhf.data.tokenize import assemble_prompt_response as assemble

    rule = tmp_path / "rules.py"
    rule.write_text("def brevity(prompts, responses):\n    return [1.0 / (1 + len(r)) for r in responses]\n")
    sources = f"rewards=[{{kind: model, path: {tiny_rm}, weight: 0.5}}, {{kind: function, path: {rule}:brevity, " \
              f"weight: 2.0, name: rule}}]"
    # row by row: the combined score is exactly the weighted sum of the sources
    cfg = load_config(PPOConfig, GRPO_YAML, _args(tiny_model, tiny_data, tmp_path / "x", ["reward_model=null", sources]))
    tok = load_tokenizer(str(tiny_model))
    reward = build_reward(cfg.rewards, cfg.reward_model, tok, "fp32", 4)
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11, 12, tok.eos_token_id], [13]]
    ids, attn, _, _ = assemble(prompts, responses, tok.pad_token_id)
    total, per = reward(RewardInputs(ids, attn, prompts, responses, tok))
    rm = load_scalar_model(str(tiny_rm), tok).eval()
    with torch.no_grad():
        rm_scores = last_token_scores(rm, ids, attn)
    texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
    rule_scores = torch.tensor([1.0 / (1 + len(t)) for t in texts])
    assert torch.allclose(per["model0"], rm_scores, atol=1e-5) and torch.allclose(per["rule"], rule_scores)
    assert torch.allclose(total, 0.5 * rm_scores + 2.0 * rule_scores, atol=1e-5)
    # end to end: logged per-source means and their weighted sum
    rows = _run(GRPO_YAML, tiny_model, tiny_data, tmp_path / "multi", ["reward_model=null", sources],
                "train.max_steps=1")
    r = rows[-1]
    assert abs(r["rollout/reward_mean"] - (0.5 * r["rollout/reward_model0_mean"] + 2.0 * r["rollout/reward_rule_mean"])) < 1e-5


# ----------------------------------------------------------------------------------------------
# Remote reward model: `turborlhf serve-rm` in a subprocess
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rm_server(tiny_rm):
    proc = subprocess.Popen([sys.executable, "-m", "turborlhf", "serve-rm", "--model", str(tiny_rm), "--port", "0",
                             "--dtype", "fp32", "--max-batch-size", "64", "--max-wait-ms", "300", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()        # "[serve-rm] DIR on http://127.0.0.1:PORT (...)"
        m = re.search(r"on (http://\S+)", line)
        assert m, f"serve-rm did not start: {line!r} (exit {proc.poll()})"
        yield m.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_remote_rm_matches_local_and_batches(rm_server, tiny_rm, tiny_data):
    from turborlhf.data.loaders import load_prompts
    from turborlhf.models.load import load_scalar_model, load_tokenizer
    from turborlhf.rewards.model import score_texts
    from turborlhf.rewards.remote import RemoteRewardModel

    tok = load_tokenizer(str(tiny_rm))
    prompts = list(load_prompts(tiny_data / "test_prompts.jsonl", tok)[:6])
    responses = ["Sure, here you go.", "I can't help with that.", "ok", "Let me think about it.", "No.", "Yes!"]
    local = score_texts(load_scalar_model(str(tiny_rm), tok).eval(), tok, prompts, responses, dtype="fp32")
    client = RemoteRewardModel(rm_server, timeout_s=30, retries=0)
    assert torch.allclose(torch.tensor(client.score(prompts, responses)), local, atol=1e-4)
    before = client.health()
    results = [None] * 6
    barrier = threading.Barrier(6)

    def one(i):
        barrier.wait()
        results[i] = client.score([prompts[i]], [responses[i]])[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = client.health()
    assert torch.allclose(torch.tensor(results), local, atol=1e-4)
    assert after["requests"] - before["requests"] == 6 and after["batches"] - before["batches"] < 6


def test_ppo_with_remote_reward(rm_server, tiny_model, tiny_data, tmp_path):
    rows = _run(GRPO_YAML, tiny_model, tiny_data, tmp_path / "remote",
                ["reward_model=null", f"rewards=[{{kind: remote, path: {rm_server}, timeout_s: 30}}]"],
                "train.max_steps=1")
    assert len(rows) == 1 and math.isfinite(rows[0]["rollout/reward_mean"])
