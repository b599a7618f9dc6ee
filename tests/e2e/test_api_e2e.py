"""The Python trainer objects (`turborlhf.api`) on tiny random models: GRPO on an in-memory dataset
with a reward function reading its `answer` column, SFT from Parquet / save_to_disk / in-memory
data and an in-memory model (the same weights as the command line), DPO from a dict, callbacks on
every step, `.step()` == `.train()`, and callable rewards on the Ray backend."""
from __future__ import annotations

import json
import math

import pytest

from tests.e2e.helpers import REPO, max_weight_diff, metrics, run_cli, weights

QUIET = {"log": {"tensorboard": False, "progress": False}}
SFT_ARGS = {"model": {"dtype": "fp32"}, "data": {"max_len": 96, "max_samples": 32},
            "optim": {"lr": 1e-3, "warmup_steps": 1}, "train": {"max_steps": 3, "sequences_per_step": 4, "micro_batch_size": 2}, **QUIET}


def _questions(n: int = 8) -> list[dict]:
    return [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i), "level": i % 3} for i in range(n)]


def exact_answer(prompts, completions, answer, **kwargs):
    """TRL-style reward: 1 if the completion contains the answer (module level: Ray pickles it by value)."""
    return [float(a in c) for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    return [-len(c) / 100.0 for c in completions]


def test_grpo_in_memory_dataset_reward_reads_answer_column(tiny_model, tmp_path):
    from datasets import Dataset

    from turborlhf import GRPOTrainer

    rows = _questions()
    calls: list[tuple] = []

    def reward(prompts, completions, answer, level, **kwargs):
        calls.append((list(prompts), list(answer), list(level), sorted(kwargs)))
        return [float(a in c) + 0.01 * len(c) for c, a in zip(completions, answer)]

    steps = []

    class Steps:
        def on_step_end(self, step, metrics):
            steps.append(step)

    out = tmp_path / "grpo"
    trainer = GRPOTrainer(model=str(tiny_model), reward_funcs=reward, train_dataset=Dataset.from_list(rows),
                          args={"train": {"max_steps": 2}, "output_dir": str(out), **QUIET}, callbacks=[Steps()])
    result = trainer.train()
    assert result.output_dir == out and result.global_step == 2 and steps == [1, 2]
    assert (out / "model.safetensors").exists() and max_weight_diff(weights(tiny_model), weights(out)) > 0
    # GRPO's preset with its defaults: 8 prompts × 4 samples per step, one call per step
    assert len(calls) == 2 and all(len(p) == 32 for p, *_ in calls)
    by_question = {r["prompt"]: (r["answer"], r["level"]) for r in rows}
    for prompts, answers, levels, others in calls:
        for p, a, lv in zip(prompts, answers, levels):     # each row got its own prompt's columns
            assert by_question[p] == (a, lv)
        assert others == ["completion_ids"]                # as TRL passes them; `prompt` itself is not a column
    rows_logged = metrics(out)
    assert [r["step"] for r in rows_logged] == [1, 2]
    assert all(math.isfinite(r["rollout/reward_mean"]) and r["rollout/reward_mean"] > 0 for r in rows_logged)
    assert trainer.args.algo.advantage_estimator == "grpo" and trainer.args.rewards[0].kind == "callable"


def test_a_reward_function_requiring_completion_ids_is_accepted(tiny_model, tmp_path):
    """TRL passes completion_ids to every reward function: one that requires it was refused as
    needing a column the data lacks."""
    from turborlhf import GRPOTrainer

    seen = []

    def by_ids(prompts, completions, completion_ids):
        seen.append(len(completion_ids))
        return [float(len(ids)) for ids in completion_ids]

    GRPOTrainer(model=str(tiny_model), reward_funcs=by_ids, train_dataset=_questions(),
                args={"train": {"max_steps": 1}, "output_dir": str(tmp_path / "g"), **QUIET}).train()
    assert seen and seen[0] > 0


def test_reward_function_missing_column_is_named(tiny_model, tmp_path):
    from turborlhf import GRPOTrainer
    from turborlhf.rewards.functions import RewardFunctionError

    def needs_solution(prompts, completions, solution):
        return [0.0] * len(completions)

    trainer = GRPOTrainer(model=str(tiny_model), reward_funcs=needs_solution, train_dataset=_questions(),
                          args={"train": {"max_steps": 1}, "output_dir": str(tmp_path / "g"), **QUIET})
    with pytest.raises(RewardFunctionError, match="needs_solution.*'solution'.*answer, level"):
        trainer.train()


def test_rl_trainer_refuses_an_eval_dataset_it_would_ignore(tiny_model, tmp_path):
    """PPO has no held-out evaluation during training: an eval_dataset is a clear error, not a no-op."""
    from turborlhf import GRPOTrainer
    from turborlhf.errors import UserError

    def reward(prompts, completions):
        return [0.0] * len(completions)

    with pytest.raises(UserError, match="eval_dataset: GRPOTrainer has no held-out evaluation"):
        GRPOTrainer(model=str(tiny_model), reward_funcs=reward, train_dataset=_questions(), eval_dataset=_questions(),
                    args={"output_dir": str(tmp_path / "g"), **QUIET})


def _pairs(tiny_data):
    from datasets import Dataset

    rows = [json.loads(l) for l in (tiny_data / "train_pairs.jsonl").read_text().splitlines()[:32]]
    return Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])


def test_sft_from_parquet_save_to_disk_memory_and_in_memory_model_match_the_cli(tiny_model, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from turborlhf import SFTTrainer

    ds = _pairs(tiny_data)
    ds.to_parquet(str(tmp_path / "pairs.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ds))
    run_cli("sft", "--config", REPO / "configs/tiny/sft.yaml", f"model.name_or_path={tiny_model}",
            f"data.train_file={tmp_path / 'pairs.jsonl'}", "data.max_samples=32", "train.max_steps=3",
            "train.save_every=0", f"output_dir={tmp_path / 'cli'}", "log.tensorboard=false", "log.progress=false")
    cli = weights(tmp_path / "cli")
    sources = {"parquet": str(tmp_path / "pairs.parquet"), "saved": tmp_path / "saved", "memory": ds}
    for name, data in sources.items():
        out = tmp_path / name
        SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(out)}, train_dataset=data).train()
        assert max_weight_diff(cli, weights(out)) < 1e-6, name
    assert (tmp_path / "memory" / "data" / "train" / "dataset_info.json").exists()   # written with save_to_disk
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    out = tmp_path / "model_object"
    SFTTrainer(model=model, args={**SFT_ARGS, "output_dir": str(out)}, train_dataset=ds).train()
    assert (out / "input_model" / "tokenizer.json").exists()
    assert max_weight_diff(cli, weights(out)) < 1e-6


def test_dpo_with_dict_args_and_errors_naming_fields(tiny_model, tiny_data, tmp_path):
    from turborlhf import DPOConfig, DPOTrainer
    from turborlhf.config import ConfigError

    rows = list(_pairs(tiny_data))[:16]
    args = {"model": {"dtype": "fp32"}, "algo": {"beta": 0.2}, "train": {"max_steps": 2, "pairs_per_step": 4,
                                                                          "micro_batch_size": 2},
            "output_dir": tmp_path / "dpo", **QUIET}      # a Path is fine
    trainer = DPOTrainer(model=str(tiny_model), args=args, train_dataset=rows)
    assert isinstance(trainer.args, DPOConfig) and trainer.args.algo.beta == 0.2
    result = trainer.train()
    assert [r["step"] for r in metrics(result.output_dir)] == [1, 2] and result.metrics["rewards/accuracy"] >= 0
    with pytest.raises(ConfigError, match="algo.beta"):
        DPOTrainer(model=str(tiny_model), args={**args, "algo": {"beta": "high"}}, train_dataset=rows)
    with pytest.raises(ConfigError, match="train.no_such_field"):
        DPOTrainer(model=str(tiny_model), args={"train": {"no_such_field": 1}, "output_dir": tmp_path / "bad"},
                   train_dataset=rows)


def test_callbacks_see_every_step_and_the_final_evaluation(tiny_model, tiny_data, tmp_path):
    from turborlhf import SFTTrainer, TrainerCallback

    seen: list = []

    class Record(TrainerCallback):
        def on_train_begin(self, name, total_steps):
            seen.append(("begin", name, total_steps))

        def on_step_end(self, step, metrics):
            seen.append(("step", step, round(metrics["train/loss"], 6)))

        def on_log(self, step, metrics):
            seen.append(("log", step, sorted(metrics)[:1]))

        def on_train_end(self, name, step):
            seen.append(("end", name, step))

    ds = _pairs(tiny_data)
    trainer = SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(tmp_path / "sft")},
                         train_dataset=ds, eval_dataset=ds.select(range(8)), callbacks=[Record()])
    trainer.train()
    losses = [round(r["train/loss"], 6) for r in metrics(tmp_path / "sft") if "train/loss" in r]
    assert seen[0] == ("begin", "sft", 3) and seen[-1] == ("end", "sft", 3)
    assert [s for s in seen if s[0] == "step"] == [("step", i + 1, x) for i, x in enumerate(losses)]
    assert ("log", 3, ["eval/loss"]) in seen                       # the final evaluation row
    assert trainer.state.global_step == 3 and len(trainer.state.log_history) == 4


def test_step_gives_the_weights_of_train(tiny_model, tiny_data, tmp_path):
    from turborlhf import SFTTrainer

    ds = _pairs(tiny_data)
    a = SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(tmp_path / "a")}, train_dataset=ds)
    a.train()
    b = SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(tmp_path / "b")}, train_dataset=ds)
    stepped = [b.step() for _ in range(3)]                         # the third also exports
    assert max_weight_diff(weights(tmp_path / "a"), weights(tmp_path / "b")) < 1e-7
    assert [m["train/loss"] for m in stepped] == [r["train/loss"] for r in metrics(tmp_path / "a")]
    with pytest.raises(RuntimeError, match="all 3 steps are done"):
        b.step()
    # .train() after a .step() runs the rest
    c = SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(tmp_path / "c")}, train_dataset=ds)
    c.step()
    assert c.train().global_step == 3
    assert max_weight_diff(weights(tmp_path / "a"), weights(tmp_path / "c")) < 1e-7


def test_callable_reward_on_the_ray_backend_matches_local(tiny_model, tmp_path):
    pytest.importorskip("ray")
    from turborlhf import GRPOTrainer

    common = {"rollout": {"max_new_tokens": 8, "batch_size": 16}, "algo": {"prompts_per_step": 2},
              "train": {"max_steps": 2, "micro_batch_size": 4}, "actor": {"dtype": "fp32", "device": "cpu"},
              **QUIET}                             # CPU workers (tests/e2e/test_cuda_e2e.py has a GPU one)
    for backend in ("local", "ray"):
        args = {**common, "output_dir": str(tmp_path / backend),
                "distributed": {"backend": backend, "timeout_s": 180}}
        GRPOTrainer(model=str(tiny_model), reward_funcs=[exact_answer, short], reward_weights=[1.0, 0.5],
                    train_dataset=_questions(), args=args).train()
    a, b = metrics(tmp_path / "local"), metrics(tmp_path / "ray")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        for k in ("rollout/reward_exact_answer_mean", "rollout/reward_short_mean", "rollout/reward_mean", "policy/loss"):
            assert math.isclose(ra[k], rb[k], rel_tol=1e-4, abs_tol=1e-5), (k, ra[k], rb[k])
    assert any(r["rollout/reward_short_mean"] < 0 for r in b)
    assert max_weight_diff(weights(tmp_path / "local"), weights(tmp_path / "ray")) < 1e-5


def test_the_other_trainers_and_config_objects(tiny_model, tiny_data, tmp_path):
    """RewardTrainer, KTOTrainer, PPOTrainer (stepped, with the RM and a config object) and
    RLOOTrainer (a reward model beside a callable, weighted) run from Python."""
    from turborlhf import KTOTrainer, PPOConfig, PPOTrainer, RewardTrainer, RLOOTrainer

    pairs = _pairs(tiny_data)
    small = {"model": {"dtype": "fp32"}, "data": {"max_len": 96}, **QUIET}
    rm = RewardTrainer(model=tiny_model, train_dataset=pairs.select(range(16)), eval_dataset=pairs.select(range(16, 20)),
                       args={**small, "train": {"max_steps": 2, "pairs_per_step": 4, "micro_batch_size": 2},
                             "output_dir": str(tmp_path / "rm")}).train()       # a Dataset held out: no file digest
    assert rm.global_step == 2 and (tmp_path / "rm" / "model.safetensors").exists()
    assert json.loads((tmp_path / "rm" / "eval.json").read_text())["n"] == 4
    kto_rows = [{"prompt": r["prompt"], "completion": r["chosen"], "label": i % 2 == 0} for i, r in enumerate(pairs)]
    kto = KTOTrainer(model=tiny_model, train_dataset=kto_rows[:16],
                     args={**small, "train": {"max_steps": 2, "examples_per_step": 4, "micro_batch_size": 2},
                           "output_dir": str(tmp_path / "kto")}).train()
    assert [r["step"] for r in metrics(kto.output_dir) if "train/loss" in r] == [1, 2]
    rl = {"rollout": {"max_new_tokens": 8}, "algo": {"prompts_per_step": 2}, "train": {"max_steps": 2},
          "actor": {"dtype": "fp32"}, **QUIET}
    cfg = PPOConfig.model_validate({**rl, "data": {"prompts_file": str(tiny_data / "train_prompts.jsonl")},
                                    "reward_model": str(rm.output_dir), "output_dir": str(tmp_path / "ppo")})
    ppo = PPOTrainer(model=tiny_model, args=cfg)
    first, second = ppo.step(), ppo.step()                       # the second (last) exports the actor
    assert math.isfinite(first["critic/loss"]) and math.isfinite(second["rollout/reward_mean"])
    assert (tmp_path / "ppo" / "model.safetensors").exists() and ppo.train().global_step == 2
    assert ppo.args.critic is None and ppo.args.critic_init == str(rm.output_dir)
    rloo = RLOOTrainer(model=tiny_model, reward_model=rm.output_dir, reward_funcs=short, reward_weights=[1.0, 0.5],
                       train_dataset=_questions(), args={**rl, "output_dir": str(tmp_path / "rloo")})
    rows = metrics(rloo.train().output_dir)
    assert rloo.args.algo.advantage_estimator == "rloo" and [s.weight for s in rloo.args.rewards] == [1.0, 0.5]
    assert all("rollout/reward_short_mean" in r and "rollout/reward_model0_mean" in r for r in rows)


def test_a_ppo_config_object_given_to_grpo_keeps_the_preset(tiny_model, tmp_path):
    """GRPOTrainer(args=PPOConfig(...)) ran PPO with GAE and a critic: every PPOConfig default was
    laid over GRPO's preset."""
    from turborlhf import GRPOTrainer, PPOConfig

    args = PPOConfig.model_validate({"data": {"prompts_file": "set/below"}, "train": {"max_steps": 1},
                                     "reward_model": "some/reward-model",
                                     "output_dir": str(tmp_path / "g")})
    t = GRPOTrainer(model=tiny_model, train_dataset=_questions(), args=args)
    assert t.args.algo.advantage_estimator == "grpo" and t.args.algo.n_samples_per_prompt > 1
    assert t.args.train.max_steps == 1 and not t.args.algo.needs_critic
    # a built-in reward named as a string is that function, not a model id
    named = GRPOTrainer(model=tiny_model, reward_funcs="gsm8k_accuracy", train_dataset=_questions(),
                        args={"output_dir": str(tmp_path / "n")})
    assert [(s.kind, s.path) for s in named.args.rewards] == [("function", "gsm8k_accuracy")]


def test_a_run_stopped_by_an_error_is_not_restarted_by_the_same_object(tiny_model, tiny_data, tmp_path):
    from turborlhf import SFTTrainer

    class Boom:
        def on_step_end(self, step, metrics):
            if step == 2:
                raise ValueError("stop here")

    t = SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(tmp_path / "s")},
                   train_dataset=_pairs(tiny_data), callbacks=[Boom()])
    t.step()
    with pytest.raises(ValueError, match="stop here"):
        t.step()
    for again in (t.step, t.train):
        with pytest.raises(RuntimeError, match="the run stopped .ValueError: stop here.; continue it"):
            again()


def test_the_cli_refuses_a_callable_source_in_one_line(tiny_model, tiny_data, tmp_path, capsys):
    from turborlhf.cli import main

    rc = main(["grpo", "--config", str(REPO / "configs/tiny/grpo.yaml"), f"actor.name_or_path={tiny_model}",
               "reward_model=null", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}",
               "rewards=[{kind: callable, path: accuracy}]", f"output_dir={tmp_path}", "log.tensorboard=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: rewards: the callable reward source 'accuracy' exists only in")


def test_close_of_a_trainer_never_started_frees_its_output_dir(tiny_model, tiny_data, tmp_path):
    """A trainer built and closed without a step kept output_dir locked until the process ended: no
    other process could run there."""
    import subprocess
    import sys

    from turborlhf import SFTTrainer

    out = tmp_path / "sft"
    trainer = SFTTrainer(model=str(tiny_model), train_dataset=str(tiny_data / "train_sft.jsonl"),
                         args={"output_dir": str(out), "train": {"max_steps": 1}, **QUIET})
    probe = [sys.executable, "-c", "import sys; from pathlib import Path; from turborlhf.engine.lifecycle import "
             "lock_output_dir; lock_output_dir(Path(sys.argv[1]))", str(out)]
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO / "src")}
    assert subprocess.run(probe, env=env, capture_output=True).returncode != 0        # held
    trainer.close()
    assert subprocess.run(probe, env=env, capture_output=True).returncode == 0
    with pytest.raises(RuntimeError):
        trainer.step()


def test_close_then_resume_from_checkpoint_reproduces_the_run(tiny_model, tiny_data, tmp_path):
    from turborlhf import SFTTrainer

    ds = _pairs(tiny_data)
    args = {**SFT_ARGS, "train": {**SFT_ARGS["train"], "save_every": 1}}
    SFTTrainer(model=str(tiny_model), args={**args, "output_dir": str(tmp_path / "full")}, train_dataset=ds).train()
    ended = []

    class End:
        def on_train_end(self, name, step):
            ended.append(step)
    part = SFTTrainer(model=str(tiny_model), args={**args, "output_dir": str(tmp_path / "r")}, train_dataset=ds,
                      callbacks=[End()])
    part.step()
    part.step()
    assert [c.name for c in (tmp_path / "r" / "checkpoints").glob("step-*")] == ["step-000001"]
    part.close()                                                   # stopped after step 2: a checkpoint of it
    assert not (tmp_path / "r" / "model.safetensors").exists()
    assert (tmp_path / "r" / "checkpoints" / "step-000002").is_dir()     # step 2 was not left to redo
    assert ended == [2]                                            # trackers and callbacks were ended
    for call in (part.step, part.train):                           # they restarted the run from step 0
        with pytest.raises(RuntimeError, match=r"the run stopped .*close\(\) ended it.*resume_from_checkpoint"):
            call()
    with pytest.raises(RuntimeError, match="exported when the run ends"):
        part.save_model(tmp_path / "copy")
    again = SFTTrainer(model=str(tiny_model), args={**args, "output_dir": str(tmp_path / "r")}, train_dataset=ds)
    assert again.train(resume_from_checkpoint=True).global_step == 3
    assert max_weight_diff(weights(tmp_path / "full"), weights(tmp_path / "r")) < 1e-7
    # TRL scripts end with save_model(dir): the export, copied (no run files)
    copy = again.save_model(tmp_path / "copy")
    assert max_weight_diff(weights(tmp_path / "r"), weights(copy)) == 0
    assert (copy / "tokenizer_config.json").exists() and not (copy / "config.yaml").exists()
    assert again.save_model() == tmp_path / "r"
    assert [r["step"] for r in metrics(tmp_path / "r")] == [1, 2, 3]
    # TRL's checkpoint-path form: the newest checkpoint is taken (a finished run reports its steps);
    # another path is refused (it was ignored, and the newest taken)
    from turborlhf.errors import UserError

    done = SFTTrainer(model=str(tiny_model), args={**args, "output_dir": str(tmp_path / "full")}, train_dataset=ds)
    newest = tmp_path / "full" / "checkpoints" / "step-000003"
    assert done.train(resume_from_checkpoint=str(newest)).global_step == 3
    other = SFTTrainer(model=str(tiny_model), args={**args, "output_dir": str(tmp_path / "full")}, train_dataset=ds)
    with pytest.raises(UserError, match="continues from the newest checkpoint"):
        other.train(resume_from_checkpoint=str(tmp_path / "r" / "checkpoints" / "step-000001"))
    fresh = SFTTrainer(model=str(tiny_model), args={**args, "output_dir": str(tmp_path / "none")}, train_dataset=ds)
    assert fresh.train(resume_from_checkpoint=None).global_step == 3             # TRL's default: a fresh run


def test_an_in_memory_model_on_a_device_is_named_in_a_warning(tmp_path):
    """The trainer trains its own copy of an in-memory model; one left on a GPU would hold that
    memory twice over, so the user is told (a stand-in model: no GPU here)."""
    import types

    import torch

    from turborlhf.api import _save_model

    saved = []
    param = types.SimpleNamespace(device=torch.device("cuda", 0), numel=lambda: 2**28, element_size=lambda: 2)
    model = types.SimpleNamespace(config=None, parameters=lambda: [param], save_pretrained=saved.append)
    tok = types.SimpleNamespace(save_pretrained=saved.append)
    with pytest.warns(UserWarning, match=r"model passed in stays on cuda:0 \(0\.50 GiB\)"):
        _save_model(model, tok, tmp_path / "input_model", "model")
    assert saved == [tmp_path / "input_model"] * 2
    param.device = torch.device("cpu")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _save_model(model, tok, tmp_path / "input_model", "model")


def test_a_peft_model_is_refused_in_one_line(tiny_model, tiny_data, tmp_path):
    """save_pretrained of a peft model writes its adapters alone: the trainer then failed with
    'optimizer got an empty parameter list'."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from turborlhf import SFTTrainer
    from turborlhf.errors import UserError

    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(UserError, match="model: a peft .LoRA. model; pass its merged model"):
        SFTTrainer(model=peft, args={**SFT_ARGS, "output_dir": str(tmp_path / "p")}, train_dataset=_pairs(tiny_data))


def test_an_in_memory_reward_model_is_saved_with_its_own_tokenizer(tmp_path):
    """reward_funcs=[<a loaded reward model>] was saved with the policy's processing_class: a
    reward model with another vocabulary then scored the policy's token ids as its own."""
    from transformers import AutoModelForSequenceClassification

    from turborlhf.api import _own_tokenizer, _save_model
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.models.load import load_tokenizer
    from turborlhf.models.tiny import tiny_llama_config

    policy_tok, rm_tok = make_tiny_tokenizer(), make_tiny_tokenizer()
    rm_tok.add_tokens([f"<rm{i}>" for i in range(8)])
    cfg = tiny_llama_config(len(rm_tok), pad_token_id=rm_tok.pad_token_id, bos_token_id=rm_tok.bos_token_id,
                            eos_token_id=rm_tok.eos_token_id, num_labels=1)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(tmp_path / "rm")
    rm_tok.save_pretrained(tmp_path / "rm")
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    path = _save_model(rm, _own_tokenizer(rm, policy_tok, "reward_funcs[0]"), tmp_path / "saved", "reward_funcs[0]")
    assert len(load_tokenizer(path)) == len(rm_tok) != len(policy_tok)



def test_reward_processing_classes_give_an_in_memory_reward_model_its_tokenizer(tiny_model, tmp_path):
    """TRL's reward_processing_classes was not accepted: a reward model built in memory (no directory,
    so no tokenizer of its own) could only be saved with the policy's tokenizer."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification

    from turborlhf import GRPOTrainer
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.errors import UserError
    from turborlhf.models.load import load_tokenizer
    from turborlhf.models.tiny import tiny_llama_config

    rm_tok = make_tiny_tokenizer()
    rm_tok.add_tokens([f"<rm{i}>" for i in range(8)])
    rm = AutoModelForSequenceClassification.from_config(tiny_llama_config(
        len(rm_tok), pad_token_id=rm_tok.pad_token_id, bos_token_id=rm_tok.bos_token_id,
        eos_token_id=rm_tok.eos_token_id, num_labels=1))
    out = tmp_path / "grpo"
    kw = dict(model=str(tiny_model), train_dataset=Dataset.from_list(_questions()),
              args={"train": {"max_steps": 1}, "output_dir": str(out), **QUIET})
    GRPOTrainer(reward_funcs=[rm, exact_answer], reward_processing_classes=[rm_tok, None], **kw)
    assert len(load_tokenizer(out / "reward_model_0")) == len(rm_tok) != len(load_tokenizer(str(tiny_model)))
    with pytest.raises(UserError, match="reward_processing_classes: 1 for 2 reward functions"):
        GRPOTrainer(reward_funcs=[rm, exact_answer], reward_processing_classes=[rm_tok], **kw)


def test_api_staging_neither_keeps_an_earlier_run_nor_overwrites_what_it_did_not_write(tiny_model, tiny_data,
                                                                                       tmp_path):
    """In-memory data staged inside output_dir made every API run count as "starting from files inside
    it": an earlier run's checkpoints were kept, and a later resume continued them. A project folder
    given as output_dir lost its own data/train to the staging; a dataset loaded from the staged
    directory itself was deleted before it was saved."""
    import datasets

    from turborlhf import SFTTrainer
    from turborlhf.errors import UserError

    ds = _pairs(tiny_data)
    out = tmp_path / "run"
    SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(out)}, train_dataset=ds).train()
    first = weights(out)
    import subprocess
    import sys
    free = subprocess.run([sys.executable, "-c", "from pathlib import Path; from turborlhf.engine.lifecycle import "
                           f"lock_output_dir; lock_output_dir(Path({str(out)!r}))"], capture_output=True, text=True)
    assert free.returncode == 0, free.stderr          # a finished trainer no longer holds output_dir
    SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(out), "optim": {"lr": 5e-3},
                                            "train": {**SFT_ARGS["train"], "max_steps": 1}}, train_dataset=ds).train()
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000001"]   # run 1's are gone
    assert max_weight_diff(first, weights(out)) > 0
    again = datasets.load_from_disk(str(out / "data" / "train"))          # the staged copy, passed back in
    SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(out)}, train_dataset=again).train()

    project = tmp_path / "project"
    (project / "data" / "train").mkdir(parents=True)
    (project / "data" / "train" / "my_notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"data/train exists and was not written by turborlhf"):
        SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(project)}, train_dataset=ds)
    assert (project / "data" / "train" / "my_notes.txt").read_text() == "mine"


def test_api_arguments_a_trl_user_may_pass_wrongly_are_named(tiny_model, tiny_data, tmp_path):
    from transformers import TrainerCallback as HFCallback

    from turborlhf import GRPOTrainer, SFTTrainer
    from turborlhf.config import PPOConfig
    from turborlhf.errors import UserError

    args = {**SFT_ARGS, "output_dir": str(tmp_path / "s")}
    with pytest.raises(UserError, match=r"callbacks\[0\]: a transformers TrainerCallback"):   # was a TypeError mid-run
        SFTTrainer(model=str(tiny_model), args=args, train_dataset=_pairs(tiny_data), callbacks=[HFCallback()])
    with pytest.raises(UserError, match="model: expected a path, a hub id or a transformers model, got int"):
        SFTTrainer(model=3, args=args, train_dataset=_pairs(tiny_data))
    # a PPOConfig's explicit values equal to PPO's defaults are kept over GRPO's preset (they were dropped)
    ppo = PPOConfig(reward_model=str(tiny_model), data={"prompts_file": str(tiny_data / "train_prompts.jsonl")},
                    algo={"advantage_estimator": "gae", "n_samples_per_prompt": 1}, output_dir=str(tmp_path / "g"))
    trainer = GRPOTrainer(model=str(tiny_model), args=ppo)
    assert (trainer.args.algo.advantage_estimator, trainer.args.algo.n_samples_per_prompt) == ("gae", 1)


def test_a_stepped_trainer_left_open_ends_its_run_at_exit(tiny_model, tiny_data, tmp_path):
    """A script that steps a trainer and ends without close() printed two "Exception ignored"
    tracebacks at interpreter exit, and its callbacks' on_train_end never ran."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text("import turborlhf as T\n"
                      "class End:\n    def on_train_end(self, name, step): print('ended', name, step, flush=True)\n"
                      f"t = T.SFTTrainer(model={str(tiny_model)!r}, args={{'model': {{'dtype': 'fp32'}}, "
                      f"'output_dir': {str(tmp_path / 'o')!r}, 'train': {{'max_steps': 3, 'sequences_per_step': 4, "
                      "'micro_batch_size': 2}, 'log': {'tensorboard': False, 'progress': False}}, "
                      "train_dataset=[{'prompt': f'Q{i}', 'completion': f' a{i}'} for i in range(8)], "
                      "callbacks=[End()])\n"
                      "t.step()\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ended sft 1" in r.stdout, r.stderr[-2000:]
    assert "Exception ignored" not in r.stderr, r.stderr[-2000:]


def test_a_trainer_left_open_keeps_its_steps_at_exit_as_close_does(tiny_model, tiny_data, tmp_path):
    """close() saves a checkpoint of the steps taken; a script that ended without it lost every step
    since the last checkpoint (save_every=0: all of them), and the resumed run trained them again."""
    import subprocess
    import sys

    from turborlhf import SFTTrainer

    out = tmp_path / "o"
    args = {**SFT_ARGS, "output_dir": str(out)}
    rows = [{"prompt": f"Q{i}", "completion": f" a{i}"} for i in range(8)]
    script = tmp_path / "script.py"
    script.write_text(f"import turborlhf as T\nt = T.SFTTrainer(model={str(tiny_model)!r}, args={args!r}, "
                      f"train_dataset={rows!r})\nt.step()\nt.step()\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Exception ignored" not in r.stderr, r.stderr[-2000:]
    assert [c.name for c in (out / "checkpoints").glob("step-*")] == ["step-000002"], r.stderr[-2000:]
    assert not (out / "model.safetensors").exists()          # nothing exported: the run is not over
    assert "step 2/3" in r.stderr and "close()" in r.stderr     # one line says so, and how to end it
    again = SFTTrainer(model=str(tiny_model), args=args, train_dataset=rows)
    assert again.train(resume_from_checkpoint=True).global_step == 3
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]     # steps 1 and 2 were not trained again


def test_a_checkpoint_that_cannot_be_written_at_exit_names_the_steps_lost(tiny_model, tiny_data, tmp_path,
                                                                           monkeypatch, capsys):
    """Where the exit path cannot save (here the write fails), one line says how many steps are lost
    and to call close(), instead of a traceback or nothing."""
    import weakref

    import turborlhf.trainers.common as common
    from turborlhf import SFTTrainer
    from turborlhf.api import _end_if_open

    t = SFTTrainer(model=str(tiny_model), args={**SFT_ARGS, "output_dir": str(tmp_path / "o")},
                   train_dataset=_pairs(tiny_data))
    t.step()
    t.step()

    def full(*a, **k):
        raise OSError("No space left on device")
    monkeypatch.setattr(common, "save_checkpoint", full)
    _end_if_open(weakref.ref(t))
    err = [line for line in capsys.readouterr().err.splitlines() if "SFTTrainer" in line]
    assert len(err) == 1 and "last 2 steps" in err[0] and "close()" in err[0] and "No space left" in err[0], err
    assert not (tmp_path / "o" / "checkpoints").exists()
    with pytest.raises(RuntimeError, match="the run stopped"):       # ended: it does not start again from step 0
        t.step()


def test_trl_habits_that_were_silently_ignored(tiny_model, tiny_data, tmp_path):
    """processing_class beside a model directory (the run read the directory's tokenizer), a staged
    dataset derived with select/map (the staged original was trained on), an HF-style callback
    (a TypeError after step 1), and the log history of a resumed trainer (this process's rows)."""
    import warnings

    from datasets import load_from_disk

    from turborlhf import SFTTrainer
    from turborlhf.data.chat import set_chat_template
    from turborlhf.errors import UserError
    from turborlhf.models.load import load_tokenizer

    out = tmp_path / "sft"
    args = {**SFT_ARGS, "output_dir": str(out)}
    tok = load_tokenizer(str(tiny_model))
    set_chat_template(tok, "plain")
    with pytest.raises(UserError, match="processing_class: differs from the tokenizer of model"):
        SFTTrainer(model=str(tiny_model), args=args, train_dataset=_pairs(tiny_data), processing_class=tok)
    # another end-of-turn token (an existing one): the run would stop responses at the model's own, silently
    tok = load_tokenizer(str(tiny_model))
    tok.eos_token = tok.pad_token if tok.pad_token != tok.eos_token else tok.convert_ids_to_tokens(0)
    with pytest.raises(UserError, match="its eos_token"):
        SFTTrainer(model=str(tiny_model), args=args, train_dataset=_pairs(tiny_data), processing_class=tok)

    class HFStyle:
        def on_log(self, args, state, control, logs=None): ...

    with pytest.raises(UserError, match=r"callbacks\[0\]\.on_log\(args, state, control, logs=None\)"):
        SFTTrainer(model=str(tiny_model), args=args, train_dataset=_pairs(tiny_data), callbacks=[HFStyle()])

    class Evaluating:
        def on_evaluate(self, *a): ...

    with pytest.warns(UserWarning, match="on_evaluate never called"):
        first = SFTTrainer(model=str(tiny_model), args=args, train_dataset=_pairs(tiny_data), callbacks=[Evaluating()])
    first.step()
    first.step()
    first.close()                                           # keeps a checkpoint after step 2
    staged = load_from_disk(str(out / "data" / "train"))
    mapped = staged.map(lambda r: {"chosen": r["chosen"] + " X"})
    for ds, n, tail in ((staged.select(range(4)), 4, None), (mapped, 32, " X")):
        t = SFTTrainer(model=str(tiny_model), args=args, train_dataset=ds)
        back = load_from_disk(t.args.data.train_file)
        assert len(back) == n and (tail is None or back[0]["chosen"].endswith(tail))
        t.close()

    # resumed: the history holds the earlier rows too, as HF's TrainerState is restored
    again = SFTTrainer(model=str(tiny_model), args=args, train_dataset=staged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again.train(resume_from_checkpoint=True)
    assert [r["step"] for r in again.state.log_history] == [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_epochs_set_alone_count_over_a_default_step_limit():
    """PPO/GRPO's default max_steps (20) won over train.epochs set alone, silently."""
    from turborlhf.config import GRPOConfig, load_config

    cfg = load_config(GRPOConfig, base={"data": {"prompts_file": "p"}, "reward_model": "r", "train": {"epochs": 1}})
    assert cfg.train.max_steps == 0
    assert load_config(GRPOConfig, base={"data": {"prompts_file": "p"}, "reward_model": "r"}).train.max_steps == 20
    # built directly, as TRL users do: train={"epochs": 2} kept the 20 steps
    direct = GRPOConfig(data={"prompts_file": "p"}, reward_model="r", train={"epochs": 2})
    assert (direct.train.epochs, direct.train.max_steps) == (2, 0)
    both = GRPOConfig(data={"prompts_file": "p"}, reward_model="r", train={"epochs": 2, "max_steps": 5})
    assert both.train.max_steps == 5


def test_config_classes_built_directly_keep_the_commands_section_defaults():
    """A section given as a dict was validated against the section class alone: GRPOConfig(algo=
    {"kl_coef": 0}) ran GAE with a critic (no preset), SFTConfig(optim={...}) lost SFT's lr."""
    from turborlhf.config import DPOConfig, GRPOConfig, PPOConfig, RLOOConfig, SFTConfig, load_config

    g = GRPOConfig(reward_model="r", data={"prompts_file": "p"}, algo={"kl_coef": 0.0})
    assert (g.algo.advantage_estimator, g.algo.kl_estimator, g.algo.kl_coef) == ("grpo", "k3", 0.0)
    assert not g.algo.needs_critic and g.algo.n_samples_per_prompt > 1
    assert RLOOConfig(reward_model="r", data={"prompts_file": "p"}, algo={"kl_coef": 0.01}).algo.advantage_estimator \
        == "rloo"
    for cls, base in ((SFTConfig, {"data": {"train_file": "x"}, "optim": {"warmup_steps": 3}}),
                      (DPOConfig, {"data": {"train_file": "x"}, "optim": {"schedule": "linear"}}),
                      (PPOConfig, {"reward_model": "r", "data": {"prompts_file": "p"},
                                   "train": {"micro_batch_size": 2}})):
        assert cls(**base) == load_config(cls, base=base), cls.__name__


def test_a_loaded_ppo_config_given_to_grpo_is_refused(tmp_path):
    """load_config sets every field, so its PPOConfig replaced every GRPO setting (GAE, one sample,
    a critic) though only the values set in it were to go over the preset."""
    from turborlhf import GRPOTrainer, PPOConfig
    from turborlhf.config import load_config
    from turborlhf.errors import UserError

    args = load_config(PPOConfig, base={"data": {"prompts_file": "p"}, "reward_model": "r",
                                        "output_dir": str(tmp_path / "g")})
    with pytest.raises(UserError, match="sets every algo field .* build it as GRPOConfig"):
        GRPOTrainer(model="m", reward_funcs="gsm8k_accuracy", args=args)


def test_a_preset_config_given_to_another_presets_trainer_is_refused(tmp_path):
    """GRPOTrainer(args=RLOOConfig(...)) trained GRPO, the RLOO settings dropped without a word (the
    config object's preset is neither the trainer's nor PPO's, which its own settings go over)."""
    from turborlhf import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from turborlhf.errors import UserError

    for trainer, cfg in ((GRPOTrainer, RLOOConfig), (RLOOTrainer, GRPOConfig)):
        with pytest.raises(UserError, match=f"^args: {cfg.__name__} is another preset than "):
            trainer(model="m", reward_funcs="gsm8k_accuracy", train_dataset=[{"prompt": "2+2="}],
                    args=cfg(output_dir=str(tmp_path / cfg.__name__)))
        assert not (tmp_path / cfg.__name__).exists()


def test_reward_trainer_uses_a_margin_column_as_trl_does(tiny_model, tiny_data, tmp_path):
    """TRL's RewardTrainer subtracts a dataset's margin column in the loss; it was ignored here."""
    from turborlhf import RewardTrainer
    from turborlhf.config import RMConfig

    rows = [{**r, "margin": 2.0} for r in _pairs(tiny_data).select(range(8)).to_list()]
    common = {"train": {"max_steps": 1, "pairs_per_step": 4, "micro_batch_size": 4}, **QUIET}
    on = RewardTrainer(model=str(tiny_model), train_dataset=rows, args={**common, "output_dir": str(tmp_path / "a")})
    assert on.args.train.margin
    on.close()
    off_args = {**common, "output_dir": str(tmp_path / "b"), "train": {**common["train"], "margin": False}}
    off = RewardTrainer(model=str(tiny_model), train_dataset=rows, args=off_args)
    assert not off.args.train.margin
    off.close()
    cfg = RMConfig(model={"name_or_path": str(tiny_model)}, data={"train_file": "x"}, output_dir=str(tmp_path / "c"))
    obj = RewardTrainer(model=str(tiny_model), train_dataset=rows, args=cfg)
    assert obj.args.train.margin
    obj.close()
    no_col = RewardTrainer(model=str(tiny_model), train_dataset=_pairs(tiny_data).select(range(8)),
                           args={**common, "output_dir": str(tmp_path / "d")})
    assert not no_col.args.train.margin
    no_col.close()


def test_config_objects_are_built_without_data_and_the_trainer_gives_it(tiny_model, tiny_rm, tmp_path):
    """TRL's ``SFTConfig(output_dir=...)`` is a config and the dataset goes to the trainer; here
    every config the API has a trainer for refused it (pydantic's multi-line "data: Field required",
    GRPO's and PPO's "no reward" too). A trainer then given no dataset, or a trainer's ``train``
    called with such a config, is a one-line error naming the field, before anything is written."""
    from turborlhf import (DPOConfig, GRPOConfig, GRPOTrainer, KTOConfig, PPOConfig, PPOTrainer, RLOOConfig,
                           RMConfig, SFTConfig, SFTTrainer)
    from turborlhf.config import ConfigError

    for cls in (SFTConfig, RMConfig, DPOConfig, KTOConfig, PPOConfig, GRPOConfig, RLOOConfig):
        cfg = cls(output_dir=str(tmp_path / cls.__name__))
        field = "data.prompts_file" if isinstance(cfg, PPOConfig) else "data.train_file"
        assert cfg.missing_inputs()[0].startswith(f"{field}: required"), cls.__name__
    sft = SFTTrainer(model=str(tiny_model), args=SFTConfig(output_dir=str(tmp_path / "sft")),
                     train_dataset=[{"prompt": "hi", "response": "there"}])
    assert sft.args.data.train_file == str(tmp_path / "sft" / "data" / "train.jsonl")
    sft.close()
    with pytest.raises(ConfigError, match=r"^data\.train_file: required \(.*train_dataset="):
        SFTTrainer(model=str(tiny_model), args=SFTConfig(output_dir=str(tmp_path / "none")))
    from turborlhf.trainers.sft import train

    with pytest.raises(ConfigError, match=r"^data\.train_file: required"):
        train(SFTConfig(output_dir=str(tmp_path / "direct")))
    assert not (tmp_path / "direct").exists()
    grpo = GRPOTrainer(model=str(tiny_model), reward_funcs=exact_answer, train_dataset=_questions(),
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo")))
    assert grpo.args.algo.advantage_estimator == "grpo" and [s.kind for s in grpo.args.rewards] == ["callable"]
    grpo.close()
    # PPO's critic section without name_or_path starts from the reward model given to the trainer, not
    # from ModelCfg's default model (the config object's unset fields are not carried over)
    ppo = PPOTrainer(model=str(tiny_model), reward_funcs=str(tiny_rm), train_dataset=_questions(),
                     args=PPOConfig(critic={"freeze_layers": 1}, output_dir=str(tmp_path / "ppo")))
    assert ppo.args.critic_init == str(tiny_rm) and ppo.args.critic.freeze_layers == 1
    ppo.close()


def test_a_preset_config_given_to_the_ppo_trainer_keeps_its_preset(tiny_model, tiny_rm, tmp_path):
    """Only the fields set in a config object are taken; a GRPOConfig's own algo section is its
    class's default, never set, so PPOTrainer(args=GRPOConfig(...)) trained PPO with GAE and a critic."""
    from turborlhf import GRPOConfig, PPOTrainer

    ppo = PPOTrainer(model=str(tiny_model), reward_funcs=str(tiny_rm), train_dataset=_questions(),
                     args=GRPOConfig(output_dir=str(tmp_path / "grpo"), train={"max_steps": 3}))
    assert (ppo.args.algo.advantage_estimator, ppo.args.algo.n_samples_per_prompt, ppo.args.train.max_steps) == (
        "grpo", 4, 3) and not ppo.args.algo.needs_critic
    ppo.close()
    # a value given for a field of the preset's section still wins over the preset's default
    mine = PPOTrainer(model=str(tiny_model), reward_funcs=str(tiny_rm), train_dataset=_questions(),
                      args=GRPOConfig(output_dir=str(tmp_path / "mine"), algo={"n_samples_per_prompt": 2}))
    assert (mine.args.algo.advantage_estimator, mine.args.algo.n_samples_per_prompt, mine.args.algo.kl_estimator,
            mine.output_dir) == ("grpo", 2, "k3", tmp_path / "mine")
    mine.close()
