"""Several reward sources behind one call: ``score_i = Σ_k w_k · s_k(prompt_i, response_i)``.

Sources (config ``rewards: [{kind, path, weight, ...}]``, plus the legacy ``reward_model``
directory as a ``model`` source named ``rm`` with weight 1):

- ``model``: a reward-model directory loaded in-process; it scores the token ids the policy
  produced (prompt + response, head at the last response token), exactly as PPO always has. A
  reward model whose vocabulary differs from the policy's scores the decoded texts instead, its
  EOS appended to the responses that ended with a stop token (one cut at `max_new_tokens` is
  scored as cut, as with the ids).
- ``function``: ``path/to/module.py:function``, ``package.module:function`` or a built-in
  verifier's name (`turborlhf.rewards.functions`, `turborlhf.rewards.verifiers`), called with
  texts and, by name, the prompts file's other columns (``answer``, ...) as TRL does.
- ``remote``: the URL of a ``turborlhf serve-rm`` server (`turborlhf.rewards.remote`).
- ``callable``: an in-process Python callable passed to the Python API (``reward_funcs=``,
  `turborlhf.rewards.callables`); ``path`` is the key it was given under.

The weighted sum is the only combination (TRL GRPO's ``reward_weights``, OpenRLHF's sum of
remote rewards); per-source scores are returned too so trainers can log each one. Texts are
decoded once per batch and only when a source needs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

__all__ = ["RewardInputs", "CombinedReward", "combine_scores", "build_reward", "rows_to_columns"]


@dataclass
class RewardInputs:
    """One batch to score. ``B`` rows; ``ids_BT``/``attn_BT`` are ``[prompt | response]`` rows as the
    policy saw them (any padding), ``prompt_ids``/``response_ids`` the unpadded parts; ``columns``
    the prompts file's other fields, ``{name: B values}`` (see `rows_to_columns`)."""

    ids_BT: torch.Tensor
    attn_BT: torch.Tensor
    prompt_ids: Sequence[Sequence[int]]
    response_ids: Sequence[Sequence[int]]
    tokenizer: object
    columns: Optional[dict[str, list]] = None
    _texts: Optional[tuple[list[str], list[str]]] = field(default=None, repr=False)

    def texts(self) -> tuple[list[str], list[str]]:
        """``(prompts, responses)``: rendered prompt texts (special tokens kept) and responses
        without special tokens (no EOS); decoded on first use."""
        if self._texts is None:
            tok = self.tokenizer
            self._texts = ([tok.decode(p) for p in self.prompt_ids],
                           [tok.decode(r, skip_special_tokens=True) for r in self.response_ids])
        return self._texts


def rows_to_columns(rows: Optional[Sequence[Optional[dict]]]) -> Optional[dict[str, list]]:
    """Per-row column dicts → ``{name: [value per row]}`` over the union of the rows' keys (None
    where a row lacks one); None for no rows or no columns at all."""
    if not rows:
        return None
    names = list(dict.fromkeys(k for r in rows for k in (r or {})))
    return {k: [(r or {}).get(k) for r in rows] for k in names} or None


class _ModelSource:
    def __init__(self, path: str, tokenizer, dtype: str, chunk: int, device: str | torch.device = "cpu",
                 compute_device: str | torch.device | None = None) -> None:
        from turborlhf.models.attention import attention_for_compute_device
        from turborlhf.models.load import load_tokenizer
        from turborlhf.rewards.model import load_reward_model

        rm_tok = load_tokenizer(path)
        self.same_vocab = rm_tok.get_vocab() == tokenizer.get_vocab()
        self.tok = tokenizer if self.same_vocab else rm_tok
        if not self.same_vocab:
            from turborlhf.data.chat import stop_ids
            from turborlhf.rewards.model import warn_if_other_format
            warn_if_other_format(rm_tok, tokenizer, path)
            self.stops = set(stop_ids(tokenizer))      # a response ending otherwise was cut at max_new_tokens
        from turborlhf.engine.hardware import compute_dtype

        dtype = compute_dtype(dtype, torch.device(compute_device or device).type)
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        self.model = load_reward_model(path, self.tok, dtype=torch_dtype, device=device).eval().requires_grad_(False)
        attention_for_compute_device(self.model, compute_device or device)
        self.dtype, self.chunk = dtype, chunk

    @torch.no_grad()
    def __call__(self, inp: RewardInputs) -> torch.Tensor:
        from turborlhf.engine.train import autocast
        from turborlhf.models.forward import last_token_scores
        from turborlhf.rewards.model import score_texts

        if not self.same_vocab:         # the texts re-tokenised, up to the reward model's whole context
            ctx = int(getattr(self.model.config, "max_position_embeddings", None) or 1024)
            finished = [bool(r) and int(r[-1]) in self.stops for r in inp.response_ids]   # a cut one scored as cut
            return score_texts(self.model, self.tok, *inp.texts(), max_len=ctx, dtype=self.dtype,
                               batch_size=self.chunk, add_eos=finished)
        B = inp.ids_BT.shape[0]
        with autocast(self.dtype, self.model):
            return torch.cat([last_token_scores(self.model, inp.ids_BT[s:s + self.chunk], inp.attn_BT[s:s + self.chunk])
                              for s in range(0, B, self.chunk)]).float()


class _FunctionSource:
    may_skip_rows = True          # None (NaN) for a response the function does not score

    def __init__(self, spec: str) -> None:
        from turborlhf.rewards.functions import load_reward_function

        self.spec, self.fn = spec, load_reward_function(spec)

    def __call__(self, inp: RewardInputs) -> torch.Tensor:
        from turborlhf.rewards.functions import call_reward_function

        return torch.tensor(call_reward_function(self.fn, *inp.texts(), name=f"reward function {self.spec!r}",
                                                 columns=inp.columns, allow_none=True,
                                                 completion_ids=getattr(inp, "response_ids", None)))


class _RemoteSource:
    def __init__(self, url: str, timeout_s: float, retries: int) -> None:
        from turborlhf.rewards.remote import RemoteRewardModel

        self.client = RemoteRewardModel(url, timeout_s=timeout_s, retries=retries)

    def __call__(self, inp: RewardInputs) -> torch.Tensor:
        return torch.tensor(self.client.score(*inp.texts()))


def combine_scores(per_source_B: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """``Σ_k weights[k] · per_source_B[k]`` in fp32, shape (B,). A NaN score (a reward function's
    ``None``: it does not score that row) is left out of its row's sum, as TRL's ``nansum``. A row
    that no source scores has no reward: an error, neither a NaN nor the 0 that TRL's ``nansum``
    gives it with a warning (a silent 0 would train the policy towards or away from that row).

    Raises:
        ValueError: no sources, a source without a weight, or sources of different lengths.
        RewardFunctionError: (a `turborlhf.errors.UserError` and ValueError) a row that no source
            scores (every score NaN); the message names the rows and the sources.
    """
    if not per_source_B:
        raise ValueError("combine_scores: no reward sources")
    shapes = {tuple(s.shape) for s in per_source_B.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"combine_scores: every source must give one score per row, got shapes {shapes}")
    missing = set(per_source_B) - set(weights)
    if missing:
        raise ValueError(f"combine_scores: no weight for {sorted(missing)}")
    scored = torch.stack([~s.isnan() for s in per_source_B.values()]).any(0)
    if not bool(scored.all()):
        from turborlhf.rewards.functions import RewardFunctionError

        rows = torch.nonzero(~scored).flatten().tolist()
        raise RewardFunctionError(
            f"no reward source scored row(s) {rows[:8]}{' ...' if len(rows) > 8 else ''} of {len(scored)} "
            f"({', '.join(repr(k) for k in per_source_B)} returned None there): each response needs a score "
            "from at least one source; add a source that scores those prompts or return a number for them")
    return sum(float(weights[k]) * s.float().nan_to_num(nan=0.0) for k, s in per_source_B.items())


class CombinedReward:
    """Callable ``(RewardInputs) -> (score_B, {name: source score_B})`` with ``score = Σ w·s``
    (`combine_scores`). A source's scores are NaN where it returned None (functions and callables
    only); the combined score is never NaN."""

    def __init__(self, sources: list[tuple[str, float, object]]) -> None:
        names = [n for n, _, _ in sources]
        if not sources:
            raise ValueError("no reward sources")
        if len(set(names)) != len(names):
            raise ValueError(f"reward source names must be unique, got {names}")
        self.sources = sources
        self.weights = {n: w for n, w, _ in sources}

    def __call__(self, inp: RewardInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # on the CPU: reward models score where they run (a GPU), functions and servers on the CPU
        per = {name: fn(inp).float().cpu() for name, _, fn in self.sources}
        for name, _, fn in self.sources:     # only a function's None (NaN) means "not scored"
            if not getattr(fn, "may_skip_rows", False) and bool(per[name].isnan().any()):
                raise ValueError(f"reward source {name!r} returned NaN scores")
        return combine_scores(per, self.weights), per


def build_reward(sources: Sequence, reward_model: Optional[str], tokenizer, dtype: str = "auto",
                 chunk: int = 8, callables=None, device: str | torch.device = "cpu",
                 compute_device: str | torch.device | None = None) -> CombinedReward:
    """Load every source.

    Args:
        sources: ``RewardSourceCfg``-like objects (``kind``, ``path``, ``weight``, ``name``,
            ``timeout_s``, ``retries``).
        reward_model: optional RM directory, added first as source ``rm`` with weight 1.
        tokenizer: the policy's tokenizer (decodes texts; decides whether an RM can read ids).
        dtype: compute precision of in-process reward models (``auto``, ``bf16`` or ``fp32``; ``auto``:
            this host's choice for `device`, `turborlhf.engine.hardware`).
        chunk: rows per reward-model forward pass.
        callables: the ``kind: callable`` sources' functions
            (`turborlhf.rewards.callables.RewardCallables`), keyed by their ``path``.
        device: where in-process reward models are loaded (and compute, unless `compute_device`).
        compute_device: where they compute when it differs from `device` (reward models kept on the
            CPU between uses, ``distributed.ref_reward_offload``); their precision is chosen for it.

    Raises:
        ValueError: no source, duplicate names, unknown kind; `RewardFunctionError` for a bad
            function spec (loaded eagerly so a typo fails before any training).
    """
    loaded: list[tuple[str, float, object]] = []
    if reward_model:
        loaded.append(("rm", 1.0, _ModelSource(reward_model, tokenizer, dtype, chunk, device, compute_device)))
    for i, s in enumerate(sources):
        name = s.name or f"{s.kind}{i}"
        if s.kind == "model":
            fn: object = _ModelSource(s.path, tokenizer, dtype, chunk, device, compute_device)
        elif s.kind == "function":
            fn = _FunctionSource(s.path)
        elif s.kind == "remote":
            fn = _RemoteSource(s.path, s.timeout_s, s.retries)
        elif s.kind == "callable":
            from turborlhf.rewards.callables import RewardCallables

            fn = (callables if callables is not None else RewardCallables()).source(s.path, name)
        else:
            raise ValueError(f"unknown reward source kind {s.kind!r}")
        loaded.append((name, float(s.weight), fn))
    return CombinedReward(loaded)
