import subprocess
import sys

import pytest

from turborlhf.cli import main
from turborlhf.config import ConfigError, PPOConfig, SFTConfig, load_config


def test_import_and_help_stay_light():
    code = ("import sys, turborlhf, turborlhf.cli, turborlhf.config\n"
            "from turborlhf.cli import main\n"
            "import contextlib, io\n"
            "with contextlib.redirect_stdout(io.StringIO()): main(['--help'])\n"
            "heavy = [m for m in ('torch', 'transformers', 'ray', 'vllm') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_config_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        load_config(SFTConfig, None, ["data.train_file=x", "optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"train\.no_such_field"):
        load_config(SFTConfig, None, ["data.train_file=x", "train.no_such_field=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(SFTConfig, bad)
    assert main(["sft", "data.train_file=x", "--optim.lr", "abc"]) == 2


def test_a_key_given_twice_in_a_yaml_file_is_an_error(tmp_path):
    """PyYAML keeps the last of two equal keys: the run trained at the lr written further down."""
    f = tmp_path / "c.yaml"
    f.write_text("data: {train_file: a.jsonl}\noptim:\n  lr: 1.0e-5\n  warmup_steps: 2\n  lr: 3.0e-4\n")
    with pytest.raises(ConfigError, match=r"line 5, column 3: key 'lr' given twice \(first at line 3\)"):
        load_config(SFTConfig, f)
    f.write_text("data: {train_file: a.jsonl}\noptim: {lr: 1.0e-5}\ntrain: {lr: 2}\n")     # other mappings: fine
    with pytest.raises(ConfigError, match=r"train\.lr"):
        load_config(SFTConfig, f)


def test_help_shows_a_list_of_sections_as_optional_with_per_item_fields(capsys):
    """`turborlhf ppo --help` listed `--rewards.kind` and `--rewards.path` as "required", though
    `rewards` is an optional list (default []) and `--rewards.kind` is no override that works: the
    list is one `--rewards` line now, its items' fields `rewards[].kind` (needed per item)."""
    with pytest.raises(SystemExit):
        main(["ppo", "--help"])
    lines = {ln.split()[0]: ln.split()[1:] for ln in capsys.readouterr().out.splitlines()
             if ln.startswith("  ") and ln.split() and ln.split()[0].lstrip("-").startswith(("rewards", "data."))}
    assert lines["--rewards"][:2] == ["list", "default=[]"]
    assert lines["rewards[].kind"][1:4] == ["needed", "per", "item"]
    assert lines["rewards[].weight"][1] == "item" and lines["rewards[].weight"][2] == "default=1.0"
    assert not any(k.startswith("--rewards.") for k in lines)
    assert lines["--data.prompts_file"][1] == "required"        # a required field of a section still is
    with pytest.raises(ConfigError, match="rewards.kind: cannot set a sub-field"):
        load_config(PPOConfig, None, ["data.prompts_file=x", "rewards.kind=function"])


def test_a_leading_zero_integer_that_yaml_reads_as_octal_is_an_error(tmp_path):
    """PyYAML follows YAML 1.1: `seed: 010` or `max_steps: 010` loaded as 8, silently (and so did the
    override `train.max_steps=010`). Such a value is an error naming the line and the dotted field;
    0, 07 (the same in octal), hex, underscores and quoted text stay as they were."""
    f = tmp_path / "c.yaml"
    f.write_text("data: {train_file: a.jsonl}\ntrain:\n  seed: 010\n")
    with pytest.raises(ConfigError, match=r"c\.yaml, line 3: train\.seed: 010 would be read as octal 8 "
                                          r"\(YAML 1\.1\); write 10 or 8$"):
        load_config(SFTConfig, f)
    with pytest.raises(ConfigError, match=r"^train\.max_steps: 010 would be read as octal 8"):
        load_config(SFTConfig, None, ["data.train_file=x", "train.max_steps=010"])
    f.write_text("data: {train_file: a.jsonl}\nlog: {run_name: '010'}\n"
                 "train: {seed: 0, max_steps: 07, threads: 00, save_every: 0x10, keep_checkpoints: 1_0}\n")
    cfg = load_config(SFTConfig, f, ["train.micro_batch_size=10"])
    assert (cfg.train.seed, cfg.train.max_steps, cfg.train.threads, cfg.train.save_every) == (0, 7, 0, 16)
    assert cfg.train.keep_checkpoints == 10 and cfg.train.micro_batch_size == 10
    assert cfg.log.run_name == "010"


def test_a_colon_number_that_yaml_reads_as_base_60_is_an_error(tmp_path):
    """PyYAML follows YAML 1.1: `max_steps: 1:30` loaded as 90 and `lr: 1:30.5` as 90.5, silently (and
    so did the override `train.max_steps=1:30`), and `run_name: 1:30` was refused as "not a valid
    string". Such a value is an error naming the line, the dotted field, the text and the number;
    quoted text, colon text YAML 1.1 keeps as text (0:30, 12:60) and a text field's override stay."""
    f = tmp_path / "c.yaml"
    f.write_text("data: {train_file: a.jsonl}\ntrain:\n  max_steps: 1:30\n")
    with pytest.raises(ConfigError, match=r"c\.yaml, line 3: train\.max_steps: 1:30 would be read as the base-60 "
                                          r"number 90 \(YAML 1\.1\); quote it \('1:30'\) for text, or write 90$"):
        load_config(SFTConfig, f)
    f.write_text("data: {train_file: a.jsonl}\nlog: {run_name: 1:30}\n")
    with pytest.raises(ConfigError, match=r"line 2: log\.run_name: 1:30 would be read as the base-60 number 90 "):
        load_config(SFTConfig, f)
    f.write_text("data: {train_file: a.jsonl}\noptim: {lr: 1:30.5}\n")
    with pytest.raises(ConfigError, match=r"optim\.lr: 1:30\.5 would be read as the base-60 number 90\.5 .*90\.5$"):
        load_config(SFTConfig, f)
    with pytest.raises(ConfigError, match=r"^train\.max_steps: 1:30 would be read as the base-60 number 90"):
        load_config(SFTConfig, None, ["data.train_file=x", "train.max_steps=1:30"])
    f.write_text("data: {train_file: a.jsonl}\nlog: {run_name: '1:30', project: 0:30}\n"
                 "model: {name_or_path: 12:60}\n")
    cfg = load_config(SFTConfig, f, ["data.response_key=1:30"])
    assert (cfg.log.run_name, cfg.log.project, cfg.model.name_or_path) == ("1:30", "0:30", "12:60")
    assert cfg.data.response_key == "1:30"


def test_overrides_take_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data: {train_file: a.jsonl}\noptim: {lr: 0.1}\n")
    cfg = load_config(SFTConfig, f, ["optim.lr=0.5", "train.max_steps=7"])
    assert cfg.optim.lr == 0.5 and cfg.train.max_steps == 7 and cfg.data.train_file == "a.jsonl"


def test_a_text_field_override_keeps_its_text():
    """Overrides were parsed as YAML whatever the field: a Jinja template with '#' became null (the
    tokenizer's own template trained, silently), 'run #2' lost its end, 2024 was a number."""
    template = "### Instruction: {% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg = load_config(SFTConfig, None, ["data.train_file=x", f"data.chat_template={template}",
                                        "log.run_name=lr 1e-5 #2", "optim.lr=3e-4"])
    assert cfg.data.chat_template == template and cfg.log.run_name == "lr 1e-5 #2" and cfg.optim.lr == 3e-4
    assert load_config(SFTConfig, None, ["data.train_file=x", "log.run_name=2024"]).log.run_name == "2024"
    assert load_config(SFTConfig, None, ["data.train_file=x", "data.chat_template=null"]).data.chat_template is None
    # A value wholly quoted, as a script passes it without a shell to strip them, loses its quotes;
    # quotes inside the text stay.
    quoted = load_config(SFTConfig, None, ["data.train_file=x", 'log.run_name="run #2"'])
    assert quoted.log.run_name == "run #2"
    assert load_config(SFTConfig, None, ["data.train_file=x", "log.run_name='2024'"]).log.run_name == "2024"
    assert load_config(SFTConfig, None, ["data.train_file=x", 'log.run_name=say "hi"']).log.run_name == 'say "hi"'


def test_a_pipeline_stage_override_reads_the_stages_field_types():
    """Inside a pipeline's sft/rm/ppo section every value was parsed as YAML: run_name=2024 was
    refused as a number, "exp #2" became "exp", prompt_key=yes a boolean."""
    from turborlhf.config import PipelineConfig

    cfg = load_config(PipelineConfig, None, ["sft.log.run_name=exp #2", "rm.log.run_name=2024",
                                             "ppo.data.prompt_key=yes", "ppo.optim.lr=1e-6", "sft.train.max_steps=3"])
    assert cfg.sft["log"]["run_name"] == "exp #2" and cfg.rm["log"]["run_name"] == "2024"
    assert cfg.ppo["data"]["prompt_key"] == "yes" and float(cfg.ppo["optim"]["lr"]) == 1e-6
    assert cfg.sft["train"]["max_steps"] == 3


def test_partial_section_override_keeps_command_defaults():
    from turborlhf.config import PPOConfig

    cfg = load_config(PPOConfig, None, ["reward_model=r", "data.prompts_file=p", "optim.warmup_steps=3",
                                        "train.seed=3"])
    assert cfg.optim.lr == 1e-6 and cfg.optim.schedule == "constant" and cfg.optim.warmup_steps == 3
    assert cfg.train.max_steps == 20 and cfg.train.seed == 3


@pytest.mark.parametrize("argv, field", [
    (["--optim.lr"], "optim.lr"),                          # a flag without its value was lr = 1.0
    (["--optim.lr", "--train.max_steps", "3"], "optim.lr"),
    (["train.max_steps=true"], "train.max_steps"),         # was max_steps = 1
    (["optim.max_grad_norm=false"], "optim.max_grad_norm"),  # was 0.0: clipping silently off
    (["log.progress=1"], "log.progress"),                  # a number is not true/false
    (["--no.such"], "no.such"),
])
def test_strict_overrides_name_the_field(argv, field, capsys):
    from turborlhf.cli import _split_overrides

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(SFTConfig, None, ["data.train_file=x", *_split_overrides(argv, SFTConfig)])
    assert main(["sft", "data.train_file=x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err


@pytest.mark.parametrize("cmd, overrides, field", [
    ("sft", ["optim.betas=[0.9,1.5]"], "optim.betas"),           # was torch's "invalid betas" traceback
    ("sft", ["optim.betas=[true,0.9]"], "optim.betas"),          # was beta1 = 1.0
    ("sft", ["train.epochs=.inf"], "train.epochs"),              # was an OverflowError traceback
    ("sft", ["optim.lr=nan"], "optim.lr"),
    ("ppo", ["algo.eps_clip=1.5"], "algo.eps_clip"),             # the rest failed inside a worker, after start-up
    ("ppo", ["algo.dual_clip=0.5"], "algo.dual_clip"),
    ("ppo", ["algo.value_clip=-1"], "algo.value_clip"),
    ("ppo", ["algo.eps_clip_high=0"], "algo.eps_clip_high"),
    ("ppo", ["algo.kl_coef=0", "algo.kl_target=1"], "kl_target"),
    ("ppo", ["rollout.min_new_tokens=65", "rollout.max_new_tokens=64"], "min_new_tokens"),
    ("conditional-sft", ["tags.format=<good>"], "tags"),          # was accepted: one tag for every bin
    ("conditional-sft", ["tags.n_bins=3", "tags.generation_bin=3"], "generation_bin"),
])
def test_values_that_fail_late_are_refused_at_load(cmd, overrides, field, capsys):
    required = {"sft": ["data.train_file=x"], "ppo": ["reward_model=r", "data.prompts_file=p"],
                "conditional-sft": ["reward_model=r", "data.train_file=x"]}[cmd]
    assert main([cmd, *required, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err, err


@pytest.mark.parametrize("override, field", [("data.test_prompts_file=t.jsonl", "data.test_prompts_file"),
                                             ("train.eval_every=5", "train.eval_every")])
def test_ppo_refuses_the_fields_it_never_read(override, field, capsys):
    """PPO has no periodic held-out evaluation: setting its fields is an error naming them, not a no-op."""
    from turborlhf.config import PPOConfig

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(PPOConfig, None, ["reward_model=r", "data.prompts_file=p", override])
    assert main(["ppo", "reward_model=r", "data.prompts_file=p", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err
    assert load_config(SFTConfig, None, ["data.train_file=x", "data.test_file=y", "train.eval_every=5"]
                       ).train.eval_every == 5
    with pytest.raises(ConfigError, match="train.eval_every=5 evaluates data.test_file, which is not set"):
        load_config(SFTConfig, None, ["data.train_file=x", "train.eval_every=5"])     # it evaluated nothing


@pytest.mark.parametrize("override, field", [("train.eval_every=5", "train.eval_every"),
                                             ("train.save_every=2", "train.save_every")])
def test_rejection_sampling_refuses_the_train_fields_it_never_read(override, field, capsys):
    """Rejection sampling takes the SFT loop's `train` section but checkpoints once per round and has
    no held-out evaluation: `train.eval_every` and `train.save_every` were accepted and did nothing.
    Setting either is an error naming it; 0 (their default) still loads."""
    from turborlhf.config import RejectionSamplingConfig

    required = ["reward_model=r", "data.prompts_file=p"]
    with pytest.raises(ConfigError, match=field.replace(".", r"\.") + r"=\d+ is not used by rejection sampling"):
        load_config(RejectionSamplingConfig, None, [*required, override])
    assert main(["rejection-sampling", *required, override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err
    cfg = load_config(RejectionSamplingConfig, None, [*required, "train.eval_every=0", "train.save_every=0"])
    assert (cfg.train.eval_every, cfg.train.save_every) == (0, 0)


def test_conditional_sft_eval_every_needs_a_test_file(capsys):
    """Conditional SFT runs the SFT loop, whose `train.eval_every` evaluates `data.test_file`, but it
    lacked the check sft, rm, dpo and kto have: `train.eval_every` without a test file evaluated
    nothing, silently. It is an error naming both fields now; with a test file it loads."""
    from turborlhf.config import ConditionalSFTConfig

    required = ["reward_model=r", "data.train_file=x"]
    with pytest.raises(ConfigError, match=r"train\.eval_every=5 evaluates data\.test_file, which is not set$"):
        load_config(ConditionalSFTConfig, None, [*required, "train.eval_every=5"])
    assert main(["conditional-sft", *required, "train.eval_every=5"]) == 2
    assert "train.eval_every=5" in capsys.readouterr().err
    cfg = load_config(ConditionalSFTConfig, None, [*required, "train.eval_every=5", "data.test_file=t"])
    assert cfg.train.eval_every == 5 and cfg.data.test_file == "t"


def test_bare_flag_sets_a_true_false_field_and_numbers_stay_numbers():
    from turborlhf.cli import _split_overrides

    cfg = load_config(SFTConfig, None, ["data.train_file=x", *_split_overrides(
        ["--model.gradient_checkpointing", "--optim.lr", "1e-5", "--train.max_steps", "3", "--log.progress",
         "false", "--optim.max_grad_norm", "2"], SFTConfig)])
    assert cfg.model.gradient_checkpointing is True and cfg.optim.lr == 1e-5 and cfg.train.max_steps == 3
    assert cfg.log.progress is False and cfg.optim.max_grad_norm == 2.0


def test_a_flag_value_holding_an_equals_sign_is_the_flags_value():
    """"--log.run_name lr=1e-5" and "--data.train_file run=2/train.jsonl" were read as a bare flag
    followed by another override, and refused ("no value given")."""
    from turborlhf.cli import _split_overrides

    got = _split_overrides(["--log.run_name", "lr=1e-5", "--data.train_file", "run=2/t.jsonl",
                            "--model.gradient_checkpointing", "optim.lr=1e-4"], SFTConfig)
    assert got == ["log.run_name=lr=1e-5", "data.train_file=run=2/t.jsonl", "model.gradient_checkpointing=true",
                   "optim.lr=1e-4"]
    cfg = load_config(SFTConfig, None, got)
    assert cfg.log.run_name == "lr=1e-5" and cfg.data.train_file == "run=2/t.jsonl" and cfg.optim.lr == 1e-4


def test_an_unknown_key_close_to_a_field_is_suggested():
    with pytest.raises(ConfigError, match=r"optim\.lrr: Extra inputs are not permitted \(did you mean 'lr'\?\)"):
        load_config(SFTConfig, None, ["data.train_file=x", "optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"model\.lora\.rnak: .*did you mean 'rank'"):
        load_config(SFTConfig, None, ["data.train_file=x", "model.lora.rnak=4"])
    with pytest.raises(ConfigError) as e:
        load_config(SFTConfig, None, ["data.train_file=x", "optim.zzzz=1"])
    assert "did you mean" not in str(e.value)


def test_a_tilde_in_a_path_field_is_the_home_directory(tmp_path, monkeypatch):
    """``output_dir: ~/runs/x`` wrote to ./~/runs/x."""
    from turborlhf.config import PPOConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(SFTConfig, None, ["data.train_file=~/a.jsonl", "output_dir=~/runs/x", "model.name_or_path=~/m"])
    assert (cfg.output_dir, cfg.data.train_file, cfg.model.name_or_path) == \
        (f"{tmp_path}/runs/x", f"{tmp_path}/a.jsonl", f"{tmp_path}/m")
    ppo = PPOConfig(reward_model="~/rm", data={"prompts_file": "p"}, output_dir="~/o")
    assert (ppo.reward_model, ppo.output_dir, ppo.data.prompts_file) == (f"{tmp_path}/rm", f"{tmp_path}/o", "p")


def test_a_config_file_without_data_or_reward_is_refused_in_one_line(tmp_path, capsys):
    """The data file (PPO's reward too) is no longer required to build a config, as in TRL, where the
    Python API's trainer gets it; a run still needs it: the command line refuses a file without it in
    one line naming the field (it was pydantic's "invalid config" block)."""
    f = tmp_path / "c.yaml"
    f.write_text(f"output_dir: {tmp_path / 'out'}\n")
    for cmd, fields in (("sft", ["data.train_file: required"]), ("rm", ["data.train_file: required"]),
                        ("dpo", ["data.train_file: required"]), ("kto", ["data.train_file: required"]),
                        ("grpo", ["data.prompts_file: required", "no reward: set reward_model or rewards"])):
        assert main([cmd, "--config", str(f)]) == 2, cmd
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and all(x in err[0] for x in fields), (cmd, err)
    assert not (tmp_path / "out").exists()
    assert load_config(PPOConfig, None, ["data.prompts_file=p", "reward_model=r"]).data.prompts_file == "p"
    with pytest.raises(ConfigError, match=r"^sft\.data\.train_file: required"):      # a pipeline stage's prefix
        from turborlhf.config import validate_section
        validate_section(SFTConfig, {}, "sft")
