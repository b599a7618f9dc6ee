import time

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer


def test_special_tokens_and_size(tok):
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 512
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert tok.eos_token_id == tok.pad_token_id == 2
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == 1
    # plain encode adds no special tokens; special tokens are single ids inside text
    assert tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"][0] == 1


def test_chat_template_chatml_shape(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    gen = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
    assert gen == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    sysm = [{"role": "system", "content": "S"}] + msgs[:1]
    assert tok.apply_chat_template(sysm, tokenize=False).startswith("<|im_start|>system\nS<|im_end|>\n")


def test_round_trip_any_text(tok):
    for text in ["Hello, world!", "  spaces\tand\nnewlines ", "émoji 😀 and 中文", ""]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids) == text


def test_deterministic_and_fast():
    t0 = time.perf_counter()
    a, b = make_tiny_tokenizer(), make_tiny_tokenizer()
    assert time.perf_counter() - t0 < 1.0
    assert a.get_vocab() == b.get_vocab()
    s = "Human: what is the reward?\n\nAssistant: a number."
    assert a(s)["input_ids"] == b(s)["input_ids"]


def test_save_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    t2 = AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "user", "content": "Which way?"}]
    a = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert t2.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == a
    assert t2(a, add_special_tokens=False)["input_ids"] == tok(a, add_special_tokens=False)["input_ids"]
    assert (len(t2), t2.eos_token_id, t2.pad_token_id, t2.bos_token_id) == (512, 2, 2, 1)
