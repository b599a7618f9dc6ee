"""Role objects for the group tests (importable by Ray workers)."""
from __future__ import annotations

import os
import time


class Toy:
    """Rank-dependent behaviour: `delays[rank]` seconds per item, `hang_rank` never answers."""

    def __init__(self, rank_env: str = "TOY_RANK", delays=(0.0, 0.0), hang_rank: int = -1) -> None:
        self.rank = int(os.environ.get(rank_env, "0"))
        self.delays, self.hang_rank = delays, hang_rank

    def set_rank(self, rank: int) -> None:
        self.rank = rank

    def work(self, x: int) -> tuple[int, int]:
        if self.rank == self.hang_rank:
            time.sleep(3600)
        time.sleep(self.delays[self.rank])
        return x * x, self.rank

    def fail(self) -> None:
        raise TimeoutError("reward model at http://127.0.0.1:9 did not answer after 3 tries: timed out after 1 s")

    def die(self) -> None:
        os._exit(1)

    def pid(self) -> int:
        return os.getpid()
