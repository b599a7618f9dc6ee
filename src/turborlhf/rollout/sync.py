"""Weight sync from the trainer to a rollout engine, verified on a fixed canary batch.

After every policy update the trainer pushes its weights into the engine (`load_weights`, no
disk). A push can go wrong silently: a name mapped to the wrong slot, a fused matrix filled in
the wrong order, a stale packed/compiled copy that never sees the new values, a remote engine
that dropped a tensor. Generation would then sample from a policy the trainer does not have, and
PPO's importance ratios would be quietly wrong. So after each push, both sides score the same
canary batch (a few prompts with fixed responses) and the mean per-token log-probs must agree:

    diff_i = | mean_t logp_engine(r_it | p_i, r_i<t) - mean_t logp_trainer(r_it | p_i, r_i<t) |
    mean_i diff_i <= tol, else WeightSyncError naming the engine and the discrepancy.

The trainer side is the trainer's model itself (the fp32 master weights the optimizer holds),
run under bf16 autocast when the engine is bf16 so that both sides round weights and matmuls
alike. What remains is precision noise that differs from row to row, while a sync bug shifts
every row; so the test statistic is the mean over the canary rows (the worst row is reported
beside it). Measured on SmolLM2-135M, SFT policy, 16 HH canary rows with 32-token prompts, bf16
FastEngine: fp32 trainer mean 0.016 / worst row 0.034; bf16-autocast trainer mean 0.008 / worst
0.026. The worst row grows as the policy drifts: with an fp32 trainer and the worst row as the
statistic, a demo PPO run at KL ~7 was stopped at 0.051 > 0.05. The tolerance follows the
engine's precision (`default_tolerance`, `turborlhf.config.SYNC_TOLERANCE`: the measured noise
times a margin; fp32 engines measure 0.0000, so a tiny tolerance catches any fault there).
What a bf16 check cannot see: a corruption smaller than bf16 rounding (e.g. a few skipped
updates of lr·grad size); the faults measured below and beside it are in docs/rollout.md.

Typical use (what the trainers do):

    canary = make_canary(engine, prompt_ids[:4])       # greedy responses at the initial weights
    verify_sync(engine, model, canary, tol)            # the engine was built right
    ... train ...
    report = push_weights(engine, model, canary, tol)  # after every policy update
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from turborlhf.errors import RunError
from turborlhf.metrics import M

from .base import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["Canary", "SyncReport", "WeightSyncError", "make_canary", "canary_windows", "trainer_logprobs",
           "policy_weights", "verify_sync", "push_weights", "start_sync_check", "default_tolerance",
           "rounds_weights", "canary_rows"]


def default_tolerance(dtype) -> float:
    """`rollout.sync_tolerance` for an engine of `dtype` ("bf16", "fp32", a torch.dtype...):
    `turborlhf.config.SYNC_TOLERANCE` (measured noise x margin); fp16, finer than bf16, gets
    bf16's. Raises ValueError for an unknown dtype."""
    from turborlhf.config import SYNC_TOLERANCE

    from ._util import resolve_dtype

    dt = resolve_dtype(dtype)
    return SYNC_TOLERANCE["fp32"] if dt == torch.float32 else SYNC_TOLERANCE["bf16"]


def _tol(tol: Optional[float], engine) -> float:
    return float(tol) if tol is not None else default_tolerance(getattr(engine, "dtype", "bf16"))


class WeightSyncError(RunError):
    """The engine's log-probs on the canary batch disagree with the trainer's after a push."""


@dataclass(frozen=True)
class Canary:
    """Fixed prompts and responses (token ids) scored after every weight push.

    bf16_weights: the engine that built it computes in fp32 on weights rounded to bf16
    (FastEngine's `weight_dtype='bf16'`), so `trainer_logprobs` rounds the trainer's 2-D weights
    alike and the check keeps fp32's tolerance."""

    prompts: tuple[tuple[int, ...], ...]
    responses: tuple[tuple[int, ...], ...]
    bf16_weights: bool = False

    def __post_init__(self):
        if not self.prompts or len(self.prompts) != len(self.responses):
            raise ValueError("a canary needs >= 1 prompt and exactly one response per prompt")
        for i, (p, r) in enumerate(zip(self.prompts, self.responses)):
            if not p or not r:
                raise ValueError(f"canary row {i}: empty prompt or response")


@dataclass
class SyncReport:
    """Outcome of one push/verify. Log-prob differences in nats; times in seconds."""

    engine: str
    mean_diff: float = 0.0         # mean over rows of |Δ mean per-token log-prob| (the test statistic)
    max_mean_diff: float = 0.0     # max over rows of |Δ mean per-token log-prob| (diagnostic)
    max_token_diff: float = 0.0    # max over all canary tokens of |Δ log-prob| (diagnostic)
    tol: float = 0.0
    push_s: float = 0.0
    verify_s: float = 0.0
    verified: bool = False

    def metrics(self) -> dict:
        """Flat metric dict (`sync/...`) for the trainers' loggers."""
        out = {M.T_WEIGHT_PUSH: self.push_s, M.T_SYNC_VERIFY: self.verify_s}
        if self.verified:
            out.update({M.SYNC_LOGP_DIFF: self.mean_diff, M.SYNC_ROW_DIFF: self.max_mean_diff,
                        M.SYNC_TOKEN_DIFF: self.max_token_diff})
        return out


def make_canary(engine, prompts: Sequence[Sequence[int]], n: Optional[int] = None, response_tokens: int = 16,
                prompt_tokens: int = 16) -> Canary:
    """Canary from the first `n` prompts, each cut to `prompt_tokens` tokens of its own (see
    `canary_windows`), with the engine's greedy response of exactly `response_tokens` tokens (no
    stop token), generated once at the current weights and fixed from then on.

    Short windows keep the check cheap (every weight is exercised by any tokens; 16 instead of 32
    prompt tokens took it from 1.15 to 0.87 s per push on SmolLM2, trainer and engine side
    together, with the same statistic). `n` (None: `canary_rows(engine)`) sets how many rows the
    statistic averages precision noise over. Raises ValueError if `prompts` is empty."""
    n = canary_rows(engine) if n is None else n
    ps = canary_windows(list(prompts)[:n], prompt_tokens)
    out = engine.generate(ps, SamplingParams(max_new_tokens=response_tokens, min_new_tokens=response_tokens,
                                             temperature=0.0, seed=0))  # seeded: leaves the global RNG alone
    return Canary(tuple(tuple(p) for p in ps), tuple(tuple(r) for r in out.response_ids), rounds_weights(engine))


def canary_rows(engine) -> int:
    """Rows of a canary for `engine`: 8 where it computes in bf16 (precision noise 0.008-0.016
    nats per row against a tolerance of 0.025-0.05, so the mean over rows needs them), 4 where it
    computes in fp32 (noise below 1e-5 against 0.001, bf16-rounded weights included: the trainer's
    side is rounded alike). Half the rows halve the check on both sides, which every PPO step pays
    (about 0.4 of 1.1 s per step on the PPO bench, 2-core Xeon); a sync fault moves every row."""
    return 4 if getattr(engine, "dtype", None) == torch.float32 else 8


def rounds_weights(engine) -> bool:
    """True for an engine that computes in fp32 on bf16-rounded weights (FastEngine's
    `weight_dtype='bf16'`)."""
    return getattr(engine, "dtype", None) == torch.float32 and getattr(engine, "weight_dtype", None) == torch.bfloat16


def canary_windows(prompts: Sequence[Sequence[int]], k: int) -> list[list[int]]:
    """The last `k` tokens of each prompt after removing what all of them share at the start and
    at the end (a system prompt, an instruction appended to every question, the chat template's
    assistant header), so the rows differ. The statistic averages precision noise over rows; rows
    cut from templated prompts were otherwise identical (every GSM8K prompt ends with the same 16
    tokens), the mean was one row's noise, and a correct push failed the bf16 check (0.034 > 0.025
    on a GRPO run). Prompts that differ nowhere, or a single prompt, keep their last `k` tokens.
    Raises ValueError if `prompts` is empty."""
    ps = [list(map(int, p)) for p in prompts]
    if not ps:
        raise ValueError("make_canary needs at least one prompt")
    shortest = min(len(p) for p in ps)
    pre = 0
    while pre < shortest and all(p[pre] == ps[0][pre] for p in ps):
        pre += 1
    suf = 0
    while suf < shortest - pre and all(p[-1 - suf] == ps[0][-1 - suf] for p in ps):
        suf += 1
    if len(ps) < 2 or pre + suf >= shortest:       # nothing distinct left in some prompt
        return [p[-k:] for p in ps]
    return [p[pre:len(p) - suf][-k:] for p in ps]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP/FSDP wrappers
        model = model.module
    return getattr(model, "_orig_mod", model)                                     # torch.compile


def policy_weights(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of a trainer's causal LM as an engine expects them: wrapper
    prefixes gone, peft LoRA adapters merged (into a copy; the trainer keeps its adapters)."""
    model = _unwrap(model)
    if hasattr(model, "merge_and_unload"):  # peft
        from turborlhf.models.load import merge_lora_for_save
        model = merge_lora_for_save(model)
    return model.named_parameters()


def trainer_logprobs(model: torch.nn.Module, canary: Canary, compute_dtype=None) -> list[list[float]]:
    """Per-token log-probs (temperature 1) of the canary responses under the trainer's model,
    without grad, in eval mode (the training flag is restored). One forward over all rows
    (right-padded, so the real tokens' positions and attention are those of each row alone).

    compute_dtype: the engine's dtype ("bf16", torch.bfloat16, ...): a bf16 engine is compared
    with the trainer's weights under bf16 autocast (the same rounding of weights and matmuls),
    which halves the precision noise of the check; None or fp32 = the parameters' own dtype.
    With `canary.bf16_weights` (an fp32 engine on bf16-rounded weights) the forward reads the
    trainer's 2-D parameters rounded to bf16 (each module's while it runs, `_rounded_matrices`;
    LoRA adapters merged first, as the engine receives them), so both sides compute the same
    policy in fp32."""
    from ._util import resolve_dtype, response_token_logprobs

    from turborlhf.engine.train import compute_device

    model = _unwrap(model)
    dev = compute_device(model)       # an FSDP model offloading its shards computes off their device
    dt = resolve_dtype(compute_dtype) if compute_dtype is not None else None
    rounded = canary.bf16_weights and dt != torch.bfloat16
    if rounded and hasattr(model, "merge_and_unload"):  # peft: round the merged matrices, as pushed
        from turborlhf.models.load import merge_lora_for_save
        model = merge_lora_for_save(model)
    was_training = model.training
    out: list[list[float]] = []
    try:
        model.eval()
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dt == torch.bfloat16):
            seqs = [list(p) + list(r) for p, r in zip(canary.prompts, canary.responses)]
            S = max(len(x) for x in seqs)
            ids = torch.tensor([x + [0] * (S - len(x)) for x in seqs], device=dev)
            attn = torch.tensor([[1] * len(x) + [0] * (S - len(x)) for x in seqs], device=dev)
            kw = dict(input_ids=ids, attention_mask=attn, use_cache=False)
            if not rounded:
                logits_BSV = model(**kw).logits
            else:
                with _rounded_matrices(model) as missed:
                    logits_BSV = model(**kw).logits
                if missed:     # a matrix whose module never ran may have been read unrounded: round a copy
                    params = {n: _round_bf16(p) if _is_matrix(p) else p for n, p in model.named_parameters()}
                    logits_BSV = torch.func.functional_call(model, params, (), kw).logits
            out = response_token_logprobs(logits_BSV, ids, [len(p) for p in canary.prompts],
                                          [len(r) for r in canary.responses])
    finally:
        model.train(was_training)
    return out


def _is_matrix(p: Optional[torch.Tensor]) -> bool:
    return p is not None and p.dim() == 2 and p.is_floating_point()


def _round_bf16(p: torch.Tensor) -> torch.Tensor:
    return p.detach().to(torch.bfloat16).to(p.dtype)


@contextlib.contextmanager
def _rounded_matrices(model: torch.nn.Module):
    """Within the block (no grad), a forward of `model` reads every 2-D floating parameter rounded
    to bf16, as FastEngine's bf16 weights are, without a rounded copy of the whole model (540 MB
    for SmolLM2-135M in fp32), and with the rounding read while it is in cache: 0.12 → 0.06 s per
    check there, natively and limited to AVX2 alike (the trainer side 0.27 → 0.21 s and 0.33 →
    0.28 s; 2-core Xeon).

    - A matrix of one module only (the projections): rounded into a buffer just before that
      module's forward and put back after it (a module called inside its own forward keeps its
      rounded matrices until the outer call returns; buffers are per name, shape and nesting
      depth, so no two live matrices share one).
    - A matrix with several owners (tied embeddings) or of an embedding: rounded once for the
      whole block and swapped into every owner, so a read through any of them, inside a module's
      forward or not (``F.linear(h, embed.weight)``), sees the rounded values.

    Yields the set of names of one-module matrices whose module never ran (filled when the block
    ends): such a matrix may have been read some other way unrounded, and the caller then rounds a
    copy, which covers every way of reading it. Every parameter is back in place when the block
    ends, also when the forward raised. Raises RuntimeError under grad (autograd would keep
    buffers that the next module overwrites)."""
    if torch.is_grad_enabled():
        raise RuntimeError("_rounded_matrices reuses its buffers: use it under torch.no_grad()")
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for mod in model.modules():
        for n, p in mod._parameters.items():
            if _is_matrix(p):
                owners.setdefault(id(p), []).append((mod, n))
    shared = {pid for pid, own in owners.items()
              if len(own) > 1 or any(isinstance(m, torch.nn.Embedding) for m, _ in own)}
    whole: list[tuple[torch.nn.Module, str, torch.Tensor]] = []     # (owner, name, own tensor), block-wide
    rounded_ids: set[int] = set()
    bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    seen: set[int] = set()
    missed: set[str] = set()
    active: dict[int, list] = {}               # id(module) → [calls inside, {name: own tensor}, module]

    def swap_in(mod, args):
        entry = active.get(id(mod))
        if entry is not None:                  # called inside its own forward: already rounded
            entry[0] += 1
            return
        own, depth = {}, len(active)
        for n, p in mod._parameters.items():
            if _is_matrix(p) and id(p) not in rounded_ids:
                key = (n, tuple(p.shape), p.dtype, p.device, depth)
                if key not in bufs:
                    bufs[key] = (torch.empty(p.shape, dtype=torch.bfloat16, device=p.device), torch.empty_like(p))
                half, full = bufs[key]
                half.copy_(p.detach())
                full.copy_(half)
                own[n], mod._parameters[n] = p, full
                seen.add(id(p))
        active[id(mod)] = [0, own, mod]

    def swap_back(mod, args, out):
        entry = active[id(mod)]
        if entry[0]:
            entry[0] -= 1
            return
        mod._parameters.update(entry[1])
        del active[id(mod)]

    handles = []
    try:
        for pid in shared:
            first_mod, first_name = owners[pid][0]
            r = _round_bf16(first_mod._parameters[first_name])
            rounded_ids.add(id(r))
            for mod, n in owners[pid]:
                whole.append((mod, n, mod._parameters[n]))
                mod._parameters[n] = r
        for mod in model.modules():            # the shared matrices are swapped out by now: the rest
            if any(p is not None and id(p) in owners for p in mod._parameters.values()):
                handles += [mod.register_forward_pre_hook(swap_in), mod.register_forward_hook(swap_back)]
        yield missed
    finally:
        for h in handles:
            h.remove()
        for _, own, mod in active.values():    # a forward that raised: its modules get their own back
            mod._parameters.update(own)
        active.clear()
        for mod, n, p in whole:
            mod._parameters[n] = p
        covered = shared | seen
        missed.update(n for n, p in model.named_parameters() if id(p) in owners and id(p) not in covered)


def verify_sync(engine, model: torch.nn.Module, canary: Canary, tol: Optional[float] = None,
                report: Optional[SyncReport] = None) -> SyncReport:
    """Compare `engine.score_logprobs` with `trainer_logprobs` on `canary`.

    tol: None = `default_tolerance(engine.dtype)`.
    Returns the filled SyncReport. Raises WeightSyncError (naming the engine class, the mean and
    worst row differences, both mean log-probs of the worst row and the tolerance) if
    mean_i |Δ mean_i| > tol or the engine returns the wrong number of log-probs."""
    return check_engine(engine, trainer_logprobs(model, canary, getattr(engine, "dtype", None)), canary, tol, report)


def check_engine(engine, ref: list[list[float]], canary: Canary, tol: Optional[float] = None,
                 report: Optional[SyncReport] = None) -> SyncReport:
    """`verify_sync` when the trainer's canary log-probs `ref` (`trainer_logprobs`) were computed
    elsewhere, e.g. in the actor's worker process while the engine lives in a rollout worker.
    Same report and the same WeightSyncError."""
    tol = _tol(tol, engine)
    rep = report or SyncReport(engine=type(engine).__name__)
    rep.tol = tol
    t0 = time.perf_counter()
    got = engine.score_logprobs([list(p) for p in canary.prompts], [list(r) for r in canary.responses])
    rep.verify_s = time.perf_counter() - t0
    if len(got) != len(canary.responses):
        raise WeightSyncError(f"{rep.engine}: weight-sync check returned log-probs for {len(got)} canary rows "
                              f"of {len(canary.responses)}")
    worst, worst_i, tok, diffs = -1.0, 0, 0.0, []
    for i, (a, b, r) in enumerate(zip(got, ref, canary.responses)):
        if len(a) != len(r):
            raise WeightSyncError(f"{rep.engine}: weight-sync check returned {len(a)} log-probs for canary row {i} "
                                  f"of {len(r)} tokens")
        ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        d = abs(float(ta.mean() - tb.mean()))
        diffs.append(d)
        tok = max(tok, float((ta - tb).abs().max()))
        if not d <= worst:  # also catches NaN
            worst, worst_i = d, i
    mean = sum(diffs) / len(diffs)
    rep.mean_diff, rep.max_mean_diff, rep.max_token_diff = mean, worst, tok
    if not mean <= tol:   # also catches NaN
        mean_e = sum(got[worst_i]) / len(got[worst_i])
        mean_t = sum(ref[worst_i]) / len(ref[worst_i])
        raise WeightSyncError(
            f"{rep.engine}: weights out of sync with the trainer after a push: the mean per-token log-probs "
            f"of the {len(diffs)} canary rows differ by {mean:.4f} on average > rollout.sync_tolerance {tol:g} "
            f"(worst row {worst_i}: {mean_e:.4f} engine vs {mean_t:.4f} trainer; max per-token |diff| {tok:.4f}). "
            f"A tensor was dropped, misnamed or not refreshed in the engine; or raise the tolerance if the "
            f"engine's precision is lower than expected.")
    rep.verified = True
    return rep


def push_weights(engine, model: torch.nn.Module, canary: Optional[Canary] = None, tol: Optional[float] = None,
                 verify: bool = True) -> SyncReport:
    """Push the trainer's weights into `engine` (`load_weights(policy_weights(model))`) and, if
    `verify` and a canary is given, check them with `verify_sync`.

    Returns a SyncReport (push and verify seconds, differences). Raises WeightSyncError on a
    failed check; KeyError/ValueError from the engine on unknown names or bad shapes."""
    tol = _tol(tol, engine)
    rep = SyncReport(engine=type(engine).__name__, tol=tol)
    t0 = time.perf_counter()
    engine.load_weights(policy_weights(model))
    rep.push_s = time.perf_counter() - t0
    if verify and canary is not None:
        verify_sync(engine, model, canary, tol, report=rep)
    return rep


def start_sync_check(engine, model: torch.nn.Module, prompts: Sequence[Sequence[int]], verify: bool,
                     tol: Optional[float] = None, n: Optional[int] = None, response_tokens: int = 16) -> Optional[Canary]:
    """A trainer's start-up step: if `verify`, build the canary from the first `n` prompts and
    check the freshly built engine against the trainer (WeightSyncError if it was built wrong);
    returns the canary to pass to every later `push_weights`, or None when not verifying."""
    if not verify:
        return None
    canary = make_canary(engine, prompts, n=n, response_tokens=response_tokens)
    tol = _tol(tol, engine)
    rep = verify_sync(engine, model, canary, tol)
    logger.info(f"[sync] {rep.engine} matches the trainer on {len(canary.prompts)} canary rows: mean |Δ mean "
                f"log-prob| {rep.mean_diff:.4f} <= {tol:g} (worst row {rep.max_mean_diff:.4f})")
    return canary
