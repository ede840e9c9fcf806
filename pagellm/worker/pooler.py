"""Embedding requests in the worker: which sequences pool instead of sampling, and what each has
pooled so far while its prompt is computed in chunks (``pooling_params.Pooling``).

A vector is made of the final-normed hidden states the model returns for the prompt's tokens:
the last token's (LAST), the mean of all (MEAN) or the first token's (CLS), in float32, cut to
the asked ``dimensions`` and then L2-normalized where asked (the order matryoshka models need).
A chunk that starts at position 0 starts the sum afresh, so a preempted request recomputed from
its start pools the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.pooling_params import Pooling
from pagellm.step import SchedulerOutput


@dataclass(frozen=True)
class PoolChunk:
    """One embedding sequence's rows in a step's flat batch: positions ``start`` on, in rows
    ``first_row`` to ``end_row`` (exclusive); ``finishes``: its prompt's last chunk."""

    seq_id: str
    start: int
    first_row: int
    end_row: int
    finishes: bool


class Pooler:
    """The embedding sequences this worker holds (``apply`` keeps them in step with the batch)."""

    def __init__(self) -> None:
        self.pooling: dict[str, Pooling] = {}
        self._partial: dict[str, torch.Tensor] = {}  # MEAN: the sum so far; CLS: the first token's

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.pooling

    def __bool__(self) -> bool:
        return bool(self.pooling)

    def apply(self, step: SchedulerOutput) -> None:
        """New embedding sequences come, finished ones go."""
        for seq_id in step.finished_seq_ids:
            self.pooling.pop(seq_id, None)
            self._partial.pop(seq_id, None)
        for new in step.new_sequences:
            if new.pooling is not None:
                self.pooling[new.seq_id] = new.pooling

    def pool(self, hidden: torch.Tensor, chunks: list[PoolChunk], failed: dict[str, str]) -> dict[str, list[float]]:
        """Take each chunk's hidden states; returns the vectors of the sequences whose prompt ends
        here (a sequence that cannot be pooled goes to ``failed``)."""
        finished: list[tuple[str, Pooling, torch.Tensor]] = []
        for chunk in chunks:
            pooling = self.pooling[chunk.seq_id]
            vector = self._take(chunk, pooling, hidden)
            if chunk.finishes:
                if vector is None:
                    failed[chunk.seq_id] = f"{pooling.pooling_type} pooling lacks the prompt's first positions"
                else:
                    finished.append((chunk.seq_id, pooling, vector))
        vectors = {}
        for seq_id, pooling, vector in finished:
            vector = _finish(vector, pooling)
            if not bool(torch.isfinite(vector).all()):
                failed[seq_id] = "the pooled vector is not finite (the model's hidden states overflowed)"
                continue
            vectors[seq_id] = vector.tolist()
        return vectors

    def _take(self, chunk: PoolChunk, pooling: Pooling, hidden: torch.Tensor) -> torch.Tensor | None:
        """Add a chunk to its sequence's partial result; the whole result on its last chunk."""
        seq_id, rows = chunk.seq_id, hidden[chunk.first_row : chunk.end_row]
        if pooling.pooling_type == "LAST":
            return rows[-1].float() if chunk.finishes else None
        if chunk.start == 0:
            self._partial.pop(seq_id, None)
        if pooling.pooling_type == "MEAN":
            total = rows.float().sum(dim=0)
            if chunk.start > 0:
                if seq_id not in self._partial:
                    return None
                total += self._partial[seq_id]
            self._partial[seq_id] = total
            return total / (chunk.start + len(rows)) if chunk.finishes else None
        if chunk.start == 0:  # CLS
            self._partial[seq_id] = rows[0].float()
        return self._partial.get(seq_id) if chunk.finishes else None


def _finish(vector: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """Cut to the asked dimensions, then normalize (float32, on the CPU for the output)."""
    if pooling.dimensions is not None:
        vector = vector[: pooling.dimensions]
    if pooling.normalize:
        vector = F.normalize(vector, dim=-1)
    return vector.cpu()
