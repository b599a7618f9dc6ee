"""Trainers read any data source with the data's own keys, and a base model (no chat template) is
trained on plain text, or on messages once `data.chat_template` names one."""
import json
import shutil

import pytest

from tests.e2e.helpers import REPO, metrics, run_cli
from turborlhf.data import DataError, load_sft
from turborlhf.models.load import load_tokenizer


@pytest.fixture(scope="module")
def base_model(tiny_model, tmp_path_factory):
    """The tiny model with its chat template removed, as a base model's directory is."""
    d = tmp_path_factory.mktemp("base") / "model"
    shutil.copytree(tiny_model, d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    from turborlhf.models.load import load_tokenizer

    assert not load_tokenizer(str(d)).chat_template
    return d


def _sft(model, data, out, *extra):
    run_cli("sft", "--config", REPO / "configs/tiny/sft.yaml", f"model.name_or_path={model}",
            f"data.train_file={data}", f"output_dir={out}", "train.max_steps=2", "train.save_every=0",
            "log.tensorboard=false", "log.progress=false", *extra)


def test_base_model_plain_text_and_chat_template(base_model, tmp_path):
    from transformers import AutoTokenizer

    qa = tmp_path / "qa.jsonl"       # {question, answer}, plain text: needs no template, only the key names
    qa.write_text("".join(json.dumps({"question": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(8)))
    _sft(base_model, qa, tmp_path / "plain", "data.prompt_key=question", "data.response_key=answer")
    assert len([r for r in metrics(tmp_path / "plain") if "train/loss" in r]) == 2

    chats = tmp_path / "chats.jsonl"  # messages need a template: refused with the line and the field to set
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Hi {i}"},
                                                       {"role": "assistant", "content": "Hello"}]}) + "\n"
                             for i in range(8)))
    with pytest.raises(DataError, match=r"chats\.jsonl: line 1: .*data\.chat_template"):
        load_sft(chats, load_tokenizer(str(base_model)))
    with pytest.raises(AssertionError, match="exited with 2"):     # the CLI: one line, exit code 2
        _sft(base_model, chats, tmp_path / "refused")
    _sft(base_model, chats, tmp_path / "chatml", "data.chat_template=chatml")
    saved = AutoTokenizer.from_pretrained(tmp_path / "chatml")   # the template travels with the model
    assert saved.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                     tokenize=False) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_rm_reads_parquet_with_mapped_keys(tiny_model, tiny_data, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(l) for l in (tiny_data / "train_pairs.jsonl").read_text().splitlines()[:16]]
    mapped = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in rows]
    path = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list(mapped).to_parquet(str(path))
    out = tmp_path / "rm"
    run_cli("rm", "--config", REPO / "configs/tiny/rm.yaml", f"model.name_or_path={tiny_model}",
            f"data.train_file={path}", "train.max_steps=2", f"output_dir={out}", "log.tensorboard=false",
            "data.prompt_key=q", "data.chosen_key=good", "data.rejected_key=bad")
    assert len([r for r in metrics(out) if "train/loss" in r]) == 2


def test_chat_template_field_is_validated():
    from turborlhf.config import ConfigError, SFTConfig, load_config

    with pytest.raises(ConfigError, match="chat_template"):
        load_config(SFTConfig, None, ["data.train_file=x", "data.chat_template=nonsense"])
