import gzip
import json
import os

from turborlhf.data.jsonl import JsonLineError, read_jsonl, write_jsonl


def test_read_plain_and_gz_with_line_numbers(tmp_path):
    text = '{"a": 1}\n\n{bad json\n  \n["x"]\n{"b": "ü"}'  # no trailing newline
    plain = tmp_path / "x.jsonl"
    plain.write_text(text, encoding="utf-8")
    gz = tmp_path / "x.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(text)
    for p in (plain, gz):
        rows = list(read_jsonl(p))
        assert [n for n, _ in rows] == [1, 3, 5, 6]
        assert rows[0][1] == {"a": 1}
        assert isinstance(rows[1][1], JsonLineError) and rows[1][1].text == "{bad json"
        assert rows[2][1] == ["x"] and rows[3][1] == {"b": "ü"}


def test_a_byte_order_mark_and_crlf_lose_nothing(tmp_path):
    """A file saved with a UTF-8 BOM (Windows editors) lost its first example as bad JSON."""
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n{"b": "\xef\xbb\xbfx"}\r\n')
    assert list(read_jsonl(p)) == [(1, {"a": 1}), (2, {"b": "\ufeffx"})]     # only the file's BOM goes


def test_bom_of_joined_files_and_absurd_nesting_are_line_problems(tmp_path):
    """`cat a.jsonl b.jsonl` of two BOM files lost b's first record; a deeply nested line raised
    RecursionError (no file, no line) instead of being reported as that line's bad JSON."""
    p = tmp_path / "joined.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\xef\xbb\xbf{"b": 2}\n' + b"[" * 100_000 + b"\n")
    rows = list(read_jsonl(p))
    assert rows[:2] == [(1, {"a": 1}), (2, {"b": 2})]
    assert rows[2][0] == 3 and isinstance(rows[2][1], JsonLineError)


def test_a_lone_surrogate_escape_is_a_bad_line(tmp_path):
    """JSON's "\\ud83d" alone parses to a string no encoder takes: it passed the loaders and failed
    later in tokenisation with no file or line. A bad line now; a whole pair (an emoji) is text."""
    p = tmp_path / "s.jsonl"
    p.write_text('{"prompt": "a\\ud83d", "response": "b"}\n{"prompt": "\\ud83d\\ude00 ok", "response": "b"}\n'
                 '{"x": ["\\udc00"]}\n')
    rows = list(read_jsonl(p))
    assert isinstance(rows[0][1], JsonLineError) and "surrogate" in rows[0][1].message
    assert rows[1] == (2, {"prompt": "\U0001F600 ok", "response": "b"})
    assert isinstance(rows[2][1], JsonLineError)


def test_write_atomic_round_trip(tmp_path):
    rows = [{"i": i, "t": "é"} for i in range(5)]
    for name in ("out.jsonl", "out.jsonl.gz"):
        p = tmp_path / "sub" / name
        assert write_jsonl(p, rows) == 5
        assert [o for _, o in read_jsonl(p)] == rows
    assert sorted(os.listdir(tmp_path / "sub")) == ["out.jsonl", "out.jsonl.gz"]  # no temp left
    assert json.loads((tmp_path / "sub/out.jsonl").read_text().splitlines()[0])["t"] == "é"


def test_write_failure_keeps_old_file(tmp_path):
    p = tmp_path / "f.jsonl"
    write_jsonl(p, [{"old": True}])

    def rows():
        yield {"new": 1}
        raise RuntimeError("boom")

    try:
        write_jsonl(p, rows())
    except RuntimeError:
        pass
    assert [o for _, o in read_jsonl(p)] == [{"old": True}]
    assert os.listdir(tmp_path) == ["f.jsonl"]
