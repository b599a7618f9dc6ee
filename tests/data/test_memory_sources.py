"""In-memory sources of `turborlhf.data.sources.open_rows`: `Rows` and a `datasets.Dataset`."""
from __future__ import annotations

import pytest

from turborlhf.data.errors import DataError
from turborlhf.data.loaders import load_sft
from turborlhf.data.sources import Rows, open_rows


def test_rows_and_datasets_are_sources(tok):
    from datasets import Dataset

    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d", "extra": None}]
    assert open_rows(Rows(rows))[0] == "row"
    assert load_sft(Rows(rows), tok) == [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
    assert [r for _, r in open_rows(Dataset.from_list(rows))[1]] == [rows[0], {"prompt": "c", "response": "d"}]
    with pytest.raises(DataError, match=r"^<in-memory rows>: 1 bad row\(s\) and no usable record: .*row 1"):
        load_sft(Rows([{"prompt": "a"}]), tok)
