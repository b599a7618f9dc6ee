"""Rejection sampling (best-of-n + SFT, iterated) and conditional SFT, end to end on the tiny model."""
import json
import math
import shutil

import pytest
import torch

from tests.e2e.helpers import REPO, max_weight_diff, metrics, run_cli, weights


def _rows(path):
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


# ----------------------------------------------------------------------------------------------
# Rejection sampling
# ----------------------------------------------------------------------------------------------

def test_select_best_hand_values():
    from turborlhf.trainers.rejection_sampling import round_prompts, select_best

    s = torch.tensor([[0.1, 0.9, 0.9], [-1.0, -2.0, -0.5], [2.0, 1.0, 0.0]])
    fin = torch.tensor([[True, True, True], [True, True, True], [False, True, True]])
    best, keep, _ = select_best(s, fin)
    assert best.tolist() == [1, 2, 0] and keep.all()          # first maximum on ties
    best, keep, sel = select_best(s, fin, min_score=0.0, missing_eos_penalty=1.5)
    assert best.tolist() == [1, 2, 1]                         # 2.0 - 1.5 < 1.0: the finished one wins
    assert keep.tolist() == [True, False, True]
    assert sel[2].tolist() == pytest.approx([0.5, 1.0, 0.0])
    with pytest.raises(ValueError):
        select_best(s, fin[:2])
    # a NaN score is never the winner (argmax took it: NaN compares as the maximum)
    nan = float("nan")
    best, keep, _ = select_best(torch.tensor([[0.5, nan, 0.2], [nan, nan, nan]]), torch.ones(2, 3, dtype=torch.bool),
                                min_score=0.0)
    assert best[0] == 0 and keep.tolist() == [True, False]
    r0, r1 = round_prompts(10, 4, 0, seed=1), round_prompts(10, 4, 1, seed=1)
    assert len(set(r0)) == 4 and not set(r0) & set(r1)       # rounds take fresh slices
    assert sorted(sum((round_prompts(10, 5, k, 1) for k in range(2)), [])) == list(range(10))


def _rs(tiny_model, tiny_rm, tiny_data, out, *extra):
    run_cli("rejection-sampling", "--config", REPO / "configs/tiny/rejection_sampling.yaml",
            f"model.name_or_path={tiny_model}", f"reward_model={tiny_rm}",
            f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}", "data.max_samples=16", f"output_dir={out}",
            *extra)


def test_rejection_sampling_rounds_selection_resume_export(tiny_model, tiny_rm, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "rs"
    _rs(tiny_model, tiny_rm, tiny_data, out)
    for k in (1, 2):
        rows = _rows(out / f"round_{k}" / "best.jsonl")
        assert len(rows) == 4
        for r in rows:                                        # the winner is the argmax of its candidates
            assert len(r["candidate_scores"]) == 3
            assert r["best_index"] == max(range(3), key=lambda j: (r["candidate_scores"][j], -j))
            assert r["score"] == max(r["candidate_scores"])
        m = json.loads((out / f"round_{k}" / "metrics.json").read_text())
        assert m["rollout/best_score_mean"] == pytest.approx(sum(r["score"] for r in rows) / 4, abs=1e-5)
        assert m["rollout/best_score_mean"] >= m["rollout/reward_mean"] - 1e-6
    assert {r["prompt"] for r in _rows(out / "round_1" / "best.jsonl")}.isdisjoint(
        {r["prompt"] for r in _rows(out / "round_2" / "best.jsonl")})
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("rollout/reward_mean", "rollout/best_score_mean", "rollout/best_of_n_gain", "train/loss",
                "timing/generate", "timing/score", "timing/train"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert max_weight_diff(weights(tiny_model), weights(out)) > 1e-6
    AutoModelForCausalLM.from_pretrained(out)

    # crash after round 1: resume redoes round 2 exactly
    final, round2 = weights(out), (out / "round_2" / "best.jsonl").read_text()
    shutil.rmtree(out / "checkpoints" / "step-000002")
    shutil.rmtree(out / "round_2")
    (out / "checkpoints" / "latest").write_text("step-000001")
    (out / "model.safetensors").unlink()
    _rs(tiny_model, tiny_rm, tiny_data, out, "--resume")
    assert (out / "round_2" / "best.jsonl").read_text() == round2
    assert max_weight_diff(final, weights(out)) < 1e-5
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_rejection_sampling_threshold_and_accumulate(tiny_model, tiny_rm, tiny_data, tmp_path):
    out = tmp_path / "rs2"
    _rs(tiny_model, tiny_rm, tiny_data, out, "algo.min_score=1.0e9", "algo.rounds=1", "rollout.engine=hf")
    rows = _rows(out / "round_1" / "best.jsonl")
    assert not any(r["kept"] for r in rows)                   # nothing beats the threshold: no update
    assert max_weight_diff(weights(tiny_model), weights(out)) == 0.0
    out = tmp_path / "rs3"
    _rs(tiny_model, tiny_rm, tiny_data, out, "algo.accumulate=true", "algo.missing_eos_penalty=100.0",
        "algo.score_truncated_with_eos=false", "model.lora.rank=4")     # LoRA: engine built and synced merged
    assert metrics(out)[1]["train/examples"] == 8             # winners of rounds 1 and 2
    for r in _rows(out / "round_2" / "best.jsonl"):           # a finished candidate beats any unfinished one
        assert r["finished"] or not any(r["candidate_finished"])


# ----------------------------------------------------------------------------------------------
# Conditional SFT
# ----------------------------------------------------------------------------------------------

def test_nan_scores_stay_out_of_the_round_metrics_and_the_bins():
    """One NaN score made every rejection-sampling round metric NaN, and put every conditional-SFT
    example in the best bin (all edges NaN)."""
    from turborlhf.errors import RunError
    from turborlhf.trainers.conditional_sft import _without_nan_scores, bin_edges
    from turborlhf.trainers.rejection_sampling import BEST_SCORE, GAIN, _round_metrics, select_best

    scores = torch.tensor([[1.0, float("nan")], [3.0, 0.0]])
    fin = torch.ones(2, 2, dtype=torch.bool)
    best, keep, _ = select_best(scores, fin)
    m = _round_metrics(scores, fin, best, keep, [[1], [1, 2], [1], [1]], 1.0)
    assert m["rollout/reward_mean"] == pytest.approx(4 / 3) and m[BEST_SCORE] == 2.0
    assert m[GAIN] == pytest.approx(2 - 4 / 3) and not math.isnan(m["rollout/reward_std"])
    with pytest.raises(ValueError, match="NaN"):
        bin_edges(torch.tensor([0.0, float("nan"), 1.0]), 2)
    rows, kept = _without_nan_scores([{"i": 0}, {"i": 1}, {"i": 2}], torch.tensor([0.5, float("nan"), 2.0]))
    assert [r["i"] for r in rows] == [0, 2] and kept.tolist() == [0.5, 2.0]
    with pytest.raises(RunError, match="all 1 examples NaN"):
        _without_nan_scores([{}], torch.tensor([float("nan")]))


CHATML = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
SYS = "<|im_start|>system\nBe nice<|im_end|>\n" + CHATML


def test_bins_and_condition_prompt(tiny_model):
    from turborlhf.config import CSFTTagCfg
    from turborlhf.models.load import load_tokenizer
    from turborlhf.trainers.conditional_sft import (bin_edges, chat_anchors, condition_prompt, make_tag_info,
                                                    score_bins)

    s = torch.tensor([3.0, -1.0, 0.5, 2.0, 10.0, 0.0])
    edges = bin_edges(s, 3, "quantile")
    bins = score_bins(s, edges)
    order = s.argsort()
    assert bins[order].tolist() == sorted(bins.tolist())       # monotone in the score
    assert bins.min() == 0 and bins.max() == 2 and bins.bincount().tolist() == [2, 2, 2]
    assert score_bins(torch.tensor([-5.0, 1.0, 5.0]), [0.0, 2.0]).tolist() == [0, 1, 2]
    assert score_bins(torch.tensor([2.0]), [0.0, 2.0]).tolist() == [2]   # an edge belongs to the bin above
    assert bin_edges(torch.tensor([0.0, 3.0]), 3, "uniform") == pytest.approx([1.0, 2.0])
    with pytest.raises(ValueError):
        bin_edges(s, 3, "nope")

    anchors = chat_anchors(load_tokenizer(str(tiny_model)))
    assert anchors == {"turn_end": "<|im_end|>\n<|im_start|>assistant\n", "system_header": "<|im_start|>system\n",
                       "system_block": "<|im_start|>system\n<<TAG_SLOT_7f3a>><|im_end|>\n"}
    info = make_tag_info(CSFTTagCfg(n_bins=3), edges, anchors, s, bins)
    assert info["best_bin"] == 2 and info["best_tag"] == "<rm_score>=2"
    assert condition_prompt(CHATML, info) == "<|im_start|>user\nHi <rm_score>=2<|im_end|>\n<|im_start|>assistant\n"
    assert condition_prompt(CHATML, info, 0) == "<|im_start|>user\nHi <rm_score>=0<|im_end|>\n<|im_start|>assistant\n"
    assert condition_prompt("Human: hi\n\nAssistant:", info) == "Human: hi\n\nAssistant: <rm_score>=2"
    sys_info = {**info, "position": "system"}
    assert condition_prompt(SYS, sys_info) == SYS.replace("system\nBe", "system\n<rm_score>=2 Be")
    assert condition_prompt(CHATML, sys_info) == "<|im_start|>system\n<rm_score>=2<|im_end|>\n" + CHATML
    assert condition_prompt(CHATML, {**info, "position": "prefix"}) == "<rm_score>=2 " + CHATML
    with pytest.raises(ValueError):
        condition_prompt(CHATML, info, 3)


def test_conditional_sft_end_to_end(tiny_model, tiny_rm, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from turborlhf.evaluate import eval_policy
    from turborlhf.trainers.conditional_sft import condition_prompt, evaluate_conditional

    out = tmp_path / "csft"
    run_cli("conditional-sft", "--config", REPO / "configs/tiny/conditional_sft.yaml",
            f"model.name_or_path={tiny_model}", f"reward_model={tiny_rm}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"output_dir={out}",
            "data.policy_samples_per_prompt=2", f"data.test_file={tiny_data / 'test_pairs.jsonl'}")
    info = json.loads((out / "conditional_sft.json").read_text())
    assert info["best_tag"] == "<rm_score>=2" and info["n_bins"] == 3 and sum(info["bin_counts"]) == 48
    scored = _rows(out / "scored.jsonl")                      # 12 pairs → 24 data + 12×2 policy samples
    assert len(scored) == 48 and {r["source"] for r in scored} == {"chosen", "rejected", "policy"}
    by_score = sorted(scored, key=lambda r: r["score"])
    assert [r["bin"] for r in by_score] == sorted(r["bin"] for r in scored)   # tags monotone in score
    assert all(condition_prompt(r["prompt"], info, r["bin"]).count(f"<rm_score>={r['bin']}") == 1 for r in scored)
    assert len([r for r in metrics(out) if "train/loss" in r]) == 3
    assert math.isfinite(metrics(out)[-1]["eval/loss"])      # tagged NLL of the test pairs (training edges)
    assert {r["bin"] for r in _rows(out / "scored_test.jsonl")} <= {0, 1, 2}
    # policy samples cut at max_new_tokens are scored as cut (no EOS appended), as eval-policy does
    import torch

    from turborlhf.models.load import load_scalar_model, load_tokenizer
    from turborlhf.rewards.model import score_texts
    cut = [r for r in scored if r["source"] == "policy" and not r["finished"]]
    assert cut                                                # the tiny policy rarely samples EOS in 8 tokens
    rtok = load_tokenizer(str(tiny_rm))
    args = (load_scalar_model(str(tiny_rm), rtok).eval(), rtok, [r["prompt"] for r in cut], [r["response"] for r in cut], 96,
            "fp32")
    stored = torch.tensor([r["score"] for r in cut])
    assert torch.allclose(score_texts(*args, add_eos=[False] * len(cut)), stored, atol=1e-5)
    assert not torch.allclose(score_texts(*args), stored, atol=1e-5)          # closing them with EOS differs
    assert max_weight_diff(weights(tiny_model), weights(out)) > 1e-6
    AutoModelForCausalLM.from_pretrained(out)

    # evaluation generates with the best tag and scores the untagged prompt
    kw = dict(n=4, max_new_tokens=4, seed=7)
    res = evaluate_conditional(str(out), str(tiny_rm), str(tiny_data / "test_prompts.jsonl"),
                               samples_out=str(tmp_path / "s.jsonl"), reference_dir=str(tiny_model), **kw)
    base = eval_policy(str(out), str(tiny_rm), str(tiny_data / "test_prompts.jsonl"), reference_dir=str(tiny_model),
                       use_tag=False, **kw)
    assert set(base) <= set(res) and res["tag"] == "<rm_score>=2" and res["n"] == 4 and "tag" not in base
    # `turborlhf eval-policy` on a conditional-SFT directory applies its best tag by itself
    auto = eval_policy(str(out), str(tiny_rm), str(tiny_data / "test_prompts.jsonl"), reference_dir=str(tiny_model),
                       **kw)
    assert {k: v for k, v in auto.items() if "seconds" not in k} == {k: v for k, v in res.items() if "seconds" not in k}
    from turborlhf.errors import UserError
    for policy, bin_, why in ((out, 3, "the policy's bins are 0 … 2"), (tiny_model, 1, "not a conditional-SFT")):
        with pytest.raises(UserError, match=f"--tag-bin {bin_}: .*{why}"):    # a traceback / silently ignored
            eval_policy(str(policy), str(tiny_rm), str(tiny_data / "test_prompts.jsonl"), tag_bin=bin_, **kw)
    for r in _rows(tmp_path / "s.jsonl"):
        assert r["conditioned_prompt"] == condition_prompt(r["prompt"], info)
        assert "<rm_score>=2" in r["conditioned_prompt"] and "<rm_score>" not in r["prompt"]

    # resume from the step-2 checkpoint reuses the scores and reproduces the final policy
    final = weights(out)
    shutil.rmtree(out / "checkpoints" / "step-000003")
    (out / "checkpoints" / "latest").write_text("step-000002")
    run_cli("conditional-sft", "--config", REPO / "configs/tiny/conditional_sft.yaml",
            f"model.name_or_path={tiny_model}", "reward_model=/nonexistent", "--resume-changed",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"output_dir={out}")
    assert max_weight_diff(final, weights(out)) < 1e-5


def test_conditional_sft_resume_keeps_the_configured_chat_template(tiny_model, tiny_rm, tiny_data, tmp_path):
    """A resumed run reads its scored examples back instead of loading the data, which was where
    ``data.chat_template`` reached the tokenizer: the exported tokenizer lost it."""
    from turborlhf.data.chat import CHAT_TEMPLATES
    from turborlhf.models.load import load_tokenizer

    out = tmp_path / "csft"
    args = ["conditional-sft", "--config", REPO / "configs/tiny/conditional_sft.yaml", f"model.name_or_path={tiny_model}",
            f"reward_model={tiny_rm}", f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"output_dir={out}",
            "data.chat_template=plain", "log.tensorboard=false"]
    run_cli(*args)
    assert load_tokenizer(str(out)).chat_template == CHAT_TEMPLATES["plain"]
    shutil.rmtree(out / "checkpoints" / "step-000003")
    (out / "checkpoints" / "latest").write_text("step-000002")
    run_cli(*args, "--resume")
    assert load_tokenizer(str(out)).chat_template == CHAT_TEMPLATES["plain"]


def test_conditional_sft_policy_samples_only(tiny_model, tiny_rm, tiny_data, tmp_path):
    """`data.dataset_responses=false`: the pair file only supplies prompts; every example is a
    policy sample; without policy samples the config is refused, naming the field."""
    from turborlhf.config import ConditionalSFTConfig, ConfigError, load_config

    out = tmp_path / "csft"
    args = ("--config", REPO / "configs/tiny/conditional_sft.yaml", f"model.name_or_path={tiny_model}",
            f"reward_model={tiny_rm}", f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"output_dir={out}")
    run_cli("conditional-sft", *args, "data.policy_samples_per_prompt=3", "data.dataset_responses=false",
            f"data.test_file={tiny_data / 'test_pairs.jsonl'}", "data.max_test_samples=2")
    assert len(_rows(out / "scored_test.jsonl")) == 4                 # the test file's first 2 pairs, both answers
    scored = _rows(out / "scored.jsonl")
    assert len(scored) == 12 * 3 and {r["source"] for r in scored} == {"policy"}
    assert json.loads((out / "conditional_sft.json").read_text())["bin_counts"] == [12, 12, 12]
    with pytest.raises(ConfigError, match="data.*policy_samples_per_prompt > 0"):
        load_config(ConditionalSFTConfig, REPO / "configs/tiny/conditional_sft.yaml",
                    ["data.dataset_responses=false", "data.policy_samples_per_prompt=0"])
    # a LoRA policy samples through its merged weights (the peft model went to the engine: a KeyError)
    run_cli("conditional-sft", *args[:-1], f"output_dir={tmp_path / 'lora'}", "model.lora.rank=4",
            "data.policy_samples_per_prompt=1", "data.max_samples=4")


def test_eval_policy_kl_from_engine_logprobs(tiny_model, tiny_rm, tiny_data, tmp_path, monkeypatch):
    """The KL to the reference takes the policy's side from the fp32 engine's temperature-1
    log-probs of its samples (sampled at T 0.7, top-p 0.9), and equals the KL with a policy forward."""
    import turborlhf.evaluate as ev
    from turborlhf.models.tiny import save_tiny_causal_lm

    ref = save_tiny_causal_lm(tmp_path / "ref", seed=1)          # another model: a KL far from 0
    kw = dict(n=6, max_new_tokens=6, seed=3, dtype="fp32", reference_dir=str(ref))
    prompts = str(tiny_data / "test_prompts.jsonl")
    eng = ev.eval_policy(str(tiny_model), str(tiny_rm), prompts, **kw)
    gen = ev.generate_responses
    monkeypatch.setattr(ev, "generate_responses", lambda *a, **k: gen(*a, **{**k, "raw_logprobs": False}))
    fwd = ev.eval_policy(str(tiny_model), str(tiny_rm), prompts, **kw)
    assert (eng["kl_policy_logprobs"], fwd["kl_policy_logprobs"]) == ("engine", "forward")
    assert abs(eng["kl_to_reference"]) > 0.1
    assert eng["kl_to_reference"] == pytest.approx(fwd["kl_to_reference"], abs=1e-4)
    assert eng["reward_mean"] == fwd["reward_mean"]


def test_eval_policy_kl_of_a_policy_to_itself_is_zero_under_bf16(tiny_model, tiny_rm, tiny_data):
    """Under bf16 the reference was loaded with bf16 weights and the policy with fp32 ones: their
    roundings differ, a KL between equal models."""
    import turborlhf.evaluate as ev

    res = ev.eval_policy(str(tiny_model), str(tiny_rm), str(tiny_data / "test_prompts.jsonl"), n=4, max_new_tokens=6,
                         seed=3, dtype="bf16", reference_dir=str(tiny_model))
    assert res["kl_policy_logprobs"] == "forward" and res["kl_to_reference"] == 0.0


def test_evaluations_record_what_auto_resolved_to(tiny_model, tiny_rm, tiny_data):
    """eval-policy, eval-rm and eval-math results did not say which precision and device their
    ``auto`` chose, so two hosts' numbers could not be told apart."""
    import turborlhf.evaluate as ev
    from turborlhf.engine.hardware import compute_dtype
    from turborlhf.eval_math import eval_math

    res = ev.eval_policy(str(tiny_model), str(tiny_rm), str(tiny_data / "test_prompts.jsonl"), n=2, max_new_tokens=4,
                         engine="hf", dtype="fp32")
    assert res["hardware"] == {"rollout": {"engine": "HFEngine", "dtype": "fp32", "device": "cpu"},
                               "scoring": {"dtype": "fp32", "device": "cpu"}}
    rm = ev.eval_rm(str(tiny_rm), str(tiny_data / "test_pairs.jsonl"), max_len=64, limit=2)
    assert rm["hardware"] == {"dtype": compute_dtype("auto", "cpu"), "device": "cpu"}
    problems = tiny_data / "math.jsonl"
    problems.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": "#### 4"}\n')
    m = eval_math(str(tiny_model), str(problems), n=2, max_new_tokens=4, engine="fast", dtype="fp32")
    assert m["hardware"]["rollout"]["engine"] == "FastEngine" and m["hardware"]["rollout"]["dtype"] == "fp32"


def test_conditional_sft_without_a_test_set_drops_an_earlier_runs(tiny_model, tiny_rm, tiny_data, tmp_path):
    """A fresh run without data.test_file in a directory an earlier run scored a test set in kept
    that scored_test.jsonl, which its --resume then evaluated on."""
    out = tmp_path / "csft"
    args = ["conditional-sft", "--config", REPO / "configs/tiny/conditional_sft.yaml",
            f"model.name_or_path={tiny_model}", f"reward_model={tiny_rm}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"output_dir={out}", "train.max_steps=1",
            "log.tensorboard=false"]
    run_cli(*args, f"data.test_file={tiny_data / 'test_pairs.jsonl'}", "data.max_test_samples=4")
    assert (out / "scored_test.jsonl").exists()
    run_cli(*args)
    assert not (out / "scored_test.jsonl").exists()
    assert not any("eval/loss" in r for r in metrics(out))


def test_rejection_sampling_and_conditional_sft_refuse_an_edited_data_file_on_resume(tiny_model, tiny_rm, tiny_data,
                                                                                     tmp_path, capsys):
    """The data file edited between the runs (same path, same config) resumed silently: rejection
    sampling drew its later rounds from other prompts, conditional SFT trained on the scores of the
    old file (the other trainers refuse it)."""
    from turborlhf.cli import main

    def edit_and_resume(data, args, out, last):
        shutil.rmtree(out / "checkpoints" / f"step-{last:06d}")
        (out / "checkpoints" / "latest").write_text(f"step-{last - 1:06d}")
        lines = data.read_text().splitlines(keepends=True)
        data.write_text("".join(lines[::-1]))
        capsys.readouterr()
        assert main(args + ["--resume"]) == 2
        assert "the examples of the steps done differ" in capsys.readouterr().err
        assert main(args + ["--resume", "--resume-changed"]) == 0

    prompts = tmp_path / "prompts.jsonl"
    shutil.copy(tiny_data / "train_prompts.jsonl", prompts)
    out = tmp_path / "rs"
    rs = ["rejection-sampling", "--config", str(REPO / "configs/tiny/rejection_sampling.yaml"),
          f"model.name_or_path={tiny_model}", f"reward_model={tiny_rm}", f"data.prompts_file={prompts}",
          "data.max_samples=16", f"output_dir={out}", "log.tensorboard=false"]
    assert main(rs) == 0
    edit_and_resume(prompts, rs, out, 2)

    pairs = tmp_path / "pairs.jsonl"
    shutil.copy(tiny_data / "train_pairs.jsonl", pairs)
    out = tmp_path / "csft"
    csft = ["conditional-sft", "--config", str(REPO / "configs/tiny/conditional_sft.yaml"),
            f"model.name_or_path={tiny_model}", f"reward_model={tiny_rm}", f"data.train_file={pairs}",
            f"output_dir={out}", "log.tensorboard=false"]
    assert main(csft) == 0
    edit_and_resume(pairs, csft, out, 3)


def test_eval_policy_scores_the_prompt_the_policy_saw(tiny_model, tiny_rm, tiny_data, tmp_path):
    """The policy generated from prompts cut to 256 tokens (fixed), while the reward model scored
    the whole prompt re-encoded: not what PPO's reward model reads (the cut prompt, the sampled
    ids). Now one max_prompt_len cuts the prompt for the policy, the reward model and the reference."""
    from turborlhf.data.tokenize import encode_prompt
    from turborlhf.engine.hardware import resolve_device
    from turborlhf.evaluate import _reward_sequences, eval_policy, sample_policy
    from turborlhf.models.load import load_scalar_model, load_tokenizer
    from turborlhf.rewards.model import score_token_ids

    prompts = str(tiny_data / "test_prompts.jsonl")
    kw = dict(n=3, max_new_tokens=4, temperature=0.7, top_p=0.9, seed=5, engine="auto", dtype="fp32")
    s = sample_policy(str(tiny_model), prompts, device=resolve_device("cpu"), max_prompt_len=12, **kw)
    tok, rm_tok = load_tokenizer(str(tiny_model)), load_tokenizer(str(tiny_rm))
    full = [encode_prompt(tok, p, 4096) for p in s.prompts]
    assert all(len(f) > 12 for f in full) and all(len(p) == 12 for p in s.plain_prompt_ids)
    seqs = _reward_sequences(rm_tok, s)
    assert seqs == [list(p) + list(r) for p, r in zip(s.prompt_ids, s.response_ids)]
    res = eval_policy(str(tiny_model), str(tiny_rm), prompts, max_prompt_len=12, **kw)
    want = score_token_ids(load_scalar_model(str(tiny_rm), rm_tok).eval(), rm_tok.pad_token_id, seqs, "fp32")
    assert res["reward_mean"] == pytest.approx(float(want.mean()), abs=1e-5) and res["max_prompt_len"] == 12
