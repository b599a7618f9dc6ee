"""End-to-end DPO / KTO / eval-dpo on the tiny model and the real HH sample (converted with the tiny
tokenizer). Runs use one torch thread: the tiny model gains nothing from more, and on a shared
machine oversubscribed threads are many times slower."""
import json
import math
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO, max_weight_diff, metrics, rewind_to, run_cli, weights

LN2 = math.log(2)


@pytest.fixture
def counters(monkeypatch):
    """Count reference log-prob computations and model loads inside the DPO/KTO trainers."""
    import turborlhf.models.load as L
    import turborlhf.models.reference as R
    import turborlhf.trainers.dpo as D

    calls = {"ref": 0, "load": 0}
    real_ref, real_load = R.compute_reference_logps, R.load_causal_lm

    def ref(*a, **k):
        calls["ref"] += 1
        return real_ref(*a, **k)

    def load(*a, **k):
        calls["load"] += 1
        return real_load(*a, **k)

    monkeypatch.setattr(R, "compute_reference_logps", ref)
    for module in (L, R, D):  # the trainers' policy loads (load_trainable), the reference, eval-dpo
        monkeypatch.setattr(module, "load_causal_lm", load)
    return calls


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    from turborlhf.models.tiny import save_tiny_causal_lm

    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny_other"), seed=1)


def _dpo(tiny_model, tiny_data, out, *extra):
    run_cli("dpo", "--config", REPO / "configs/tiny/dpo.yaml", f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"data.test_file={tiny_data / 'test_pairs.jsonl'}",
            "data.max_samples=8", "data.max_test_samples=8", f"output_dir={out}", "train.keep_checkpoints=3",
            "train.threads=1", *extra)


def _kto(tiny_model, tiny_data, out, *extra, train_file="train_kto.jsonl"):
    run_cli("kto", "--config", REPO / "configs/tiny/kto.yaml", f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / train_file}", f"data.test_file={tiny_data / 'test_kto.jsonl'}",
            "data.max_samples=16", "data.max_test_samples=8", f"output_dir={out}", "train.keep_checkpoints=3",
            "train.threads=1", *extra)


def _train_rows(out):
    return [r for r in metrics(out) if "train/loss" in r]


# ---------------------------------------------------------------------------------------- DPO


def test_dpo_trains_caches_reference_once_and_resumes(tiny_model, tiny_data, tmp_path, counters):
    from transformers import AutoModelForCausalLM

    from turborlhf.trainers.dpo import eval_dpo

    out = tmp_path / "dpo"
    _dpo(tiny_model, tiny_data, out)  # 8 pairs, 4 per step, 4 steps = 2 epochs
    rows = _train_rows(out)
    assert len(rows) == 4 and all(math.isfinite(r["train/loss"]) for r in rows)
    # policy == reference at step 1: h = 0, so loss = ln 2 and every implicit reward is 0 up to the
    # rounding of two differently batched forwards (~1e-6 on AVX2-only CPUs, exactly 0 on others);
    # accuracy (a strict >) counts that rounding, so it is not asserted here
    assert abs(rows[0]["train/loss"] - LN2) < 1e-5
    assert abs(rows[0]["rewards/margin"]) < 1e-5
    assert abs(rows[0]["rewards/chosen"]) < 1e-5 and abs(rows[0]["rewards/rejected"]) < 1e-5
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "train/grad_norm"):
        assert key in rows[0]
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    assert any("eval/accuracy" in r and "eval/rewards/margin" in r for r in metrics(out))
    # reference log-probs: computed once for both epochs, by the policy itself (one model load)
    assert counters == {"ref": 1, "load": 1} and (out / "ref_logps.pt").exists()
    # parameters changed; the export is a plain HF causal LM
    assert max_weight_diff(weights(tiny_model), weights(out)) > 1e-4
    AutoModelForCausalLM.from_pretrained(out)
    # eval-dpo's numbers are the trainer's final eval numbers
    ev = json.loads((out / "eval.json").read_text())
    res = eval_dpo(str(out), str(tiny_model), str(tiny_data / "test_pairs.jsonl"), beta=0.1, max_len=96, limit=8,
                   dtype="fp32")
    assert res["n"] == ev["n"] == 8 and res["accuracy"] == ev["accuracy"]
    assert abs(res["margin"] - ev["margin"]) < 1e-5
    # resume after a crash at step 2: cached reference log-probs, only the checkpoint is loaded
    final = weights(out)
    rewind_to(out, 2)
    before = dict(counters)  # eval_dpo loaded two models
    _dpo(tiny_model, tiny_data, out, "--resume")
    assert counters == {"ref": before["ref"], "load": before["load"] + 1}
    assert max_weight_diff(final, weights(out)) < 1e-6
    assert len(_train_rows(out)) == 4


@pytest.mark.parametrize("loss,extra,step1_loss", [
    ("ipo", ["algo.ipo_normalize_by_length=true"], 25.0),          # (0 - 1/(2β))² at h = 0
    ("cdpo", ["algo.label_smoothing=0.1", "algo.nll_coef=0.5"], None),
    ("robust", ["algo.label_smoothing=0.1"], LN2),
])
def test_dpo_loss_variants_run(tiny_model, tiny_data, tmp_path, loss, extra, step1_loss):
    out = tmp_path / loss
    _dpo(tiny_model, tiny_data, out, f"algo.loss={loss}", "train.max_steps=2", "train.save_every=0", *extra)
    rows = _train_rows(out)
    assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)
    if step1_loss is None:  # cDPO at h = 0 is ln 2; the NLL term adds nll_coef · NLL
        step1_loss = LN2 + 0.5 * rows[0]["train/nll"]
    assert abs(rows[0]["train/loss"] - step1_loss) < 1e-4
    assert max_weight_diff(weights(tiny_model), weights(out)) > 1e-4


def test_dpo_reference_free_loads_no_reference(tiny_model, tiny_data, tmp_path, counters):
    out = tmp_path / "dpo_free"
    _dpo(tiny_model, tiny_data, out, "algo.reference_free=true", "train.max_steps=2", "train.save_every=0")
    rows = _train_rows(out)
    assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)
    assert counters == {"ref": 0, "load": 1} and not (out / "ref_logps.pt").exists()


def test_dpo_separate_reference_is_loaded_then_cached(tiny_model, other_model, tiny_data, tmp_path, counters):
    out = tmp_path / "dpo_ref"
    _dpo(tiny_model, tiny_data, out, f"reference={other_model}", "train.max_steps=1", "train.save_every=0")
    assert counters == {"ref": 1, "load": 2}
    assert abs(_train_rows(out)[0]["train/loss"] - LN2) > 1e-3  # policy ≠ reference: h ≠ 0
    # same data and reference: the cache is reused; another reference invalidates it
    _dpo(tiny_model, tiny_data, out, f"reference={other_model}", "train.max_steps=1", "train.save_every=0")
    assert counters == {"ref": 1, "load": 3}
    _dpo(tiny_model, tiny_data, out, "train.max_steps=1", "train.save_every=0")
    assert counters == {"ref": 2, "load": 4}
    assert abs(_train_rows(out)[0]["train/loss"] - LN2) < 1e-5


def test_eval_dpo_json(tiny_model, other_model, tiny_data):
    from turborlhf.trainers.dpo import eval_dpo

    data = tiny_data / "test_pairs.jsonl"
    proc = subprocess.run([sys.executable, "-m", "turborlhf", "eval-dpo", "--policy", str(other_model),
                           "--reference", str(tiny_model), "--data", str(data), "--limit", "6", "--max-len", "96",
                           "--beta", "0.2", "--json"], capture_output=True, text=True, check=True, cwd=REPO)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["n"] == 6 and 0.0 <= res["accuracy"] <= 1.0 and res["beta"] == 0.2
    assert math.isclose(res["margin"], res["chosen_reward_mean"] - res["rejected_reward_mean"], abs_tol=1e-5)
    # a policy against itself: every implicit reward is exactly 0, so strict accuracy is 0
    same = eval_dpo(str(tiny_model), str(tiny_model), str(data), max_len=96, limit=6, dtype="fp32")
    assert same["accuracy"] == 0.0 and same["margin"] == 0.0 and same["n"] == 6
    from turborlhf.trainers.dpo import eval_dpo_main     # out of range: --limit -1 dropped the last pair silently
    for flag, value in (("--limit", "-1"), ("--max-len", "1"), ("--beta", "0"), ("--batch-size", "0")):
        with pytest.raises(SystemExit, match="2"):
            eval_dpo_main(["--policy", "p", "--reference", "r", "--data", "d", flag, value])


# ---------------------------------------------------------------------------------------- KTO


def test_kto_trains_caches_reference_once_and_resumes(tiny_model, tiny_data, tmp_path, counters):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "kto"
    _kto(tiny_model, tiny_data, out)
    rows = _train_rows(out)
    assert len(rows) == 4 and all(math.isfinite(r["train/loss"]) for r in rows)
    # policy == reference: r = 0 and z0 = 0, so every example's loss is 1 - σ(0) = 0.5
    # (exactly 0 on the CPU; differently batched GPU forwards round to ~1e-5)
    assert abs(rows[0]["train/loss"] - 0.5) < 1e-6 and abs(rows[0]["policy/kl"]) < 1e-4
    # the KL reference point is clamped at 0, so "kl >= 0" could not fail: recompute the final
    # held-out one, max(0, mean log-ratio of the exported policy over the test set's mismatched
    # pairs), from the exported model and the reference
    from turborlhf.trainers.kto import _kl_pairs, load_kto, load_tokenizer, sequence_logps

    tok = load_tokenizer(str(tiny_model))
    test_kl = _kl_pairs(tok, load_kto(tiny_data / "test_kto.jsonl", tok)[:8], range(8), 96)
    logps = [sequence_logps(AutoModelForCausalLM.from_pretrained(m), tok.pad_token_id, test_kl, "fp32", 8)
             for m in (out, tiny_model)]
    raw = float((logps[0] - logps[1]).mean())
    assert raw != 0.0 and abs(metrics(out)[-1]["eval/kl"] - max(0.0, raw)) < 1e-4
    assert any("rewards/margin" in r for r in rows) and any("eval/kl" in r for r in metrics(out))
    assert counters == {"ref": 1, "load": 1} and (out / "ref_logps.pt").exists()
    assert max_weight_diff(weights(tiny_model), weights(out)) > 1e-4
    AutoModelForCausalLM.from_pretrained(out)
    final = weights(out)
    rewind_to(out, 2)
    _kto(tiny_model, tiny_data, out, "--resume")
    assert counters == {"ref": 1, "load": 2}
    assert max_weight_diff(final, weights(out)) < 1e-6
    assert len(_train_rows(out)) == 4


def test_kto_from_pairs_warns_on_weights_and_micro_batching_keeps_the_gradient(tiny_model, tiny_data, tmp_path):
    common = ("train.max_steps=1", "train.save_every=0", "algo.desirable_weight=2.0", "optim.lr=1e-4")
    with pytest.warns(UserWarning, match=r"outside \[1, 4/3\]"):
        _kto(tiny_model, tiny_data, tmp_path / "a", *common, "train.micro_batch_size=4", train_file="train_pairs.jsonl")
    with pytest.warns(UserWarning, match=r"outside \[1, 4/3\]"):
        _kto(tiny_model, tiny_data, tmp_path / "b", *common, "train.micro_batch_size=1",
             train_file="train_pairs.jsonl")
    a, b = _train_rows(tmp_path / "a")[0], _train_rows(tmp_path / "b")[0]
    # z0 is estimated once per step, so splitting the step into micro-batches changes nothing
    assert abs(a["train/loss"] - b["train/loss"]) < 1e-6
    assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 1e-5 * a["train/grad_norm"]


def test_kto_mismatched_pairs_rotation():
    from turborlhf.trainers.kto import mismatch_sources

    assert mismatch_sources(["a", "b", "c"]) == [2, 0, 1]  # TRL: prompt j gets completion j-1
    assert mismatch_sources(["a", "a", "b", "b"]) == [2, 3, 0, 1]  # shift 1 would reuse a's own answers
    assert mismatch_sources(["a", "a"]) == [1, 0]  # no mismatch possible: fall back to the rotation
    with pytest.raises(ValueError):
        mismatch_sources(["a"])


def test_a_reference_of_another_vocabulary_is_refused_and_the_cache_is_never_unpickled(tiny_model, tiny_data,
                                                                                       tmp_path, capsys):
    """A reference with another tokenizer scored the policy's token ids as its own (meaningless
    log-probs, or an IndexError for a smaller embedding); `ref_logps.pt` found in output_dir was
    unpickled with code execution allowed, on a fresh run too."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from turborlhf.cli import main
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.models.tiny import tiny_llama_config

    other_tok = make_tiny_tokenizer()
    other_tok.add_tokens([f"<ref{i}>" for i in range(8)])
    AutoModelForCausalLM.from_config(tiny_llama_config(len(other_tok))).save_pretrained(tmp_path / "other")
    other_tok.save_pretrained(tmp_path / "other")
    AutoModelForCausalLM.from_config(tiny_llama_config(16)).save_pretrained(tmp_path / "small")   # no tokenizer
    base = ["dpo", "--config", str(REPO / "configs/tiny/dpo.yaml"), f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", "data.max_samples=8", "train.max_steps=1",
            "train.threads=1", "log.tensorboard=false"]
    for ref, why in (("other", "its tokenizer .* differs from the policy's"), ("small", "its embedding has 16 rows")):
        assert main(base + [f"reference={tmp_path / ref}", f"output_dir={tmp_path / ref}_run"]) == 2
        assert __import__("re").search(f"error: reference .*{ref}: {why}", capsys.readouterr().err)

    class Planted:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)
    (tmp_path / "run").mkdir()
    torch.save({"key": Planted()}, tmp_path / "run" / "ref_logps.pt")
    assert main(base + [f"output_dir={tmp_path / 'run'}"]) == 0
    assert not (tmp_path / "ran").exists()


def test_kto_refuses_a_one_example_test_set(tiny_model, tiny_data, tmp_path, capsys):
    """One held-out example gave no eval/* metrics and no eval.json, silently."""
    from turborlhf.cli import main

    assert main(["kto", "--config", str(REPO / "configs/tiny/kto.yaml"), f"model.name_or_path={tiny_model}",
                 f"data.train_file={tiny_data / 'train_kto.jsonl'}", f"data.test_file={tiny_data / 'test_kto.jsonl'}",
                 "data.max_test_samples=1", "train.max_steps=1", f"output_dir={tmp_path / 'k'}"]) == 2
    assert "data.test_file: KTO's evaluation needs at least 2 examples" in capsys.readouterr().err


def test_kto_refuses_a_one_example_train_set(tiny_model, tiny_data, tmp_path, capsys):
    """One training example ended in a ValueError traceback."""
    from turborlhf.cli import main

    base = ["kto", "--config", str(REPO / "configs/tiny/kto.yaml"), f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_kto.jsonl'}", "data.test_file=null", "train.max_steps=1"]
    assert main(base + ["data.max_samples=1", f"output_dir={tmp_path / 'k'}"]) == 2
    err = capsys.readouterr().err
    assert "data.train_file: KTO needs at least 2 training examples" in err and "got 1 (data.max_samples)" in err
