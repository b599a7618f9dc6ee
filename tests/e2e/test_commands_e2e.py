"""`turborlhf generate`, `chat`, `export` (LoRA merged, --push-to-hub) and the `grpo` / `rloo`
aliases, on the tiny random model."""
import io
import json
import sys

import pytest
import yaml
import torch

from tests.e2e.helpers import REPO, max_weight_diff, metrics, run_cli, weights
from turborlhf.cli import main


def _prompts(tiny_data, n=3):
    return [json.loads(l) for l in (tiny_data / "test_prompts.jsonl").read_text().splitlines()[:n]]


def test_generate_matches_the_engine_and_reads_any_source(tiny_model, tiny_data, tmp_path):
    from turborlhf.data.tokenize import encode_prompt
    from turborlhf.models.load import load_tokenizer
    from turborlhf.rollout import make_engine
    from turborlhf.rollout.base import SamplingParams

    rows = _prompts(tiny_data)
    src = tmp_path / "q.jsonl"
    src.write_text("".join(json.dumps({"question": r["prompt"]}) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    run_cli("generate", "--model", tiny_model, "--prompts", src, "--output", out, "--prompt-key", "question",
            "--n", "2", "--temperature", "0", "--max-new-tokens", "6", "--dtype", "fp32")
    got = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(got) == 6 and [g["sample"] for g in got] == [0, 1] * 3
    assert [g["prompt"] for g in got] == [r["prompt"] for r in rows for _ in range(2)]
    # the same greedy continuation as the engine gives directly, stop token removed
    tok = load_tokenizer(str(tiny_model))
    eng = make_engine("auto", str(tiny_model), dtype="fp32")
    ref = eng.generate([encode_prompt(tok, r["prompt"], 1024) for r in rows],
                       SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(tok.eos_token_id,)))
    for i, (ids, fin) in enumerate(zip(ref.response_ids, ref.finished)):
        for g in got[2 * i:2 * i + 2]:
            assert g["response"] == tok.decode(ids[:-1] if fin else ids, skip_special_tokens=True)
            assert (g["finished"], g["response_tokens"]) == (fin, len(ids))
    assert main(["generate", "--model", str(tiny_model), "--prompts", str(tmp_path / "none.jsonl"),
                 "--output", str(out)]) == 2
    # past the model's context: one error, no output written (the HF engine ran past it silently)
    ctx = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    long_out = tmp_path / "long.jsonl"
    assert main(["generate", "--model", str(tiny_model), "--prompts", str(src), "--output", str(long_out),
                 "--prompt-key", "question", "--engine", "hf", "--max-new-tokens", str(ctx)]) == 2
    assert not long_out.exists()
    # a prompt longer than the context is cut to fit by default (the default limit of 1024 tokens, a
    # 1024-position model's whole context, failed with advice to lower the new-token limit)
    src.write_text(json.dumps({"question": "word " * (2 * ctx)}) + "\n")
    assert main(["generate", "--model", str(tiny_model), "--prompts", str(src), "--output", str(long_out),
                 "--prompt-key", "question", "--max-new-tokens", "2", "--dtype", "fp32"]) == 0
    assert len(long_out.read_text().splitlines()) == 1
    with pytest.raises(SystemExit, match="2"):                     # --limit -1 dropped the last prompt
        main(["generate", "--model", str(tiny_model), "--prompts", str(src), "--output", str(out), "--limit", "-1"])


def _chat(tiny_model, monkeypatch, capsys, text, *extra):
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    capsys.readouterr()
    assert main(["chat", "--model", str(tiny_model), "--temperature", "0", "--max-new-tokens", "5",
                 "--dtype", "fp32", *extra]) == 0
    return capsys.readouterr().out


def test_chat_is_multi_turn_and_streams(tiny_model, monkeypatch, capsys):
    from turborlhf.commands.generate import chat_loop
    from turborlhf.models.load import load_tokenizer
    from turborlhf.rollout import make_engine
    from turborlhf.rollout.base import SamplingParams

    tok = load_tokenizer(str(tiny_model))
    eng = make_engine("auto", str(tiny_model), dtype="fp32")
    seen = []

    class Recording:
        def generate(self, prompts, params):
            seen.append(tok.decode(prompts[0]))
            return eng.generate(prompts, params)

    out = io.StringIO()
    conv = chat_loop(Recording(), tok, SamplingParams(max_new_tokens=5, temperature=0), io.StringIO("first\nsecond\n"),
                     out, system="Be brief.")
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user", "assistant"]
    assert out.getvalue() == "".join(m["content"] + "\n" for m in conv[2::2])
    # the second turn sees the whole conversation, rendered by the chat template
    assert seen[1] == tok.apply_chat_template(conv[:4], add_generation_prompt=True, tokenize=False)
    assert "first" in seen[1] and "Be brief." in seen[1]
    seen.clear()                              # /reset: the next turn starts from the system message again
    conv = chat_loop(Recording(), tok, SamplingParams(max_new_tokens=5, temperature=0),
                     io.StringIO("first\n/reset\nsecond\n"), io.StringIO(), system="Be brief.")
    assert "first" not in seen[1] and [m["content"] for m in conv[:2]] == ["Be brief.", "second"]

    # the HF engine's reply arrives in pieces as it is decoded (the fast engine's in one write)
    from turborlhf.rollout.hf import HFEngine

    class Counting(io.StringIO):
        writes = 0

        def write(self, text):
            self.writes += 1
            return super().write(text)

    params = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=(tok.eos_token_id,))
    streamed, whole = Counting(), Counting()
    chat_loop(HFEngine(str(tiny_model), dtype="fp32"), tok, params, io.StringIO("hello\n"), streamed, stream=True)
    chat_loop(eng, tok, params, io.StringIO("hello\n"), whole)
    assert streamed.getvalue() == whole.getvalue() and whole.writes == 1 and streamed.writes > 2
    # sampled with a seed: the same reply streamed or not, and torch's global generator untouched
    hf = HFEngine(str(tiny_model), dtype="fp32")
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, stop_token_ids=(tok.eos_token_id,))
    before = torch.get_rng_state()
    streamed, whole = io.StringIO(), io.StringIO()
    chat_loop(hf, tok, sampled, io.StringIO("hello\nagain\n"), streamed, stream=True)
    chat_loop(hf, tok, sampled, io.StringIO("hello\nagain\n"), whole)
    assert streamed.getvalue() == whole.getvalue() and len(whole.getvalue()) > 10
    assert torch.equal(torch.get_rng_state(), before)

    # piped stdin through the command; the HF engine streams token by token, the same text as whole replies
    fast = _chat(tiny_model, monkeypatch, capsys, "hello\nagain\n")
    streamed = _chat(tiny_model, monkeypatch, capsys, "hello\nagain\n", "--engine", "hf")
    whole = _chat(tiny_model, monkeypatch, capsys, "hello\nagain\n", "--engine", "hf", "--no-stream")
    assert streamed == whole == fast and streamed.count("\n") >= 2


def test_chat_and_generate_refuse_what_they_cannot_serve_before_reading_a_line(tiny_model, tmp_path, monkeypatch,
                                                                             capsys):
    """chat never checked prompt + new tokens against the context (HF ran past it silently, the fast
    engine ended the session at the first line); a template refusing the system message was a
    traceback after the first line; a NaN temperature sampled garbage on the fast engine."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    base = ["chat", "--model", str(tiny_model), "--dtype", "fp32"]
    for extra, message in ((["--max-prompt-len", "1020", "--max-new-tokens", "20"], "exceed the policy's context"),
                           (["--temperature", "nan"], "temperature must be >= 0, got nan")):
        capsys.readouterr()
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert message in err and err.startswith("error: ") and "Traceback" not in err
    no_system = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not " \
                "supported') }}{% endif %}{{ m['content'] }}{% endfor %}"
    assert main(base + ["--chat-template", no_system, "--system", "Be brief."]) == 2
    assert "--system: the chat template refuses a system message (TemplateError: System role not supported)" \
        in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert main(["generate", "--model", str(tiny_model), "--prompts", str(prompts), "--output",
                 str(tmp_path / "o.jsonl"), "--temperature", "nan"]) == 2
    assert "temperature must be >= 0, got nan" in capsys.readouterr().err


def test_export_merges_lora_checkpoint_and_pushes(tiny_model, tiny_data, tiny_rm, tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    run = tmp_path / "sft"
    run_cli("sft", "--config", REPO / "configs/tiny/sft.yaml", f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", "data.max_samples=16", f"output_dir={run}",
            "train.max_steps=2", "model.lora.rank=4", "model.lora.alpha=8", "log.tensorboard=false")
    assert (run / "checkpoints" / "step-000002" / "policy" / "adapter_config.json").exists()
    out = tmp_path / "exported"
    run_cli("export", "--checkpoint", run, "--output", out)
    AutoModelForCausalLM.from_pretrained(out)
    assert not (out / "adapter_config.json").exists()
    assert max_weight_diff(weights(out), weights(run)) < 1e-6          # = the trainer's merged final export
    assert max_weight_diff(weights(out), weights(tiny_model)) > 1e-5   # the adapters were merged in
    # a full fine-tuned reward model keeps its scalar head
    rm_out = tmp_path / "rm_exported"
    run_cli("export", "--checkpoint", tiny_rm / "checkpoints" / "step-000002", "--output", rm_out)
    AutoModelForSequenceClassification.from_pretrained(rm_out)
    assert max_weight_diff(weights(rm_out), weights(tiny_rm)) < 1e-6
    assert main(["export", "--checkpoint", str(run), "--model", "critic", "--output", str(tmp_path / "x")]) == 2
    assert "no model 'critic'" in capsys.readouterr().err
    # an output whose replacement would delete a run or other files is refused (it was deleted)
    (tmp_path / "shelf").mkdir()
    (tmp_path / "shelf" / "notes.txt").write_text("keep me")
    for dest, why in ((run, "would replace the checkpoint"), (tmp_path, "would replace the checkpoint"),
                      (tmp_path / "shelf", "holds notes.txt")):
        assert main(["export", "--checkpoint", str(run), "--output", str(dest)]) == 2
        assert why in capsys.readouterr().err
    assert (tmp_path / "shelf" / "notes.txt").read_text() == "keep me" and (run / "checkpoints").is_dir()

    # --push-to-hub: the hub cannot be reached here, so check the calls huggingface_hub gets
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, *a, **k: calls.append(("create", a, k)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder",
                        lambda self, **k: calls.append(("upload", k)) or "https://hub/commit/1")
    run_cli("export", "--checkpoint", run, "--output", out, "--push-to-hub", "me/tiny-sft", "--private")
    assert calls[0] == ("create", ("me/tiny-sft",), {"repo_type": "model", "private": True, "exist_ok": True})
    assert calls[1][0] == "upload" and calls[1][1]["folder_path"] == str(out)
    assert calls[1][1]["repo_id"] == "me/tiny-sft" and calls[1][1]["repo_type"] == "model"


@pytest.mark.parametrize("alias,estimator", [("grpo", "grpo"), ("rloo", "rloo")])
def test_grpo_and_rloo_are_ppo_with_the_preset(alias, estimator, tiny_model, tiny_rm, tiny_data, tmp_path):
    out = tmp_path / alias
    run_cli(alias, f"actor.name_or_path={tiny_model}", f"actor.dtype=fp32", f"reward_model={tiny_rm}",
            f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}", "data.max_samples=8", "algo.prompts_per_step=2",
            "rollout.max_new_tokens=6", "rollout.dtype=fp32", "train.max_steps=1", "train.micro_batch_size=4",
            f"output_dir={out}", "log.tensorboard=false")
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["algo"]["advantage_estimator"] == estimator and cfg["algo"]["n_samples_per_prompt"] == 4
    assert cfg["algo"]["kl_use_loss"] == (alias == "grpo")
    row = metrics(out)[-1]
    assert "policy/loss" in row and "critic/loss" not in row           # no critic
