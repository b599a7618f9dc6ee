"""Tiny random Llama-style models built in-process from a config (no download), for tests and
smoke runs. They share the ChatML tiny tokenizer of `turborlhf.data.tiny_tokenizer`."""
from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["tiny_llama_config", "save_tiny_causal_lm"]


def tiny_llama_config(vocab_size: int, hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                      pad_token_id: int = 0, bos_token_id: int = 1, eos_token_id: int = 2, **extra):
    """A tiny `LlamaConfig`; ``extra``: any other `LlamaConfig` field (``attention_dropout=0.1``)."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-5,
              pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return LlamaConfig(**{**kw, **extra})


def save_tiny_causal_lm(out_dir: str | Path, seed: int = 0, **config_kw) -> Path:
    """Write a tiny random `LlamaForCausalLM` and the tiny tokenizer to `out_dir`; returns it."""
    from transformers import AutoModelForCausalLM

    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer

    out = Path(out_dir)
    tok = make_tiny_tokenizer()
    cfg = tiny_llama_config(len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, **config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
