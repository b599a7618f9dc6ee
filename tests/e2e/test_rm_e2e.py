import json
import math

import pytest
import torch

from tests.e2e.helpers import REPO, max_weight_diff, metrics, rewind_to, run_cli, weights, with_score_stats


def _rm(tiny_model, tiny_data, out, *extra):
    run_cli("rm", "--config", REPO / "configs/tiny/rm.yaml", f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"data.test_file={tiny_data / 'test_pairs.jsonl'}",
            "data.max_samples=64", f"output_dir={out}", "train.keep_checkpoints=3", *extra)


def test_rm_trains_saves_and_resumes(tiny_model, tiny_data, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "rm"
    _rm(tiny_model, tiny_data, out)
    rows = metrics(out)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    ev = json.loads((out / "eval.json").read_text())
    assert 0.0 <= ev["accuracy"] <= 1.0 and ev["n"] > 0
    # loads with the stock HF class, and HF's own pooling scores the same token as our trainer
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.pad_token_id != tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    from turborlhf.models.forward import last_token_scores

    texts = ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there<|im_end|>",
             "<|im_start|>user\nhow are you<|im_end|>\n<|im_start|>assistant\nfine<|im_end|>"]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        hf = model(**batch).logits.squeeze(-1)
        ours = last_token_scores(model, batch["input_ids"], batch["attention_mask"])
    assert torch.allclose(hf, ours, atol=1e-5)
    # trained weights differ from the base; resume reproduces the uninterrupted run
    final = weights(out)
    rewind_to(out, 2)
    _rm(tiny_model, tiny_data, out, "--resume")
    assert max_weight_diff(final, weights(out)) < 1e-6


def test_rm_margin_and_centering_options_run(tiny_model, tiny_data, tmp_path):
    _rm(tiny_model, tiny_data, tmp_path / "rm2", "train.max_steps=2", "train.center_rewards_coef=0.01",
        "train.freeze_embeddings=true", "data.max_test_samples=3")
    assert len(metrics(tmp_path / "rm2")) >= 2
    assert json.loads((tmp_path / "rm2" / "eval.json").read_text())["n"] == 3    # the test file's first 3 pairs


@pytest.mark.parametrize("lora", [False, True])
def test_an_export_of_the_final_checkpoint_keeps_the_score_statistics(lora, tiny_model, tiny_data, tmp_path):
    """The final evaluation writes reward_mean/reward_std into the run's export after the last
    checkpoint is saved, so `turborlhf export` of the run (its latest checkpoint: the same weights)
    wrote the reward model again without them. The final checkpoint's export has them now (a LoRA
    one's, merged, too); an earlier checkpoint's, whose weights were not evaluated, has none."""
    out = tmp_path / "rm"
    _rm(tiny_model, tiny_data, out, "data.max_test_samples=3", *(["model.lora.rank=4"] if lora else []))
    run_cfg = json.loads((out / "config.json").read_text())
    assert math.isfinite(run_cfg["reward_mean"]) and run_cfg["reward_std"] > 0
    for src, dest in ((out, "run"), (out / "checkpoints" / "step-000004" / "reward_model", "model_dir")):
        run_cli("export", "--checkpoint", src, "--output", tmp_path / dest)
        got = json.loads((tmp_path / dest / "config.json").read_text())
        assert (got["reward_mean"], got["reward_std"]) == (run_cfg["reward_mean"], run_cfg["reward_std"]), dest
    run_cli("export", "--checkpoint", out / "checkpoints" / "step-000002", "--output", tmp_path / "earlier")
    assert "reward_mean" not in json.loads((tmp_path / "earlier" / "config.json").read_text())


def test_the_evaluation_loss_uses_the_pairs_margins_as_training_does():
    """`train.margin`: training minimised −log σ(rc − rr − m) but eval/loss left m out, so the
    two were not comparable (and a model meeting every margin read as better than it was)."""
    from turborlhf.trainers.reward_model import pair_margins, summarize_scores

    ch, rj = torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.0])
    enc = [{"margin": 2.0}, {"margin": 0.0}]
    want = (-math.log(1 / (1 + math.exp(1.0))) - math.log(1 / (1 + math.exp(-0.5)))) / 2
    assert summarize_scores(ch, rj, pair_margins(enc, True))["loss"] == pytest.approx(want, rel=1e-6)
    assert pair_margins(enc, False) is None and pair_margins(enc + [{"margin": None}], True) is None


@pytest.mark.parametrize("lora", [False, True])
def test_a_reward_model_trained_further_without_a_test_set_drops_the_old_score_statistics(lora, tiny_rm, tiny_data,
                                                                                            tmp_path):
    """Loading a model copies its config: a reward model trained further from one with
    reward_mean/reward_std, without a test set to measure the new weights, saved the old statistics
    with the new weights (run export, checkpoints, and `turborlhf export` of them, LoRA merged too)."""
    start = with_score_stats(tiny_rm, tmp_path / "start")
    out = tmp_path / "rm"
    run_cli("rm", "--config", REPO / "configs/tiny/rm.yaml", f"model.name_or_path={start}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", "data.max_samples=8", "train.max_steps=2",
            f"output_dir={out}", *(["model.lora.rank=4"] if lora else []))
    run_cli("export", "--checkpoint", out, "--output", tmp_path / "exported")
    ckpt = out / "checkpoints" / "step-000002" / "reward_model"
    for d in (out, tmp_path / "exported", *([] if lora else [ckpt])):
        got = json.loads((d / "config.json").read_text())
        assert "reward_mean" not in got and "reward_std" not in got, d
    if not lora:     # a checkpoint an earlier version wrote with the statistics it loaded: its export drops them
        cfg = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**cfg, "reward_mean": 12.5, "reward_std": 3.0}))
        run_cli("export", "--checkpoint", out, "--output", tmp_path / "exported")
        assert "reward_mean" not in json.loads((tmp_path / "exported" / "config.json").read_text())
