"""Pipeline parallelism: the decoder layers cut into consecutive stages, one per group of
ranks, with each micro-batch's hidden states sent from one stage to the next.

Stage 0 holds the embedding, the last stage the final norm and the LM head (and samples); each
stage holds only its layers' weights and its layers' KV cache (the same block ids on every
stage, so the block manager does not change). What crosses a stage boundary is the residual
stream ``[tokens, hidden]`` (the layer output plus its residual, summed: what the next layer's
input norm would add first), one tensor per micro-batch, through ``torch.distributed``'s
point-to-point send and receive (gloo).

The stages overlap in one of two ways. On one node the engine keeps a step in flight per stage
(``LLMEngine._pipelined_step``): while the last stage finishes step n, stage 0 runs step n + 1.
Across nodes and on Ray a step runs at a time, cut into micro-batches of whole requests in the
scheduler's order: while stage 1 runs micro-batch 1, stage 0 runs micro-batch 2 (``m``
micro-batches over ``s`` stages take ``m + s - 1`` slots instead of ``m * s``, with a bubble at
each step's ends). Either way every stage runs its work in submission order, so a block written
by an earlier step or micro-batch (a prefix-cache hit on a block computed in flight, a freed
block handed on) is written before it is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagellm.step import ScheduledSequence


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage: layers ``start`` to ``end - 1`` of the model's ``num_layers``."""

    index: int
    size: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        """Holds the embedding: its input is token ids."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm and the LM head: its output is sampled."""
        return self.index == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def holds_layer(self, layer: int) -> bool:
        return self.start <= layer < self.end


def stage_layers(num_layers: int, size: int) -> list[tuple[int, int]]:
    """Each stage's ``(start, end)``: an even split, the first stages taking one more layer
    where it does not divide (the last stage also runs the LM head)."""
    if not 1 <= size <= num_layers:
        raise ValueError(f"pipeline_parallel_size={size} must be between 1 and the model's {num_layers} layers")
    base, extra = divmod(num_layers, size)
    bounds, start = [], 0
    for index in range(size):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def pipeline_stage(index: int, size: int, num_layers: int) -> PipelineStage:
    """Stage ``index`` of ``size`` over a model of ``num_layers`` layers."""
    start, end = stage_layers(num_layers, size)[index]
    return PipelineStage(index, size, start, end)


def micro_batches(scheduled: list[ScheduledSequence], count: int) -> list[list[ScheduledSequence]]:
    """The step's requests cut into at most ``count`` consecutive groups of about equal token
    counts (order kept: see the module docstring); every group has at least one request."""
    if count <= 1 or len(scheduled) <= 1:
        return [scheduled]
    total = sum(r.num_tokens for r in scheduled)
    groups: list[list[ScheduledSequence]] = [[]]
    done = 0
    for i, request in enumerate(scheduled):
        # Start a new group once this one reached its share, while requests remain for the rest.
        target = total * len(groups) / count
        left = len(scheduled) - i
        if groups[-1] and len(groups) < count and (done >= target or left <= count - len(groups)):
            groups.append([])
        groups[-1].append(request)
        done += request.num_tokens
    return groups


class PipelineLink:
    """This rank's sends to the next stage and receives from the previous one (the ranks of
    the same tensor-parallel index in the neighbouring stages), one tensor per micro-batch."""

    def __init__(self, stage: PipelineStage, prev_rank: int | None, next_rank: int | None,
                 hidden_size: int, dtype: torch.dtype) -> None:  # fmt: skip
        self.stage = stage
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.hidden_size, self.dtype = hidden_size, dtype
        self._pending: list[tuple[Any, torch.Tensor]] = []  # sends in flight and their tensors

    def recv(self, num_tokens: int, tag: int) -> torch.Tensor:
        """The previous stage's residual stream for a micro-batch of ``num_tokens`` tokens."""
        assert self.prev_rank is not None, "the first stage receives token ids, not hidden states"
        tensor = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype)
        dist.recv(tensor, src=self.prev_rank, tag=tag)
        return tensor

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        """Start sending a micro-batch's residual stream on (finished by :meth:`flush`)."""
        assert self.next_rank is not None, "the last stage samples; it sends nothing on"
        tensor = tensor.to(self.dtype).contiguous()
        self._pending.append((dist.isend(tensor, dst=self.next_rank, tag=tag), tensor))

    def flush(self) -> None:
        """Wait for this step's sends (their tensors may then be freed)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()
