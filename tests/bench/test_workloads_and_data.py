"""configs/bench/*.yaml are valid trainer configs, and the peer gets the same numbers from them;
the inputs both sides read."""
import json
from pathlib import Path

import pytest
import yaml

from turborlhf import config as C
from turborlhf.bench.data import first_user_turn, load_hh_pairs, write_bench_data
from turborlhf.bench.workloads import WORKLOADS, RunContext, data_needed, our_command, our_config, peer_args, repo_root

REPO = Path(__file__).resolve().parents[2]
HH = REPO / "data" / "hh-rlhf" / "harmless-base-1800.jsonl.gz"
CLASSES = {"ppo": C.PPOConfig, "grpo": C.PPOConfig, "dpo": C.DPOConfig, "rm": C.RMConfig}


def _ctx(tmp_path, **kw):
    data = {"prompts": tmp_path / "prompts.jsonl", "pairs": tmp_path / "pairs.jsonl"}
    return RunContext(repo=REPO, model_dir="/m/smollm2", data=data, threads=2, warmup=1, steps=3, **kw)


def _opt(args, name):
    return args[args.index(name) + 1]


def test_repo_root_is_this_checkout():
    assert repo_root() == REPO


@pytest.mark.parametrize("command", ["ppo", "grpo", "dpo", "rm"])
def test_bench_configs_validate_and_feed_the_peer(command, tmp_path):
    w, ctx = WORKLOADS[command], _ctx(tmp_path)
    raw = our_config(w, ctx, tmp_path / "run", seed=5)
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(raw))
    cfg = C.load_config(CLASSES[command], f)                 # a config our trainer accepts
    assert cfg.output_dir == str(tmp_path / "run") and cfg.train.max_steps == 4 and cfg.train.seed == 5
    assert cfg.train.threads == 2
    args = peer_args(w, raw, ctx, tmp_path / "peer", seed=5)
    assert _opt(args, "--steps") == "4" and _opt(args, "--seed") == "5" and _opt(args, "--model") == "/m/smollm2"
    assert float(_opt(args, "--lr")) == cfg.optim.lr
    cmd = our_command(w, ctx, f, 5)
    assert cmd[1:4] == ["-m", "turborlhf", w.trainer]
    if command in ("ppo", "grpo"):
        assert cfg.actor.name_or_path == "/m/smollm2" and cfg.data.prompts_file == str(ctx.data["prompts"])
        assert cfg.rollout.min_new_tokens == cfg.rollout.max_new_tokens and "--force-length" in args
        assert int(_opt(args, "--batch" if command == "ppo" else "--prompts")) == cfg.algo.prompts_per_step
    if command == "ppo":
        assert cfg.reward_model == "/m/smollm2" and cfg.algo.needs_critic and cfg.algo.needs_reference
        assert cfg.algo.prompts_per_step == 8 and cfg.rollout.max_new_tokens == 64 and cfg.algo.ppo_epochs == 1
        assert int(_opt(args, "--resp-len")) == 64 and int(_opt(args, "--max-prompt-len")) == cfg.rollout.max_prompt_len
        assert float(_opt(args, "--temperature")) == cfg.rollout.temperature
    if command == "grpo":
        assert not cfg.algo.needs_critic and not cfg.algo.needs_reference     # TRL's beta = 0
        assert cfg.algo.prompts_per_step * cfg.algo.n_samples_per_prompt == 8
        assert int(_opt(args, "--group")) == cfg.algo.n_samples_per_prompt == 4
        assert int(_opt(args, "--new-tokens")) == cfg.rollout.max_new_tokens == 48
        spec = cfg.rewards[0].path
        assert Path(spec.rpartition(":")[0]).is_file()           # resolved against the checkout
    if command in ("dpo", "rm"):
        assert cfg.model.name_or_path == "/m/smollm2" and cfg.data.train_file == str(ctx.data["pairs"])
        assert cfg.data.max_samples == 4 * cfg.train.pairs_per_step      # one pass over exactly these pairs
        assert cfg.train.micro_batch_size == cfg.train.pairs_per_step    # one forward per step, as TRL
        assert int(_opt(args, "--batch")) == cfg.train.pairs_per_step
        assert int(_opt(args, "--max-length")) == cfg.data.max_len
    expected = {"ppo": (8, 64), "grpo": (2, 48), "dpo": (4, 512), "rm": (8, 384)}[command]
    if command in ("dpo", "rm"):
        assert (cfg.train.pairs_per_step, cfg.data.max_len) == expected
    else:
        assert (cfg.algo.prompts_per_step, cfg.rollout.max_new_tokens) == expected


def test_options_reach_both_sides(tmp_path):
    ctx = _ctx(tmp_path, force_length=False, gradient_checkpointing=True)
    raw = our_config(WORKLOADS["ppo"], ctx, tmp_path / "run", 0)
    args = peer_args(WORKLOADS["ppo"], raw, ctx, tmp_path, 0)
    assert raw["rollout"]["min_new_tokens"] == 0 and "--force-length" not in args
    assert raw["actor"]["gradient_checkpointing"] and raw["critic"]["gradient_checkpointing"]
    assert "--gradient-checkpointing" in args
    raw = our_config(WORKLOADS["dpo"], ctx, tmp_path / "run", 0)
    assert raw["model"]["gradient_checkpointing"]


@pytest.mark.parametrize("command,peer_opt", [("grpo", "--new-tokens"), ("ppo", "--resp-len")])
def test_response_length_reaches_both_sides(command, peer_opt, tmp_path):
    """`bench grpo --new-tokens N` (cost growth with response length): both sides generate N tokens."""
    for force in (True, False):
        ctx = _ctx(tmp_path, response_tokens=1024, force_length=force)
        raw = our_config(WORKLOADS[command], ctx, tmp_path / "run", 0)
        assert raw["rollout"]["max_new_tokens"] == 1024
        assert raw["rollout"]["min_new_tokens"] == (1024 if force else 0)
        args = peer_args(WORKLOADS[command], raw, ctx, tmp_path, 0)
        assert _opt(args, peer_opt) == "1024" and ("--force-length" in args) == force
        C.PPOConfig.model_validate(raw)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("command", ["ppo", "grpo", "dpo", "rm", "generate"])
def test_both_sides_run_at_the_harness_precision(command, dtype, tmp_path):
    """No side is pinned to bf16: the host's choice reaches our config and the peer's --dtype. Our
    side runs on the CPU as the peer scripts do (TRL's `use_cpu`), also where a GPU is visible."""
    w, ctx = WORKLOADS[command], _ctx(tmp_path, dtype=dtype)
    raw = our_config(w, ctx, tmp_path / "run", 0) if w.trainer else None
    assert _opt(peer_args(w, raw, ctx, tmp_path, 0), "--dtype") == dtype
    if raw is None:
        assert _opt(our_command(w, ctx, None, 0), "--dtype") == dtype
        return
    model = raw.get("model") or raw["actor"]
    assert model["dtype"] == dtype and raw.get("rollout", {"dtype": dtype})["dtype"] == dtype
    assert model["device"] == "cpu" and raw.get("rollout", {"device": "cpu"})["device"] == "cpu"
    if command in ("ppo", "grpo"):
        assert raw["distributed"]["device"] == "cpu"
        C.PPOConfig.model_validate(raw)


@pytest.mark.parametrize("command", ["ppo", "grpo", "generate"])
def test_our_rollout_engine_chooses_its_arithmetic_under_dtype_auto(command, tmp_path):
    """`bench --dtype auto`: our engine gets `rollout.dtype: auto` (it may compute in fp32 on the
    same bf16 weights where that measures faster), the training and the peer keep the harness's."""
    w, ctx = WORKLOADS[command], _ctx(tmp_path, dtype="bf16", rollout_dtype="auto")
    raw = our_config(w, ctx, tmp_path / "run", 0) if w.trainer else None
    assert _opt(peer_args(w, raw, ctx, tmp_path, 0), "--dtype") == "bf16"
    if raw is None:
        assert _opt(our_command(w, ctx, None, 0), "--dtype") == "auto"
    else:
        assert raw["actor"]["dtype"] == "bf16" and raw["rollout"]["dtype"] == "auto"
        C.PPOConfig.model_validate(raw)


def test_generate_sides_share_their_options(tmp_path):
    ctx = _ctx(tmp_path)
    ours = our_command(WORKLOADS["generate"], ctx, None, 3)
    peer = peer_args(WORKLOADS["generate"], None, ctx, tmp_path, 3)
    assert ours[2:2 + len(peer)] == peer and ours[1].endswith("benchmarks/ours_generate.py")   # and --weight-dtype
    assert _opt(peer, "--batch-sizes") == "1,8,32" and _opt(peer, "--new") == "64"
    assert data_needed(WORKLOADS["generate"], None, ctx) == (0, 32)


def test_bench_data_files(tmp_path):
    paths = write_bench_data(HH, tmp_path, n_pairs=12, n_prompts=40)
    pairs = [json.loads(l) for l in paths["pairs"].read_text().splitlines()]
    prompts = [json.loads(l)["prompt"] for l in paths["prompts"].read_text().splitlines()]
    assert len(pairs) == 12 and len(prompts) == 40
    assert all(p["prompt"].endswith("\n\nAssistant:") and p["prompt"].startswith("\n\nHuman: ") for p in pairs)
    assert all(p["chosen"].strip() and p["rejected"].strip() for p in pairs)
    turns = [m[0]["content"] for m in prompts]
    assert len(set(turns)) == 40 and all(m[0]["role"] == "user" and len(m) == 1 for m in prompts)
    assert turns[0] == first_user_turn(pairs[0]["prompt"])
    assert load_hh_pairs(HH, 12) == pairs


def test_bench_pairs_are_ones_neither_side_truncates(tmp_path):
    """TRL's RewardTrainer drops a pair past max_length, `turborlhf rm` cuts its prompt: the two
    sides trained on different pairs and lengths. The bench's pairs now fit both untouched."""
    from turborlhf.bench.data import fits_untruncated
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    n = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])
    longest = lambda r: max(n(r["prompt"] + r["chosen"]), n(r["prompt"] + r["rejected"]))
    assert max(map(longest, load_hh_pairs(HH, 12))) > 96               # the unfiltered pairs would be cut
    paths = write_bench_data(HH, tmp_path, n_pairs=12, n_prompts=0, fits=fits_untruncated(tok, 96))
    pairs = [json.loads(l) for l in paths["pairs"].read_text().splitlines()]
    assert len(pairs) == 12 and max(map(longest, pairs)) + 4 <= 96


def test_bench_data_errors(tmp_path):
    assert first_user_turn("\n\nHuman: hi there \n\nAssistant: yes\n\nHuman: more\n\nAssistant:") == "hi there"
    with pytest.raises(ValueError, match="not an HH prompt"):
        first_user_turn("no turns")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b", "rejected": "\\n\\nHuman: a\\n\\nAssistant: c"}\n'
                   '{"chosen": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_hh_pairs(bad, 5)
    assert len(load_hh_pairs(bad, 1)) == 1                  # stops before the bad line
    one = tmp_path / "one.jsonl"
    one.write_text(bad.read_text().splitlines()[0] + "\n")
    with pytest.raises(ValueError, match="only 1 usable pairs, 2 needed"):
        load_hh_pairs(one, 2)


def test_the_ppo_benchs_reward_model_follows_the_base_model(tmp_path):
    """The head was written once and reused whatever `--model` a later run named: our side scored
    (and its critic started) from an earlier model's trunk while TRL's used the new one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from turborlhf.bench.data import write_fresh_reward_model
    from turborlhf.models.tiny import save_tiny_causal_lm

    a, b = save_tiny_causal_lm(tmp_path / "a", seed=0), save_tiny_causal_lm(tmp_path / "b", seed=1)
    out = tmp_path / "data" / "reward_model"

    def embeddings(path, cls):
        return cls.from_pretrained(path).model.embed_tokens.weight

    write_fresh_reward_model(a, out)
    mtime = (out / "config.json").stat().st_mtime_ns
    write_fresh_reward_model(a, out)                                   # the same model: kept
    assert (out / "config.json").stat().st_mtime_ns == mtime
    write_fresh_reward_model(b, out)                                   # another one: rebuilt on it
    assert torch.equal(embeddings(out, AutoModelForSequenceClassification), embeddings(b, AutoModelForCausalLM))


@pytest.mark.parametrize("script", ["trl_dpo.py", "trl_grpo.py", "trl_ppo.py", "trl_rm.py"])
def test_the_trl_peers_load_fp32_master_weights(script):
    """The peers loaded the checkpoint in its stored dtype: from a bf16 checkpoint TRL trained
    pure-bf16 weights (even under --dtype fp32) while our side keeps fp32 master weights, and the
    report named the harness's precision for both. Every model load now asks for fp32."""
    import ast

    tree = ast.parse((REPO / "benchmarks" / "peers" / script).read_text())
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "from_pretrained" and isinstance(n.func.value, ast.Name)
             and n.func.value.id.startswith("AutoModelFor")]
    assert loads
    for call in loads:
        kw = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert kw.get("dtype") == "torch.float32", (script, ast.unparse(call))


@pytest.mark.parametrize("command", ["ppo", "grpo", "dpo", "rm", "generate"])
def test_an_explicit_dtype_pins_our_weights_and_moments_too(command, tmp_path):
    """--dtype fp32 left our engine on bf16 weights and our AdamW on bf16 moments (the `auto`
    choices of an fp32 host) while the record said "fp32 on both sides"; docs/benchmarks.md
    promises an explicit --dtype pins our side to it."""
    w = WORKLOADS[command]
    pinned = _ctx(tmp_path, dtype="fp32", rollout_dtype="fp32")
    auto = _ctx(tmp_path, dtype="fp32", rollout_dtype="auto")
    if command == "generate":
        assert _opt(our_command(w, pinned, None, 0), "--weight-dtype") == "same"
        assert _opt(our_command(w, auto, None, 0), "--weight-dtype") == "auto"
        # HF's script takes no such option (its child died at argument parsing, every time)
        import subprocess
        import sys

        args = peer_args(w, None, pinned, tmp_path, 0)
        assert "--weight-dtype" not in args
        help_text = subprocess.run([sys.executable, str(REPO / w.peer_script), "--help"], capture_output=True,
                                   text=True).stdout
        assert all(a in help_text for a in args if a.startswith("--"))
        return
    raw = our_config(w, pinned, tmp_path / "run", 0)
    cfg = CLASSES[command].model_validate(raw)
    assert cfg.optim.state_dtype == "fp32" and (command in ("dpo", "rm") or cfg.rollout.weight_dtype == "same")
    assert our_config(w, auto, tmp_path / "run", 0).get("optim", {}).get("state_dtype") in (None, "auto")


def test_the_description_says_the_sizes_of_this_run(tmp_path):
    from turborlhf.bench.workloads import describe

    gen = describe(WORKLOADS["generate"], _ctx(tmp_path, new_tokens=8, batch_sizes=(1, 2)))
    assert gen == "rollout generation: 8 new tokens per row, batch 1/2"
    assert "responses set to 6 tokens" in describe(WORKLOADS["grpo"], _ctx(tmp_path, response_tokens=6))
    assert describe(WORKLOADS["dpo"], _ctx(tmp_path)) == WORKLOADS["dpo"].description


def test_hw_peak_measures_bf16_only_where_it_is_native():
    """`benchmarks/hw_peak.py` by default: an emulated bf16 matmul takes minutes at ~1 GFLOP/s, so
    with AVX-512 switched off (no native bf16 on any host) only fp32 is measured."""
    import os
    import subprocess
    import sys

    script = repo_root() / "benchmarks" / "hw_peak.py"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, str(script), "--n", "64", "--iters", "1", "--mib", "1", "--threads", "1"],
                         env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    res = json.loads(out.split("BENCH_RESULT ", 1)[1])
    assert res["bf16_gflops"] is None and res["fp32_gflops"] > 0
