import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from turborlhf.data import DataError, Pair, convert_pair, parse_dialogue, prepare_hh, run_prepare_data, split_of
from turborlhf.data.errors import Problem
from turborlhf.data.hh_rlhf import parse_hub_spec
from turborlhf.data.jsonl import read_jsonl

REAL = Path(__file__).parents[2] / "data/hh-rlhf/harmless-base-1800.jsonl.gz"


def hh(*turns):
    return "".join(f"\n\n{who}: {text}" for who, text in turns)


def line(chosen, rejected):
    return json.dumps({"chosen": chosen, "rejected": rejected})


P = [("Human", "Hi there"), ("Assistant", "Hello!"), ("Human", "How are you?")]
GOOD = line(hh(*P, ("Assistant", "Fine, thanks.")), hh(*P, ("Assistant", "Go away.")))

# (line text, expected problem kind or None); blank line 8 is skipped but counted in numbering
CASES = [
    (GOOD, None),  # 1
    ('{"chosen": "\\n\\nHuman: hi', "bad_json"),  # 2
    (json.dumps({"chosen": hh(("Human", "a"), ("Assistant", "b"))}), "missing_key"),  # 3
    (json.dumps({"chosen": ["not", "a string"], "rejected": "x"}), "missing_key"),  # 4
    (line(hh(("Human", "A"), ("Assistant", "x")), hh(("Human", "B"), ("Assistant", "y"))), "prompt_mismatch"),  # 5
    (line(hh(("Human", "A"), ("Assistant", "x")), hh(("Human", "A"), ("Assistant", "  "))), "empty_response"),  # 6
    (line(hh(("Human", "only a question")), hh(("Human", "only a question"))), "no_assistant_turn"),  # 7
    ("", None),  # 8 blank
    (line(hh(("Human", "Q"), ("Assistant", "Human: role-play. Human: again")),
          hh(("Human", "Q"), ("Assistant", "No"))), None),  # 9: "Human:" inside a turn
    (line(hh(("Human", "A"), ("Assistant", "x"), ("Human", "more")), hh(("Human", "A"), ("Assistant", "y"))),
     "no_assistant_turn"),  # 10: ends with a human turn
    ("[1, 2]", "missing_key"),  # 11
    (line(hh(("Assistant", "x")), hh(("Assistant", "y"))), "empty_prompt"),  # 12
    (line(hh(("Human", "A"), ("Assistant", "Same.")), hh(("Human", "A"), ("Assistant", " Same. "))),
     "same_response"),  # 13: no preference (a constant loss, a tie in accuracy)
]


def write_cases(path, cases=CASES):
    path.write_text("\n".join(c for c, _ in cases) + "\n", encoding="utf-8")
    return path


def test_parse_dialogue_roles_and_inline_human():
    text = "\n\nHuman: hi\n\nAssistant: Human: so you say. Human: yes\n\nAssistant: more\n\nHuman: bye"
    assert parse_dialogue(text) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Human: so you say. Human: yes\n\nmore"},  # merged
        {"role": "user", "content": "bye"},
    ]
    assert parse_dialogue("Human: start of text\n\nAssistant: ok") == [
        {"role": "user", "content": "start of text"},
        {"role": "assistant", "content": "ok"},
    ]


def test_convert_pair_good():
    pair = convert_pair(json.loads(GOOD), line=1)
    assert isinstance(pair, Pair)
    assert pair.prompt_messages == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    assert (pair.chosen, pair.rejected) == ("Fine, thanks.", "Go away.")


def test_convert_pair_every_problem_kind(tmp_path):
    path = write_cases(tmp_path / "in.jsonl")
    got = {n: convert_pair(obj, n) for n, obj in read_jsonl(path)}
    for n, (_, kind) in enumerate(CASES, start=1):
        if CASES[n - 1][0] == "":
            assert n not in got
        elif kind is None:
            assert isinstance(got[n], Pair), n
        else:
            assert isinstance(got[n], Problem) and got[n].kind == kind and got[n].line == n, (n, got[n])
    assert got[9].chosen == "Human: role-play. Human: again"


def test_prepare_report_lists_problems_with_lines(tok, tmp_path):
    report = prepare_hh(write_cases(tmp_path / "in.jsonl"), tmp_path / "out", tok)
    assert report["lines_read"] == 12
    assert sum(report["pairs_written"].values()) == 2
    expect = {"bad_json": [2], "missing_key": [3, 4, 11], "prompt_mismatch": [5], "empty_response": [6],
              "no_assistant_turn": [7, 10], "empty_prompt": [12], "same_response": [13]}
    assert {k: v["lines"] for k, v in report["problems"].items() if v["count"]} == expect
    assert report["problems_total"] == 10
    assert report["lines_read"] == sum(report["pairs_written"].values()) + report["problems_total"]
    assert json.loads((tmp_path / "out/report.json").read_text()) == report


def test_strict_raises_with_lines(tok, tmp_path):
    with pytest.raises(DataError) as e:
        prepare_hh(write_cases(tmp_path / "in.jsonl"), tmp_path / "out", tok, strict=True)
    msg = str(e.value)
    for frag in ("bad_json", "at line 2", "missing_key", "3, 4, 11", "prompt_mismatch", "line 5", "7, 10"):
        assert frag in msg
    assert not (tmp_path / "out").exists()  # nothing written
    # strict on clean data is fine
    write_cases(tmp_path / "ok.jsonl", [(GOOD, None)])
    assert prepare_hh(tmp_path / "ok.jsonl", tmp_path / "ok", tok, strict=True)["problems_total"] == 0


def make_many(n, seed=0):
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        p = [("Human", f"question number {i} {rng.random():.6f}")]
        lines.append(line(hh(*p, ("Assistant", f"good {i}")), hh(*p, ("Assistant", f"bad {i}"))))
    return lines


def read_all(d):
    return {f.name: f.read_bytes() for f in sorted(Path(d).glob("*.jsonl"))}


def test_split_deterministic_order_independent_disjoint(tok, tmp_path):
    lines = make_many(300)
    (tmp_path / "a.jsonl").write_text("\n".join(lines))
    shuffled = lines[:]
    random.Random(1).shuffle(shuffled)
    (tmp_path / "b.jsonl").write_text("\n".join(shuffled + lines[:20]))  # + duplicates
    r1 = prepare_hh(tmp_path / "a.jsonl", tmp_path / "o1", tok, test_fraction=0.2)
    prepare_hh(tmp_path / "a.jsonl", tmp_path / "o2", tok, test_fraction=0.2)
    assert read_all(tmp_path / "o1") == read_all(tmp_path / "o2")  # byte-identical reruns
    assert 30 < r1["pairs_written"]["test"] < 90  # ~60 expected

    def prompts_by_split(d):
        return {s: {json.dumps(o["prompt_messages"]) for _, o in read_jsonl(Path(d) / f"{s}_pairs.jsonl")}
                for s in ("train", "test")}

    a = prompts_by_split(tmp_path / "o1")
    prepare_hh(tmp_path / "b.jsonl", tmp_path / "o3", tok, test_fraction=0.2)
    b = prompts_by_split(tmp_path / "o3")
    assert a == b  # same prompt -> same split whatever the order
    assert not (a["train"] & a["test"])
    r3 = json.loads((tmp_path / "o3/report.json").read_text())
    assert r3["prompts_written"] == r1["prompts_written"]  # duplicates de-duplicated in prompts files
    assert split_of("x", 0.0) == "train" and split_of("x", 1.0) == "test"


def test_output_files_keys_and_order(tok, tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(make_many(60)))
    report = prepare_hh(tmp_path / "in.jsonl", tmp_path / "out", tok, test_fraction=0.3)
    out = tmp_path / "out"
    for split in ("train", "test"):
        pairs = [o for _, o in read_jsonl(out / f"{split}_pairs.jsonl")]
        comps = [o for _, o in read_jsonl(out / f"{split}_comparisons.jsonl")]
        prompts = [o for _, o in read_jsonl(out / f"{split}_prompts.jsonl")]
        kto = [o for _, o in read_jsonl(out / f"{split}_kto.jsonl")]
        assert len(pairs) == report["pairs_written"][split] > 0
        assert len(comps) == 2 * len(pairs) and len(kto) == 2 * len(pairs)
        assert len(prompts) == report["prompts_written"][split]
        for i, p in enumerate(pairs):
            assert set(p) == {"prompt", "chosen", "rejected", "prompt_messages"}
            assert p["prompt"].endswith("<|im_start|>assistant\n")
            assert p["chosen"].startswith("good") and p["rejected"].startswith("bad")
            assert not p["chosen"].endswith("<|im_end|>")
            c, r = comps[2 * i]["text"], comps[2 * i + 1]["text"]  # chosen first, then rejected
            assert set(comps[2 * i]) == {"text"}
            assert c == p["prompt"] + p["chosen"] + "<|im_end|>\n"
            assert r == p["prompt"] + p["rejected"] + "<|im_end|>\n"
            assert kto[2 * i] == {"prompt": p["prompt"], "completion": p["chosen"], "label": True}
            assert kto[2 * i + 1] == {"prompt": p["prompt"], "completion": p["rejected"], "label": False}
        assert all(set(o) == {"text", "prompt"} and o["text"] == o["prompt"] for o in prompts)
    kinds = ("pairs", "comparisons", "prompts", "kto")
    expected = {f"{s}_{k}.jsonl" for s in ("train", "test") for k in kinds} | {"report.json"}
    assert {f.name for f in out.iterdir()} == expected


def test_real_sample(tok, tmp_path):
    report = prepare_hh(REAL, tmp_path, tok)
    assert report["lines_read"] == 1800
    assert report["problems"]["prompt_mismatch"]["lines"] == [1255, 1689]
    empty = [d for d in report["problem_details"] if d["kind"] == "empty_response"]
    assert len(empty) == 4 and all(d["detail"] == "chosen response empty" for d in empty)
    assert report["problems_total"] == 6
    assert sum(report["pairs_written"].values()) == 1794
    assert report["pairs_written"] == {"train": 1610, "test": 184}
    # "Human:" inside assistant turns stays in the content (e.g. line 30 has "Assistant: Human: ...")
    texts = [o["prompt"] for _, o in read_jsonl(tmp_path / "train_pairs.jsonl")] + [
        o["prompt"] for _, o in read_jsonl(tmp_path / "test_pairs.jsonl")]
    assert any("<|im_start|>assistant\nHuman: " in t for t in texts)


def test_hub_spec_and_missing_file(tok, tmp_path):
    assert parse_hub_spec("Anthropic/hh-rlhf") == ("Anthropic/hh-rlhf", None, "train")
    assert parse_hub_spec("Anthropic/hh-rlhf/harmless-base:test") == ("Anthropic/hh-rlhf", "harmless-base", "test")
    assert parse_hub_spec("data/missing.jsonl") is None
    with pytest.raises(FileNotFoundError):
        prepare_hh(tmp_path / "nope.jsonl", tmp_path / "out", tok)


def test_run_prepare_data(tok, tmp_path, capsys):
    tok.save_pretrained(tmp_path / "tok")
    write_cases(tmp_path / "in.jsonl")
    args = SimpleNamespace(dataset="hh-rlhf", input=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "out"),
                           test_fraction=0.5, strict=False, tokenizer=str(tmp_path / "tok"))
    report = run_prepare_data(args)
    out = capsys.readouterr().out
    assert "prompt_mismatch: 1 (lines 5)" in out and "missing_key: 3 (lines 3, 4, 11)" in out
    assert report["test_fraction"] == 0.5
    with pytest.raises(ValueError):
        run_prepare_data(SimpleNamespace(**{**vars(args), "dataset": "nope"}))


def test_hub_loader_without_datasets(monkeypatch, tok, tmp_path):
    import sys

    from turborlhf.data import load_hh_from_hub

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match="pip install datasets"):
        next(load_hh_from_hub("Anthropic/hh-rlhf"))
    with pytest.raises(ImportError, match="datasets"):
        prepare_hh("Anthropic/hh-rlhf", tmp_path / "out", tok)


def test_a_hub_id_that_cannot_load_is_one_line(monkeypatch, tok, tmp_path):
    """prepare-data hh-rlhf printed datasets' traceback for a hub id it could not load (offline here)."""
    import datasets

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'Anthropic/hh-rlhf' on the Hub (OfflineModeIsEnabled)\nmore")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"^Anthropic/hh-rlhf: no such file, and loading it as a Hugging Face hub "
                                        r"dataset failed \(ConnectionError: Couldn't reach .*OfflineModeIsEnabled"):
        prepare_hh("Anthropic/hh-rlhf", tmp_path / "out", tok)


def test_prepare_hh_reads_parquet(monkeypatch, tok, tmp_path, capsys):
    """A Parquet file (the hub's Anthropic/hh-rlhf ships them) failed with "line 1 is not UTF-8 text"
    from the JSON-lines reader, as gsm8k's did: it is read by row through the same reader, bad rows
    reported by row number, a damaged one refused in one line, a missing one not taken for a hub id."""
    import datasets

    path = tmp_path / "train-00000-of-00001.parquet"
    rows = [json.loads(text) for text, _ in (CASES[0], CASES[4])]        # good, then prompt_mismatch
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    tok.save_pretrained(tmp_path / "tok")
    args = SimpleNamespace(dataset="hh-rlhf", input=str(path), output_dir=str(tmp_path / "out"),
                           test_fraction=0.0, strict=False, tokenizer=str(tmp_path / "tok"))
    report = run_prepare_data(args)
    assert "prompt_mismatch: 1 (lines 2)" in capsys.readouterr().out
    assert report["lines_read"] == 2 and report["pairs_written"] == {"train": 1, "test": 0}
    (pair,) = [obj for _, obj in read_jsonl(tmp_path / "out/train_pairs.jsonl")]
    assert (pair["chosen"], pair["rejected"]) == ("Fine, thanks.", "Go away.")
    with pytest.raises(DataError, match=r"1 bad row\(s\): prompt_mismatch \(1\) at row 2"):
        prepare_hh(path, tmp_path / "strict", tok, strict=True)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1\xff\xfe not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file") as e:
        prepare_hh(bad, tmp_path / "bad", tok)
    assert "UTF-8" not in str(e.value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("a missing file is not a hub id"))
    with pytest.raises(FileNotFoundError, match=r"data/nope\.parquet: no such file"):
        prepare_hh("data/nope.parquet", tmp_path / "nope", tok)
