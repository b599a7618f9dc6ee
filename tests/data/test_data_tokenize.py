import pytest
import torch

from turborlhf.data import encode_prompt, encode_prompt_response, length_grouped_batches, pad_batch, pad_masks
from turborlhf.data.tokenize import encode_conversation

PROMPT = "<|im_start|>user\nTell me a long story about a dog and a cat<|im_end|>\n<|im_start|>assistant\n"
RESP = "Once upon a time there was a dog who liked a cat very much."


def ids(tok, s):
    return tok(s, add_special_tokens=False)["input_ids"]


def test_no_truncation(tok):
    p, r = ids(tok, PROMPT), ids(tok, RESP)
    e = encode_prompt_response(tok, PROMPT, RESP, max_len=1000)
    assert e["input_ids"] == p + r + [tok.eos_token_id]
    assert e["loss_mask"] == [0] * len(p) + [1] * (len(r) + 1)
    assert e["prompt_len"] == len(p)
    assert not e["prompt_truncated"] and not e["response_truncated"]
    e2 = encode_prompt_response(tok, PROMPT, RESP, max_len=1000, add_eos=False)
    assert e2["input_ids"] == p + r and sum(e2["loss_mask"]) == len(r)


def test_prompt_cut_from_left_first(tok):
    p, r = ids(tok, PROMPT), ids(tok, RESP) + [tok.eos_token_id]
    L = len(r) + 5  # whole response fits if it may take len(r); prompt keeps its last 5 tokens
    e = encode_prompt_response(tok, PROMPT, RESP, max_len=L, min_response_tokens=len(r))
    assert len(e["input_ids"]) == L
    assert e["input_ids"] == p[-5:] + r
    assert e["prompt_len"] == 5 and e["prompt_truncated"] and not e["response_truncated"]
    assert e["input_ids"][-1] == tok.eos_token_id


def test_response_cut_from_right_keeps_min(tok):
    p, r = ids(tok, PROMPT), ids(tok, RESP) + [tok.eos_token_id]
    e = encode_prompt_response(tok, PROMPT, RESP, max_len=10, min_response_tokens=4)
    assert e["input_ids"] == p[-6:] + r[:4]
    assert e["loss_mask"] == [0] * 6 + [1] * 4
    assert e["response_truncated"] and e["input_ids"][-1] != tok.eos_token_id
    # default minimum is max_len // 2
    e = encode_prompt_response(tok, PROMPT, RESP, max_len=10)
    assert e["prompt_len"] == 5 and e["input_ids"] == p[-5:] + r[:5]
    # short prompt, long response: prompt whole, response fills the rest
    short = ids(tok, "<|im_start|>assistant\n")
    e = encode_prompt_response(tok, "<|im_start|>assistant\n", RESP * 5, max_len=20)
    assert e["input_ids"][: len(short)] == short and e["prompt_len"] == len(short)
    assert len(e["input_ids"]) == 20 and e["response_truncated"]
    # prompt a bit too long, short response: prompt cut only as much as needed
    e = encode_prompt_response(tok, PROMPT, "Ok", max_len=len(p))
    r_ok = ids(tok, "Ok") + [tok.eos_token_id]
    assert e["input_ids"] == p[len(r_ok):] + r_ok


def test_encode_prompt_left_truncates(tok):
    p = ids(tok, PROMPT)
    assert encode_prompt(tok, PROMPT, 1000) == p
    assert encode_prompt(tok, PROMPT, 4) == p[-4:]


def test_pad_batch_right_and_left():
    seqs = [[5, 6, 7], [8], []]
    ids_BT, mask_BT = pad_batch(seqs, pad_id=0)
    assert ids_BT.dtype == torch.long and ids_BT.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert mask_BT.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    ids_BT, mask_BT = pad_batch(seqs, pad_id=9, side="left")
    assert ids_BT.tolist() == [[5, 6, 7], [9, 9, 8], [9, 9, 9]]
    assert mask_BT.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert pad_masks([[0, 1], [1]], side="left").tolist() == [[0, 1], [0, 1]]
    assert pad_batch([[1, 2, 3]], 0, pad_to_multiple_of=4)[0].tolist() == [[1, 2, 3, 0]]
    with pytest.raises(ValueError):
        pad_batch([], 0)
    with pytest.raises(ValueError):
        pad_batch([[1]], 0, side="middle")


def test_length_grouped_batches():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 500) for _ in range(1000)]
    b1 = length_grouped_batches(lengths, 8, seed=3, megabatch_mult=10)
    assert b1 == length_grouped_batches(lengths, 8, seed=3, megabatch_mult=10)
    assert b1 != length_grouped_batches(lengths, 8, seed=4, megabatch_mult=10)
    assert sorted(i for b in b1 for i in b) == list(range(1000))
    assert all(len(b) == 8 for b in b1)

    def padding(batches):
        return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in batches)

    naive = [list(range(i, i + 8)) for i in range(0, 1000, 8)]
    assert padding(b1) < 0.3 * padding(naive)
    b = length_grouped_batches([3, 1, 2, 5, 4], 2, seed=0, shuffle=False)
    assert b == [[3, 4], [0, 2], [1]]
    assert length_grouped_batches([3, 1, 2, 5, 4], 2, seed=0, shuffle=False, drop_last=True) == [[3, 4], [0, 2]]


def test_a_tokenizer_that_adds_bos_gets_it_on_every_prompt_through_truncation():
    """Llama-style tokenizers put BOS before what they encode; prompts are encoded without added
    special tokens (for an exact prompt/response boundary), so plain-text prompts lost it."""
    from tokenizers import processors

    from turborlhf.data.tokenize import encode_pair
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.bos_token = "<|im_start|>"
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                                   special_tokens=[("<|im_start|>", bos)])
    plain = tok("Question: what is two and two?", add_special_tokens=False)["input_ids"]
    assert tok("Question: what is two and two?")["input_ids"] == [bos] + plain
    assert encode_prompt(tok, "Question: what is two and two?", 64) == [bos] + plain
    assert encode_prompt(tok, "Question: what is two and two?", 4) == [bos] + plain[-3:]    # BOS kept
    e = encode_prompt_response(tok, "Question: what is two and two?", " four", 64)
    assert e["input_ids"][:1] == [bos] and e["prompt_len"] == len(plain) + 1
    cut = encode_prompt_response(tok, "Question: what is two and two?", " four", 6, min_response_tokens=2)
    assert cut["input_ids"][:1] == [bos] and cut["prompt_truncated"] and len(cut["input_ids"]) == 6
    assert encode_prompt(tok, "<|im_start|>user", 64).count(bos) == 1                          # not twice
    pair = encode_pair(tok, "Question: what is two and two?", " four", " five and a longer answer", 10)
    assert pair["chosen"]["input_ids"][:1] == pair["rejected"]["input_ids"][:1] == [bos]
    assert pair["chosen"]["prompt_len"] == pair["rejected"]["prompt_len"]
    # a tokenizer that adds none (the tiny one, SmolLM2) is unchanged
    assert encode_prompt(make_tiny_tokenizer(), "Question: what is two and two?", 64) == plain


def test_a_templated_response_ends_with_the_templates_end_of_turn_token():
    """A base model with ChatML (data.chat_template: chatml) whose EOS is <|endoftext|>: a
    response after a rendered prompt ended with EOS, a token its prompts never show after an
    assistant turn; TRL's conversational data ends it with the template's <|im_end|>. Rollouts
    stop at either."""
    from turborlhf.data.chat import stop_ids, turn_end
    from turborlhf.data.loaders import load_sft
    from turborlhf.data.sources import Rows
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert turn_end(tok) == (None, "<|im_start|>assistant\n") and stop_ids(tok) == (im_end,)   # EOS is it
    base = make_tiny_tokenizer()
    base.eos_token, base.chat_template = "<|endoftext|>", None
    rows = load_sft(Rows([{"messages": [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"}]}]), base, chat_template="chatml")
    enc = encode_prompt_response(base, rows[0]["prompt"], rows[0]["response"], 64)
    assert enc["input_ids"][-1] == im_end and base.eos_token_id not in enc["input_ids"]
    assert stop_ids(base) == (base.eos_token_id, im_end)
    plain = encode_prompt_response(base, "Question: hi\nAnswer:", " hello", 64)     # not rendered: EOS
    assert plain["input_ids"][-1] == base.eos_token_id


def test_rollouts_stop_at_every_end_token_of_the_generation_config(tmp_path):
    """generation_config.json's eos_token_id list (Llama 3.1 Instruct: three ids) was ignored: a
    rollout ran on past a listed end token and was flagged as truncated; HF generate stops there."""
    import json

    from turborlhf.data.chat import stop_ids
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from transformers import AutoTokenizer

    make_tiny_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    alone = stop_ids(tok)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [alone[0], 5, 7]}))
    assert stop_ids(tok) == (*alone, 5, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": alone[0]}))
    assert stop_ids(tok) == alone


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello friend"}, {"role": "user", "content": "what is two and two"},
        {"role": "assistant", "content": "four"}]


def _trained(tok, enc):
    return tok.decode([t for t, m in zip(enc["input_ids"], enc["loss_mask"]) if m])


def test_multiturn_sft_trains_every_assistant_turn(tok):
    """data.multiturn (OpenRLHF --multiturn, TRL assistant_only_loss): every assistant turn of a
    conversation is trained, each closed by its end-of-turn token; the sequence is the rendered
    conversation either way, and without it only the last turn is trained."""
    from turborlhf.data.chat import render_conversation
    from turborlhf.data.loaders import load_sft
    from turborlhf.data.sources import Rows
    from turborlhf.data.tokenize import encode_examples

    last, every = (load_sft(Rows([{"messages": CONV}]), tok, multiturn=m) for m in (False, True))
    assert "turns" not in last[0] and len(every[0]["turns"]) == 2
    assert (every[0]["prompt"], every[0]["response"]) == (last[0]["prompt"], last[0]["response"])
    e_last, e_every = encode_examples(tok, last, 512)[0], encode_examples(tok, every, 512)[0]
    assert e_every["input_ids"] == e_last["input_ids"] == ids(tok, render_conversation(tok, CONV).rstrip("\n"))
    assert _trained(tok, e_last) == "four<|im_end|>"
    assert _trained(tok, e_every) == "hello friend<|im_end|>four<|im_end|>"
    assert e_every["prompt_len"] == e_last["prompt_len"]
    # truncation: the last response is kept, the earliest tokens go first
    short = encode_examples(tok, every, 12)[0]
    assert short["input_ids"] == e_every["input_ids"][-12:] and short["prompt_truncated"]
    assert short["loss_mask"] == e_every["loss_mask"][-12:]
    # a conversation with one assistant turn is the single-turn record
    one = load_sft(Rows([{"messages": CONV[:3]}]), tok, multiturn=True)
    assert "turns" not in one[0]


def test_multiturn_sft_with_the_plain_template_trains_the_conversation_its_prompts_render():
    """`plain` writes no end-of-turn token, yet every earlier assistant turn got an EOS appended:
    trained on "hello friend<EOS>\\n\\nwhat is two and two", the model was prompted for its next
    turn with "hello friend\\n\\nwhat is two and two" (the same template's rendering). An earlier
    turn now ends with what the template writes after it (nothing here, <|im_end|> for ChatML, as
    TRL trains the rendered conversation); the last one ends with EOS as in single-turn SFT, so
    the model still learns to stop."""
    from turborlhf.data.chat import render_conversation, render_prompt
    from turborlhf.data.loaders import load_sft
    from turborlhf.data.sources import Rows
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.data.tokenize import encode_examples

    own = make_tiny_tokenizer()          # the template is set on the tokenizer: not the shared fixture's
    every = encode_examples(own, load_sft(Rows([{"messages": CONV}]), own, chat_template="plain", multiturn=True),
                            512)[0]
    last = encode_examples(own, load_sft(Rows([{"messages": CONV}]), own, chat_template="plain"), 512)[0]
    assert every["input_ids"][:every["prompt_len"]] == ids(own, render_prompt(own, CONV[:-1]))
    assert every["input_ids"] == last["input_ids"] == ids(own, render_conversation(own, CONV)) + [own.eos_token_id]
    trained = [t for t, m in zip(every["input_ids"], every["loss_mask"]) if m]
    assert trained == ids(own, "hello friend") + ids(own, "four") + [own.eos_token_id]
    # ChatML on a base model (EOS <|endoftext|>) still trains the <|im_end|> it writes after each turn
    base = make_tiny_tokenizer()
    base.eos_token, base.chat_template = "<|endoftext|>", None
    enc = encode_examples(base, load_sft(Rows([{"messages": CONV}]), base, chat_template="chatml", multiturn=True),
                          512)[0]
    assert enc["input_ids"] == ids(base, render_conversation(base, CONV).rstrip("\n"))
    assert _trained(base, enc) == "hello friend<|im_end|>four<|im_end|>"


def test_multiturn_sft_refuses_a_template_that_rewrites_earlier_turns():
    """A template that renders earlier assistant turns differently once later ones follow (as
    reasoning templates drop earlier thinking) cannot give per-turn masks: a one-line data error
    naming the record, not a silently misaligned mask."""
    from turborlhf.data.errors import DataError
    from turborlhf.data.loaders import load_sft
    from turborlhf.data.sources import Rows
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()          # its template is replaced below
    drop = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\\n"
            "...<|im_end|>\\n' }}{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    assert load_sft(Rows([{"messages": CONV}]), tok, chat_template=drop)            # the last turn alone is fine
    with pytest.raises(DataError, match="multiturn_template.*message 5"):
        load_sft(Rows([{"messages": CONV}]), tok, chat_template=drop, multiturn=True)


def test_sft_config_passes_multiturn_to_the_loader():
    from turborlhf.config import SFTConfig

    cfg = SFTConfig.model_validate({"data": {"train_file": "x.jsonl", "multiturn": True}})
    assert cfg.data.loader_kwargs()["multiturn"] is True


def test_the_first_token_is_never_in_the_loss_mask(tok):
    """A conversation cut from the left (or a response given the whole budget) can start with a
    trained token; no position predicts it, so counting it inflated the loss's token count."""
    from turborlhf.data.loaders import load_sft
    from turborlhf.data.sources import Rows
    from turborlhf.data.tokenize import encode_examples

    rows = load_sft(Rows([{"messages": CONV}]), tok, multiturn=True)
    full = encode_examples(tok, rows, 512)[0]
    start = full["loss_mask"].index(1)                       # the first response's first token
    cut = encode_examples(tok, rows, len(full["input_ids"]) - start)[0]
    assert cut["input_ids"] == full["input_ids"][start:]
    assert cut["loss_mask"] == [0] + full["loss_mask"][start + 1:]
    whole = encode_prompt_response(tok, PROMPT, RESP, max_len=4, min_response_tokens=4)
    assert whole["prompt_len"] == 0 and whole["loss_mask"] == [0, 1, 1, 1]


def test_a_response_that_writes_its_own_end_token_gets_no_second_one(tok):
    """Data ending its responses with the EOS / end-of-turn text got a second one appended (both
    trained), and in a preference pair where only one side wrote it the reward model had a free
    "two EOS" cue. The end token is appended only when missing, as OpenRLHF and TRL do."""
    from turborlhf.data.tokenize import encode_conversation, encode_pair, response_end_id

    end = response_end_id(tok, "Q:")
    end_text = tok.decode([end])
    plain = encode_prompt_response(tok, "Q:", " hello", 64)["input_ids"]
    written = encode_prompt_response(tok, "Q:", " hello" + end_text, 64)["input_ids"]
    assert written == plain and plain[-1] == end and plain[-2] != end
    pair = encode_pair(tok, "Q:", " hello" + end_text, " bye", 64)
    assert [e["input_ids"][-2:].count(end) for e in pair.values()] == [1, 1]
    conv = encode_conversation(tok, [("Q:", " a" + end_text), ("Q2:", " b" + end_text)], 64)["input_ids"]
    assert conv.count(end) == 2


def test_cut_responses_are_counted_in_one_warning(tok, caplog):
    """Responses cut at max_len trained without their end token, and a reward model compared a cut
    side with a whole one, without a word."""
    import logging

    from turborlhf.data.tokenize import encode_examples, report_truncation

    rows = [{"prompt": "a " * 30, "response": "b " * 30}, {"prompt": "a", "response": "b"}]
    with caplog.at_level(logging.WARNING):
        report_truncation("sft", encode_examples(tok, rows, 16), 16)
    assert "[sft] 1 of 2 responses were cut at data.max_len=16 (no end token) and 1 prompts lost their start" \
        in caplog.text
    caplog.clear()
    report_truncation("sft", encode_examples(tok, rows[1:], 16), 16)
    assert caplog.text == ""


def _bos_tokenizer():
    from tokenizers import processors

    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.bos_token = "<|im_start|>"
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                                   special_tokens=[("<|im_start|>", tok.bos_token_id)])
    return tok


class _CountingTokenizer:
    """Wraps a tokenizer and counts its encode calls (a list of texts counts once)."""

    def __init__(self, tok):
        self._tok, self.calls = tok, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._tok(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.mark.parametrize("bos", [False, True])
def test_data_sets_are_encoded_in_batched_tokenizer_calls_with_the_same_ids(tok, bos):
    """The trainers' data sets (SFT examples, multi-turn conversations, preference pairs, KTO rows,
    prompts) are tokenized in a few batched calls instead of one or more per text, and give the
    ids the text-by-text encoding gives, BOS-adding tokenizers included."""
    from turborlhf.data.tokenize import encode_examples, encode_pair, encode_prompts
    from turborlhf.rewards.model import encode_pairs
    from turborlhf.trainers.kto import _encode

    base = _bos_tokenizer() if bos else tok
    n = 12
    rows = [{"prompt": f"{PROMPT} number {i}" * (1 + i % 3), "response": f"{RESP} {i}" * (1 + i % 4)}
            for i in range(n)]
    rows.append({"turns": [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "hello<|im_end|>"),
                           ("\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n", "four")],
                 "prompt": "unused", "response": "unused"})
    pairs = [{"prompt": r["prompt"], "chosen": r["response"], "rejected": f"no {i}" * (1 + i % 5)}
             for i, r in enumerate(rows[:n])]
    kto_rows = [{"prompt": p["prompt"], "completion": p["chosen"], "label": i % 2 == 0} for i, p in enumerate(pairs)]

    # text by text, as before: the reference
    want_sft = [encode_conversation(base, r["turns"], 40) if r.get("turns")
                else encode_prompt_response(base, r["prompt"], r["response"], 40) for r in rows]
    want_pairs = [encode_pair(base, p["prompt"], p["chosen"], p["rejected"], 40) for p in pairs]
    want_kto = [encode_prompt_response(base, r["prompt"], r["completion"], 40) for r in kto_rows]
    want_prompts = [encode_prompt(base, r["prompt"], 24) for r in rows[:n]]

    counting = _CountingTokenizer(base)
    assert encode_examples(counting, rows, 40) == want_sft
    got_pairs = encode_pairs(counting, pairs, 40)
    assert [(e["chosen"], e["rejected"]) for e in got_pairs] == [(w["chosen"]["input_ids"], w["rejected"]["input_ids"])
                                                               for w in want_pairs]
    assert [{k: v for k, v in e.items() if k != "label"} for e in _encode(counting, kto_rows, 40)] == want_kto
    assert encode_prompts(counting, [r["prompt"] for r in rows[:n]], 24) == want_prompts
    # a batched call and a BOS probe per data set, however many rows (text by text: 3 to 5 calls per row)
    assert counting.calls <= 4 * 3, counting.calls
