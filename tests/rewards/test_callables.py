"""In-process reward callables (`turborlhf.rewards.callables`): TRL's keyword call with the data's
columns, columns found by prompt ids, by-value pickling for Ray workers, the CLI's refusal."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turborlhf.rewards.callables import CallableSource, PromptColumns, RewardCallables, callable_kwargs
from turborlhf.rewards.functions import RewardFunctionError

SRC = Path(__file__).resolve().parents[2] / "src"
COLS = {"answer": ["4", "6"], "level": [1, 2]}


def test_keyword_call_as_trl():
    def trl_style(completions, **kwargs):
        return []

    args, kw = callable_kwargs(trl_style, ["p1", "p2"], ["c1", "c2"], COLS, "f")
    assert args == () and kw == {"prompts": ["p1", "p2"], "completions": ["c1", "c2"], **COLS}

    def named(prompts, completions, answer):
        return []

    args, kw = callable_kwargs(named, ["p"], ["c"], COLS, "f")
    assert args == () and kw == {"prompts": ["p"], "completions": ["c"], "answer": COLS["answer"]}


def test_positional_texts_for_other_names_and_optional_columns():
    def plain(p, r, level=None, missing=0):
        return []

    args, kw = callable_kwargs(plain, ["p"], ["c"], COLS, "f")
    assert args == (["p"], ["c"]) and kw == {"level": [1, 2]}


def test_a_required_column_the_data_lacks_is_named():
    def needs(prompts, completions, solution):
        return []

    with pytest.raises(RewardFunctionError, match="reward function 'needs' needs the column 'solution'.*answer, level"):
        callable_kwargs(needs, [], [], COLS, "reward function 'needs'")


class _Inputs:
    """What `RewardInputs` offers a source: texts and the prompt ids."""

    def __init__(self, prompt_ids, prompts, completions):
        self.prompt_ids, self._texts = prompt_ids, (prompts, completions)

    def texts(self):
        return self._texts


def test_columns_found_by_prompt_ids_and_scores_checked():
    table = PromptColumns({(5, 6): {"answer": "4"}, (7,): {"answer": "6", "extra": True}})
    seen = {}

    def fn(prompts, completions, answer, **kw):
        seen.update(answer=answer, kw=kw)
        return [float(a in c) for c, a in zip(completions, answer)]

    src = CallableSource(fn, "acc", table)
    out = src(_Inputs([[7], [5, 6], [5, 6]], ["b", "a", "a"], ["6", "no", "44"]))
    assert out.tolist() == [1.0, 0.0, 1.0]
    assert seen["answer"] == ["6", "4", "4"] and seen["kw"] == {"extra": [True, None, None]}
    bad = CallableSource(lambda prompts, completions: [1.0], "short", table)
    with pytest.raises(RewardFunctionError, match="'short' returned 1 values for 3 responses"):
        bad(_Inputs([[7], [5, 6], [5, 6]], ["b", "a", "a"], ["x", "y", "z"]))


def test_callables_pickle_by_value_for_workers_that_cannot_import_their_module(tmp_path):
    """A function of this test module reaches a process whose path has only src/ (as a Ray worker
    has): pickled by reference, it would fail there with ModuleNotFoundError: tests."""
    def rule(prompts, completions, answer):
        return [len(c) + float(a) for c, a in zip(completions, answer)]

    blob = pickle.dumps(RewardCallables({"rule": rule, "glob": _module_level}, PromptColumns({(1,): {"answer": "2"}})))
    (tmp_path / "blob.pkl").write_bytes(blob)
    code = ("import pickle, sys; c = pickle.load(open('blob.pkl', 'rb')); "
            "print(c['rule'](['p'], ['abc'], ['2']), c['glob'](['x']), dict(c.columns))")
    env = dict(os.environ, PYTHONPATH=str(SRC))
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[5.0] [11] {(1,): {'answer': '2'}}"
    assert "tests" not in sys.modules.get("cloudpickle").cloudpickle._PICKLE_BY_VALUE_MODULES  # unregistered after


_OFFSET = 10


def _module_level(xs):
    return [len(x) + _OFFSET for x in xs]


def test_a_callable_source_without_its_callable_is_refused_in_one_line():
    from turborlhf.config import RewardSourceCfg
    from turborlhf.rewards.combine import build_reward

    src = RewardSourceCfg(kind="callable", path="accuracy")
    with pytest.raises(RewardFunctionError, match="callable reward source 'accuracy' exists only in the Python"):
        build_reward([src], None, tokenizer=None)
    combined = build_reward([src], None, tokenizer=None, callables=RewardCallables({"accuracy": lambda p, r: [1.0]}))
    assert [n for n, _, _ in combined.sources] == ["callable0"]
    assert torch.equal(combined.sources[0][2](_Inputs([[1]], ["p"], ["c"])), torch.tensor([1.0]))
