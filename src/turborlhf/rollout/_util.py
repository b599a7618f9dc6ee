"""Small helpers shared by the rollout engines (validation, dtype names, weight-name mapping)."""
from __future__ import annotations

from typing import Sequence

import torch

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}

# wrappers that prefix parameter names (DDP, torch.compile, FSDP activation checkpointing)
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """'auto' | 'bf16' | 'fp16' | 'fp32' (or a torch.dtype) → torch.dtype; 'auto' is the host's
    choice for `device` (`turborlhf.engine.hardware.compute_dtype`). Raises ValueError if unknown."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower() == "auto":
        from turborlhf.engine.hardware import compute_dtype

        dtype = compute_dtype("auto", device)
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def strip_wrapper_prefixes(name: str) -> str:
    """'module._orig_mod.model.layers.0...' → 'model.layers.0...'."""
    changed = True
    while changed:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None = None) -> list[list[int]]:
    """Validate token-id prompts; returns them as lists of ints. Raises ValueError."""
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        out.append(p)
    return out


def cut_at_stop(ids: Sequence[int], stop_ids: set[int], min_new_tokens: int = 0) -> tuple[list[int], bool]:
    """Truncate a generated row after its first stop token at index >= min_new_tokens.

    Returns (tokens incl. the stop token, finished flag)."""
    ids = list(ids)
    for j, t in enumerate(ids):
        if j >= min_new_tokens and t in stop_ids:
            return ids[: j + 1], True
    return ids, False


def response_token_logprobs(logits_BSV: torch.Tensor, ids_BS: torch.Tensor, prompt_lens: Sequence[int],
                            response_lens: Sequence[int]) -> list[list[float]]:
    """Each row's log-probs (fp32 log-softmax of `logits_BSV`, temperature 1) of its response tokens
    ``ids_BS[b, p:p + r]``, for rows laid out as a prompt of p then a response of r tokens. The
    labels are read from `ids_BS` on its device and the whole batch comes back in one copy (a copy
    per row and a label tensor sent per row each waited for a GPU). Returns B lists of r floats."""
    parts = [logits_BSV[b, p - 1: p + r - 1].float().log_softmax(-1).gather(-1, ids_BS[b, p: p + r, None]).squeeze(-1)
             for b, (p, r) in enumerate(zip(prompt_lens, response_lens)) if r]
    flat = torch.cat(parts).tolist() if parts else []
    out, i = [], 0
    for r in response_lens:
        out.append(flat[i: i + r])
        i += r
    return out
