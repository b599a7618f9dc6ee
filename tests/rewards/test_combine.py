"""Combining reward sources: score = Σ weight · score."""
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
