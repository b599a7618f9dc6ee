"""Loading policies (causal LMs), critics and reward models (causal-LM backbone + scalar head).

Weights are kept in fp32 ("master weights"); compute runs under bf16 autocast when the config
says `dtype: bf16` (see `turborlhf.engine.train.autocast`). A critic or reward model is a
`AutoModelForSequenceClassification` with `num_labels=1`: built from a causal-LM directory it
gets a fresh scalar head `score` (normal(0, initializer_range)); built from a saved reward model
it is reloaded as is, so `AutoModelForSequenceClassification.from_pretrained(dir)` loads what we save.

Padding: when a tokenizer pads with its EOS token (SmolLM2 does), HF's sequence-classification
pooling ("rightmost token != pad_token_id") would skip the trailing EOS. We switch the pad token
to the tokenizer's unk token when it is distinct, and set `config.pad_token_id` accordingly, so
the saved reward model scores the EOS position exactly as our trainers do.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from turborlhf.models.zoo import resolve_model_path

__all__ = ["load_tokenizer", "load_causal_lm", "load_scalar_model", "backbone_of",
           "apply_lora", "merge_lora_for_save"]


def load_tokenizer(name_or_path: str):
    """Tokenizer with a pad token distinct from EOS when possible; right padding."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        if tok.unk_token_id is not None and tok.unk_token_id != tok.eos_token_id:
            tok.pad_token = tok.unk_token
        elif tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def _sync_special_ids(model, tok) -> None:
    if tok is None:
        return
    model.config.pad_token_id = tok.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tok.pad_token_id


def load_causal_lm(name_or_path: str, tokenizer=None, gradient_checkpointing: bool = False,
                   dtype: torch.dtype = torch.float32) -> nn.Module:
    """Causal LM in `dtype` (fp32 master weights by default), train mode off (call .train())."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    _sync_special_ids(model, tokenizer)
    _disable_dropout(model)
    _unfreeze_padding_row(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def load_scalar_model(name_or_path: str, tokenizer=None, gradient_checkpointing: bool = False,
                      dtype: torch.dtype = torch.float32) -> nn.Module:
    """`AutoModelForSequenceClassification(num_labels=1)`: a reward model or critic.

    From a causal-LM directory the head is new; from a saved reward model it is reloaded.
    """
    import logging

    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(name_or_path)
    prev = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)  # "newly initialized: score.weight" is expected here
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    finally:
        hf_logging.set_verbosity(prev)
    _sync_special_ids(model, tokenizer)
    _disable_dropout(model)
    _unfreeze_padding_row(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def backbone_of(model: nn.Module) -> nn.Module:
    """The decoder stack (returns hidden states) of a causal LM or scalar model, LoRA or not."""
    base = model
    if hasattr(base, "get_base_model"):  # peft
        base = base.get_base_model()
    return getattr(base, base.base_model_prefix)


def _unfreeze_padding_row(model: nn.Module) -> None:
    """HF builds ``nn.Embedding(padding_idx=config.pad_token_id)``, whose row never receives
    gradient. When pad == EOS (SmolLM2) that silently freezes the EOS embedding, and the frozen row
    changes whenever the pad id does. Pad positions are masked out of every loss here, so the
    padding row needs no special treatment: clear it."""
    emb = model.get_input_embeddings()
    if isinstance(emb, nn.Embedding):
        emb.padding_idx = None


def _disable_dropout(model: nn.Module) -> None:
    """RLHF convention (TRL `disable_dropout`, OpenRLHF): dropout off so log-probs are deterministic."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    for k in ("attention_dropout", "hidden_dropout", "dropout"):
        if hasattr(model.config, k) and isinstance(getattr(model.config, k), float):
            setattr(model.config, k, 0.0)


def apply_lora(model: nn.Module, lora_cfg) -> nn.Module:
    """Wrap with peft LoRA adapters when `lora_cfg.rank > 0` (else return model unchanged)."""
    if not lora_cfg or lora_cfg.rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    task = "SEQ_CLS" if hasattr(model, "score") else "CAUSAL_LM"
    pcfg = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                      target_modules=list(lora_cfg.target_modules), task_type=task,
                      modules_to_save=["score"] if task == "SEQ_CLS" else None)
    return get_peft_model(model, pcfg)


def merge_lora_for_save(model: nn.Module) -> nn.Module:
    """A plain HF model with adapters merged (a copy; the training model keeps its adapters)."""
    if not hasattr(model, "merge_and_unload"):
        return model
    import copy

    return copy.deepcopy(model).merge_and_unload()


def env_threads(n: int = 0) -> int:
    n = n or int(os.environ.get("TURBORLHF_THREADS", "0")) or (os.cpu_count() or 1)
    torch.set_num_threads(n)
    return n
