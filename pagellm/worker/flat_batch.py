"""One forward's inputs: spans of the input batch's rows flattened into one token batch.

Each span is a row's positions ``start .. start + length - 1``; the token ids are read from the
row (prompt, output, then any drafts written past its tokens), the KV slots from its block table.
The target's step and the draft sources' forwards (``worker/drafter.py``) build theirs here.
Array work is numpy (a few microseconds an op, where torch's small ops cost ~10 on these CPUs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.worker.device import to_device
from pagellm.worker.input_batch import InputBatch


@dataclass
class FlatLayout:
    """Where each span's tokens sit in the flat batch."""

    rows: np.ndarray  # [n] input-batch rows
    starts: np.ndarray  # [n] first position of each span
    query_lens: np.ndarray  # [n] tokens of each span
    query_start: np.ndarray  # [n + 1] offsets of the spans in the flat batch
    req_index: np.ndarray  # [T] the span of each flat token
    positions: np.ndarray  # [T] each flat token's position in its sequence

    @classmethod
    def of(cls, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray) -> FlatLayout:
        num_tokens = int(query_lens.sum())
        query_start = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        req_index = np.repeat(np.arange(len(rows)), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) + (starts - query_start[:-1])[req_index]
        return cls(rows, starts, query_lens, query_start, req_index, positions)

    @property
    def last_indices(self) -> np.ndarray:
        """The flat index of each span's last token."""
        return self.query_start[1:] - 1


@dataclass
class FlatInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    extra: list[torch.Tensor]  # the caller's int64 arrays, moved with the rest


def flat_inputs(
    batch: InputBatch, layout: FlatLayout, block_size: int, device: torch.device, extra: Sequence[np.ndarray] = (),
    token_offset: int = 0,
) -> FlatInputs:
    """The tensors of one forward over ``layout``'s spans (on CUDA one pinned buffer and one
    asynchronous copy, on CPU the same tensors); ``token_offset``: each position's input is the
    token that many places on (the multi-token-prediction layer's: the next one)."""
    rows, positions = layout.rows, layout.positions
    ids = batch.token_ids[rows[layout.req_index], positions + token_offset].astype(np.int64)
    num_blocks = batch.num_blocks[rows]
    tables = batch.block_table[rows, : int(num_blocks.max())]  # a copy (fancy indexing)
    tables[np.arange(tables.shape[1]) >= num_blocks[:, None]] = 0  # past each table's end
    slots = tables[layout.req_index, positions // block_size] * block_size + positions % block_size
    seq_lens = layout.starts + layout.query_lens
    arrays = [ids, positions, slots, tables, layout.query_start, seq_lens, *extra]
    tensors = to_device([torch.from_numpy(np.ascontiguousarray(a)) for a in arrays], device)
    input_ids, positions_t, slot_mapping, block_tables, query_start_loc, seq_lens_t = tensors[:6]
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        query_lens=layout.query_lens.tolist(),
        seq_lens=seq_lens.tolist(),
        query_start_loc=query_start_loc,
        seq_lens_tensor=seq_lens_t,
        block_size=block_size,
        state_slots=batch.state_slot[rows].tolist() if batch.uses_states else None,
    )
    return FlatInputs(input_ids, positions_t, metadata, tensors[6:])
