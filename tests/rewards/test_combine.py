"""Combining reward sources: score = Σ weight · score."""
import re
from types import SimpleNamespace

import pytest
import torch

from turborlhf.rewards.combine import CombinedReward, RewardInputs, build_reward, combine_scores


def test_combine_scores_is_the_weighted_sum():
    per = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([10.0, -4.0])}
    assert torch.equal(combine_scores(per, {"a": 0.5, "b": 2.0}), torch.tensor([20.5, -7.0]))
    with pytest.raises(ValueError, match="no weight"):
        combine_scores(per, {"a": 1.0})
    with pytest.raises(ValueError, match="one score per row"):
        combine_scores({"a": torch.ones(2), "b": torch.ones(3)}, {"a": 1, "b": 1})


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(96 + i) for i in ids)


def test_function_sources_get_texts_and_are_weighted(tmp_path):
    f = tmp_path / "rules.py"
    f.write_text("def n_chars(prompts, responses):\n    return [len(r) for r in responses]\n"
                 "def has_a(prompts, responses):\n    return [float('a' in p) for p in prompts]\n")
    src = [SimpleNamespace(kind="function", path=f"{f}:n_chars", weight=0.5, name=None, timeout_s=1, retries=0),
           SimpleNamespace(kind="function", path=f"{f}:has_a", weight=-2.0, name="a", timeout_s=1, retries=0)]
    reward = build_reward(src, None, _Tok())
    inp = RewardInputs(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), [[1, 2], [2]], [[3, 4, 5], [6]], _Tok())
    total, per = reward(inp)
    assert inp.texts() == (["ab", "b"], ["cde", "f"])
    assert torch.equal(per["function0"], torch.tensor([3.0, 1.0])) and torch.equal(per["a"], torch.tensor([1.0, 0.0]))
    assert torch.allclose(total, torch.tensor([0.5 * 3 - 2.0, 0.5 * 1]))


def test_duplicate_names_are_rejected():
    with pytest.raises(ValueError, match="unique"):
        CombinedReward([("x", 1.0, None), ("x", 2.0, None)])


@pytest.mark.parametrize("overrides, named", [
    (["rewards=[{kind: function, path: a.py:f, name: acc}, {kind: function, path: b.py:g, name: acc}]"],
     "'acc' (rewards[0].name=acc, rewards[1].name=acc)"),
    (["reward_model=rm_dir", "rewards=[{kind: function, path: a.py:f, name: rm}]"],
     "'rm' (rewards[0].name=rm; reward_model"),
    (["rewards=[{kind: function, path: a.py:f, name: function1}, {kind: function, path: b.py:g}]"],
     "rewards[1] (default name function1)"),
])
def test_duplicate_reward_names_are_a_config_error(overrides, named):
    """They were refused only once the models had loaded, by a traceback from CombinedReward."""
    from turborlhf.config import ConfigError, GRPOConfig, load_config

    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(GRPOConfig, None, ["data.prompts_file=p.jsonl", *overrides])


def test_a_function_returning_none_leaves_its_rows_to_the_other_sources(tmp_path):
    """TRL's convention for task-specific reward functions: None = not scored by this function,
    left out of that row's weighted sum (it was an error). A row no source scores is an error, and
    a NaN from any other kind of source is never read as "not scored"."""
    f = tmp_path / "rules.py"
    f.write_text("def math(prompts, responses):\n    return [1.0 if 'b' in p else None for p in prompts]\n"
                 "def code(prompts, responses):\n    return [None if 'b' in p else 2.0 for p in prompts]\n"
                 "def never(prompts, responses):\n    return [None for p in prompts]\n")
    spec = lambda fn, name, w=1.0: SimpleNamespace(kind="function", path=f"{f}:{fn}", weight=w, name=name,
                                                   timeout_s=1, retries=0)
    inp = RewardInputs(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), [[1, 2], [3]], [[3, 4, 5], [6]], _Tok())
    total, per = build_reward([spec("math", "m", 0.5), spec("code", "c", 2.0)], None, _Tok())(inp)
    assert torch.equal(total, torch.tensor([0.5, 4.0])) and per["m"].isnan().tolist() == [False, True]
    with pytest.raises(ValueError, match=r"no reward source scored row\(s\) \[0, 1\]"):
        build_reward([spec("never", "n")], None, _Tok())(inp)
    nan_model = lambda inp: torch.tensor([float("nan"), 1.0])
    with pytest.raises(ValueError, match="'rm' returned NaN"):
        CombinedReward([("rm", 1.0, nan_model), ("m", 1.0, build_reward([spec("math", "m")], None, _Tok())
                                                         .sources[0][2])])(inp)


def test_a_row_no_source_scores_is_a_one_line_user_error_naming_the_sources():
    """Every source returning None for a row leaves it without a reward: an error (never a NaN nor
    a silent 0), a `UserError` and ValueError, on one line naming the rows, of how many, and the
    sources that returned None (it named none of them, and was a plain ValueError)."""
    from turborlhf.errors import UserError

    nan = float("nan")
    per = {"math": torch.tensor([1.0, nan, nan]), "code": torch.tensor([nan, 2.0, nan])}
    with pytest.raises(UserError, match=r"row\(s\) \[2\] of 3 \('math', 'code' returned None there\)") as e:
        combine_scores(per, {"math": 1.0, "code": 0.5})
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
    per["math"][2] = 0.0
    assert combine_scores(per, {"math": 1.0, "code": 0.5}).tolist() == [1.0, 1.0, 0.0]

def test_a_reward_model_with_another_vocabulary_reads_the_whole_response():
    """The text path (a reward model whose vocabulary differs from the policy's) cut prompt +
    response to 1024 tokens from the right, so a long response was scored at a token in its
    middle, silently. It reads up to the reward model's own context now."""
    from transformers import LlamaForSequenceClassification

    from turborlhf.data.chat import stop_ids
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.models.tiny import tiny_llama_config
    from turborlhf.rewards.combine import _ModelSource
    from turborlhf.rewards.model import score_texts

    torch.manual_seed(0)
    tok = make_tiny_tokenizer()
    cfg = tiny_llama_config(len(tok), pad_token_id=0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            max_position_embeddings=2048, num_labels=1)
    model = LlamaForSequenceClassification(cfg).eval()
    src = _ModelSource.__new__(_ModelSource)
    src.same_vocab, src.tok, src.model, src.dtype, src.chunk = False, tok, model, "fp32", 8
    src.stops = set(stop_ids(tok))                           # the policy's stop tokens, as __init__ sets them
    prompt_ids = tok.encode("Human: hello there\n\nAssistant:", add_special_tokens=False)
    response_ids = torch.randint(10, 500, (1200,), generator=torch.Generator().manual_seed(1)).tolist()
    inp = RewardInputs(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), [prompt_ids], [response_ids], tok)
    whole = score_texts(model, tok, *inp.texts(), max_len=2048, dtype="fp32", add_eos=[False])
    assert torch.allclose(src(inp), whole, atol=1e-6)
    # a response that ended with a stop token is scored with the reward model's EOS; one cut at
    # max_new_tokens as cut (every one was scored as finished: the ids path scores it as cut)
    rows = [response_ids[:20] + [tok.eos_token_id], response_ids[:20]]
    inp = RewardInputs(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), [prompt_ids] * 2, rows, tok)
    want = score_texts(model, tok, *inp.texts(), max_len=2048, dtype="fp32", add_eos=[True, False])
    assert torch.allclose(src(inp), want, atol=1e-6) and not torch.allclose(want[0], want[1])


def test_a_reward_model_of_another_chat_format_is_named(caplog):
    """A reward model of another vocabulary reads the policy's rendering of each prompt (the
    decoded text), silently, though it was trained on its own template's."""
    import logging

    from turborlhf.data.chat import set_chat_template
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.rewards.model import warn_if_other_format

    chatml, plain = make_tiny_tokenizer(), make_tiny_tokenizer()
    set_chat_template(plain, "plain")
    with caplog.at_level(logging.WARNING, logger="turborlhf.rewards.model"):
        warn_if_other_format(chatml, make_tiny_tokenizer(), "rm-same")
        assert not caplog.records
        warn_if_other_format(chatml, plain, "rm-other")
    assert "rm-other: its chat template ends prompts with '<|im_start|>assistant\\n'" in caplog.text
