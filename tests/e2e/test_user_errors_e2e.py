"""Bad input is one line ``error: ...`` naming the file, path or field, with exit code 2 (the full
traceback only under ``--debug``); data is checked before any model loads; a causal LM given as a
reward model for scoring is refused."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO


def _cli(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), TURBORLHF_THREADS="1", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "turborlhf", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def _one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    err = [l for l in res.stderr.splitlines()    # progress bars and the data's truncation count aside
           if l.strip() and "it/s]" not in l and "examples/s]" not in l and " were cut at data.max_len" not in l]
    assert res.returncode == 2, res.stderr[-3000:]
    assert len(err) == 1 and err[0].startswith("error: "), res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def _sft(tiny_model, train_file, tmp_path, *extra):
    return _cli("sft", "--config", REPO / "configs/tiny/sft.yaml", f"model.name_or_path={tiny_model}",
                f"data.train_file={train_file}", f"output_dir={tmp_path / 'out'}", "log.tensorboard=false", *extra)


def test_data_errors_are_one_line_before_any_model_loads(tiny_model, tmp_path):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"prompt": "p", "response": "r"}).encode() + b"\n"
                       + '{"prompt": "caf\xe9", "response": "r"}\n'.encode("latin-1"))
    _one_line_error(_sft(tiny_model, latin1, tmp_path), str(latin1), "line 2 is not UTF-8")
    _one_line_error(_sft(tiny_model, tmp_path / "missing.jsonl", tmp_path), "missing.jsonl", "no such file")
    # a directory is read as a save_to_disk directory or a folder of data files (datasets): this one is neither
    _one_line_error(_sft(tiny_model, tmp_path, tmp_path), "neither a save_to_disk directory nor a directory of data files")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    res = _sft(tiny_model, bad, tmp_path)
    _one_line_error(res, str(bad), "bad_json")
    assert "Loading weights" not in res.stderr                       # the data was checked first


def test_debug_shows_the_traceback(tiny_model, tmp_path):
    res = _sft(tiny_model, tmp_path / "missing.jsonl", tmp_path, "--debug")
    assert res.returncode != 0 and "Traceback" in res.stderr and "ConfigError: data.train_file" in res.stderr


def test_a_directory_that_is_not_a_model(tiny_data, tmp_path):
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    _one_line_error(_sft(empty, tiny_data / "train_pairs.jsonl", tmp_path), str(empty), "not a model directory")
    _one_line_error(_sft(tmp_path / "nowhere", tiny_data / "train_pairs.jsonl", tmp_path), "no such model directory")


def test_bad_reward_function_path(tiny_model, tiny_rm, tiny_data, tmp_path):
    res = _cli("ppo", "--config", REPO / "configs/tiny/grpo.yaml", f"actor.name_or_path={tiny_model}",
               f"reward_model={tiny_rm}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}",
               f"output_dir={tmp_path / 'ppo'}", "rewards=[{kind: function, path: \"nowhere/rf.py:score\"}]")
    _one_line_error(res, "nowhere/rf.py", "not found")


def test_causal_lm_as_reward_model_is_refused_for_scoring(tiny_model, tiny_rm, tiny_data, tmp_path):
    """A causal-LM directory gave a random score head, its warning muted: PPO learned from noise and
    eval-rm reported about 0.5."""
    res = _cli("eval-rm", "--model", tiny_model, "--data", tiny_data / "test_pairs.jsonl", "--limit", "4")
    _one_line_error(res, str(tiny_model), "not a reward model", "LlamaForCausalLM")
    res = _cli("ppo", "--config", REPO / "configs/tiny/ppo.yaml", f"actor.name_or_path={tiny_model}",
               f"reward_model={tiny_model}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}",
               f"output_dir={tmp_path / 'ppo'}", "train.max_steps=1", "log.tensorboard=false")
    _one_line_error(res, "not a reward model")
    assert "Loading weights" not in res.stderr                      # refused before the actor loaded
    res = _cli("rejection-sampling", "--config", REPO / "configs/tiny/rejection_sampling.yaml",
               f"model.name_or_path={tiny_model}", f"reward_model={tiny_model}",
               f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}", f"output_dir={tmp_path / 'rs'}")
    _one_line_error(res, "not a reward model")
    assert "Loading weights" not in res.stderr
    # a critic built from a causal LM (fresh head, to be trained) stays legitimate, and a trained RM scores
    from turborlhf.config import ModelCfg
    from turborlhf.models.load import load_tokenizer, load_trainable
    from turborlhf.rewards.model import load_reward_model

    tok = load_tokenizer(str(tiny_model))
    assert load_trainable("scalar", ModelCfg(name_or_path=str(tiny_model)), tok).score.weight.requires_grad
    load_reward_model(str(tiny_rm), tok)


@pytest.mark.parametrize("lines, strict", [([], False), (["not json", "{}"], False), (["not json"], True)])
def test_prepare_data_fails_when_nothing_valid_or_strict(lines, strict, tiny_model, tiny_data, tmp_path):
    src = tmp_path / "raw.jsonl.gz"
    good = (REPO / "data/hh-rlhf/harmless-base-1800.jsonl.gz")
    with gzip.open(good, "rt") as f:
        first = f.readline().strip()
    body = lines + ([first] if strict else [])          # --strict: one bad line among good ones fails too
    with gzip.open(src, "wt") as f:
        f.write("".join(l + "\n" for l in body))
    res = _cli("prepare-data", "hh-rlhf", "--input", src, "--output-dir", tmp_path / "out", "--tokenizer", tiny_model,
               *(["--strict"] if strict else []))
    _one_line_error(res, str(src), "bad line" if lines else "no valid pair")


def test_a_non_finite_step_is_one_line_with_exit_code_1(tiny_model, tiny_data, tmp_path):
    """A run that would go on silently wrong (here: weights blown to inf by lr 1e38) stops with one
    line naming the role and tensor, exit code 1, no traceback (`turborlhf.errors.RunError`)."""
    res = _sft(tiny_model, tiny_data / "train_pairs.jsonl", tmp_path, "optim.lr=1e38", "optim.max_grad_norm=0",
               "train.max_steps=4", "log.progress=false")
    err = [l for l in res.stderr.splitlines() if l.startswith("error: ")]
    assert res.returncode == 1, res.stderr[-3000:]
    assert len(err) == 1 and "policy:" in err[0] and "Traceback" not in res.stderr, res.stderr[-3000:]


def test_freeze_layers_beyond_the_model_is_one_line(tiny_model, tiny_data, tmp_path):
    res = _sft(tiny_model, tiny_data / "train_pairs.jsonl", tmp_path, "model.freeze_layers=2")
    _one_line_error(res, "freeze_layers=2 must be below the model's 2 decoder layers")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # a config validator's error: "error: invalid config:" and the field's line, as for every section
    res = _sft(tiny_model, tiny_data / "train_pairs.jsonl", tmp_path, "model.freeze_layers=1", "model.lora.rank=4")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "model: Value error, freeze_layers and lora both choose what trains" in res.stderr


def test_a_device_the_host_lacks_is_one_line(tiny_model, tiny_data, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    _one_line_error(_sft(tiny_model, tiny_data / "train_pairs.jsonl", tmp_path, "model.device=cuda"),
                    "no CUDA device")


def test_prompts_that_cannot_take_the_new_tokens_are_one_line_before_any_model_loads(tiny_model, tiny_rm, tiny_data,
                                                                                      tmp_path):
    """The tiny model has 1024 positions: the engine refused the rollout mid-run."""
    res = _cli("ppo", "--config", REPO / "configs/tiny/ppo.yaml", f"actor.name_or_path={tiny_model}",
               f"reward_model={tiny_rm}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}",
               f"output_dir={tmp_path / 'out'}", "rollout.max_new_tokens=1020", "log.tensorboard=false")
    _one_line_error(res, "rollout.max_new_tokens=1020", "1024 positions")


def test_a_mistyped_model_path_a_lora_directory_and_a_stray_argument_are_one_line(tiny_model, tiny_data, tmp_path):
    """A relative path that does not exist reads as a hub id: transformers' OSError traceback, exit
    1. A LoRA adapter directory as the model to train: 'optimizer got an empty parameter list'. A
    stray positional argument exited 1."""
    _one_line_error(_sft("runs/no-such-sft", tiny_data / "train_pairs.jsonl", tmp_path),
                    "runs/no-such-sft: not a local directory")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model)}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (adapter / f).write_bytes((tiny_model / f).read_bytes())
    _one_line_error(_sft(adapter, tiny_data / "train_pairs.jsonl", tmp_path), "a LoRA adapter directory")
    _one_line_error(_sft(tiny_model, tiny_data / "train_pairs.jsonl", tmp_path, "stray.yaml"),
                    "unexpected argument 'stray.yaml'")


@pytest.mark.parametrize("name, args, flag", [
    ("eval-policy", ["--n", "0"], "--n: 0"),                 # printed NaN means (not JSON) and exited 0
    ("eval-policy", ["--n", "-1"], "--n: -1"),               # evaluated all prompts but the last
    ("eval-rm", ["--limit", "-1"], "--limit: -1"),           # scored all pairs but the last
])
def test_evaluation_counts_out_of_range_are_refused(tmp_path, capsys, name, args, flag):
    from turborlhf.evaluate import main

    need = (["--model", "m", "--data", "d"] if name == "eval-rm"
            else ["--policy", "p", "--reward-model", "r", "--prompts", "q"])
    with pytest.raises(SystemExit) as exit_:
        main(name, need + args)
    assert exit_.value.code == 2 and f"{flag} is out of range" in capsys.readouterr().err


@pytest.mark.parametrize("code, reason", [("EROFS", "Read-only file system"), ("ENOSPC", "No space left on device")])
def test_a_read_only_or_full_run_directory_is_one_line(code, reason, tiny_model, tiny_data, tmp_path, monkeypatch,
                                                       capsys):
    """An output_dir on a read-only or full disk printed OSError's traceback: the path and the reason
    now (exit 1; checkpoints are written whole or not at all). Other OSErrors keep their traceback."""
    import errno

    import turborlhf.engine.run as run
    from turborlhf.cli import main

    where = tmp_path / "out" / "config.yaml"

    def refuse(*a, **k):
        raise OSError(getattr(errno, code), reason, str(where))
    monkeypatch.setattr(run, "setup_run", refuse)
    args = ["sft", "--config", str(REPO / "configs/tiny/sft.yaml"), f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"output_dir={tmp_path / 'out'}"]
    assert main(args) == 1
    assert capsys.readouterr().err == f"error: {where}: {reason}\n"
    monkeypatch.setattr(run, "setup_run", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        main(args)


def test_paths_of_the_wrong_kind_are_one_line(tiny_model, tiny_data, tmp_path, capsys):
    """A directory as --config, --output or --samples-out, an --output-dir that is a file and a
    --test-fraction out of range were tracebacks (the output ones after all the work was done)."""
    from turborlhf.cli import main

    capsys.readouterr()
    assert main(["sft", "--config", str(tmp_path)]) == 2
    assert "cannot read it as a YAML config" in capsys.readouterr().err
    prompts = str(tiny_data / "test_prompts.jsonl")
    for argv in (["generate", "--model", str(tiny_model), "--prompts", prompts, "--output", str(tmp_path)],
                 ["eval-policy", "--policy", str(tiny_model), "--reward-model", "rm", "--prompts", prompts,
                  "--samples-out", str(tmp_path)]):
        with pytest.raises(SystemExit, match="2"):
            main(argv)
        assert "is a directory; give a file path" in capsys.readouterr().err
    hh = str(REPO / "data/hh-rlhf/harmless-base-1800.jsonl.gz")
    (tmp_path / "afile").write_text("")
    for extra, needle in ((["--output-dir", str(tmp_path / "pd"), "--test-fraction", "1.5"], "test_fraction"),
                          (["--output-dir", str(tmp_path / "afile")], "File exists")):
        assert main(["prepare-data", "hh-rlhf", "--input", hh, "--tokenizer", str(tiny_model), *extra]) == 2
        assert needle in capsys.readouterr().err
