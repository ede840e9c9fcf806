"""What a scan layer (Mamba-2, gated delta-net: ``model/mamba2.py``, ``model/delta_net.py``)
keeps from step to step, and how a step's requests split for its scan: the decode tokens (one
token a request) advance their states in one batched update, each longer span (a prompt or a
chunk of one) runs its own chunked scan; a request starting at position 0 starts from zeros.

A short span that continues a state (a sequence verifying speculative drafts, or computing again
the tokens it accepted) runs token by token through the decode update instead, as plain decoding
would have run those tokens: the chunked form sums in another order, and speculative decoding's
output must be plain decoding's bit for bit (``stepwise_split``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.speculative_config import MAX_VERIFY_TOKENS

# The longest span run token by token (a speculating sequence's).
STEPWISE_MAX_TOKENS = MAX_VERIFY_TOKENS


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
class Span:
    """A request with more than one token this step: its state slot, its tokens' rows."""

    slot: int
    start: int
    end: int
    fresh: bool  # it starts at position 0 (its state from zeros)


@dataclass(frozen=True)
class ScanPlan:
    """One step's requests, split by how their scan runs (the same for every scan layer)."""

    decode_slots: torch.Tensor  # [D] the state slots of the requests with one token this step
    decode_tokens: torch.Tensor | None  # [D] their tokens' rows; None where they are every token, in order
    decode_index: torch.Tensor  # [D] their tokens' rows, always (a kernel's indices)
    decode_fresh: torch.Tensor | None  # [D] which of them start at position 0; None where none does
    single_slot: int | None  # the slot of the step's one decode request (its state updated in place)
    spans: tuple[Span, ...]

    def decode_states(self, ssm: torch.Tensor) -> torch.Tensor:
        """The decode requests' states [D, ...] (zeros where fresh): a view of the one request's
        row, updated in place; else a gathered copy (:meth:`store_decode_states` writes it back)."""
        if self.single_slot is not None:
            state = ssm[self.single_slot : self.single_slot + 1]
            return state.zero_() if self.decode_fresh is not None else state
        state = ssm[self.decode_slots]
        return state if self.decode_fresh is None else state.masked_fill_(self.decode_fresh[:, None, None, None], 0.0)

    def store_decode_states(self, ssm: torch.Tensor, state: torch.Tensor) -> None:
        if self.single_slot is None:
            ssm[self.decode_slots] = state

    def with_decode_rows(self, out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``out`` with the decode tokens' rows set to ``rows`` (``rows`` itself where they are every token)."""
        if self.decode_tokens is None:
            return rows
        out[self.decode_tokens] = rows
        return out

    def decode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s rows of the decode tokens (all of ``x`` where they are every token)."""
        return x if self.decode_tokens is None else x[self.decode_tokens]

    def span_state(self, ssm: torch.Tensor, span: Span) -> torch.Tensor:
        """The state a span starts from: its slot's row (a view), or zeros."""
        return torch.zeros_like(ssm[span.slot]) if span.fresh else ssm[span.slot]


def scan_plan(metadata: AttentionMetadata, device: torch.device) -> ScanPlan:
    """The step's :class:`ScanPlan` (cached in ``metadata.derived``)."""
    plan = metadata.derived.get("scan")
    if plan is None:
        plan = metadata.derived["scan"] = _build_plan(metadata, device)
    return plan  # type: ignore[return-value]


def _build_plan(metadata: AttentionMetadata, device: torch.device) -> ScanPlan:
    if metadata.state_slots is None:
        raise ValueError("a scan layer needs each request's state slot (AttentionMetadata.state_slots)")
    query_lens = np.asarray(metadata.query_lens, dtype=np.int64)
    slots = np.asarray(metadata.state_slots, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(query_lens)))
    fresh = np.asarray(metadata.seq_lens, dtype=np.int64) == query_lens
    one = np.flatnonzero(query_lens == 1)
    spans = tuple(Span(int(slots[r]), int(starts[r]), int(starts[r + 1]), bool(fresh[r]))
                  for r in np.flatnonzero(query_lens > 1))  # fmt: skip
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    every = len(one) == len(query_lens)  # (then the decode tokens are rows 0 .. D - 1, in order)
    return ScanPlan(
        decode_slots=as_tensor(slots[one]), decode_tokens=None if every else as_tensor(starts[one]),
        decode_index=as_tensor(starts[one]),
        decode_fresh=as_tensor(fresh[one]) if fresh[one].any() else None,
        single_slot=int(slots[one[0]]) if len(one) == 1 else None, spans=spans,
    )  # fmt: skip


def scan_step(
    proj: torch.Tensor, state: ScanState, metadata: AttentionMetadata, on_kernel: bool,
    kernel: Callable[[torch.Tensor, ScanState, ScanPlan], torch.Tensor],
    by_tensor_ops: Callable[[torch.Tensor, ScanState, AttentionMetadata, ScanPlan], torch.Tensor],
) -> torch.Tensor:
    """A scan layer's step from its input projection's rows ``proj`` to its output projection's
    input: the decode tokens on its kernel where it runs one (``kernel``: their rows, the others
    left for the spans) and the prompt chunks apart, by tensor ops on a metadata of their own;
    every token by ``by_tensor_ops`` where there is no kernel or no decode token. Short spans
    continuing a state go token by token (:func:`stepwise_split`)."""
    split = stepwise_split(metadata, proj.device)
    if split:
        out: torch.Tensor | None = None
        for part in split:  # (in order: each token step reads the state the one before left)
            rows = scan_step(proj[part.rows], state, part.metadata, on_kernel, kernel, by_tensor_ops)
            out = rows.new_empty(proj.shape[0], rows.shape[1]) if out is None else out
            out[part.rows] = rows
        assert out is not None
        return out
    plan = scan_plan(metadata, proj.device)
    if not on_kernel or not len(plan.decode_slots):
        return by_tensor_ops(proj, state, metadata, plan)
    out = kernel(proj, state, plan)
    if plan.spans:
        part = span_part(metadata, proj.device)
        out[part.rows] = by_tensor_ops(proj[part.rows], state, part.metadata, scan_plan(part.metadata, proj.device))
    return out


def stepwise_split(metadata: AttentionMetadata, device: torch.device) -> tuple[SpanPart, ...]:
    """Where the step has spans of at most ``STEPWISE_MAX_TOKENS`` tokens continuing a state: the
    step as token steps (step j: the j-th token of each such span; the first also every decode
    token), then the other spans as one part; empty where it has none. Cached in
    ``metadata.derived``."""
    split = metadata.derived.get("scan_stepwise")
    if split is None:
        split = metadata.derived["scan_stepwise"] = _stepwise_split(metadata, device)
    return split  # type: ignore[return-value]


def _stepwise_split(metadata: AttentionMetadata, device: torch.device) -> tuple[SpanPart, ...]:
    lens = np.asarray(metadata.query_lens, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lens)))
    continuing = np.asarray(metadata.seq_lens, dtype=np.int64) > lens
    short = np.flatnonzero((lens > 1) & (lens <= STEPWISE_MAX_TOKENS) & continuing)
    if not len(short):
        return ()
    ones = np.flatnonzero(lens == 1)
    parts = []
    for j in range(int(lens[short].max())):
        requests = np.sort(np.concatenate((ones, short))) if j == 0 else short[lens[short] > j]
        steps = np.where(lens[requests] > 1, j, 0)  # (each request's token j; a decode token's only one)
        seq_lens = np.asarray(metadata.seq_lens, dtype=np.int64)[requests] - lens[requests] + steps + 1
        parts.append(_part(metadata, requests, starts[requests] + steps, np.ones(len(requests), np.int64), seq_lens,
                           device))  # fmt: skip
    rest = np.flatnonzero((lens > 1) & ~np.isin(np.arange(len(lens)), short))
    if len(rest):
        rows = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in rest])
        parts.append(_part(metadata, rest, rows, lens[rest], np.asarray(metadata.seq_lens)[rest], device))
    return tuple(parts)


@dataclass(frozen=True)
class SpanPart:
    """Some of a step's tokens, apart from the others: a metadata of their own (their requests'
    tokens back to back, in order) and their rows in the step."""

    metadata: AttentionMetadata
    rows: torch.Tensor  # [S] int64


def _part(
    metadata: AttentionMetadata, requests: np.ndarray, rows: np.ndarray, query_lens: np.ndarray,
    seq_lens: np.ndarray, device: torch.device,
) -> SpanPart:
    """The part of the step holding ``rows`` of ``requests`` (``query_lens`` of each, ending at
    ``seq_lens``)."""
    assert metadata.state_slots is not None
    index, chosen = torch.from_numpy(np.asarray(rows, np.int64)).to(device), torch.from_numpy(requests).to(device)
    sub = AttentionMetadata(
        slot_mapping=metadata.slot_mapping[index], block_tables=metadata.block_tables[chosen],
        query_lens=query_lens.tolist(), seq_lens=[int(n) for n in seq_lens],
        query_start_loc=torch.from_numpy(np.concatenate(([0], np.cumsum(query_lens)))).to(device),
        seq_lens_tensor=torch.from_numpy(np.asarray(seq_lens, np.int64)).to(device), block_size=metadata.block_size,
        state_slots=[metadata.state_slots[r] for r in requests],
    )  # fmt: skip
    return SpanPart(sub, index)


def span_part(metadata: AttentionMetadata, device: torch.device) -> SpanPart:
    """The step's requests with more than one token, apart from its decode tokens (which a kernel
    runs). Cached in ``metadata.derived``."""
    part = metadata.derived.get("scan_spans")
    if part is None:
        query_lens = np.asarray(metadata.query_lens, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(query_lens)))
        keep = np.flatnonzero(query_lens > 1)
        rows = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in keep] or [np.zeros(0, np.int64)])
        seq_lens = np.asarray(metadata.seq_lens, dtype=np.int64)[keep]
        part = metadata.derived["scan_spans"] = _part(metadata, keep, rows, query_lens[keep], seq_lens, device)
    return part  # type: ignore[return-value]
