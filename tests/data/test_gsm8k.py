"""`prepare-data gsm8k`: real GSM8K lines plus malformed ones -> prompt files that keep the answer
as a column, problems reported by line number; the loader hands the columns to PPO."""
import gzip
import json
from pathlib import Path

import pytest

from turborlhf.cli import main
from turborlhf.data.errors import DataError
from turborlhf.data.gsm8k import GSM8K_INSTRUCTION, prepare_gsm8k
from turborlhf.data.jsonl import read_jsonl

REPO = Path(__file__).resolve().parents[2]
GSM8K_TRAIN = REPO / "data" / "gsm8k" / "train.jsonl.gz"


@pytest.fixture()
def sample(tmp_path) -> Path:
    """The first 3 real training lines, then one of each malformed kind, then a comma answer."""
    with gzip.open(GSM8K_TRAIN, "rt") as f:
        real = [next(f).rstrip("\n") for _ in range(3)]
    lines = real + [
        '{"question": "broken json", ',                                     # 4 bad_json
        json.dumps({"question": "no answer key"}),                          # 5 missing_key
        json.dumps({"question": "  ", "answer": "x\n#### 3"}),               # 6 empty_question
        json.dumps({"question": "Q?", "answer": "I do not know"}),           # 7 no_final_answer
        "",                                                                 # 8 blank: skipped, still counted
        json.dumps({"question": "How many?", "answer": "2 * 540 = 1080\n#### 1,080"}),   # 9 fine
    ]
    path = tmp_path / "sample.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prepare_gsm8k_cli_reports_bad_lines(sample, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["prepare-data", "gsm8k", "--input", str(sample), "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped 4 bad line(s)" in printed and "no_final_answer: 1 (lines 7)" in printed
    rows = [r for _, r in read_jsonl(out / "sample_prompts.jsonl")]
    assert [r["answer"] for r in rows] == ["72", "10", "5", "1080"]         # separators removed
    first = rows[0]
    assert first["prompt"] == [{"role": "user", "content": first["question"] + "\n\n" + GSM8K_INSTRUCTION}]
    assert first["solution"].endswith("#### 72") and first["question"].startswith("Natalia sold clips")
    sft = [r for _, r in read_jsonl(out / "sample_sft.jsonl")]                 # cold-start SFT rows
    assert [r["prompt"] for r in sft] == [r["prompt"] for r in rows]
    assert sft[0]["response"] == ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"      # annotations kept
                                  "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
    assert sft[3]["response"] == "2 * 540 = 1080\n#### 1080"                                  # "#### 1,080"
    report = json.loads((out / "sample_report.json").read_text())
    assert report["files"] == ["sample_prompts.jsonl", "sample_sft.jsonl", "sample_report.json"]
    assert report["lines_read"] == 8 and report["prompts_written"] == 4
    assert {k: v["lines"] for k, v in report["problems"].items() if v["count"]} == {
        "bad_json": [4], "missing_key": [5], "empty_question": [6], "no_final_answer": [7]}


def test_strict_and_missing_input(sample, tmp_path, capsys):
    with pytest.raises(DataError, match=r"4 bad line\(s\): bad_json \(1\) at line 4"):
        prepare_gsm8k(sample, tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()
    assert main(["prepare-data", "gsm8k", "--input", str(sample), "--output-dir", str(tmp_path / "s"),
                 "--strict"]) == 2
    assert "bad_json (1) at line 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["prepare-data", "gsm8k", "--output-dir", str(tmp_path)])
    assert "gsm8k needs --input" in capsys.readouterr().err


def test_prompt_records_keep_the_columns(sample, tmp_path, tiny_model):
    from turborlhf.data.chat import render_prompt
    from turborlhf.data.loaders import load_prompt_records, load_prompts
    from turborlhf.models.load import load_tokenizer

    prepare_gsm8k(sample, tmp_path)
    tok = load_tokenizer(str(tiny_model))
    recs = load_prompt_records(tmp_path / "sample_prompts.jsonl", tok)
    assert [r["columns"]["answer"] for r in recs] == ["72", "10", "5", "1080"]
    assert set(recs[0]["columns"]) == {"answer", "solution", "question"}          # the prompt key is not a column
    first = next(r for _, r in read_jsonl(tmp_path / "sample_prompts.jsonl"))
    assert recs[0]["prompt"] == render_prompt(tok, first["prompt"])             # rendered with the policy's template
    assert list(load_prompts(tmp_path / "sample_prompts.jsonl", tok)) == [r["prompt"] for r in recs]


def test_shipped_gsm8k_files_convert_cleanly(tmp_path):
    report = prepare_gsm8k(GSM8K_TRAIN, tmp_path)
    assert report["lines_read"] == 7473 and report["prompts_written"] == 7473 and report["problems_total"] == 0


def test_prepare_gsm8k_reads_parquet(tmp_path, capsys):
    """A Parquet file (the hub's openai/gsm8k ships them) failed with a raw UTF-8 decode error from the
    JSON-lines reader; it is read by row, named without its suffix, and a damaged one is refused in one line."""
    import datasets

    path = tmp_path / "train-00000-of-00001.parquet"
    datasets.Dataset.from_list([{"question": "How many?", "answer": "2 * 540 = 1080\n#### 1,080"},
                                {"question": "Q?", "answer": "I do not know"}]).to_parquet(str(path))
    out = tmp_path / "out"
    assert main(["prepare-data", "gsm8k", "--input", str(path), "--output-dir", str(out)]) == 0
    assert "no_final_answer: 1 (lines 2)" in capsys.readouterr().out
    (row,) = [obj for _, obj in read_jsonl(out / "train-00000-of-00001_prompts.jsonl")]
    assert row["answer"] == "1080" and row["question"] == "How many?"
    with pytest.raises(DataError, match=r"1 bad row\(s\): no_final_answer \(1\) at row 2"):
        prepare_gsm8k(path, tmp_path / "strict", strict=True)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1\xff\xfe not parquet")
    assert main(["prepare-data", "gsm8k", "--input", str(bad), "--output-dir", str(out)]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert str(bad) in err and "not a readable parquet file" in err and "UTF-8" not in err
