"""RL with verifiable rewards on the tiny model: a GRPO run whose reward functions read the prompts
file's `answer` column (a built-in verifier named without a path, and a user rule that checks each
row got its own prompt's answer), and `turborlhf eval-math`."""
import json

import pytest

from tests.e2e.helpers import REPO, metrics, run_cli
from turborlhf.cli import main

GRPO_YAML = REPO / "configs/tiny/grpo.yaml"
N_SAMPLES = 4


def _problems(path, n=6):
    """GSM8K-format lines whose answer is recoverable from the question: "Problem k" → k·11."""
    rows = [{"question": f"Problem {k}: what is {k} times 11?", "answer": f"{k} * 11 = {k * 11}\n#### {k * 11:,}"}
            for k in range(1, n + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_grpo_reward_functions_read_the_answer_column(tiny_model, tmp_path):
    raw = _problems(tmp_path / "gsm.jsonl")
    run_cli("prepare-data", "gsm8k", "--input", raw, "--output-dir", tmp_path / "data")
    log = tmp_path / "seen.jsonl"
    rule = tmp_path / "rules.py"
    rule.write_text(
        "import json, re\n"
        f"LOG = {str(log)!r}\n"
        "def check(prompts, completions, answer, solution):\n"
        "    with open(LOG, 'a') as f:\n"
        "        f.write(json.dumps({'prompts': prompts, 'answer': answer, 'solution': solution}) + '\\n')\n"
        "    return [float(len(c) % 2) for c in completions]\n"
        "def old_style(prompts, responses):\n"
        "    return [0.5 for _ in responses]\n")
    sources = (f"rewards=[{{kind: function, path: gsm8k_accuracy, name: acc}}, "
               f"{{kind: function, path: 'turborlhf.rewards.verifiers:gsm8k_format', name: fmt, weight: 0.5}}, "
               f"{{kind: function, path: {rule}:check, name: check}}, {{kind: function, path: {rule}:old_style, "
               f"name: old}}]")
    out = tmp_path / "grpo"
    run_cli("ppo", "--config", GRPO_YAML, f"actor.name_or_path={tiny_model}", "reward_model=null", sources,
            f"data.prompts_file={tmp_path / 'data' / 'gsm_prompts.jsonl'}", f"output_dir={out}",
            "log.tensorboard=false", "train.threads=1", "train.max_steps=2", "rollout.max_new_tokens=6",
            "rollout.max_prompt_len=256",
            f"algo.n_samples_per_prompt={N_SAMPLES}")
    calls = [json.loads(l) for l in log.read_text().splitlines()]
    rows = [(p, a, s) for c in calls for p, a, s in zip(c["prompts"], c["answer"], c["solution"])]
    assert len(rows) == 2 * 2 * N_SAMPLES                         # max_steps × prompts_per_step × samples
    for prompt, answer, solution in rows:                         # every row got its own prompt's answer
        k = int(prompt.split("Problem ")[1].split(":")[0])
        assert answer == str(k * 11) and solution.endswith(f"#### {k * 11:,}")
    for c in calls:                                               # a prompt's samples share one answer, in order
        groups = [c["answer"][i:i + N_SAMPLES] for i in range(0, len(c["answer"]), N_SAMPLES)]
        assert all(len(set(g)) == 1 for g in groups)
    r = [m for m in metrics(out) if "rollout/reward_mean" in m][-1]
    assert r["rollout/reward_old_mean"] == 0.5 and 0 <= r["rollout/reward_acc_mean"] <= 1
    assert abs(r["rollout/reward_mean"] - (r["rollout/reward_acc_mean"] + 0.5 * r["rollout/reward_fmt_mean"] + r["rollout/reward_check_mean"] + 0.5)) < 1e-5


def test_eval_math_prints_the_metrics(tiny_model, tmp_path, capsys):
    from turborlhf.rewards.verifiers import gsm8k_accuracy, gsm8k_format

    data = _problems(tmp_path / "test.jsonl", n=5)
    with data.open("a") as f:
        f.write("{not json\n")                                     # line 6: skipped with a warning
    samples = tmp_path / "samples.jsonl"
    assert main(["eval-math", "--policy", str(tiny_model), "--data", str(data), "--n", "4", "--max-new-tokens", "8",
                 "--json", "--samples-out", str(samples), "--dtype", "fp32"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"accuracy", "format_rate", "n", "response_length_mean", "strict_accuracy", "eos_fraction"} <= set(res)
    assert res["n"] == 4 and 1 <= res["response_length_mean"] <= 8 and res["temperature"] == 0.0
    assert res["tool"] == "calculator" and res["tool_calls"] == 0      # GSM8K: the calculator, never called here
    rows = [json.loads(l) for l in samples.read_text().splitlines()]
    texts, answers = [r["response"] for r in rows], [r["answer"] for r in rows]
    assert answers == ["11", "22", "33", "44"] and "#### <number>" in rows[0]["prompt"]
    assert res["accuracy"] == sum(gsm8k_accuracy([], texts, answer=answers)) / 4
    assert res["format_rate"] == sum(gsm8k_format([], texts)) / 4
    # greedy: the same responses again
    assert main(["eval-math", "--policy", str(tiny_model), "--data", str(data), "--n", "4", "--max-new-tokens", "8",
                 "--json", "--samples-out", str(tmp_path / "again.jsonl"), "--dtype", "fp32"]) == 0
    assert [json.loads(l)["response"] for l in (tmp_path / "again.jsonl").read_text().splitlines()] == texts
    capsys.readouterr()
    assert main(["eval-math", "--policy", str(tiny_model), "--data", str(data), "--n", "4", "--max-new-tokens", "8",
                 "--json", "--dtype", "fp32", "--tool", "none"]) == 0
    off = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert off["tool"] == "none" and off["accuracy"] == res["accuracy"]
    assert main(["eval-math", "--policy", str(tiny_model), "--data", str(data), "--tool", "calculator",
                 "--engine", "vllm"]) == 2
    assert "needs --engine fast, hf or auto" in capsys.readouterr().err
    assert main(["eval-math", "--policy", str(tiny_model), "--data", str(tmp_path / "missing.jsonl")]) == 2
    capsys.readouterr()
    assert main(["eval-math", "--policy", str(tiny_model), "--data", str(data), "--max-new-tokens", "100000"]) == 2
    assert "exceed the policy's context" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:                    # argparse: one line naming the flag
        main(["eval-math", "--policy", str(tiny_model), "--data", str(data), "--max-new-tokens", "0"])
    assert exc.value.code == 2 and "--max-new-tokens: 0 is out of range" in capsys.readouterr().err


def test_eval_math_scores_with_any_reward_and_its_columns(tiny_model, tmp_path, capsys):
    """--reward NAME: a prompt file's every column reaches the reward function; accuracy is the
    mean of its scores and the GSM8K-only keys are null; a bad name is one line, exit 2."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i), "level": i, "question": f"q{i}"}) + "\n"
                            for i in range(3)))                    # a prompt file with a question column
    samples = tmp_path / "samples.jsonl"
    fn = tmp_path / "score.py"
    fn.write_text("def level(prompts, completions, answer, level, **columns):\n"
                  "    assert answer == [str(x) for x in level]\n"
                  "    return [x / 4 for x in level]\n")
    assert main(["eval-math", "--policy", str(tiny_model), "--data", str(data), "--max-new-tokens", "4",
                 "--reward", f"{fn}:level", "--json", "--dtype", "fp32", "--samples-out", str(samples)]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["accuracy"] == (0 + 1 + 2) / 4 / 3 and res["n"] == 3 and res["reward"] == f"{fn}:level"
    assert res["strict_accuracy"] is None and res["format_rate"] is None and res["tool"] == "none"
    assert [json.loads(l)["prompt"] for l in samples.read_text().splitlines()] == ["Say 0.", "Say 1.", "Say 2."]
    assert main(["eval-math", "--policy", str(tiny_model), "--data", str(data), "--reward", "no_such_reward"]) == 2
    err = capsys.readouterr().err
    assert "no_such_reward" in err and "Traceback" not in err


def test_demo_math_configs_are_valid_and_chained():
    """configs/gsm8k_smollm2: the cold-start SFT trains on the prepared (annotated) solutions and writes what
    GRPO starts from; GRPO has DAPO-style settings and verifiers that resolve by name, with the
    format term worth less than a correct answer (the 0.5 partial-credit term was reward-hacked)."""
    from turborlhf.config import PPOConfig, SFTConfig, load_config
    from turborlhf.rewards.functions import load_reward_function
    from turborlhf.rewards.verifiers import gsm8k_accuracy, gsm8k_format

    sft = load_config(SFTConfig, REPO / "configs/gsm8k_smollm2/sft.yaml", [])
    cfg = load_config(PPOConfig, REPO / "configs/gsm8k_smollm2/grpo.yaml", [])
    assert sft.data.train_file == "runs/gsm8k/data/train_sft.jsonl" and cfg.actor.name_or_path == sft.output_dir
    assert cfg.data.prompts_file == "runs/gsm8k/data/train_prompts.jsonl"
    A = cfg.algo
    assert (A.advantage_estimator, A.n_samples_per_prompt, A.loss_reduction) == ("grpo", 8, "token_mean")
    assert A.eps_clip_high > A.eps_clip and A.kl_coef <= 0.01 and A.dynamic_sampling
    assert cfg.output_dir == "runs/gsm8k/policy"
    assert cfg.rollout.tool == "calculator"          # the SFT rows teach its <<expression=value>> calls
    assert [load_reward_function(r.path) for r in cfg.rewards] == [gsm8k_accuracy, gsm8k_format]
    weights = {r.name: r.weight for r in cfg.rewards}
    assert weights["format"] < weights["accuracy"] / 2


def test_eval_math_data_without_answers_says_what_it_needs(tiny_model, tmp_path):
    """The hint named data.prompt_key and friends, which eval-math has no way to set."""
    from turborlhf.data.errors import DataError
    from turborlhf.eval_math import load_problems
    from turborlhf.models.load import load_tokenizer

    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "response": "4"}) + "\n")
    with pytest.raises(DataError, match=r"the record has \['prompt', 'response'\] \(prepare-data gsm8k") as e:
        load_problems(str(path), load_tokenizer(str(tiny_model)))
    assert "data.prompt_key" not in str(e.value)


def test_eval_math_reads_reasoning_gym_tasks_without_a_reference_answer(tiny_model, tmp_path):
    """prepare-data reasoning-gym writes ``"answer": null`` for tasks scored from their metadata
    (graph_color): eval-math refused the file as GSM8K data without an answer."""
    from turborlhf.eval_math import load_problems
    from turborlhf.models.load import load_tokenizer

    path = tmp_path / "graph_color_prompts.jsonl"
    row = {"prompt": [{"role": "user", "content": "Color the graph"}], "answer": None,
           "metadata": {"source_dataset": "graph_color"}, "question": "Color the graph"}
    path.write_text(json.dumps(row) + "\n")
    (got,) = load_problems(str(path), load_tokenizer(str(tiny_model)))
    assert got["answer"] is None and got["metadata"] == row["metadata"] and "Color the graph" in got["prompt"]


def test_eval_math_answer_of_the_wrong_type_is_a_bad_value(tiny_model, tmp_path):
    """A record whose ``answer`` is a list or a dict was reported as a missing key ("need
    'question'+'answer' ... the record has ['answer', 'prompt']"): it is a wrong type, named with its file,
    line and key."""
    from turborlhf.data.errors import DataError
    from turborlhf.eval_math import load_problems
    from turborlhf.models.load import load_tokenizer

    tok = load_tokenizer(str(tiny_model))
    rows = (({"prompt": "2+2?", "answer": ["4"]}, "list"), ({"question": "2+2?", "answer": {"n": 4}}, "dict"))
    for row, kind in rows:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps(row) + "\n")
        with pytest.warns(UserWarning) as w:
            (got,) = load_problems(str(path), tok)
        assert got["answer"] == "2"
        (msg,) = [str(x.message) for x in w if "skipped" in str(x.message)]
        assert str(path) in msg and "missing_key" not in msg and "\n" not in msg
        assert f"bad_value (1) at line 2 (line 2: 'answer' must be a string or a number, got {kind})" in msg
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(DataError, match=rf"bad_value \(1\) at line 1 \(line 1: 'answer' .* got {kind}\)"):
            load_problems(str(path), tok)
