"""`turborlhf export` and the HF files every save writes: what a plain transformers user loads
(pad id, stop tokens, file modes), and the outputs an export must never write into."""
import json
import os
import shutil

import pytest
import torch

from turborlhf.commands.export import ExportError, export_checkpoint
from turborlhf.engine.checkpoint import _write_hf


def _umask_mode(is_dir=False):
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if is_dir else 0o666) & ~umask


def test_a_base_model_trained_on_chatml_stops_at_the_end_of_turn_in_plain_generate(tiny_model, tmp_path):
    """A base model whose EOS is ``<|endoftext|>``, trained with a ChatML template: its responses end
    with ``<|im_end|>``, where turborlhf's rollouts stop, but the export's generation_config named
    only the base's EOS, so plain HF ``generate`` ran on past the turn. Saved files are readable as
    any other file (safetensors wrote the weights 0600)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.eos_token = "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.generation_config.eos_token_id = tok.eos_token_id
    _write_hf(model, tok, tmp_path / "out")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [tok.eos_token_id, im_end] and im_end != tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id         # the training model's, untouched
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == _umask_mode()


def test_a_reward_model_export_keeps_its_pad_id_and_tokenizer(tiny_model, tmp_path):
    """A reward model trained elsewhere with pad = EOS (TRL's usual set-up) pools at the rightmost
    token that is not EOS; the export re-saved it with the tokenizer's unk as its pad (load_tokenizer's
    switch), so transformers read another token and scored the same text otherwise."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    src = tmp_path / "rm"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1, pad_token_id=tok.eos_token_id)
    torch.nn.init.normal_(rm.score.weight, std=1.0)
    rm.save_pretrained(src)
    tok.save_pretrained(src)
    export_checkpoint(src, tmp_path / "out")
    ids = tok(["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>"], return_tensors="pt")
    scores = []
    for d in (src, tmp_path / "out"):
        m = AutoModelForSequenceClassification.from_pretrained(d).eval()
        assert m.config.pad_token_id == tok.eos_token_id and AutoTokenizer.from_pretrained(d).pad_token_id == tok.pad_token_id
        with torch.no_grad():
            scores.append(m(**ids).logits)
    assert torch.equal(*scores)


def test_export_finds_a_checkpoint_cut_short_between_its_renames_and_writes_nowhere_inside_a_run(
        tiny_model, tmp_path):
    """`latest` names a step whose re-save was killed between its two renames: --resume restores it,
    export read `latest` directly and raised a raw FileNotFoundError. An output inside the run
    (a checkpoint's model directory: it then held another step's weights beside that step's state)
    or a LoRA export onto its own base model is refused."""
    from turborlhf.engine.checkpoint import save_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    for step in (1, 2):
        save_checkpoint(run, step, {"policy": model}, tok, {"step": step}, keep=2)
    root = run / "checkpoints"
    os.replace(root / "step-000002", root / ".step-000002.old-4242")        # killed mid re-save
    export_checkpoint(run, tmp_path / "out")
    assert (root / "step-000002" / "policy").is_dir()
    for inside in (root / "step-000001" / "policy", root / "step-000002" / "exported", run / "exported"):
        with pytest.raises(ExportError, match="would replace the checkpoint it exports from .* or write inside it"):
            export_checkpoint(run, inside)
    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    from peft import LoraConfig, get_peft_model

    get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj"])) \
        .save_pretrained(tmp_path / "adapters")
    tok.save_pretrained(tmp_path / "adapters")
    before = (base / "model.safetensors").read_bytes()
    with pytest.raises(ExportError, match="would replace the adapters' base model"):
        export_checkpoint(tmp_path / "adapters", base)
    assert (base / "model.safetensors").read_bytes() == before


def test_a_new_run_clears_conditional_sfts_tag_file(tmp_path):
    """eval-policy tags the prompts of any policy whose directory holds the tag file: a plain run
    started over a conditional-SFT run must not leave it."""
    from turborlhf.data.conditioning import TAG_FILE
    from turborlhf.engine.run import clear_export

    (tmp_path / TAG_FILE).write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    assert TAG_FILE in clear_export(tmp_path)
    assert not (tmp_path / TAG_FILE).exists() and (tmp_path / "metrics.jsonl").exists()
