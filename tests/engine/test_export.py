"""`turborlhf export` and the HF files every save writes: what a plain transformers user loads
(pad id, stop tokens, file modes), and the outputs an export must never write into."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

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


# the child: an export of the tiny model into argv[3], killed once its files are staged (the
# staging directory complete, nothing moved into place yet); "run" is a trainer's final export
# into its run directory, "command" is `turborlhf export`
_EXPORT_CHILD = """
import sys, time
from pathlib import Path
import turborlhf.engine.checkpoint as C
import turborlhf.engine.run as R

real = C._write_hf
def write_hf(*a, **kw):
    real(*a, **kw)
    print("KILL ME", flush=True)
    time.sleep(600)
C._write_hf = R._write_hf = write_hf
kind, src, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
if kind == "run":
    from transformers import AutoModelForCausalLM, AutoTokenizer
    R.export_model(AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src), out)
else:
    from turborlhf.commands.export import export_checkpoint
    export_checkpoint(src, out)
"""


def _export_until_staged(kind, src, out):
    """A child process that stopped mid-export, its staged files written (see `_EXPORT_CHILD`)."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo / 'src'}{os.pathsep}{repo}", "OMP_NUM_THREADS": "1"}
    log = out.parent / f"child-{kind}.log"
    with open(log, "a") as err:
        proc = subprocess.Popen([sys.executable, "-c", _EXPORT_CHILD, kind, str(src), str(out)], env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    if proc.stdout.readline().strip() != "KILL ME":
        _end(proc)
        raise AssertionError(f"the child ended before its export was staged:\n{log.read_text()[-3000:]}")
    return proc


def _end(proc):
    proc.kill()
    proc.wait()
    proc.stdout.close()


@pytest.mark.parametrize("kind", ["run", "command"])
def test_a_later_export_removes_what_a_killed_one_left_but_not_a_running_ones(kind, tiny_model, tmp_path, capsys):
    """A SIGKILLed export (`turborlhf export`, or a trainer's final save) left its staging directory,
    a whole model's weights, in or beside the destination for good. The next export into that
    destination removes the leftovers of dead exports, naming them in one line; the staging
    directory of an export still running there stays."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turborlhf.commands.export import export_checkpoint
    from turborlhf.engine.run import export_model
    from turborlhf.metrics import console_logging

    out = tmp_path / "out"
    where = out if kind == "run" else tmp_path

    def staging():
        return {p.name for p in where.iterdir() if p.name.startswith(".") and p.is_dir()}
    running = _export_until_staged(kind, tiny_model, out)
    try:
        live = staging()
        assert live
        killed = _export_until_staged(kind, tiny_model, out)
        _end(killed)
        assert killed.returncode == -signal.SIGKILL
        dead = staging() - live
        assert dead, "the kill left nothing behind: the test did not kill mid-export"
        console_logging()
        capsys.readouterr()
        if kind == "run":
            export_model(AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model),
                         out)
        else:
            export_checkpoint(tiny_model, out)
        assert staging() == live
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if "killed export" in line and all(n in line for n in dead)]
    finally:
        _end(running)
    assert (out / "model.safetensors").exists()
