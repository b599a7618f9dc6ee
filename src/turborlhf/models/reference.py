"""The reference policy, without a second copy of the policy where possible.

- DPO/KTO: summed response log-probs computed once, before training, and cached in
  ``<output_dir>/ref_logps.pt`` under a fingerprint of the reference weights (path, file sizes
  and mtimes), the compute dtype and every token id, so a resumed run with the same fingerprint
  never builds the reference model again.
- LoRA: the reference is the policy with its adapters disabled (peft ``disable_adapter``): the
  frozen base is exactly the initial policy, also after resuming, so no reference model is
  loaded (`LoraReference`, `reference_view`).
"""
from __future__ import annotations

import array
import contextlib
import gc
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from turborlhf.data.jsonl import usual_mode
from turborlhf.models.forward import sequence_logps
from turborlhf.errors import UserError
from turborlhf.models.load import adapters_disabled, is_lora, load_causal_lm, load_tokenizer
from turborlhf.models.zoo import ModelFetchError, resolve_model_path

logger = logging.getLogger(__name__)

__all__ = ["REF_CACHE", "reference_logps", "compute_reference_logps", "LoraReference", "reference_view",
           "same_model", "reuses_policy", "check_reference_vocabulary"]

REF_CACHE = "ref_logps.pt"


def _fingerprint(reference: str, dtype: str, seq_sets: dict[str, Sequence[dict]], in_4bit: bool = False) -> str:
    """sha256 over the reference weights' identity, the compute dtype, whether they were read
    quantized to 4 bits (a QLoRA policy's base computes the log-probs) and every token id/mask."""
    h = hashlib.sha256()
    path = Path(resolve_model_path(reference))
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".json")) if path.is_dir() else []
    # "training-kernels": log-probs computed with the training forward's attention kernels
    # (`sequence_logps`); a cache of the earlier SDPA ones differs from the policy's forward under bf16
    ident = [str(path.resolve()), dtype, "training-kernels"] + [(p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                                               for p in files]
    if in_4bit:         # (the same ident as before otherwise: existing caches stay valid)
        ident.append("4bit")
    h.update(json.dumps(ident).encode())
    for name in sorted(seq_sets):
        h.update(f"|{name}:{len(seq_sets[name])}".encode())
        for s in seq_sets[name]:
            h.update(array.array("q", s["input_ids"]).tobytes())
            h.update(array.array("b", s["loss_mask"]).tobytes())
    return h.hexdigest()


def compute_reference_logps(model, pad_id: int, seq_sets: dict[str, Sequence[dict]], dtype: str,
                            batch_size: int) -> dict[str, torch.Tensor]:
    """Summed reference log-probs of every named set of sequences (no grad). Tests count calls."""
    return {name: sequence_logps(model, pad_id, seqs, dtype, batch_size) for name, seqs in seq_sets.items()}


def check_reference_vocabulary(reference: str, tokenizer, field: str = "reference",
                               role: str = "a reference model") -> None:
    """`UserError` naming `field` when the model directory `reference` has a tokenizer whose
    vocabulary differs from the policy's `tokenizer`: a reference scores the policy's token ids,
    so another vocabulary gives meaningless log-probs (a larger one, silently) or an index error
    (a smaller one). A directory without a tokenizer of its own is read with the policy's, as the
    loaders do: its embedding must cover the policy's token ids. `role` names the model in the
    message (PPO's critic, initialised from a reward model, reads the policy's ids too)."""
    try:
        own = load_tokenizer(reference)
    except Exception:            # no tokenizer files there
        from transformers import AutoConfig
        try:
            size = getattr(AutoConfig.from_pretrained(resolve_model_path(reference, fetch=False)), "vocab_size", None)
        except Exception:
            return               # not readable here: the model load names the problem
        if size is not None and size < len(tokenizer):
            raise UserError(f"{field} {reference}: its embedding has {size} rows for the policy's {len(tokenizer)} "
                            f"token ids; {role} must share the policy's vocabulary") from None
        return
    if own.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"{field} {reference}: its tokenizer ({len(own)} tokens) differs from the policy's "
                        f"({len(tokenizer)}); {role} reads the policy's token ids, so it must share "
                        "the policy's vocabulary")


def reference_logps(out: Path, reference: str, tokenizer, seq_sets: dict[str, Sequence[dict]], dtype: str,
                    batch_size: int, initial_policy=None, tag: str = "dpo", device: str = "auto") -> dict[str, torch.Tensor]:
    """Reference log-probs for `seq_sets`, computed once and cached in ``<out>/ref_logps.pt``.

    Args:
        out: run directory.
        reference: reference model (HF dir or zoo name); part of the cache fingerprint.
        tokenizer: gives the pad id.
        seq_sets: name → encoded sequences (``input_ids``/``loss_mask``).
        dtype: compute dtype (``bf16`` autocast or ``fp32``), as the policy's.
        batch_size: sequences per no-grad forward.
        initial_policy: the policy when it *is* the reference (untrained, or a LoRA model whose
            adapters are then disabled): it computes the log-probs itself (no second model).
            Otherwise the reference is loaded (fp32 weights, same autocast as the policy), used,
            and freed.
        tag: prefix of log lines.
        device: where a loaded reference computes (``auto``: cuda, mps, cpu), as the policy's.

    Returns:
        name → ``N`` fp32 tensor, in the order of ``seq_sets[name]``.
    """
    t0 = time.perf_counter()
    if initial_policy is None:
        check_reference_vocabulary(reference, tokenizer)     # also before a cache made with it is reused
    # a QLoRA policy's 4-bit base differs from the same weights read in full: a run directory reused
    # with the other setting must not read the other's log-probs
    key = _fingerprint(reference, dtype, seq_sets, bool(getattr(initial_policy, "is_loaded_in_4bit", False)))
    path = out / REF_CACHE
    if path.exists():
        try:     # tensors and plain types only: never unpickle code from a file found in the run directory
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            logger.warning(f"[{tag}] {path} is not a reference cache this version reads ({type(e).__name__}); "
                           "recomputing")
            blob = {}
        if blob.get("key") == key:
            logger.info(f"[{tag}] reference log-probs loaded from {path}")
            return blob["logps"]
        logger.info(f"[{tag}] {path} belongs to other data or another reference; recomputing")
    n = sum(len(v) for v in seq_sets.values())
    if initial_policy is not None:
        with adapters_disabled(initial_policy):
            logps = compute_reference_logps(initial_policy, tokenizer.pad_token_id, seq_sets, dtype, batch_size)
    else:
        ref = load_causal_lm(reference, tokenizer, device=device).eval().requires_grad_(False)
        logps = compute_reference_logps(ref, tokenizer.pad_token_id, seq_sets, dtype, batch_size)
        del ref
        gc.collect()
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{REF_CACHE}.")
    os.close(fd)
    torch.save({"key": key, "reference": reference, "dtype": dtype, "logps": logps}, tmp)
    usual_mode(tmp)
    os.replace(tmp, path)
    logger.info(f"[{tag}] reference log-probs of {n} sequences in {time.perf_counter() - t0:.1f}s → {path}")
    return logps


def same_model(a: str, b: str) -> bool:
    """True when two model names/paths resolve to the same place. Never fetches: a zoo model that
    is not cached yet can only equal its own name."""
    if a == b:
        return True
    try:
        return Path(resolve_model_path(a, fetch=False)).resolve() == Path(resolve_model_path(b, fetch=False)).resolve()
    except ModelFetchError:
        return False


def reuses_policy(policy, policy_init: str, reference: str, resumed: bool) -> bool:
    """Whether `policy` itself can compute the reference log-probs: the reference is the model the
    policy started from, and the policy still holds it: not yet trained (a fresh run), or LoRA
    (the frozen base under disabled adapters is the initial policy, also after resuming)."""
    return same_model(reference, policy_init) and (not resumed or is_lora(policy))


class LoraReference:
    """PPO's reference model as a view of the LoRA actor with its adapters disabled (no copy).

    Use through `reference_view`, which switches the adapters off for the duration of the
    reference forward passes."""

    def __init__(self, actor) -> None:
        if not is_lora(actor):
            raise ValueError("LoraReference needs a peft (LoRA) actor")
        self.actor = actor


@contextlib.contextmanager
def reference_view(reference):
    """Context manager yielding the module to run as the reference: a `LoraReference`'s actor
    with adapters disabled, or `reference` itself (a loaded model)."""
    if isinstance(reference, LoraReference):
        with adapters_disabled(reference.actor):
            yield reference.actor
    else:
        yield reference
