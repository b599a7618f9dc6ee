"""Running reward statistics for score normalisation (TRL legacy `use_score_scaling`, OpenRLHF
`normalize_reward`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["RunningMoments"]


@dataclass
class RunningMoments:
    """Streaming mean/variance (Chan et al. parallel update) over all scores seen so far."""

    mean: float = 0.0
    var: float = 1.0
    count: int = 0

    def update(self, x_B: torch.Tensor) -> None:
        x = x_B.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        bmean, bvar = float(x.mean()), float(x.var(unbiased=False)) if n > 1 else 0.0
        tot = self.count + n
        delta = bmean - self.mean
        m2 = self.var * self.count + bvar * n + delta * delta * self.count * n / tot
        self.mean += delta * n / tot
        self.var = m2 / tot
        self.count = tot

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 1e-12))

    def normalize(self, x_B: torch.Tensor) -> torch.Tensor:
        return (x_B - self.mean) / self.std
