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


@pytest.mark.parametrize("text", ["#### 3/4", "#### 10^3", "#### 12:30", "#### 1e3", "#### 12,3456",
                                  "#### 1,00,000", "#### 3.14.15", "the answer is 3/4", "we get \\frac{1}{2}",
                                  "so \\boxed{\\sqrt{2}}", "2^10"])
def test_only_a_whole_number_is_an_answer(text):
    """The start or end of an expression was read as the answer: "#### 3/4" scored 1 against 3,
    "\\boxed{\\frac{1}{2}}" against 2 (a false positive a policy can learn to exploit)."""
    for ref in ("3", "4", "1", "2", "10", "12", "30", "12345", "3.14", "1000"):
        assert gsm8k_accuracy([""], [text], answer=[ref]) == [0.0], (text, ref)
    assert extract_hash_answer("#### 3/4") is None and extract_last_number("3/4 of 12") == "12"


def test_a_typeset_minus_is_a_minus():
    """"#### −5" (U+2212) scored 1 against 5 and 0 against -5."""
    for text in ("#### \u22125", "The answer is \u20135", "it is \u22125"):
        assert gsm8k_accuracy(["", ""], [text, text], answer=["-5", "5"]) == [1.0, 0.0]
    assert numbers_equal("\u22123.5", "-3.5")


def test_verifiers_stay_linear_on_degenerate_responses():
    """"####" before a run of spaces, repeated tags: the regexes backtracked quadratically, seconds
    per 8,000 spaces (a policy that collapses into whitespace stalled the rollout for minutes)."""
    import time

    texts = ["#### " + " " * 20_000 + "x", "12.\n####" + "\n" * 20_000, "<answer>" * 20_000,
             "<think>\n" + "\n</think>\n<answer>\n" * 10_000 + "x"]
    t0 = time.perf_counter()
    for fn in (gsm8k_accuracy, gsm8k_strict_accuracy):
        fn([""] * 4, texts, answer=["1"] * 4)
    gsm8k_format([""] * 4, texts), answer_tag_format([""] * 4, texts), think_answer_format([""] * 4, texts)
    assert time.perf_counter() - t0 < 5          # the old code: minutes at this size


@pytest.mark.parametrize("text, ok", [
    ("<think>\na\n</think>\n<answer>\n1\n</answer>", True), ("<think>\n\n</think>\n<answer>\n\n</answer>", True),
    ("<think>\n\n</think>\n<answer>\n</answer>", False), ("<think>\n</think>\n<answer>\n1\n</answer>", False),
    ("<think>\na\n</think>\n<answer>\nb\n</think>\n<answer>\nc\n</answer>", True),
    ("<think>\na\n</think>\n<answer>\n1\n</answer>x", False), ("x<think>\na\n</think>\n<answer>\n1\n</answer>", False),
])
def test_think_answer_format_is_open_r1s_pattern(text, ok):
    import re

    pattern = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"        # open-r1's format_reward
    assert bool(re.match(pattern, text, re.DOTALL)) is ok
    assert think_answer_format([""], [text]) == [float(ok)]


def test_the_answer_tag_is_paired_as_findall_pairs_it():
    from turborlhf.rewards.verifiers import _extract_answer_tag

    for text in ("<answer>a<answer>b</answer>", "</answer><answer> x </answer>", "<answer>1</answer><answer>2",
                 "<answer>1</answer>y<answer>2</answer>", "none", "<answer></answer>"):
        found = __import__("re").findall(r"<answer>\s?(.*?)\s?</answer>", text, flags=__import__("re").DOTALL)
        assert _extract_answer_tag(text) == (found[-1].strip() if found else None), text


@pytest.mark.parametrize("gold, completion, ok", [
    ("12", "So the answer is 12 * 5 = <<12*5=60>>60.\n#### 60", 0.0),     # the #### line is the answer
    ("60", "So the answer is 12 * 5 = <<12*5=60>>60.\n#### 60", 1.0),
    ("42", "the answer is 7\n#### **42**", 1.0),
    ("-5", "#### -$5", 1.0),
    ("\\[\\frac{1}{2}\\]", "\\boxed{\\frac{1}{2}}", 1.0),                  # display math was wrapped in $...$
    ("1e3", "\\boxed{1000}", 1.0),
    ("60", "He makes 12 * 5 = <<12*5=60>>60 dollars, I think 60", 1.0),
])
def test_math_accuracy_reads_gsm8k_responses_and_any_reference(gold, completion, ok, recwarn):
    pytest.importorskip("math_verify")
    from turborlhf.rewards.verifiers import math_accuracy

    assert math_accuracy([""], [completion], answer=[gold]) == [ok]
    assert not [w for w in recwarn if "cannot parse the reference" in str(w.message)]


def test_math_accuracy_warns_on_a_reference_it_reads_as_text():
    pytest.importorskip("math_verify")
    from turborlhf.rewards.verifiers import math_accuracy

    with pytest.warns(UserWarning, match="cannot parse the reference"):
        assert math_accuracy([""], ["\\boxed{1}"], answer=["$\\[1\\]$"]) == [0.0]


def test_a_score_too_large_for_a_float_is_a_clear_error():
    with pytest.raises(RewardFunctionError, match="expected a finite number"):
        call_reward_function(lambda prompts, completions, **kw: [10 ** 400], ["p"], ["r"], "big")


@pytest.mark.parametrize("text, ref, want", [
    ("the numbers are -2, 3", "-23", None),          # a list, not -23
    ("Answer:58", "58", 1.0), ("Answer:-5", "-5", 1.0), ("Answer:-5", "5", 0.0),
    ("58: that is all", "58", 1.0),
    ("5 apples... #### 1/2", "5", 0.0),              # its final answer is 1/2, not the earlier 5
    ("#### 5\n#### 1/2", "5", 0.0),
    ("#### 2. Step two\nso the total is 9", "9", 1.0),   # a markdown heading is no answer line
    ("#### 1) Compute\n#### 7", "7", 1.0),
])
def test_numbers_read_as_written(text, ref, want):
    """Each of these was read as another number: "-2, 3" as -23 (so \\boxed{-23} scored 1), the colon
    hid "Answer:58" and turned "Answer:-5" into 5, "#### 1/2" let an earlier 5 score, and a numbered
    heading "#### 2. Step" was read as the answer 2."""
    if want is None:
        assert not numbers_equal(ref, "-2, 3") and not numbers_equal("12,34", "1234")
        return
    assert gsm8k_accuracy([""], [text], answer=[ref]) == [want]


def test_a_heading_does_not_beat_the_boxed_answer():
    pytest.importorskip("math_verify")
    from turborlhf.rewards.verifiers import math_accuracy

    text = "#### 2. Simplify\nThe sum is \\boxed{9}."
    assert math_accuracy([""], [text], answer=["9"]) == [1.0]
    assert extract_hash_answer(text) is None


@pytest.mark.parametrize("metadata", ['["a list"]', "not json", 3])
def test_reasoning_gym_metadata_that_is_no_object_is_a_clear_error(metadata):
    from turborlhf.rewards.verifiers import reasoning_gym_score

    with pytest.raises(ValueError, match="metadata of row 0"):
        reasoning_gym_score([""], ["<answer>1</answer>"], answer=["1"], metadata=[metadata])
