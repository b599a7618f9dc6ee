"""Rule-based reward functions: loading `module.py:function` from a file, and checking results."""
import math

import pytest

from turborlhf.rewards.functions import RewardFunctionError, call_reward_function, load_reward_function

GOOD = """
import math

def length_bonus(prompts, responses):
    return [len(r) / 10 for r in responses]

def wrong_length(prompts, responses):
    return [1.0]

def not_finite(prompts, responses):
    return [math.nan for _ in responses]

def not_numbers(prompts, responses):
    return ["high" for _ in responses]

def returns_none(prompts, responses):
    return None

def as_bools(prompts, responses):
    return [r.startswith("a") for r in responses]

threshold = 3
"""


@pytest.fixture()
def rules(tmp_path):
    f = tmp_path / "my_rules.py"
    f.write_text(GOOD)
    return f


def test_load_and_call(rules):
    fn = load_reward_function(f"{rules}:length_bonus")
    assert call_reward_function(fn, ["p", "q"], ["abc", "abcdefghij"]) == [0.3, 1.0]
    assert call_reward_function(load_reward_function(f"{rules}:as_bools"), ["p", "q"], ["ab", "b"]) == [1.0, 0.0]


@pytest.mark.parametrize("spec, match", [
    ("no_colon.py", "expected 'path/to/module.py:function'"),
    ("{rules}:", "expected 'path/to/module.py:function'"),
    ("/nonexistent/dir/rules.py:f", r"file /nonexistent/dir/rules.py not found"),
    ("{rules}:missing", r"has no attribute 'missing' \(functions defined there: .*length_bonus"),
    ("{rules}:threshold", "is a int, not callable"),
])
def test_loading_errors_name_the_spec(rules, spec, match):
    with pytest.raises(RewardFunctionError, match=match):
        load_reward_function(spec.format(rules=rules))


def test_import_failure_is_reported(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def f(prompts, responses):\n    return [\n")
    with pytest.raises(RewardFunctionError, match=r"importing .*broken.py failed: SyntaxError"):
        load_reward_function(f"{bad}:f")
    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(RewardFunctionError, match="RuntimeError: no GPU here"):
        load_reward_function(f"{raising}:f")


@pytest.mark.parametrize("name, match", [
    ("wrong_length", "returned 1 values for 2 responses"),
    ("not_finite", "returned nan at index 0; expected a finite number"),
    ("not_numbers", "returned 'high' at index 0"),
    ("returns_none", "returned a NoneType; expected a list of 2 numbers"),
])
def test_bad_results_are_errors(rules, name, match):
    fn = load_reward_function(f"{rules}:{name}")
    with pytest.raises(RewardFunctionError, match=match):
        call_reward_function(fn, ["p", "q"], ["a", "b"], name=f"reward function {name!r}")


def test_numpy_and_tensor_results_are_accepted(tmp_path):
    f = tmp_path / "arrays.py"
    f.write_text("import numpy as np, torch\n"
                 "def np_fn(p, r):\n    return np.arange(len(r), dtype=np.float32)\n"
                 "def t_fn(p, r):\n    return torch.ones(len(r))\n")
    assert call_reward_function(load_reward_function(f"{f}:np_fn"), ["a"] * 3, ["b"] * 3) == [0.0, 1.0, 2.0]
    assert all(math.isclose(x, 1.0) for x in call_reward_function(load_reward_function(f"{f}:t_fn"), ["a"], ["b"]))
