import json
import math
import re

import pytest

from tests.e2e.helpers import REPO, max_weight_diff, metrics, rewind_to, run_cli, weights, with_score_stats

REQUIRED = ["rollout/reward_mean", "rollout/reward_std", "policy/kl", "policy/entropy", "policy/clipfrac",
            "policy/approx_kl", "policy/loss", "critic/loss", "critic/explained_variance",
            "rollout/response_length", "timing/generate", "timing/experience", "timing/train"]


def _ppo(tiny_model, tiny_rm, tiny_data, out, *extra):
    run_cli("ppo", "--config", REPO / "configs/tiny/ppo.yaml", f"actor.name_or_path={tiny_model}",
            f"reward_model={tiny_rm}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}",
            "data.max_samples=32", f"output_dir={out}", "train.keep_checkpoints=3", *extra)


def test_ppo_end_to_end_metrics_checkpoint_resume(tiny_model, tiny_rm, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = tmp_path / "ppo"
    _ppo(tiny_model, tiny_rm, tiny_data, out)
    rows = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert len(rows) == 3
    for r in rows:
        for k in REQUIRED:
            assert k in r and math.isfinite(r[k]), (k, r.get(k))
    synced = [r["sync/logprob_mean_diff"] for r in rows if "sync/logprob_mean_diff" in r]
    assert synced and all(0 <= d <= 0.05 for d in synced)                    # every push was verified
    assert max_weight_diff(weights(tiny_model), weights(out)) > 1e-6          # the actor moved
    AutoModelForCausalLM.from_pretrained(out)
    AutoModelForSequenceClassification.from_pretrained(out / "checkpoints" / "step-000003" / "critic")
    # crash after step 2, resume: same final actor as the uninterrupted run
    final = weights(out)
    rewind_to(out, 2)
    _ppo(tiny_model, tiny_rm, tiny_data, out, "--resume")
    assert max_weight_diff(final, weights(out)) < 1e-5
    # the samples of step 3 were written again, not appended to the first run's
    assert [json.loads(l)["step"] for l in (out / "samples.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_ppo_options_adaptive_kl_samples_entropy(tiny_model, tiny_rm, tiny_data, tmp_path):
    out = tmp_path / "ppo2"
    _ppo(tiny_model, tiny_rm, tiny_data, out, "train.max_steps=2", "algo.kl_target=0.5", "algo.kl_estimator=k3",
         "algo.n_samples_per_prompt=2", "algo.entropy_coef=0.01", "algo.dual_clip=3.0", "algo.normalize_reward=true",
         "algo.critic_warmup_steps=1", "rollout.engine=hf", "optim.schedule=linear", "optim.warmup_steps=0")
    rows = [r for r in metrics(out) if "policy/kl_coef" in r]
    assert len(rows) == 2
    # train/lr is the rate the step's first update used: the actor's linear schedule spans its 4
    # updates of step 2 (it logged the rate after them, 0, one step late)
    assert rows[0]["train/lr"] == rows[1]["train/lr"] == 1e-4
    assert rows[0]["policy/kl_coef"] != rows[1]["policy/kl_coef"]  # adaptive controller moved β
    assert "policy/loss" not in rows[0] and "policy/loss" in rows[1]  # critic warm-up step


def test_ppo_stops_when_a_weight_push_goes_wrong(tiny_model, tiny_rm, tiny_data, tmp_path, monkeypatch, capsys):
    """Every push is checked on the canary batch: an engine that silently drops a tensor update
    stops the run with an error naming the rollout worker and the log-prob discrepancy."""
    from turborlhf.trainers.ppo import roles

    real = roles.RolloutWorker.load_weights

    def stale_embedding(self, state):           # a sync bug: one tensor is never refreshed
        real(self, {k: (v + 0.5 if "embed_tokens" in k else v) for k, v in state.items()})

    monkeypatch.setattr(roles.RolloutWorker, "load_weights", stale_embedding)
    with pytest.raises(AssertionError, match="exited with 1"):
        _ppo(tiny_model, tiny_rm, tiny_data, tmp_path / "bad", "train.max_steps=1")
    assert re.search(r"rollout failed in check_sync: WeightSyncError: \w+Engine: weights out of sync with the "
                     r"trainer after a push", capsys.readouterr().err)
    monkeypatch.setattr(roles.RolloutWorker, "load_weights", real)
    _ppo(tiny_model, tiny_rm, tiny_data, tmp_path / "good", "train.max_steps=1")
    row = [r for r in metrics(tmp_path / "good") if "sync/logprob_mean_diff" in r][-1]
    assert row["sync/logprob_mean_diff"] <= 0.05


def test_frozen_trunk_shared_by_reward_and_critic(tiny_model, tiny_rm, tiny_data, tmp_path, capsys):
    """The critic starts from the RM and freezes its lowest layer: the reward model and the critic
    then run that layer once per sequence (the experience's scores and values, and the critic's
    update forwards), and the run trains to the weights of the run without sharing."""
    from turborlhf.models import trunk

    hits = []
    trunk.TrunkCache.get, get = (lambda self, k: hits.append(k in self._rows) or get(self, k)), trunk.TrunkCache.get
    try:
        _ppo(tiny_model, tiny_rm, tiny_data, tmp_path / "shared", "critic.freeze_layers=1")
    finally:
        trunk.TrunkCache.get = get
    assert re.search(r"shared frozen trunk +reward, critic: lower 1 layers\n", capsys.readouterr().out)
    # per step: 4 rows scored by the RM (4 misses), valued by the critic (4 hits), then 2 epochs ×
    # 2 mini-batches of the critic's update (8 hits); 3 steps
    assert (hits.count(False), hits.count(True)) == (12, 36)
    _ppo(tiny_model, tiny_rm, tiny_data, tmp_path / "whole", "critic.freeze_layers=1",
         "distributed.share_frozen_trunk=false")
    assert re.search(r"shared frozen trunk +no\n", capsys.readouterr().out)
    assert max_weight_diff(weights(tmp_path / "shared"), weights(tmp_path / "whole")) < 1e-5
    for a, b in zip(metrics(tmp_path / "shared"), metrics(tmp_path / "whole")):
        if "critic/loss" in a:
            assert a["critic/loss"] == pytest.approx(b["critic/loss"], rel=1e-4)


def test_resume_refuses_an_edited_prompts_file(tiny_model, tiny_rm, tiny_data, tmp_path):
    """The prompts file edited between the runs resumed silently on other prompts (SFT, RM, DPO
    and KTO refused it; PPO never compared)."""
    import shutil

    from turborlhf.cli import main

    prompts = tmp_path / "prompts.jsonl"
    shutil.copy(tiny_data / "train_prompts.jsonl", prompts)
    out = tmp_path / "ppo"
    args = ["ppo", "--config", str(REPO / "configs/tiny/ppo.yaml"), f"actor.name_or_path={tiny_model}",
            f"reward_model={tiny_rm}", f"data.prompts_file={prompts}", "data.max_samples=32", f"output_dir={out}",
            "train.max_steps=2", "train.save_every=1", "train.keep_checkpoints=3", "log.tensorboard=false"]
    assert main(args) == 0
    rewind_to(out, 1)
    lines = prompts.read_text().splitlines(keepends=True)
    prompts.write_text("".join(lines[::-1]))
    assert main(args + ["--resume"]) == 2
    assert main(args + ["--resume", "--resume-changed"]) == 0


def test_a_critic_started_from_a_reward_model_of_another_vocabulary_is_refused(tiny_model, tiny_data, tmp_path,
                                                                                capsys):
    """The critic (initialised from the reward model unless critic.name_or_path is set) reads the
    actor's token ids: a reward model of another vocabulary (scored through its texts) gave it
    meaningless embeddings, or an IndexError mid-step for a smaller one. Refused, naming the field."""
    from transformers import AutoModelForSequenceClassification

    from turborlhf.cli import main
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.models.tiny import tiny_llama_config

    rm_tok = make_tiny_tokenizer()
    rm_tok.add_tokens([f"<rm{i}>" for i in range(8)])
    AutoModelForSequenceClassification.from_config(tiny_llama_config(
        len(rm_tok), pad_token_id=rm_tok.pad_token_id, bos_token_id=rm_tok.bos_token_id,
        eos_token_id=rm_tok.eos_token_id, num_labels=1)).save_pretrained(tmp_path / "rm")
    rm_tok.save_pretrained(tmp_path / "rm")
    args = ["ppo", "--config", str(REPO / "configs/tiny/ppo.yaml"), f"actor.name_or_path={tiny_model}",
            f"reward_model={tmp_path / 'rm'}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}",
            f"output_dir={tmp_path / 'ppo'}", "train.max_steps=1", "log.tensorboard=false"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "critic.name_or_path (unset: the critic starts from the reward model)" in err and "vocabulary" in err
    assert main(args + [f"critic.name_or_path={tiny_model}"]) == 0       # a critic of the policy's vocabulary


def test_resume_changed_learning_rates_and_kl_coef_take_effect(tiny_model, tiny_rm, tiny_data, tmp_path):
    """The actor's and critic's learning rates and a fixed KL coefficient changed under
    --resume-changed were logged as taken and ignored: the checkpoint's values came back."""
    from turborlhf.cli import main

    out = tmp_path / "ppo"
    args = ["ppo", "--config", str(REPO / "configs/tiny/ppo.yaml"), f"actor.name_or_path={tiny_model}",
            f"reward_model={tiny_rm}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}", "data.max_samples=32",
            f"output_dir={out}", "train.max_steps=2", "train.save_every=1", "train.keep_checkpoints=3",
            "log.tensorboard=false", "optim.schedule=constant", "optim.warmup_steps=0"]
    assert main(args + ["optim.lr=1e-4", "algo.critic_lr=1e-4", "algo.kl_coef=0.05"]) == 0
    rewind_to(out, 1)
    assert main(args + ["optim.lr=1e-3", "algo.critic_lr=2e-3", "algo.kl_coef=0.5", "--resume",
                        "--resume-changed"]) == 0
    rows = [r for r in metrics(out) if "policy/kl_coef" in r]
    assert [r["policy/kl_coef"] for r in rows] == pytest.approx([0.05, 0.5])
    assert [r["train/lr"] for r in rows] == pytest.approx([1e-4, 1e-3])
    import torch

    from turborlhf.engine.checkpoint import latest_checkpoint

    critic = torch.load(latest_checkpoint(out) / "critic" / "worker_state.pt", map_location="cpu", weights_only=False)
    groups = critic["opt"]["param_groups"]
    assert [g["lr"] for g in groups] == pytest.approx([2e-3] * len(groups))


@pytest.mark.parametrize("lora", [False, True])
def test_a_critic_started_from_a_reward_model_drops_its_score_statistics(lora, tiny_model, tiny_rm, tiny_data,
                                                                         tmp_path):
    """The critic starts from the reward model and copied its config: its checkpoints, and their
    export, carried the reward model's reward_mean/reward_std, though its weights changed and it
    outputs values, not rewards. The reward model itself keeps them."""
    rm = with_score_stats(tiny_rm, tmp_path / "rm")
    out = tmp_path / "ppo"
    _ppo(tiny_model, rm, tiny_data, out, "train.max_steps=1", "data.max_samples=4",
         *([f"critic.name_or_path={rm}", "critic.lora.rank=4"] if lora else []))
    critic = out / "checkpoints" / "step-000001" / "critic"
    run_cli("export", "--checkpoint", critic, "--output", tmp_path / "exported")
    for d in ([] if lora else [critic]) + [tmp_path / "exported"]:
        got = json.loads((d / "config.json").read_text())
        assert "reward_mean" not in got and "reward_std" not in got, d
    assert json.loads((rm / "config.json").read_text())["reward_mean"] == 12.5
