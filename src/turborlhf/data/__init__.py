"""Data layer: HH-RLHF conversion, loaders the trainers use, tokenization and batching.

Importing this package is cheap (no torch or transformers import until a function needs it).
"""

from turborlhf.data.chat import render_conversation, render_prompt
from turborlhf.data.errors import DataError, Problem
from turborlhf.data.hh_rlhf import (
    Pair,
    convert_pair,
    load_hh_from_hub,
    parse_dialogue,
    prepare_hh,
    run_prepare_data,
    split_of,
)
from turborlhf.data.jsonl import read_jsonl, write_jsonl
from turborlhf.data.loaders import DataWarning, Records, load_kto, load_pairs, load_prompts, load_sft
from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
from turborlhf.data.tokenize import (
    encode_prompt,
    encode_prompt_response,
    length_grouped_batches,
    pad_batch,
    pad_masks,
)

__all__ = [
    "DataError",
    "DataWarning",
    "Pair",
    "Problem",
    "Records",
    "convert_pair",
    "encode_prompt",
    "encode_prompt_response",
    "length_grouped_batches",
    "load_hh_from_hub",
    "load_kto",
    "load_pairs",
    "load_prompts",
    "load_sft",
    "make_tiny_tokenizer",
    "pad_batch",
    "pad_masks",
    "parse_dialogue",
    "prepare_hh",
    "read_jsonl",
    "render_conversation",
    "render_prompt",
    "run_prepare_data",
    "split_of",
    "write_jsonl",
]
