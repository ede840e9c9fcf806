"""The worker's persistent batch: every sequence the scheduler has sent and not yet finished,
one row each, kept between steps so that a step message carries only what changed (``step.py``).

A row holds the sequence's tokens (prompt, then output), its block table, its sampling
parameters and its seeded generator. Rows live in preallocated arrays that grow by doubling
(more rows, longer sequences, longer tables) and never shrink; a finished sequence's row is
filled by the last row (the batch stays dense, nothing is reallocated). A step reads its
inputs from the rows with array indexing: no per-token Python work.

A row also counts the positions whose KV the draft model holds (``num_draft_computed``, only
where one drafts: ``worker/draft_model_source.py``): never more than the target's computed positions a
step starts from, since a step recomputes from there (a preemption, rejected drafts).

A preempted sequence keeps its row (tokens and generator; its block table is sent again when
it resumes), so a seeded sample is the same whether or not it was preempted.
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.sampling_params import SamplingParams
from pagellm.step import NewSequence, ScheduledSequence, SchedulerOutput


class InputBatch:
    """The rows (see the module docstring); ``apply`` brings them up to date with a step."""

    def __init__(self, rows: int = 64, tokens: int = 1024, blocks: int = 64, block_size: int | None = None) -> None:
        self.block_size = block_size  # (a draft model's K/V is followed per block where known)
        self.row_of: dict[str, int] = {}  # sequence id -> row
        self.seq_ids: list[str] = []  # row -> sequence id
        self.token_ids = np.zeros((rows, tokens), dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)
        self.block_table = np.zeros((rows, blocks), dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.num_draft_computed = np.zeros(rows, dtype=np.int64)
        # A hybrid model's recurrent-state slot of each row (-1: none yet); ``uses_states`` once
        # any row has one, so that only a hybrid model's steps read them.
        self.state_slot = np.full(rows, -1, dtype=np.int64)
        self.uses_states = False
        # The LoRA adapter id each row runs with (0: the base model); ``uses_lora`` once any has one.
        self.lora_id = np.zeros(rows, dtype=np.int64)
        self.uses_lora = False
        self.params: list[SamplingParams] = []
        self.generators: list[torch.Generator | None] = []

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.row_of

    # ---- one step's changes ------------------------------------------------------------

    def apply(self, step: SchedulerOutput) -> None:
        """Forks copy their parents, finished rows go, new sequences come, scheduled ones take
        their new tokens and block-table entries, then their samples' rows are born (this order:
        a fork may copy a parent that finishes in the same message)."""
        for fork in step.forked_sequences:
            self._fork(fork.seq_id, fork.parent_id, fork.sampling_params)
        for seq_id in step.finished_seq_ids:
            self.remove(seq_id)
        for new in step.new_sequences:
            self.add(new)
        for item in step.scheduled:
            self._update(item)
        for item in step.scheduled:
            for sample_fork in item.forks:
                self._fork(sample_fork.seq_id, item.seq_id, sample_fork.sampling_params)

    def add(self, new: NewSequence) -> None:
        """A new row for a sequence the worker has not seen."""
        row = self._new_row(new.seq_id, new.sampling_params)
        self._set_tokens(row, 0, new.token_ids)
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_blocks[row] = 0
        if new.lora is not None:
            self.lora_id[row] = new.lora.lora_int_id
            self.uses_lora = True

    def remove(self, seq_id: str) -> None:
        """Drop a finished sequence's row; the last row moves into its place."""
        row = self.row_of.pop(seq_id)
        last = len(self.seq_ids) - 1
        if row != last:
            moved = self.seq_ids[last]
            self.row_of[moved] = row
            self.seq_ids[row] = moved
            n, b = int(self.num_tokens[last]), int(self.num_blocks[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.block_table[row, :b] = self.block_table[last, :b]
            for array in (self.num_tokens, self.num_prompt_tokens, self.num_blocks, self.num_draft_computed,
                          self.state_slot, self.lora_id):  # fmt: skip
                array[row] = array[last]
            self.params[row] = self.params[last]
            self.generators[row] = self.generators[last]
        self.seq_ids.pop()
        self.params.pop()
        self.generators.pop()

    def _fork(self, seq_id: str, parent_id: str, params: SamplingParams | None) -> None:
        """A new row copying the parent's tokens and block table (``ForkedSequence``, ``SampleFork``)."""
        parent = self.row_of[parent_id]
        row = self._new_row(seq_id, params if params is not None else self.params[parent])
        n, b = int(self.num_tokens[parent]), int(self.num_blocks[parent])
        self.token_ids[row, :n] = self.token_ids[parent, :n]
        self._set_blocks(row, 0, self.block_table[parent, :b])
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = self.num_prompt_tokens[parent]
        self.num_draft_computed[row] = self.num_draft_computed[parent]  # the same blocks (copied on write)
        self.lora_id[row] = self.lora_id[parent]

    def _update(self, item: ScheduledSequence) -> None:
        """Checked first, so a step that does not match the row changes nothing of it."""
        row = self.row_of[item.seq_id]
        if item.block_table_start > self.num_blocks[row]:
            raise ValueError(f"sequence {item.seq_id!r}: block table entries from {self.num_blocks[row]} were never sent")
        known = self.num_tokens[row] + len(item.new_token_ids)
        if item.start_position + item.num_tokens > known + item.num_drafts:
            raise ValueError(f"sequence {item.seq_id!r}: step computes tokens the worker was never sent")
        if item.new_token_ids:
            self._set_tokens(row, int(self.num_tokens[row]), item.new_token_ids)
        if item.draft_token_ids:
            self.set_drafts(row, item.draft_token_ids)
        drafted = int(self.num_draft_computed[row])
        if drafted and self.block_size:  # draft K/V only in the blocks the table still holds
            changed = _first_change(self.block_table[row, item.block_table_start : self.num_blocks[row]],
                                    item.new_block_ids)  # fmt: skip
            if changed is not None:
                drafted = min(drafted, (item.block_table_start + changed) * self.block_size)
        self._set_blocks(row, item.block_table_start, item.new_block_ids)
        self.num_draft_computed[row] = min(drafted, item.start_position)
        if item.state_slot is not None:
            self.state_slot[row] = item.state_slot
            self.uses_states = True

    def set_drafts(self, row: int, draft_token_ids: list[int]) -> None:
        """Drafts after the row's tokens, read by this step's inputs only: not counted as tokens."""
        known = int(self.num_tokens[row])
        self._set_tokens(row, known, draft_token_ids)
        self.num_tokens[row] = known

    def _new_row(self, seq_id: str, params: SamplingParams) -> int:
        if seq_id in self.row_of:
            raise ValueError(f"sequence {seq_id!r} is already in the batch")
        row = len(self.seq_ids)
        if row == len(self.num_tokens):
            self._grow_rows(2 * row)
        self.row_of[seq_id] = row
        self.seq_ids.append(seq_id)
        self.params.append(params)
        self.generators.append(None)
        self.num_tokens[row] = 0
        self.num_blocks[row] = 0
        self.num_draft_computed[row] = 0
        self.state_slot[row] = -1
        self.lora_id[row] = 0
        return row

    def reserve_tokens(self, end: int) -> None:
        """Room for every row's tokens up to position ``end`` (drafts written past their tokens)."""
        if end > self.token_ids.shape[1]:
            self.token_ids = _grown(self.token_ids, cols=max(end, 2 * self.token_ids.shape[1]))

    def _set_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        end = start + len(token_ids)
        self.reserve_tokens(end)
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def _set_blocks(self, row: int, start: int, block_ids: list[int] | np.ndarray) -> None:
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            self.block_table = _grown(self.block_table, cols=max(end, 2 * self.block_table.shape[1]))
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def _grow_rows(self, rows: int) -> None:
        self.token_ids = _grown(self.token_ids, rows=rows)
        self.block_table = _grown(self.block_table, rows=rows)
        self.num_tokens = _grown(self.num_tokens, rows=rows)
        self.num_prompt_tokens = _grown(self.num_prompt_tokens, rows=rows)
        self.num_blocks = _grown(self.num_blocks, rows=rows)
        self.num_draft_computed = _grown(self.num_draft_computed, rows=rows)
        self.state_slot = _grown(self.state_slot, rows=rows)
        self.lora_id = _grown(self.lora_id, rows=rows)

    # ---- what a step reads -------------------------------------------------------------

    def rows(self, seq_ids: list[str]) -> np.ndarray:
        """The rows of these sequences, in this order."""
        row_of = self.row_of
        return np.fromiter((row_of[s] for s in seq_ids), np.int64, len(seq_ids))

    def prompt_token_ids(self, row: int) -> np.ndarray:
        """A view of the row's prompt (valid until the next ``apply``)."""
        return self.token_ids[row, : self.num_prompt_tokens[row]]

    def output_token_ids(self, row: int) -> np.ndarray:
        """A view of the row's output so far (valid until the next ``apply``)."""
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]]

    def num_output_tokens(self, row: int) -> int:
        return int(self.num_tokens[row] - self.num_prompt_tokens[row])


def _first_change(old: np.ndarray, new: list[int]) -> int | None:
    """The first index where a block table's new entries differ from the old ones (a block
    replaced, or the new table shorter), None when they hold the same blocks."""
    common = min(len(old), len(new))
    differs = np.flatnonzero(old[:common] != np.asarray(new[:common], dtype=old.dtype))
    if len(differs):
        return int(differs[0])
    return common if len(new) < len(old) else None


def _grown(array: np.ndarray, rows: int | None = None, cols: int | None = None) -> np.ndarray:
    """A larger copy of a 1-D or 2-D array (the old contents first, zeros after)."""
    shape = (rows or array.shape[0], *(() if array.ndim == 1 else (cols or array.shape[1],)))
    grown = np.zeros(shape, dtype=array.dtype)
    grown[tuple(slice(0, n) for n in array.shape)] = array
    return grown

