import json

import pytest

from turborlhf.data import DataError, DataWarning, load_kto, load_pairs, load_prompts, load_sft

USER = [{"role": "user", "content": "Hi"}]
RENDERED = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
HH = {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello", "rejected": "\n\nHuman: Hi\n\nAssistant: Bye"}


def write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_load_pairs_all_formats(tok, tmp_path):
    rows = [
        {"prompt": RENDERED, "chosen": "Hello", "rejected": "Bye"},
        {"prompt": USER, "chosen": "Hello", "rejected": "Bye", "margin": 2},
        {"prompt": USER, "chosen": [{"role": "assistant", "content": "Hello"}],
         "rejected": [{"role": "assistant", "content": "Bye"}]},
        {"chosen": USER + [{"role": "assistant", "content": "Hello"}],
         "rejected": USER + [{"role": "assistant", "content": "Bye"}]},
        HH,
    ]
    got = load_pairs(write(tmp_path / "p.jsonl", rows), tok)
    assert len(got) == 5 and got.problems == []
    for r in got:
        assert (r["prompt"], r["chosen"], r["rejected"]) == (RENDERED, "Hello", "Bye")
    assert [r["margin"] for r in got] == [None, 2.0, None, None, None]


def test_load_pairs_bad_lines(tok, tmp_path):
    rows = [
        HH,  # 1
        "{oops",  # 2
        {"prompt": RENDERED, "chosen": "x"},  # 3 missing rejected
        {"prompt": RENDERED, "chosen": "x", "rejected": ""},  # 4 empty
        {"chosen": "\n\nHuman: A\n\nAssistant: x", "rejected": "\n\nHuman: B\n\nAssistant: y"},  # 5
        {"prompt": RENDERED, "chosen": "x", "rejected": "y", "margin": "big"},  # 6
        {"prompt": 3, "chosen": "x", "rejected": "y"},  # 7
        '{"prompt": "a", "chosen": "x", "rejected": "y", "margin": NaN}',  # 8: JSON's NaN made a NaN loss
        {"prompt": RENDERED, "chosen": "Same.", "rejected": [{"role": "assistant", "content": "Same. "}]},  # 9
    ]
    path = write(tmp_path / "p.jsonl", rows)
    with pytest.warns(DataWarning, match="skipped 8 bad line"):
        got = load_pairs(path, tok)
    assert len(got) == 1
    assert [(p.line, p.kind) for p in got.problems] == [
        (2, "bad_json"), (3, "missing_key"), (4, "empty_response"), (5, "prompt_mismatch"),
        (6, "bad_value"), (7, "bad_value"), (8, "bad_value"), (9, "same_response")]
    with pytest.raises(DataError, match=r"prompt_mismatch \(1\) at line 5"):
        load_pairs(path, tok, strict=True)
    with pytest.raises(DataError, match="no usable record"):
        load_pairs(write(tmp_path / "bad.jsonl", ["{oops"]), tok)


def test_load_prompts_formats_and_dedupe(tok, tmp_path):
    rows = [
        {"prompt": RENDERED},
        {"prompt": USER},
        {"text": RENDERED},
        HH,
        {"messages": USER + [{"role": "assistant", "content": "x"}]},
        {"prompt": [{"role": "user", "content": "Other"}]},
        {"text": 5},  # bad
        {"chosen": "\n\nHuman: Third\n\nAssistant: ", "rejected": "x"},  # empty response: prompt ok
        {"chosen": [{"role": "user", "content": "Hi"}]},
    ]
    with pytest.warns(DataWarning):
        got = load_prompts(write(tmp_path / "p.jsonl", rows), tok)
    assert list(got) == [RENDERED, "<|im_start|>user\nOther<|im_end|>\n<|im_start|>assistant\n",
                         "<|im_start|>user\nThird<|im_end|>\n<|im_start|>assistant\n"]
    assert [(p.line, p.kind) for p in got.problems] == [(7, "bad_value")]


def test_load_sft_formats(tok, tmp_path):
    rows = [
        {"prompt": RENDERED, "response": "Hello"},
        {"prompt": USER, "completion": "Hello"},
        {"messages": USER + [{"role": "assistant", "content": "Hello"}]},
        {"prompt": RENDERED, "chosen": "Hello", "rejected": "Bye"},
        HH,
        {"chosen": USER + [{"role": "assistant", "content": "Hello"}], "rejected": USER},
    ]
    got = load_sft(write(tmp_path / "s.jsonl", rows), tok)
    assert list(got) == [{"prompt": RENDERED, "response": "Hello"}] * 6


def test_load_kto_formats(tok, tmp_path):
    rows = [
        {"prompt": RENDERED, "completion": "Hello", "label": True},
        {"prompt": USER, "completion": "Bye", "label": 0},
        HH,
        {"prompt": RENDERED, "completion": "x", "label": "yes"},  # bad label
        {"prompt": RENDERED, "completion": "x"},  # missing label
    ]
    with pytest.warns(DataWarning):
        got = load_kto(write(tmp_path / "k.jsonl", rows), tok)
    assert list(got) == [
        {"prompt": RENDERED, "completion": "Hello", "label": True},
        {"prompt": RENDERED, "completion": "Bye", "label": False},
        {"prompt": RENDERED, "completion": "Hello", "label": True},
        {"prompt": RENDERED, "completion": "Bye", "label": False},
    ]
    assert [(p.line, p.kind) for p in got.problems] == [(4, "bad_value"), (5, "missing_key")]


def test_loaders_read_prepare_outputs(tok, tmp_path):
    from pathlib import Path

    from turborlhf.data import prepare_hh

    real = Path(__file__).parents[2] / "data/hh-rlhf/harmless-base-1800.jsonl.gz"
    rep = prepare_hh(real, tmp_path, tok)
    pairs = load_pairs(tmp_path / "test_pairs.jsonl", tok, strict=True)
    assert len(pairs) == rep["pairs_written"]["test"]
    assert len(load_prompts(tmp_path / "test_prompts.jsonl", tok, strict=True)) == rep["prompts_written"]["test"]
    assert len(load_kto(tmp_path / "test_kto.jsonl", tok, strict=True)) == 2 * len(pairs)
    assert len(load_sft(tmp_path / "test_pairs.jsonl", tok, strict=True)) == len(pairs)
    # the raw file through load_pairs skips exactly the converter's 6 problems
    with pytest.warns(DataWarning):
        raw = load_pairs(real, tok)
    assert len(raw) == 1794 and [p.line for p in raw.problems] == [87, 517, 926, 1104, 1255, 1689]


def test_prompts_rendered_by_another_chat_template_warn(tmp_path):
    """A prepared file rendered with another --tokenizer (or data.chat_template set on files
    rendered by the model's own) was read verbatim, silently: the model trained on another
    model's format. A warning names it; prompts in this tokenizer's format or as messages do not."""
    import warnings

    from turborlhf.data.chat import render_prompt, set_chat_template
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer

    chatml = make_tiny_tokenizer()                      # ChatML, as SmolLM2
    user = [{"role": "user", "content": "hi"}]
    path = write(tmp_path / "p.jsonl", [{"prompt": render_prompt(chatml, user), "chosen": "a", "rejected": "b"},
                                        {"prompt": user, "chosen": "a", "rejected": "b"}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_pairs(path, chatml)                        # its own format: no warning
    plain = make_tiny_tokenizer()
    set_chat_template(plain, "plain")
    with pytest.warns(DataWarning, match=r"1 of 2 prompts were rendered by another chat template .*<\|im_start\|>"):
        got = load_pairs(path, plain)
    assert got[1]["prompt"] == render_prompt(plain, user)


def test_a_data_key_no_record_has_is_an_error(tok, tmp_path):
    """A mistyped --prompt-key / data.prompt_key fell back to another column (text, messages,
    chosen), silently: generation read the 'text' column, answer included."""
    path = write(tmp_path / "p.jsonl", [{"instruction": "Say hi", "text": "### Instruction: Say hi ### Response: hi"}])
    assert load_prompts(path, tok, keys={"prompt": "instruction"}) == ["Say hi"]
    with pytest.raises(DataError, match=r"no record has the key 'instrution' given for the prompt \(data.prompt_key"):
        load_prompts(path, tok, keys={"prompt": "instrution"})


def test_conversations_the_loaders_cannot_render_faithfully_are_bad_lines(tmp_path):
    """A template that refuses a record (roles must alternate) raised jinja2's error out of the
    whole load; a tool call was dropped and its empty assistant turn trained; an empty middle turn
    was trained as a bare end of turn; content parts read as a missing 'messages' key."""
    alternating = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                   "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    a = lambda text: {"role": "assistant", "content": text}    # noqa: E731
    rows = [
        {"messages": USER + [a("Hello")]},                                                     # 1 fine
        {"messages": [{"role": "system", "content": "S"}] + USER + [a("Hello")]},               # 2 refused
        {"messages": USER + [{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
                             {"role": "tool", "content": "22C"}, a("Warm.")]},                  # 3 tool call
        {"messages": USER + [a(" "), {"role": "user", "content": "And?"}, a("Yes.")]},          # 4 empty turn
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, a("Hello")]},   # 5 parts
    ]
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer

    own = make_tiny_tokenizer()          # the template is set on the tokenizer: not the shared fixture's
    with pytest.warns(DataWarning, match="skipped 4 bad line"):
        got = load_sft(write(tmp_path / "s.jsonl", rows), own, chat_template=alternating, multiturn=True)
    assert len(got) == 1
    kinds = {p.line: (p.kind, p.detail) for p in got.problems}
    assert kinds[2][0] == "template_error" and "roles must alternate" in kinds[2][1]
    assert kinds[3] == ("bad_value", "messages[1]: an assistant message with tool_calls, which turborlhf does not "
                                     "render or train on")
    assert kinds[4] == ("empty_response", "message 2 (an assistant turn) is empty")
    assert kinds[5][0] == "bad_value" and "messages[0]: content must be a string, got list" in kinds[5][1]


def test_a_prompt_ending_in_an_assistant_message_is_continued(tok, tmp_path):
    """A prefilled assistant turn (TRL renders it with continue_final_message): it was closed and a
    second assistant header followed."""
    prefill = USER + [{"role": "assistant", "content": "Autumn"}]
    got = load_prompts(write(tmp_path / "p.jsonl", [{"prompt": prefill}]), tok)
    assert list(got) == [RENDERED + "Autumn"]
