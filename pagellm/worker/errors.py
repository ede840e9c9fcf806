"""The errors an executor raises when its ranks fail: the engine is then dead as a whole.

Kept apart from the executors so the engine above can tell a lost rank, node or Ray actor from
other failures (and name it to clients) without importing any executor.
"""

from __future__ import annotations


class RankError(RuntimeError):
    """A rank failed or died."""


class DeadRankError(RankError):
    """A rank, a node or a Ray actor of the engine is gone: its process ended, or it stopped
    answering its heartbeat. ``who`` names it in words fit for a client ("rank 1", "node 1",
    "the Ray actor of rank 1"); ``detail`` says how it was found gone, for the log."""

    def __init__(self, who: str, detail: str) -> None:
        super().__init__(who, detail)  # the args rebuild it when it crosses to the server's process
        self.who = who
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.who} is gone: {self.detail}"


def dead_rank_in(error: BaseException | None) -> DeadRankError | None:
    """The ``DeadRankError`` that ``error`` is, or was raised from (its cause or context), if any."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, DeadRankError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
