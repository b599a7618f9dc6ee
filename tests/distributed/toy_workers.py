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

    def peer_dies(self) -> None:
        """Rank 1 dies a moment after rank 0 fails as a collective's peer would ("connection reset")."""
        if self.rank == 1:
            time.sleep(0.5)
            os._exit(1)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
