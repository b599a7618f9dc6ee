"""Rollout tools: the calculator's arithmetic and triggers, and both engines writing a tool's
tokens into the response (same tokens, same mask, the continuation conditioned on them)."""
import re
import warnings

import pytest
import torch

from test_engines import GREEDY, hf_greedy
from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
from turborlhf.rollout import SamplingParams
from turborlhf.rollout.fast import FastEngine
from turborlhf.rollout.hf import HFEngine
from turborlhf.rollout.tools import Calculator, ToolCalls, evaluate_arithmetic, format_number, make_tool


@pytest.mark.parametrize("expr,value", [
    ("48/2", 24), ("0.2*50", 10), ("2 x 3", 6), ("3×4", 12), ("1,000+5", 1005), ("$5*3", 15), ("(3+4)*2", 14),
    ("-2+10", 8), ("7-10", -3), ("2**3", 8), ("10/4", 2.5), ("12÷4", 3), ("7//2", 3),
])
def test_arithmetic(expr, value):
    assert evaluate_arithmetic(expr) == pytest.approx(value)


@pytest.mark.parametrize("expr", ["10/0", "2**100**100", "9**99", "__import__('os')", "a+b", "", "3 +", "1e400",
                                  "(" * 50 + "1" + ")" * 50, "x"])
def test_not_arithmetic(expr):
    assert evaluate_arithmetic(expr) is None


def test_format_number():
    assert [format_number(v) for v in (24.0, 0.2, 10 / 3, -3.0, 2.50)] == ["24", "0.2", "3.3333", "-3", "2.5"]


def test_calculator_triggers_only_on_an_open_annotation():
    tok = make_tiny_tokenizer()
    calc = make_tool("calculator", tok)
    assert isinstance(calc, Calculator) and calc.trigger_ids

    def call(text):
        out = calc(tok.encode(text, add_special_tokens=False))
        return None if out is None else tok.decode(out)

    assert call("She sold 48/2 = <<48/2=") == "24>>"
    assert call("<<0.2*50=") == "10>>"
    assert call("so 3 + 4 =") is None                     # prose, no annotation
    assert call("<<48/2=24>>24 and 5 =") is None          # the last annotation is closed
    assert call("<<apples+pears=") is None                # not arithmetic
    assert call("<<10/0=") is None
    assert calc.calls == 2
    assert make_tool("none", tok) is None and make_tool(None, tok) is None
    with pytest.raises(ValueError, match="unknown rollout tool 'abacus'"):
        make_tool("abacus", tok)


def _sentencepiece_tokenizer(legacy: bool):
    """A Llama-style SentencePiece tokenizer built in-process: `transformers.LlamaTokenizer` (Metaspace
    word starts ``▁``, byte fallback; ``legacy``: ``▁`` before every encoded text, else before the
    first word only) over a BPE trained on GSM8K-style annotations with Llama's digits split."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    corpus = ["She sold 48/2 = <<48/2=24>>24 clips in May.", "Natalia sold 48+24 = <<48+24=72>>72 clips.",
              "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute, 0.2 x 50 = $<<0.2*50=10>>10 in all.",
              "It is 7 - 10 = <<7-10=-3>>-3 degrees, and 10/4 = <<10/4=2.5>>2.5 each."] * 10
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Digits(True)])
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return LlamaTokenizer(vocab=model["vocab"], merges=merges, legacy=legacy)


@pytest.mark.parametrize("kind", ["byte_bpe", "sentencepiece_legacy", "sentencepiece"])
def test_calculator_writes_exactly_its_text_after_the_annotation(kind):
    """A SentencePiece tokenizer (Llama, Mistral) encodes a fragment as a word, ``24>>`` as
    ``▁24>>``: the calculator wrote ``<<48/2= 24>>``, a space the annotated solutions never have.
    Its decode of the fragment alone drops that space again: only a decode in context shows it."""
    tok = make_tiny_tokenizer() if kind == "byte_bpe" else _sentencepiece_tokenizer(kind.endswith("legacy"))
    calc = Calculator(tok)
    same_ids = 0
    for text, value in [("She sold 48/2 = <<48/2=", "24"), ("<<0.2*50=", "10"), ("It is <<7-10=", "-3"),
                        ("each 10/4 = <<10/4=", "2.5")]:
        ctx = tok.encode(text, add_special_tokens=False)
        add = calc(ctx)
        assert tok.decode(ctx + add) == tok.decode(ctx) + value + ">>", (kind, text)
        # the annotated solution's tokens there (those SFT taught), unless a merge spans the "=" the
        # model sampled (SentencePiece's "=-" before -3: the context's tokens cannot change)
        annotated = tok.encode(text + value + ">>", add_special_tokens=False)
        if annotated[:len(ctx)] == ctx:
            assert ctx + add == annotated, (kind, text)
            same_ids += 1
    assert same_ids >= 3


class SpacedTokenizer:
    """One token per "<<", ">>" or other character, decoded with a space between tokens (as a
    WordPiece decoder does): no ids append "4>>" after "<< 8 / 2 =" as it is."""

    def __init__(self):
        self.vocab = {t: i for i, t in enumerate(["<<", ">>", *"0123456789=/+-*. ab"])}
        self.inv = {i: t for t, i in self.vocab.items()}

    def get_vocab(self):
        return dict(self.vocab)

    def convert_tokens_to_string(self, tokens):
        return " ".join(tokens)

    def encode(self, text, add_special_tokens=False):
        return [self.vocab[t] for t in re.findall(r"<<|>>|\S", text)]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(self.inv[i] for i in ids)


def test_calculator_warns_once_where_no_tokens_write_its_text_exactly():
    from turborlhf.rollout.tools import continuation_ids

    tok = SpacedTokenizer()
    calc = Calculator(tok)
    ctx = tok.encode("<<8/2=")
    with pytest.warns(RuntimeWarning, match=r"no tokens of this tokenizer append exactly '4>>'.*' 4 >>'"):
        assert calc(ctx) == tok.encode("4>>")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert calc(tok.encode("<<9/3=")) == tok.encode("3>>") and calc.calls == 2
    assert continuation_ids(tok, ctx, "4>>") == (tok.encode("4>>"), False)
    with pytest.raises(ValueError, match="encodes to no token"):
        continuation_ids(tok, ctx, "")


class FixedTool:
    """After each trigger token the model sampled, write FORCED (the engines must not call the
    tool on the tokens it wrote)."""

    FORCED = [7, 8, 9]

    def __init__(self, trigger: int):
        self.trigger_ids = frozenset([trigger])
        self.calls = []

    def __call__(self, response_ids):
        self.calls.append(list(response_ids))
        return list(self.FORCED)


def test_tool_calls_queue_per_row():
    calls = ToolCalls(FixedTool(trigger=5))
    assert not calls and calls.next_token(0) is None
    calls.after(0, [1, 2])                                 # no trigger: no call
    calls.after(1, [])
    assert not calls and calls.tool.calls == []
    calls.after(0, [1, 5])
    calls.after(0, [1, 5])                                 # already queued for row 0: not called again
    calls.after(3, [5])
    assert calls.tool.calls == [[1, 5], [5]]
    assert [calls.next_token(0) for _ in range(4)] == [7, 8, 9, None]
    assert calls and calls.next_token(3) == 7 and calls.next_token(2) is None


def expected_with_tool(model, prompt, trigger, n_new):
    """Greedy reference built from unforced HF generation: sample until the trigger, write the
    tool's tokens, continue from the longer context."""
    resp, mask = [], []
    while len(resp) < n_new:
        nxt = hf_greedy(model, prompt + resp, 1)[0]
        resp.append(nxt)
        mask.append(False)
        if nxt == trigger:
            for t in FixedTool.FORCED:
                resp.append(t)
                mask.append(True)
    return resp[:n_new], mask[:n_new]


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_engine_writes_tool_tokens(engine, model, prompts):
    plain = FastEngine(model, dtype="fp32").generate(prompts, GREEDY)
    counts = torch.bincount(torch.tensor([t for r in plain.response_ids for t in r]))
    trigger = int(counts.argmax())                          # the token greedy decoding emits most
    tool = FixedTool(trigger)
    eng = FastEngine(model, dtype="fp32", max_batch_size=2) if engine == "fast" else HFEngine(model, dtype="fp32")
    params = SamplingParams(max_new_tokens=16, temperature=0.0, return_logprobs=True)
    out = eng.generate(prompts, params, tool=tool)
    assert tool.calls, "the trigger never fired: the test would prove nothing"
    for p, r, m, lp in zip(prompts, out.response_ids, out.tool_mask, out.logprobs):
        want_r, want_m = expected_with_tool(model, p, trigger, 16)
        assert r == want_r and m == want_m
        assert all(x == 0.0 for x, forced in zip(lp, m) if forced)
    assert eng.generate(prompts, params).tool_mask is None
