"""Data sources through 🤗 datasets (Parquet, Arrow, save_to_disk, hub ids), JSON arrays, key mapping
and the one-line errors that name file, line or row, and key."""
import json

import pytest

from turborlhf.data import DataError, DataWarning, load_kto, load_pairs, load_prompts, load_sft
from turborlhf.data.errors import DataFileError
from turborlhf.data.sources import open_rows

datasets = pytest.importorskip("datasets")

USER = [{"role": "user", "content": "Hi"}]
RENDERED = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
PAIRS = [{"prompt": RENDERED, "chosen": "Hello", "rejected": "Bye"},
         {"prompt": "<|im_start|>user\nB<|im_end|>\n<|im_start|>assistant\n", "chosen": "Yes", "rejected": ""}]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_parquet_rows_and_row_numbered_errors(tok, tmp_path):
    path = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list(PAIRS).to_parquet(str(path))
    with pytest.warns(DataWarning, match=r"skipped 1 bad row\(s\): empty_response \(1\) at row 2 "
                                         r"\(row 2: rejected response is empty\)"):
        got = load_pairs(path, tok)
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in got] == [(RENDERED, "Hello", "Bye")]
    with pytest.raises(DataError) as e:
        load_pairs(path, tok, strict=True)
    assert _one_line(e).startswith(f"{path}: 1 bad row(s): empty_response (1) at row 2")


def test_save_to_disk_directory_and_split(tok, tmp_path):
    d = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"prompt": USER, "response": "Hello"}] * 3),
        "test": datasets.Dataset.from_list([{"prompt": RENDERED, "response": "Other"}]),
    }).save_to_disk(str(d))
    assert list(load_sft(d, tok)) == [{"prompt": RENDERED, "response": "Hello"}] * 3
    assert list(load_sft(f"{d}:test", tok)) == [{"prompt": RENDERED, "response": "Other"}]
    with pytest.raises(DataError, match="no split 'nope'|splits"):
        load_sft(f"{d}:nope", tok)
    single = tmp_path / "single"
    datasets.Dataset.from_list([{"prompt": RENDERED}]).save_to_disk(str(single))
    assert list(load_prompts(single, tok)) == [RENDERED]


def test_arrow_and_json_array_files(tok, tmp_path):
    ds = datasets.Dataset.from_list([{"prompt": RENDERED, "completion": "Hello", "label": True}])
    ds.save_to_disk(str(tmp_path / "kto"))
    arrow = next((tmp_path / "kto").glob("*.arrow"))
    assert list(load_kto(arrow, tok)) == [{"prompt": RENDERED, "completion": "Hello", "label": True}]
    arr = tmp_path / "pairs.json"
    arr.write_text(json.dumps(PAIRS))
    with pytest.warns(DataWarning, match="at row 2"):
        assert len(load_pairs(arr, tok)) == 1
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": PAIRS[:1]}))
    assert len(load_pairs(wrapped, tok)) == 1
    bom = tmp_path / "bom.json"         # a BOM made the array unreadable as one document
    bom.write_text("\ufeff" + json.dumps({"data": PAIRS[:1]}), encoding="utf-8")
    assert len(load_pairs(bom, tok)) == 1
    csv = tmp_path / "qa.csv"
    csv.write_text("question,answer\nWhat?,This\n")
    assert list(load_sft(csv, tok, keys={"prompt": "question", "response": "answer"})) == [
        {"prompt": "What?", "response": "This"}]
    numeric = tmp_path / "numeric.csv"   # datasets types an all-number column as int64: each row was refused
    numeric.write_text("question,answer\nHow many?,72\nHow much?,2.5\n")
    assert list(load_sft(numeric, tok, keys={"prompt": "question", "response": "answer"})) == [
        {"prompt": "How many?", "response": "72"}, {"prompt": "How much?", "response": "2.5"}]
    lines = tmp_path / "lines.json"       # a .json file holding JSON lines is read line by line
    lines.write_text("\n".join(json.dumps(r) for r in PAIRS) + "\n")
    with pytest.warns(DataWarning, match="at line 2"):
        assert len(load_pairs(lines, tok)) == 1


def test_key_mapping_question_answer(tok, tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"question": RENDERED, "answer": "Hello"},
        {"question": USER, "answer": "Hi there"},
        {"question": RENDERED},
    ]) + "\n")
    with pytest.raises(DataError) as e:    # not mapped: refused, naming the keys it found and the fields
        load_sft(path, tok)
    msg = _one_line(e)
    assert "at lines 1, 2, 3" in msg and "['answer', 'question']" in msg and "data.prompt_key" in msg
    keys = {"prompt": "question", "response": "answer"}
    with pytest.warns(DataWarning) as w:
        got = load_sft(path, tok, keys=keys)
    assert list(got) == [{"prompt": RENDERED, "response": "Hello"}, {"prompt": RENDERED, "response": "Hi there"}]
    assert "at line 3 (line 3: need 'question'+'answer'" in str(w[0].message)   # the data's own key names
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"q": USER, "good": "Hello", "bad": "Bye", "chosen": "ignored"}) + "\n")
    got = load_pairs(pairs, tok, keys={"prompt": "q", "chosen": "good", "rejected": "bad"})
    assert (got[0]["prompt"], got[0]["chosen"], got[0]["rejected"]) == (RENDERED, "Hello", "Bye")
    kto = tmp_path / "kto.jsonl"
    kto.write_text(json.dumps({"q": RENDERED, "out": "Hello", "label": False}) + "\n")
    assert list(load_kto(kto, tok, keys={"prompt": "q", "response": "out"})) == [
        {"prompt": RENDERED, "completion": "Hello", "label": False}]
    # the config's default keys leave every format as it was (KTO's completion included)
    from turborlhf.config import DataFormatCfg

    kto.write_text(json.dumps({"prompt": RENDERED, "completion": "Hello", "label": True}) + "\n")
    assert len(load_kto(kto, tok, **DataFormatCfg().loader_kwargs())) == 1


def test_jsonl_keeps_line_numbers_and_survives_binary(tok, tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'\n' + json.dumps(PAIRS[0]).encode() + b'\n\xff\xfe garbage\n')
    with pytest.raises(DataFileError, match=r"mixed\.jsonl: line 3 is not UTF-8 text"):
        load_pairs(path, tok)       # an encoding problem is the file's: one line naming it, not a skipped record
    pq = tmp_path / "p.parquet"
    datasets.Dataset.from_list(PAIRS[:1]).to_parquet(str(pq))
    renamed = tmp_path / "p.jsonl"          # Parquet bytes under a .jsonl name: an error naming lines, no crash
    renamed.write_bytes(pq.read_bytes())
    with pytest.raises(DataFileError, match=r"p\.jsonl: line \d+ is not UTF-8 text"):
        load_pairs(renamed, tok)


def test_missing_paths_and_hub_ids(tok, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        load_pairs(tmp_path / "nope.parquet", tok)
    with pytest.raises(FileNotFoundError):
        load_pairs(tmp_path / "nope.jsonl", tok)
    # the hub cannot be reached offline: one line naming the id
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        load_pairs("no-such-org/no-such-dataset:test", tok)
    assert _one_line(e).startswith("no-such-org/no-such-dataset:test: no such file or directory, and loading it")
    # the call is formed as datasets expects: id, data_dir and split
    calls = []

    def fake_load_dataset(repo, data_dir=None, split=None, **kw):
        calls.append((repo, data_dir, split))
        return datasets.Dataset.from_list(PAIRS[:1])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert len(load_pairs("Anthropic/hh-rlhf/harmless-base:test", tok)) == 1
    assert calls == [("Anthropic/hh-rlhf", "harmless-base", "test")]


def test_open_rows_units(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"a": 1}\n\n{"a": 2}\n')
    unit, rows = open_rows(p)
    assert unit == "line" and [n for n, _ in rows] == [1, 3]
    datasets.Dataset.from_list([{"a": 1, "b": None}, {"a": 2, "b": "x"}]).to_parquet(str(tmp_path / "a.parquet"))
    unit, rows = open_rows(tmp_path / "a.parquet")
    assert unit == "row" and list(rows) == [(1, {"a": 1}), (2, {"a": 2, "b": "x"})]


def test_a_split_of_a_json_file_is_an_error_and_one_chat_record_is_not_a_wrapper(tok, tmp_path):
    """``pairs.jsonl:test`` read the whole file (the training rows, as the test set); a JSON file
    holding one ``{"messages": [...]}`` record was unwrapped into its turns."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PAIRS[:1]))
    with pytest.raises(DataError) as e:
        load_pairs(f"{path}:test", tok)
    assert _one_line(e) == f"{path}:test: {path} is one JSON file, it has no split 'test' (use a file per split)"
    with pytest.raises(DataFileError):
        load_pairs(f"{tmp_path / 'none.jsonl'}:test", tok)
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"messages": USER + [{"role": "assistant", "content": "Hello"}]}))
    assert list(load_sft(one, tok)) == [{"prompt": RENDERED, "response": "Hello"}]
