"""HFEngine: the reference rollout engine, `transformers` `generate` on the engine's own copy of
the model (any causal LM). Slow (dynamic cache, `torch.multinomial`), but simple and general: it
is the fallback for architectures `FastEngine` does not support, and the oracle in its tests.
It samples with its own `torch.Generator`, never torch's global ones (see `_Sampler`).

    eng = HFEngine("/path/to/hf_dir", dtype="bf16")
    out = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=16, stop_token_ids=(2,)))
"""
from __future__ import annotations

import copy
import time
from typing import Iterable, Sequence

import torch

from ._util import check_prompts, cut_at_stop, resolve_dtype, response_token_logprobs, strip_wrapper_prefixes
from .base import RolloutOutput, SamplingParams
from .tools import ToolCalls

__all__ = ["HFEngine"]


class HFEngine:
    """Rollout engine over `model.generate` with left padding.

    model_or_path: a loaded `transformers` causal LM (its weights are copied, never shared) or an
        HF model directory / hub id.
    dtype: 'auto' | 'bf16' | 'fp16' | 'fp32' of the engine's copy ('auto': bf16 where `device`
        computes it natively, `turborlhf.engine.hardware`).
    device: where the copy generates: 'cpu', 'cuda', 'mps', 'auto' (cuda, then mps, then cpu) or a
        ``torch.device``; token ids and log-probs come back as Python lists either way.
    max_batch_size: sequences per `generate` call (larger requests are split).
    device_field: the setting `device` came from (e.g. ``rollout.device``), which errors name.
    Raises `turborlhf.engine.hardware.HardwareError` for a device this host lacks, naming
    `device_field` (``rollout.device=cuda but torch sees no CUDA device ...``).
    """

    def __init__(self, model_or_path, dtype: str | torch.dtype = "auto", max_batch_size: int = 64,
                 device: str | torch.device = "cpu", device_field: str = "device"):
        from turborlhf.engine.hardware import resolve_device

        self.device = device if isinstance(device, torch.device) else resolve_device(device, device_field)
        self.dtype = resolve_dtype(dtype, self.device.type)
        from turborlhf.engine.hardware import warn_if_slower_than_fp32

        warn_if_slower_than_fp32(self.dtype, self.device, "dtype")
        if isinstance(model_or_path, torch.nn.Module):
            model = copy.deepcopy(model_or_path)
        else:
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=self.dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.config = self.model.config
        # sample from the policy as `SamplingParams` say, as FastEngine does: `generate` fills every
        # field its config leaves unset from the checkpoint's generation_config (a repetition
        # penalty, no_repeat_ngram_size, suppressed or banned tokens; an EOS to stop at, padding
        # the row after it), so the model's own is replaced by a neutral one
        if getattr(self.model, "generation_config", None) is not None:
            from transformers import GenerationConfig

            self.model.generation_config = GenerationConfig()
        self.max_batch_size = max_batch_size
        self.pad_id = 0
        self._params = dict(self.model.named_parameters(remove_duplicate=False))

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, tool=None) -> RolloutOutput:
        """See `RolloutEngine.generate`. Raises ValueError on empty prompts. A `tool`
        (`turborlhf.rollout.tools`) writes its tokens through a logits processor that leaves only
        the tool's next token possible (log-prob 0, flagged in `RolloutOutput.tool_mask`)."""
        from transformers import GenerationConfig

        prompts = check_prompts(prompts, self.config.vocab_size)
        t0 = time.perf_counter()
        greedy = params.temperature == 0
        raw = params.logprobs_mode == "raw_logprobs"   # transformers' `logits`: before the logits processors
        stop = list(params.stop_token_ids)
        # generate itself is always greedy: sampling happens in `_Sampler`, the last processor
        gcfg = GenerationConfig(
            max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens, do_sample=False,
            eos_token_id=stop if stop else None, pad_token_id=self.pad_id, use_cache=True,
            num_return_sequences=1, output_scores=params.return_logprobs and not raw and greedy,
            output_logits=params.return_logprobs and raw,
            return_dict_in_generate=True, bos_token_id=None,
        )
        gen = None if greedy else torch.Generator(device=self.device)    # the call's own stream
        if gen is not None and params.seed is not None:
            gen.manual_seed(params.seed)
        elif gen is not None:
            gen.seed()                                   # nondeterministic, from the OS
        reqs = [p for p in prompts for _ in range(params.n)]  # samples of a prompt consecutive
        resp, fin, lps, tms = [], [], [], []
        with torch.inference_mode():
            for s in range(0, len(reqs), self.max_batch_size):
                chunk = reqs[s: s + self.max_batch_size]
                L = max(len(p) for p in chunk)
                ids = torch.tensor([[self.pad_id] * (L - len(p)) + p for p in chunk], device=self.device)
                mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk], device=self.device)
                forcing = _ToolForcing(tool, L) if tool is not None else None
                sampler = None if greedy else _Sampler(params, gen, record=params.return_logprobs and not raw)
                procs = [x for x in (forcing, sampler) if x is not None]
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gcfg,
                                          logits_processor=procs or None)
                new = out.sequences[:, L:]
                if params.return_logprobs and sampler is not None and not raw:
                    lp = torch.stack(sampler.logprobs[: new.shape[1]], 1).cpu()   # one-hot `out.scores`
                elif params.return_logprobs:
                    # step by step: transformers already holds one B×V per step; a stacked fp32
                    # B×T×V and its log-softmax would add two more (GBs on a GPU)
                    steps = out.logits if raw else out.scores
                    lp = torch.stack([s.float().log_softmax(-1).gather(-1, new[:, t, None]).squeeze(-1)
                                      for t, s in enumerate(steps)], 1).cpu()
                new = new.cpu()
                for i in range(new.shape[0]):
                    toks, done = cut_at_stop(new[i].tolist(), set(stop), params.min_new_tokens)
                    resp.append(toks)
                    fin.append(done)
                    forced = [(i, t) in forcing.forced for t in range(len(toks))] if forcing is not None else None
                    if params.return_logprobs:
                        row = lp[i, : len(toks)].tolist()     # a tool's token: log-prob 0, in either mode
                        lps.append([0.0 if f else x for f, x in zip(forced, row)] if forced else row)
                    if forced is not None:
                        tms.append(forced)
        return RolloutOutput(resp, fin, lps if params.return_logprobs else None,
                             timings={"generate_s": time.perf_counter() - t0},
                             tool_mask=tms if tool is not None else None)

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into the engine's model in place. Raises KeyError on an
        unknown name and ValueError on a shape mismatch."""
        with torch.no_grad():
            for name, t in named_tensors:
                name = strip_wrapper_prefixes(name)
                if name not in self._params:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    raise KeyError(f"unknown parameter {name!r}")
                p = self._params[name]
                if tuple(p.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} != engine {tuple(p.shape)}")
                p.copy_(t.detach())

    # ------------------------------------------------------------------ scoring
    def score_logprobs(self, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """Temperature-1 log-probs of each response token given its prompt (right padding)."""
        prompts = check_prompts(prompts, self.config.vocab_size)
        if len(prompts) != len(responses):
            raise ValueError("prompts and responses differ in length")
        out: list[list[float]] = []
        with torch.inference_mode():
            for s in range(0, len(prompts), self.max_batch_size):
                ps, rs = prompts[s: s + self.max_batch_size], responses[s: s + self.max_batch_size]
                seqs = [p + list(r) for p, r in zip(ps, rs)]
                L = max(len(x) for x in seqs)
                ids = torch.tensor([x + [self.pad_id] * (L - len(x)) for x in seqs], device=self.device)
                mask = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in seqs], device=self.device)
                logits = self.model(input_ids=ids, attention_mask=mask).logits
                out += response_token_logprobs(logits, ids, [len(p) for p in ps], [len(r) for r in rs])
        return out


class _Sampler:
    """The last `transformers` logits processor of a sampled `generate` call, which itself runs
    greedy: it applies temperature, top-k and top-p (transformers' own warpers, after the built-in
    processors such as min_new_tokens' stop suppression, and after `_ToolForcing`), draws each
    row's token from `generator`, and returns scores that are -inf except at that token, so the
    greedy argmax picks it. Why not `do_sample=True`: its `torch.multinomial` draws from torch's
    process-global generators, which the trainer shares (PPO may generate on a background thread,
    `trainers.ppo.async_rollout`): seeding them there reseeds the trainer, and restoring them
    (`fork_rng`) rewinds the trainer's draws made meanwhile. `logprobs` (when `record`): per step,
    each row's log-prob of its token under the distribution it was drawn from."""

    def __init__(self, params: SamplingParams, generator: torch.Generator, record: bool):
        from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                            TopPLogitsWarper)
        self.warpers = ([TemperatureLogitsWarper(params.temperature)] if params.temperature != 1 else []) \
            + ([TopKLogitsWarper(params.top_k)] if params.top_k > 0 else []) \
            + ([TopPLogitsWarper(params.top_p)] if params.top_p < 1 else [])
        self.generator = generator
        self.logprobs: list[torch.Tensor] | None = [] if record else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for w in self.warpers:
            scores = w(input_ids, scores)
        tok = torch.multinomial(scores.softmax(-1), 1, generator=self.generator)   # B×1
        if self.logprobs is not None:
            self.logprobs.append(scores.log_softmax(-1).gather(-1, tok).squeeze(-1))
        return torch.full_like(scores, float("-inf")).scatter_(-1, tok, 0.0)


class _ToolForcing:
    """A `transformers` logits processor that runs a rollout tool (`turborlhf.rollout.tools`) for
    the rows of one `generate` call: after a trigger token the tool's tokens are queued
    (`ToolCalls`), then each is made the only possible next token. `forced`: the (row, response
    position) pairs it wrote."""

    def __init__(self, tool, prompt_len: int):
        self.calls, self.L = ToolCalls(tool), prompt_len
        self.forced: set[tuple[int, int]] = set()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1] - self.L                  # response position being chosen
        if t > 0:
            triggers = self.calls.tool.trigger_ids
            for b, last in enumerate(input_ids[:, -1].tolist()):
                if last in triggers and (b, t - 1) not in self.forced:
                    self.calls.after(b, input_ids[b, self.L:].tolist())
        if self.calls:
            for b in range(scores.shape[0]):
                tok = self.calls.next_token(b)
                if tok is not None:
                    scores[b] = float("-inf")
                    scores[b, tok] = 0.0
                    self.forced.add((b, t))
        return scores
