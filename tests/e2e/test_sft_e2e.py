import math

import pytest

from tests.e2e.helpers import REPO, max_weight_diff, metrics, rewind_to, run_cli, weights


def _sft(tiny_model, tiny_data, out, *extra):
    run_cli("sft", "--config", REPO / "configs/tiny/sft.yaml", f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"data.test_file={tiny_data / 'test_pairs.jsonl'}",
            "data.max_samples=64", f"output_dir={out}", "train.keep_checkpoints=3", *extra)


def test_sft_trains_saves_and_resumes(tiny_model, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sft"
    _sft(tiny_model, tiny_data, out)
    rows = metrics(out)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) and x > 0 for x in losses)
    assert any("eval/loss" in r for r in rows)
    # parameters changed, and the export reloads as a plain HF model
    assert max_weight_diff(weights(tiny_model), weights(out)) > 1e-4
    AutoModelForCausalLM.from_pretrained(out)
    assert (out / "tb").exists() and (out / "checkpoints" / "step-000002").exists()
    # resume from step 2 reproduces the uninterrupted run
    final = weights(out)
    rewind_to(out, 2)
    _sft(tiny_model, tiny_data, out, "--resume")
    assert max_weight_diff(final, weights(out)) < 1e-6
    assert len([r for r in metrics(out) if "train/loss" in r]) == 4  # steps 1-2 kept, 3-4 appended
    # stopped in the export, after the final evaluation: resumed, that evaluation's row is not doubled
    rows = metrics(out)
    rewind_to(out, 4)
    _sft(tiny_model, tiny_data, out, "--resume")
    assert metrics(out) == rows and [r["step"] for r in rows][-2:] == [4, 4]


def test_sft_max_test_samples_evaluates_the_test_files_first_examples(tiny_model, tiny_data, tmp_path):
    """`data.max_test_samples=N`: the held-out NLL is that of the test file's first N examples."""
    from turborlhf.data.tokenize import encode_examples
    from turborlhf.data.loaders import load_sft
    from turborlhf.models.load import load_causal_lm, load_tokenizer
    from turborlhf.trainers.common import evaluate_nll

    out = tmp_path / "sft"
    _sft(tiny_model, tiny_data, out, "train.max_steps=1", "data.max_test_samples=3")
    logged = [r["eval/loss"] for r in metrics(out) if "eval/loss" in r][-1]
    tok = load_tokenizer(str(out))
    enc = encode_examples(tok, load_sft(str(tiny_data / "test_pairs.jsonl"), tok), 96)   # configs/tiny/sft.yaml
    model = load_causal_lm(str(out))
    first, every = (evaluate_nll(model, tok, e, "fp32", 8) for e in (enc[:3], enc))
    assert len(enc) > 3
    assert abs(logged - first) < 1e-4 and abs(first - every) > 1e-3


def test_every_evaluation_is_logged_whatever_log_every(tiny_model, tiny_data, tmp_path):
    """`train.eval_every=2` with `log.every=3`: the evaluations after steps 2 (and the final one)
    were computed and dropped (only steps 3 and 4 were logged); now every evaluated step is a row."""
    out = tmp_path / "sft"
    _sft(tiny_model, tiny_data, out, "train.max_steps=4", "train.eval_every=2", "log.every=3",
         "data.max_test_samples=4")
    rows = metrics(out)
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 3, 4]
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 4]


def test_resume_refuses_a_changed_step_plan(tiny_model, tiny_data, tmp_path):
    """The training file edited between the runs (same path, same config) resumed silently with
    another example order: the rest of the run repeated some examples and skipped others."""
    import shutil

    from turborlhf.cli import main

    data = tmp_path / "train.jsonl"
    shutil.copy(tiny_data / "train_pairs.jsonl", data)
    out = tmp_path / "sft"
    args = ["sft", "--config", str(REPO / "configs/tiny/sft.yaml"), f"model.name_or_path={tiny_model}",
            f"data.train_file={data}", "data.max_samples=64", f"output_dir={out}", "train.max_steps=4",
            "train.keep_checkpoints=3", "log.tensorboard=false"]
    assert main(args) == 0
    rewind_to(out, 2)
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[1:]))                        # one example fewer: another plan
    assert main(args + ["--resume"]) == 2
    assert (out / "checkpoints" / "step-000002").exists()      # nothing lost
    assert main(args + ["--resume", "--resume-changed"]) == 0


def test_a_fresh_run_removes_the_earlier_export_unless_it_starts_from_it(tiny_model, tiny_data, tmp_path):
    """A fresh run in a used output_dir left the earlier run's model.safetensors beside its own
    config.yaml until it exported: stopped early, the directory loaded as the old model. A run
    that starts from a checkpoint inside it keeps them; one whose model IS that directory is
    refused (its export would overwrite its input, and each --resume of a finished LoRA run added
    its adapters to the merged export again: base + 2·delta)."""
    from turborlhf.cli import main

    out = tmp_path / "sft"
    _sft(tiny_model, tiny_data, out, "train.max_steps=1")
    assert (out / "model.safetensors").exists()
    from turborlhf.config import SFTConfig, load_config
    from turborlhf.engine.lifecycle import start_run

    args = ["sft", "--config", str(REPO / "configs/tiny/sft.yaml"),
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", "data.max_samples=16", f"output_dir={out}",
            "train.max_steps=1", "log.tensorboard=false"]
    from turborlhf.config import ConfigError
    for resume in (False, True):
        with pytest.raises(ConfigError, match=r"output_dir .* is also model\.name_or_path"):
            start_run(load_config(SFTConfig, None, args[3:] + [f"model.name_or_path={out}"]), resume, "sft")
    assert (out / "model.safetensors").exists()                # nothing touched
    step = out / "checkpoints" / "step-000001" / "policy"      # an earlier checkpoint: kept, not deleted
    assert step.exists()
    start_run(load_config(SFTConfig, None, args[3:] + [f"model.name_or_path={step}"]), False, "sft")
    assert step.exists()
    # ...and its rotation keeps it: it was deleted at the new run's first save, and --resume then failed
    from_step = args + [f"model.name_or_path={step}", "train.max_steps=3", "train.save_every=2",
                        "train.keep_checkpoints=1"]
    assert main(from_step) == 0 and step.exists()
    assert main(from_step + ["--resume"]) == 0
    (out / "eval.json").write_text("{}")        # an earlier run's final evaluation (rm, dpo, kto write one)
    (out / "ema").mkdir()                       # and PPO's EMA export (algo.ema_beta)
    (out / "ema" / "config.json").write_text("{}")
    (out / "chat_template.jinja").write_text("{{ x }}")     # a tokenizer file the new export may not write
    start_run(load_config(SFTConfig, None, args[3:] + [f"model.name_or_path={tiny_model}"]), False, "sft")
    assert not (out / "model.safetensors").exists() and not (out / "eval.json").exists()
    assert not (out / "ema").exists() and not (out / "chat_template.jinja").exists()
    assert not (out / "config.json").exists() and (out / "config.yaml").exists()     # the run's own config stays
    assert main(args + [f"model.name_or_path={tiny_model}"]) == 0 and (out / "model.safetensors").exists()


def test_a_mistyped_input_path_leaves_the_earlier_run_alone(tiny_model, tiny_data, tmp_path, capsys):
    """A fresh run cleared the earlier run's checkpoints and export, then failed on its mistyped
    data file or model path: the earlier run was lost to a typo. The field is named first now."""
    from turborlhf.cli import main

    out = tmp_path / "sft"
    _sft(tiny_model, tiny_data, out, "train.max_steps=2")
    before = sorted(p.name for p in (out / "checkpoints").iterdir()), weights(out)
    base = ["sft", "--config", str(REPO / "configs/tiny/sft.yaml"), f"output_dir={out}", "train.max_steps=2"]
    for bad, field in ((f"data.train_file={tiny_data / 'train_pair.jsonl'}", "data.train_file"),
                       (f"model.name_or_path={tmp_path / 'no_model'}", "model.name_or_path"),
                       (f"model.name_or_path={tiny_data}", "model.name_or_path")):      # a directory, no model
        args = base + [f"model.name_or_path={tiny_model}", f"data.train_file={tiny_data / 'train_pairs.jsonl'}", bad]
        capsys.readouterr()
        assert main(args) == 2
        assert capsys.readouterr().err.strip().startswith(f"error: {field}: "), field
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before[0]
        assert max_weight_diff(before[1], weights(out)) == 0.0


def test_resume_changed_hyperparameters_take_effect(tiny_model, tiny_data, tmp_path):
    """--resume-changed logged "optim.lr: 0.001 -> 0.01" and trained on at 0.001: the optimizer's
    and the schedule's saved state brought back the old learning rate, weight decay and betas."""
    from turborlhf.cli import main
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    out = tmp_path / "sft"
    args = ["sft", "--config", str(REPO / "configs/tiny/sft.yaml"), f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", "data.max_samples=64", f"output_dir={out}",
            "train.max_steps=4", "train.keep_checkpoints=3", "optim.schedule=constant", "optim.warmup_steps=0",
            "log.tensorboard=false"]
    assert main(args + ["optim.lr=1e-3", "optim.weight_decay=0.0"]) == 0
    rewind_to(out, 2)
    assert main(args + ["optim.lr=1e-2", "optim.weight_decay=0.1", "--resume", "--resume-changed"]) == 0
    assert [r["train/lr"] for r in metrics(out) if "train/lr" in r] == pytest.approx([1e-3, 1e-3, 1e-2, 1e-2])
    groups = load_trainer_state(latest_checkpoint(out))["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == pytest.approx([1e-2] * len(groups))
    assert max(g["weight_decay"] for g in groups) == 0.1
