"""LoRA (and gradient checkpointing) through every trainer on the tiny model: adapters in the
checkpoints, a merged plain HF model as the export, exact resume, and the reference model as the
adapter-disabled policy (no second copy) in DPO, KTO and PPO."""
import json

import pytest
import torch

from tests.e2e.helpers import REPO, max_weight_diff, metrics, rewind_to, run_cli, weights

LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.gradient_checkpointing=true")


def _cmd(kind, tiny_model, tiny_rm, tiny_data, out):
    d = tiny_data
    common = [f"output_dir={out}", "train.keep_checkpoints=3"]
    return {
        "sft": ["sft", "--config", REPO / "configs/tiny/sft.yaml", f"model.name_or_path={tiny_model}",
                f"data.train_file={d / 'train_pairs.jsonl'}", "data.max_samples=16", "train.max_steps=3", *LORA],
        "rm": ["rm", "--config", REPO / "configs/tiny/rm.yaml", f"model.name_or_path={tiny_model}",
               f"data.train_file={d / 'train_pairs.jsonl'}", "data.max_samples=16", "train.max_steps=3", *LORA],
        "dpo": ["dpo", "--config", REPO / "configs/tiny/dpo.yaml", f"model.name_or_path={tiny_model}",
                f"data.train_file={d / 'train_pairs.jsonl'}", "data.max_samples=8", "train.max_steps=3", *LORA],
        "kto": ["kto", "--config", REPO / "configs/tiny/kto.yaml", f"model.name_or_path={tiny_model}",
                f"data.train_file={d / 'train_kto.jsonl'}", "data.max_samples=16", "train.max_steps=3", *LORA],
        "conditional-sft": ["conditional-sft", "--config", REPO / "configs/tiny/conditional_sft.yaml",
                            f"model.name_or_path={tiny_model}", f"reward_model={tiny_rm}",
                            f"data.train_file={d / 'train_pairs.jsonl'}", "data.max_samples=6", *LORA],
        "ppo": ["ppo", "--config", REPO / "configs/tiny/ppo.yaml", f"actor.name_or_path={tiny_model}",
                f"reward_model={tiny_rm}", f"data.prompts_file={d / 'train_prompts.jsonl'}", "data.max_samples=16",
                "actor.lora.rank=4", "actor.gradient_checkpointing=true", f"critic.name_or_path={tiny_rm}",
                "critic.lora.rank=4", "critic.dtype=fp32", "critic.gradient_checkpointing=true"],
    }[kind] + common


@pytest.mark.parametrize("kind", ["sft", "rm", "dpo", "kto", "conditional-sft", "ppo"])
def test_lora_trains_adapters_checkpoints_them_and_exports_merged(kind, tiny_model, tiny_rm, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = tmp_path / kind
    run_cli(*_cmd(kind, tiny_model, tiny_rm, tiny_data, out))
    role = {"rm": "reward_model", "ppo": "actor"}.get(kind, "policy")
    ckpt = out / "checkpoints" / "step-000003" / role
    cfg = json.loads((ckpt / "adapter_config.json").read_text())          # a peft adapter directory
    assert cfg["r"] == 4 and not (ckpt / "model.safetensors").exists()
    auto = AutoModelForSequenceClassification if kind == "rm" else AutoModelForCausalLM
    auto.from_pretrained(out)                                              # the export: plain, merged
    base, final = weights(tiny_model), weights(out)
    common = sorted(base.keys() & final.keys())
    assert len(common) >= len(base) - 1                                    # plain HF names (RM: + score)
    assert max_weight_diff({k: base[k] for k in common}, {k: final[k] for k in common}) > 1e-7  # merged in


def test_lora_sft_resume_is_exact(tiny_model, tiny_rm, tiny_data, tmp_path):
    out = tmp_path / "sft"
    args = _cmd("sft", tiny_model, tiny_rm, tiny_data, out) + ["train.save_every=1"]
    run_cli(*args)
    final = weights(out)
    rewind_to(out, 1)
    run_cli(*args, "--resume")
    assert max_weight_diff(final, weights(out)) < 1e-6


@pytest.fixture
def loads(monkeypatch):
    """Count full model loads (policy bases, references)."""
    import turborlhf.models.load as L
    import turborlhf.models.reference as R

    calls = {"n": 0}
    real = L.load_causal_lm

    def load(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    for module in (L, R):       # PPO's workers import it from L when they build
        monkeypatch.setattr(module, "load_causal_lm", load)
    return calls


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_lora_reference_is_the_adapter_disabled_policy_also_after_resume(kind, tiny_model, tiny_rm, tiny_data,
                                                                          tmp_path, loads):
    out = tmp_path / kind
    args = _cmd(kind, tiny_model, tiny_rm, tiny_data, out) + ["train.save_every=1"]
    run_cli(*args)
    assert loads["n"] == 1                                   # the policy's base only; it is its own reference
    first = [r for r in metrics(out) if "train/loss" in r][0]["train/loss"]
    assert first == pytest.approx(0.6931472 if kind == "dpo" else 0.5, abs=1e-5)
    cached = torch.load(out / "ref_logps.pt", weights_only=False)["logps"]
    final = weights(out)
    # crash after step 1 AND lose the cache: the trained LoRA policy recomputes the reference
    # log-probs with its adapters disabled (exactly the initial policy's), loading nothing else
    rewind_to(out, 1)
    (out / "ref_logps.pt").unlink()
    run_cli(*args, "--resume")
    assert loads["n"] == 2
    again = torch.load(out / "ref_logps.pt", weights_only=False)["logps"]
    assert all(torch.equal(cached[k], again[k]) for k in cached)
    assert max_weight_diff(final, weights(out)) < 1e-6


def test_lora_ppo_reference_is_the_actor_and_resume_is_exact(tiny_model, tiny_rm, tiny_data, tmp_path, loads):
    from turborlhf.config import PPOConfig, load_config
    from turborlhf.trainers.ppo import build_roles, lora_reference

    out = tmp_path / "ppo"
    args = _cmd("ppo", tiny_model, tiny_rm, tiny_data, out)
    cfg = load_config(PPOConfig, args[2], [str(a) for a in args[3:]])
    cluster = build_roles(cfg, None)
    try:
        assert lora_reference(cfg) and cluster.get("reference") is None   # the actor answers ref_logprobs
        assert loads["n"] == 1                               # no reference copy was loaded
    finally:
        cluster.shutdown()
    run_cli(*args)
    kl = [r["policy/kl"] for r in metrics(out) if "policy/kl" in r]
    assert kl[0] == pytest.approx(0.0, abs=1e-6)            # adapters start at B = 0: actor == reference
    final = weights(out)
    rewind_to(out, 2)
    run_cli(*args, "--resume")
    assert max_weight_diff(final, weights(out)) < 1e-5
