"""Built-in verifiable rewards: GSM8K `####` parsing, math-verify equivalences, format checks,
reasoning-gym scorers, and naming them from a config without a file path."""
import pytest

from turborlhf.rewards.functions import RewardFunctionError, call_reward_function, load_reward_function
from turborlhf.rewards.verifiers import (BUILTIN_REWARDS, extract_hash_answer, extract_last_number, gsm8k_accuracy,
                                         gsm8k_format, gsm8k_strict_accuracy, numbers_equal, think_answer_format,
                                         answer_tag_format)


@pytest.mark.parametrize("text, want", [
    ("so 48 + 24 = 72\n#### 72", "72"),
    ("#### 1,080", "1,080"),
    ("#### -3.5", "-3.5"),
    ("#### $1,200.50.", "$1,200.50"),
    ("#### **42**", "42"),
    ("first #### 5 then\n#### 7", "7"),            # the last one counts
    ("####72", "72"),
    ("the answer is 72", None),
    ("#### seventy", None),
])
def test_extract_hash_answer(text, want):
    assert extract_hash_answer(text) == want


@pytest.mark.parametrize("a, b, equal", [
    ("1,080", "1080", True), ("1080.00", "1080", True), ("$5", "5", True), ("72.", "72", True),
    ("-3.5", "-3.5", True), ("-3.5", "3.5", False), ("0.5", ".5", True), ("1,000,000", "1000000", True),
    ("12", "12.01", False), ("abc", "abc", False), (None, "3", False),
])
def test_numbers_equal(a, b, equal):
    assert numbers_equal(a, b) is equal


def test_last_number_fallback():
    assert extract_last_number("I had 3 apples, then 1,250 pears and -4.5 kg.") == "-4.5"
    assert extract_last_number("no digits") is None


@pytest.mark.parametrize("text, want", [
    ("So the answer is:\n- 18", "18"),          # a list item's dash is not a minus
    ("so she keeps 20 - 5", "5"),
    ("it drops to -7", "-7"), ("costs -$5", "-$5"), ("costs $-5", "$-5"), ("costs $ 5", "$ 5"),
])
def test_a_dash_before_a_space_is_not_a_sign(text, want):
    """lm-evaluation-harness's flexible-extract reads 18 and 5 there; we read -18 and -5."""
    assert extract_last_number(text) == want


def test_gsm8k_accuracy_strict_and_flexible():
    completions = ["step... 24 + 48\n#### 72", "the total is 72 clips.", "#### 71", "#### 1,080", "nothing", "#### -7"]
    answers = ["72", "72", "72", "1080", "5", "#### -7"]          # a whole solution works as reference too
    assert gsm8k_accuracy([""] * 6, completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert gsm8k_strict_accuracy([""] * 6, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        gsm8k_accuracy([""], ["#### 1"])


@pytest.mark.parametrize("fn", [gsm8k_accuracy, gsm8k_strict_accuracy])
def test_a_reference_without_a_number_warns(fn, recwarn):
    """A reference the verifier cannot read scored every response 0 without a word (math_accuracy
    warns): a GRPO group with no signal, dropped by dynamic sampling, and a run that learns nothing."""
    for bad in (None, "seventy-two", "72 apples"):
        with pytest.warns(UserWarning, match=rf"{fn.__name__}: cannot read a number from the reference answer"):
            assert fn([""], ["#### 72"], answer=[bad]) == [0.0]
    fn([""] * 3, ["#### 72"] * 3, answer=["72", "#### 72", 72])
    assert not [w for w in recwarn if "reference" in str(w.message)]


@pytest.mark.parametrize("completion, ok", [
    ("reasoning\n#### 72", 1.0), ("reasoning\n#### 1,080\n", 1.0), ("#### -2.5.", 1.0), ("#### **12**", 1.0),
    ("#### 72\nand then more text", 0.0),        # not the last line
    ("#### 3\n\n#### 3\n#### 3", 0.0),            # repeated until cut off: not the format
    ("The answer is 72", 0.0), ("#### seventy-two", 0.0), ("", 0.0), ("#### 72 apples", 0.0),
])
def test_gsm8k_format(completion, ok):
    assert gsm8k_format([""], [completion]) == [ok]


def test_gsm8k_soft_format_is_partial_credit_towards_the_format():
    from turborlhf.rewards.verifiers import gsm8k_soft_format

    completions = ["work\n#### 72", "#### 72\nThe final answer is 72.", "#### 3\n#### 3", "#### 3\nso 3\n#### 3",
                   "The answer is 72.", "#### seventy"]
    assert gsm8k_soft_format([""] * 6, completions) == [1.0, 0.75, 0.75, 0.75, 0.0, 0.0]
    assert [s == 1.0 for s in gsm8k_soft_format([""] * 6, completions)] == \
        [f == 1.0 for f in gsm8k_format([""] * 6, completions)]


def test_answer_tag_format():
    texts = ["2 + 3 = 5, so\n<answer>5</answer>", "<answer>5</answer>\n", "<answer>5</answer> because",
             "<answer>4</answer><answer>5</answer>", "<answer> </answer>", "5", "<answer>5"]
    assert answer_tag_format([""] * len(texts), texts) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_think_answer_format():
    good = "<think>\nadd them\n</think>\n<answer>\n72\n</answer>"
    assert think_answer_format(["", "", ""], [good, "<answer>72</answer>", good + " extra"]) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("gold, completion, ok", [
    ("\\frac{1}{2}", "so the answer is $\\boxed{0.5}$", 1.0),
    ("0.5", "we get \\boxed{\\frac{1}{2}}", 1.0),
    ("$\\sqrt{8}$", "it equals $2\\sqrt{2}$", 1.0),
    ("x^2+2x+1", "$(x+1)^2$", 1.0),
    ("3", "so $x = 3$", 1.0),
    ("\\{1,2\\}", "the set is $\\{2,1\\}$", 1.0),
    ("1,080", "In total 1080", 1.0),
    ("#### 72", "the answer is $72$", 1.0),        # a GSM8K solution as reference
    ("\\frac{1}{3}", "$\\boxed{0.5}$", 0.0),
    ("72", "I think 72, no: 5", 0.0),
    ("\\$18.90", "so \\boxed{18.90}", 1.0),        # MATH's escaped dollar sign is not a delimiter
    ("\\$32,\\!348", "$\\boxed{32348}$", 1.0),
])
def test_math_accuracy_equivalences(gold, completion, ok):
    pytest.importorskip("math_verify")
    from turborlhf.rewards.verifiers import math_accuracy

    assert math_accuracy([""], [completion], answer=[gold]) == [ok]


def test_reasoning_gym_score_uses_the_tasks_scorer(tmp_path):
    pytest.importorskip("reasoning_gym")
    from turborlhf.data.jsonl import read_jsonl
    from turborlhf.data.reasoning_gym import prepare_reasoning_gym
    from turborlhf.rewards.verifiers import reasoning_gym_score

    report = prepare_reasoning_gym("basic_arithmetic", 4, 7, tmp_path)
    assert report["prompts_written"] == 4
    rows = [r for _, r in read_jsonl(tmp_path / "basic_arithmetic_prompts.jsonl")]
    assert prepare_reasoning_gym("basic_arithmetic", 4, 7, tmp_path / "again") and \
        [r for _, r in read_jsonl(tmp_path / "again/basic_arithmetic_prompts.jsonl")] == rows   # seeded
    cols = {k: [r[k] for r in rows] for k in ("answer", "metadata", "question")}
    sft = [r for _, r in read_jsonl(tmp_path / "basic_arithmetic_sft.jsonl")]       # cold-start rows score 1
    assert [r["prompt"] for r in sft] == [r["prompt"] for r in rows]
    assert reasoning_gym_score([""] * 4, [r["response"] for r in sft], **cols) == [1.0] * 4
    right = [f"<think>x</think><answer>{r['answer']}</answer>" for r in rows]
    wrong = [f"<answer>{int(r['answer']) + 1}</answer>" for r in rows]
    assert reasoning_gym_score([""] * 4, right, **cols) == [1.0] * 4
    assert reasoning_gym_score([""] * 4, wrong, **cols) == [0.0] * 4
    assert reasoning_gym_score([""] * 4, [r["answer"] for r in rows], **cols) == [0.0] * 4   # no answer tags
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'nope'"):
        prepare_reasoning_gym("nope", 1, 0, tmp_path)


def test_reasoning_gym_arc_grids_and_tasks_without_reference_answers(tmp_path):
    """ARC tasks compare the parsed grid with the metadata's tuples, which JSON had made lists: a
    right answer scored 0.05. Tasks without a reference answer (graph_color) wrote SFT targets
    "<answer>None</answer>"."""
    pytest.importorskip("reasoning_gym")
    from turborlhf.data.jsonl import read_jsonl
    from turborlhf.data.reasoning_gym import prepare_reasoning_gym
    from turborlhf.rewards.verifiers import reasoning_gym_score

    for task in ("arc_agi", "rearc"):
        prepare_reasoning_gym(task, 2, 7, tmp_path)
        rows = [r for _, r in read_jsonl(tmp_path / f"{task}_prompts.jsonl")]
        cols = {k: [r[k] for r in rows] for k in ("answer", "metadata", "question")}
        assert reasoning_gym_score([""] * 2, [f"<answer>{r['answer']}</answer>" for r in rows], **cols) == [1.0, 1.0]
    report = prepare_reasoning_gym("graph_color", 2, 7, tmp_path)
    assert [r["answer"] for _, r in read_jsonl(tmp_path / "graph_color_prompts.jsonl")] == [None, None]
    assert not list(read_jsonl(tmp_path / "graph_color_sft.jsonl"))
    assert (report["sft_written"], report["sft_without_answer"]) == (0, 2)


def test_builtins_are_nameable_without_a_file():
    assert load_reward_function("gsm8k_accuracy") is gsm8k_accuracy
    assert load_reward_function("turborlhf.rewards.verifiers:gsm8k_format") is gsm8k_format
    assert set(BUILTIN_REWARDS) >= {"gsm8k_accuracy", "gsm8k_format", "math_accuracy", "reasoning_gym_score"}
    fn = load_reward_function("gsm8k_accuracy")
    assert call_reward_function(fn, ["p", "p"], ["#### 3", "#### 4"], columns={"answer": ["3", "3"]}) == [1.0, 0.0]
    with pytest.raises(RewardFunctionError, match="built-in name .*gsm8k_accuracy"):
        load_reward_function("gsm8k_acuracy")                       # a typo lists the names
    with pytest.raises(RewardFunctionError, match="importing module 'turborlhf.no_such_module' failed"):
        load_reward_function("turborlhf.no_such_module:f")
    with pytest.raises(RewardFunctionError, match="module turborlhf.rewards.verifiers has no attribute 'nope'"):
        load_reward_function("turborlhf.rewards.verifiers:nope")


def test_math_accuracy_outside_the_main_thread():
    """math-verify's timeout uses SIGALRM, which only the main thread may set: a reward worker
    thread must still get real scores."""
    pytest.importorskip("math_verify")
    import threading

    from turborlhf.rewards.verifiers import math_accuracy

    out = []
    t = threading.Thread(target=lambda: out.append(math_accuracy([""] * 2, ["so \\boxed{0.5}", "$3$"],
                                                                 answer=["\\frac{1}{2}", "4"])))
    t.start()
    t.join()
    assert out == [[1.0, 0.0]]
