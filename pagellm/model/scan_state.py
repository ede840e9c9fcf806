"""What a scan layer (Mamba-2, gated delta-net: ``model/mamba2.py``, ``model/delta_net.py``)
keeps from step to step, and how a step's requests split for its scan: the decode tokens (one
token a request) advance their states in one batched update, each longer span (a prompt or a
chunk of one) runs its own chunked scan; a request starting at position 0 starts from zeros."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata


@dataclass
class ScanState:
    """What one scan layer (Mamba-2, gated delta-net) keeps between steps, a row a state slot:
    each sequence's latest convolution inputs (``conv``: [slots, conv_kernel - 1, conv_dim], the
    model dtype) and its matrix state (``ssm``: [slots, heads, ..., ...], float32)."""

    conv: torch.Tensor
    ssm: torch.Tensor

    def slot_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor with a row a state slot (what a sample born from its parent copies)."""
        return self.conv, self.ssm


@dataclass(frozen=True)
class ScanPlan:
    """One step's requests, split by how their scan runs (the same for every scan layer)."""

    fresh: torch.Tensor  # [R] bool: the request starts at position 0 (its state from zeros)
    decode: torch.Tensor  # [D] the requests with one token this step
    decode_tokens: torch.Tensor  # [D] their tokens' rows
    spans: tuple[tuple[int, int, int], ...]  # (request, first token row, end row) of the others


def scan_plan(metadata: AttentionMetadata, device: torch.device) -> ScanPlan:
    """The step's :class:`ScanPlan` (cached in ``metadata.derived``)."""
    plan = metadata.derived.get("scan")
    if plan is None:
        query_lens = np.asarray(metadata.query_lens, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(query_lens)))
        fresh = np.asarray(metadata.seq_lens, dtype=np.int64) == query_lens
        one = np.flatnonzero(query_lens == 1)
        spans = tuple((int(r), int(starts[r]), int(starts[r + 1])) for r in np.flatnonzero(query_lens > 1))
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        plan = metadata.derived["scan"] = ScanPlan(as_tensor(fresh), as_tensor(one), as_tensor(starts[one]), spans)
    return plan  # type: ignore[return-value]
