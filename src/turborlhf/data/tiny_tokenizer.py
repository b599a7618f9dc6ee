"""A tiny, deterministic ChatML tokenizer built in-process, for tests and tiny models.

``make_tiny_tokenizer()`` trains a byte-level BPE (vocabulary 512) on a fixed, generated corpus of
a few hundred chat-like strings and wraps it in a ``transformers.PreTrainedTokenizerFast``. It has
the same special tokens and chat template *shape* as SmolLM2-Instruct, without the default system
prompt:

    id 0 ``<|endoftext|>``   id 1 ``<|im_start|>`` (bos)   id 2 ``<|im_end|>`` (eos and pad)

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n      (add_generation_prompt=True)

Byte-level BPE covers every byte, so any text (including emoji) round-trips through
encode/decode. Building takes a few milliseconds; the trained ``tokenizer.json`` is cached so
repeated calls return fresh but identical tokenizers. Save with ``save_pretrained(dir)`` and load
with ``AutoTokenizer.from_pretrained(dir)``. Tiny models should use ``len(tokenizer)`` as vocab size.
"""

from __future__ import annotations

import functools
import random

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_VOCAB_SIZE = 512

# Same shape as SmolLM2-Instruct's template, minus the default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an is are was be to of and in that it for on with as you I he she they we this what "
    "how why when where can could would should do does did not no yes please thank thanks help "
    "question answer good bad sure sorry think know want like make get tell give time day people "
    "way more some any all about from there here just really very much many one two three four "
    "five number word text model user assistant system human reward policy value train test data "
    "hello hi okay great idea example story write code python list water food house car dog cat"
).split()


def _corpus(n: int = 400, seed: int = 0) -> list[str]:
    """A fixed list of ``n`` chat-like strings (deterministic for a given seed)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        role = ("user", "assistant", "system")[i % 3]
        out.append(f"<|im_start|>{role}\n{sentence} {i}<|im_end|>\n")
        out.append(f"\n\nHuman: {sentence}\n\nAssistant: {' '.join(reversed(words))}.")
    return out


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def make_tiny_tokenizer():
    """Return a fresh tiny ChatML ``PreTrainedTokenizerFast`` (vocab 512; ids 0/1/2 are special).

    Deterministic: every call yields the same vocabulary, merges and template. Takes < 0.1 s.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|endoftext|>"],
        model_max_length=4096,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer
