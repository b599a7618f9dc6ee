"""The rollout-engine interface: every engine (HF generate, the embedded fast engine, vLLM) sits
behind these few methods, so trainers never know which one runs.

Token-level contract (follows vLLM's `SamplingParams` semantics):
- prompts are lists of token ids (already chat-templated, no padding);
- `response_ids[i]` holds the sampled tokens of request i, *including* the stop token when one
  was sampled (vLLM keeps the EOS id in `output.token_ids`); `finished[i]` tells whether a stop
  token ended it (False = cut at `max_new_tokens`);
- with `n > 1` the outputs of one prompt are consecutive: request i*n + j is sample j of prompt i;
- `temperature == 0` is greedy; `top_k <= 0` and `top_p == 1` are off; stop tokens are
  suppressed until `min_new_tokens` tokens exist; `seed` makes a call reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol, Sequence, runtime_checkable

__all__ = ["SamplingParams", "RolloutOutput", "RolloutEngine"]


LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings (vLLM names and meaning).

    `logprobs_mode` (vLLM's ``LLM(logprobs_mode=...)``, here per call) says which log-probs
    `return_logprobs` returns for the sampled tokens: ``processed_logprobs`` under the distribution
    actually sampled from (temperature-scaled, top-k/top-p filtered, stop tokens suppressed before
    ``min_new_tokens``); ``raw_logprobs`` under the model's own temperature-1 distribution, before
    any of that, which is what a trainer's forward computes at temperature 1 (PPO's old log-probs,
    a KL to a reference)."""

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: Optional[int] = None
    return_logprobs: bool = False
    logprobs_mode: str = "processed_logprobs"

    def __post_init__(self):
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if not self.temperature >= 0:                   # NaN too: the fast engine sampled garbage
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


@dataclass
class RolloutOutput:
    """Result of `RolloutEngine.generate` for B·n requests (samples of a prompt consecutive).

    response_ids: per request, generated token ids (stop token included when sampled).
    finished:     per request, True if a stop token ended the response.
    logprobs:     per request, log-probability of each sampled token, if requested (else None):
                  under the engine's sampling distribution (temperature-scaled, filtered) or, with
                  ``logprobs_mode="raw_logprobs"``, under the temperature-1 distribution.
    tool_mask:    per request and token, True where a rollout tool (`turborlhf.rollout.tools`)
                  wrote the token rather than the model sampling it; None when no tool ran.
    """

    response_ids: list[list[int]]
    finished: list[bool]
    logprobs: Optional[list[list[float]]] = None
    timings: dict = field(default_factory=dict)
    tool_mask: Optional[list[list[bool]]] = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What a trainer needs from a generation engine."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        """Sample responses for token-id prompts. Raises ValueError on empty prompts.
        FastEngine and HFEngine also take ``tool=`` (`turborlhf.rollout.tools`), whose tokens
        they flag in `RolloutOutput.tool_mask`; vLLMEngine does not."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, "object"]]) -> None:
        """Replace the engine's weights in place from (HF parameter name, tensor) pairs,
        without touching disk (weight sync after each policy update)."""
        ...

    def score_logprobs(self, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probs (temperature 1) of given response tokens: used to verify a weight sync
        against the trainer on a fixed canary batch."""
        ...
