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


@pytest.mark.parametrize("result, kind", [({0: 0.5, 1: 0.5}, "dict"), ({0.5, 1.0}, "set")])
def test_a_mapping_or_a_set_is_not_a_list_of_rewards(result, kind):
    """A dict gave its keys as the rewards, a set its own order: both are refused."""
    with pytest.raises(RewardFunctionError, match=f"returned a {kind}; expected a list of 2 numbers"):
        call_reward_function(lambda prompts, completions: result, ["p", "q"], ["a", "b"], name="f")
    assert call_reward_function(lambda prompts, completions: (x for x in (0.5, 1.0)), ["p", "q"], ["a", "b"]) \
        == [0.5, 1.0]


def test_numpy_and_tensor_results_are_accepted(tmp_path):
    f = tmp_path / "arrays.py"
    f.write_text("import numpy as np, torch\n"
                 "def np_fn(p, r):\n    return np.arange(len(r), dtype=np.float32)\n"
                 "def t_fn(p, r):\n    return torch.ones(len(r))\n")
    assert call_reward_function(load_reward_function(f"{f}:np_fn"), ["a"] * 3, ["b"] * 3) == [0.0, 1.0, 2.0]
    assert all(math.isclose(x, 1.0) for x in call_reward_function(load_reward_function(f"{f}:t_fn"), ["a"], ["b"]))


# ----------------------------------------------------------------------------------------------
# The prompts file's other columns, passed by name (TRL's convention)
# ----------------------------------------------------------------------------------------------

COLUMNS = """
def two_args(prompts, responses):
    return [float(len(r)) for r in responses]

def named(prompts, completions, answer):
    return [float(c == a) for c, a in zip(completions, answer)]

def keyword_only(prompts, completions, *, answer, level=None):
    return [float(c == a) * (level[i] if level else 1) for i, (c, a) in enumerate(zip(completions, answer))]

def var_kw(prompts, completions, **kwargs):
    return [float(kwargs["answer"][i] == c) + 10 * ("prompts" in kwargs) for i, c in enumerate(completions)]

def positional_only(p, r, /, answer):
    return [float(x == a) for x, a in zip(r, answer)]
"""


@pytest.fixture()
def col_rules(tmp_path):
    f = tmp_path / "col_rules.py"
    f.write_text(COLUMNS)
    return lambda name: load_reward_function(f"{f}:{name}")


def test_columns_are_passed_by_name(col_rules):
    cols = {"answer": ["ab", "x"], "level": [3, 3], "prompts": ["clash", "clash"]}
    # old two-argument functions keep working and get no columns
    assert call_reward_function(col_rules("two_args"), ["p", "q"], ["ab", "c"], columns=cols) == [2.0, 1.0]
    assert call_reward_function(col_rules("named"), ["p", "q"], ["ab", "c"], columns=cols) == [1.0, 0.0]
    # a column that matches a parameter with a default is passed too (level=3)
    assert call_reward_function(col_rules("keyword_only"), ["p", "q"], ["ab", "x"], columns=cols) == [3.0, 3.0]
    # **kwargs gets every column except the texts' own names
    assert call_reward_function(col_rules("var_kw"), ["p", "q"], ["ab", "c"], columns=cols) == [1.0, 0.0]
    assert call_reward_function(col_rules("positional_only"), ["p", "q"], ["ab", "c"], columns=cols) == [1.0, 0.0]


def test_missing_or_misaligned_columns_are_named(col_rules):
    with pytest.raises(RewardFunctionError, match=r"needs the column 'answer', which the training data does not have "
                                                  r"\(its columns: solution\)"):
        call_reward_function(col_rules("named"), ["p"], ["a"], name="reward function 'named'",
                             columns={"solution": ["s"]})
    with pytest.raises(RewardFunctionError, match="needs the column 'answer'"):
        call_reward_function(col_rules("named"), ["p"], ["a"])
    with pytest.raises(RewardFunctionError, match="column 'answer' has 1 values for 2 responses"):
        call_reward_function(col_rules("named"), ["p", "q"], ["a", "b"], columns={"answer": ["a"]})


def test_rows_to_columns():
    from turborlhf.rewards.combine import rows_to_columns

    assert rows_to_columns([{"answer": "1"}, {"answer": "2", "x": 0}]) == {"answer": ["1", "2"], "x": [None, 0]}
    assert rows_to_columns(None) is None and rows_to_columns([{}, {}]) is None


def test_trl_style_file_functions_get_their_arguments_by_name(tmp_path):
    """A file function was called positionally as fn(prompts, responses): TRL's
    accuracy_reward(completions, solution, **kwargs) got the prompts as completions and the
    responses as the solution (scores silently wrong), reward_len(completions, **kwargs) raised a
    TypeError, and TRL's completion_ids never came. numpy bools were refused."""
    f = tmp_path / "trl_rewards.py"
    f.write_text("import numpy as np\n"
                 "def accuracy(completions, solution, **kwargs):\n"
                 "    return [float(c == s) for c, s in zip(completions, solution)]\n"
                 "def reward_len(completions, **kwargs):\n"
                 "    return [-abs(5 - len(c)) for c in completions]\n"
                 "def ids(prompts, completions, completion_ids, **kwargs):\n"
                 "    return [len(i) for i in completion_ids]\n"
                 "def ours(prompts, responses):\n"
                 "    return [len(p) + len(r) for p, r in zip(prompts, responses)]\n"
                 "def np_bools(completions, **kwargs):\n"
                 "    return [np.bool_(c == 'x') for c in completions]\n")
    prompts, responses, cols = ["p1", "p2"], ["x", "yyyyy"], {"solution": ["x", "z"]}
    call = lambda name, **kw: call_reward_function(load_reward_function(f"{f}:{name}"), prompts, responses,
                                                   columns=cols, **kw)
    assert call("accuracy") == [1.0, 0.0]
    assert call("reward_len") == [-4.0, 0.0]
    assert call("ids", completion_ids=[[5, 6], [7]]) == [2.0, 1.0]
    assert call("ours") == [3.0, 7.0]
    assert call("np_bools") == [1.0, 0.0]
