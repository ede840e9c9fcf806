"""A draft model's drafts: a smaller model with the target's vocabulary, run greedily over its
own K/V in the target's blocks (``worker/drafter.py`` asks it, a forward a draft):

1. catch-up: one forward over the sequence's known tokens whose draft KV it does not hold yet
   (the whole prompt the first time, then the one or two tokens the last step added), whose
   last position gives the first draft;
2. then one single-token forward per further draft, all sequences batched.

Draft ``i``'s KV is written at the position the target verifies it at; where the target
rejects it, the next step computes that position again (``InputBatch.num_draft_computed``
never passes the position a step starts from).

A sequence that shares prefix-cached blocks (the next turn of a chat, a shared system prompt)
starts its catch-up past those whose draft KV is complete: ``complete`` marks a block once a
catch-up has computed the draft KV of all its tokens, and forgets it when the block's contents
may change (the target computes into it, it is copied over or loaded from the disk tier), so a
block's draft KV is trusted exactly while its tokens are the ones it was computed for.
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.model.interface import CausalLM
from pagellm.step import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from pagellm.worker.drafter import masked_argmax
from pagellm.worker.flat_batch import FlatLayout, flat_inputs
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.kv_cache import KVCache


class DraftModelSource:
    """The draft model, its KV cache (the target's block ids) and its drafts.
    ``max_tokens``: the most tokens one catch-up forward takes (the step's token budget);
    ``vocab_size``: the draft's ids (the target's may go further: padded or added rows)."""

    def __init__(
        self, model: CausalLM, kv_cache: KVCache, block_size: int, device: torch.device, argmax_kernels: object,
        max_tokens: int, vocab_size: int, num_blocks: int,
    ) -> None:
        self.model = model
        # Blocks whose draft KV holds every one of the block's tokens (see the module docstring).
        self.complete = np.zeros(num_blocks, dtype=bool)
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.argmax_kernels = argmax_kernels
        self.max_tokens = max_tokens

    def observe(self, step: SchedulerOutput, batch: InputBatch) -> None:
        """Forget the blocks whose contents ``step`` changes (after the batch took it, before
        :meth:`first`): copies' targets take their source's mark, loaded blocks and every
        scheduled row's blocks from the first position the target computes lose theirs."""
        for source, target in step.block_copies:
            self.complete[target] = self.complete[source]
        for load in step.kv_loads:
            self.complete[load.block_ids] = False
        if step.scheduled:
            rows = batch.rows([item.seq_id for item in step.scheduled])
            first = np.fromiter((item.start_position for item in step.scheduled), np.int64, len(rows)) // self.block_size
            self.complete[_table_span(batch, rows, first, batch.num_blocks[rows])] = False

    def first(
        self, batch: InputBatch, rows: np.ndarray, known: np.ndarray, masks: dict[int, np.ndarray],
        output: ModelRunnerOutput,
    ) -> list[int | None]:
        """Catch each row's draft KV up to its known tokens (past the complete blocks it
        shares); the greedy token after its last."""
        starts = self._past_complete_blocks(batch, rows, batch.num_draft_computed[rows].copy(), known)
        output.draft_catch_up = max(output.draft_catch_up, int((known - starts).max()))
        first = self._catch_up(batch, rows, starts, known, masks)
        # Every known token's draft KV is computed now.
        self.complete[_table_span(batch, rows, np.zeros_like(known), known // self.block_size)] = True
        return list(first)

    def next(
        self, batch: InputBatch, rows: np.ndarray, live: np.ndarray, last: np.ndarray, masks: list[np.ndarray | None]
    ) -> list[int]:
        layout = FlatLayout.of(rows[live], last, np.ones(len(live), dtype=np.int64))
        return self._forward(batch, layout, layout.last_indices, masks)

    def finish(self, batch: InputBatch, rows: np.ndarray, known: np.ndarray, counts: np.ndarray) -> None:
        """The last draft's K/V is never written: computed up to the one before it (the
        catch-up's last known position where no draft is left)."""
        batch.num_draft_computed[rows] = known + np.maximum(counts - 1, 0)

    def after_target(
        self, hidden: torch.Tensor, scheduled: list[ScheduledSequence], batch: InputBatch, output: ModelRunnerOutput
    ) -> None:
        """(Nothing: the draft model catches up on the tokens themselves in the next step.)"""

    def _past_complete_blocks(
        self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, known: np.ndarray
    ) -> np.ndarray:
        """Each row's catch-up start moved past the complete blocks it reaches (not past its last
        known position, whose draft forward gives the first draft)."""
        for i, row in enumerate(rows):
            block, held = int(starts[i]) // self.block_size, int(batch.num_blocks[row])
            while block < held and block * self.block_size < known[i] and self.complete[batch.block_table[row, block]]:
                block += 1
            starts[i] = max(int(starts[i]), min(block * self.block_size, int(known[i]) - 1))
        return starts

    def _catch_up(
        self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, masks: dict[int, np.ndarray]
    ) -> list[int]:
        """Compute the draft KV of each row's positions ``starts .. ends - 1`` (at most
        ``max_tokens`` a forward, long spans cut into chunks); the greedy token after each
        row's last position (under its mask row, ``masks[i]``, where it has one)."""
        first = [0] * len(rows)
        position = starts.copy()
        while True:
            pending = np.flatnonzero(position < ends)
            if not len(pending):
                return first
            chosen, lengths, budget = [], [], self.max_tokens
            for i in pending:
                length = min(int(ends[i] - position[i]), budget)
                if length <= 0:
                    break
                chosen.append(i)
                lengths.append(length)
                budget -= length
            chosen_np = np.asarray(chosen, dtype=np.int64)
            lengths_np = np.asarray(lengths, dtype=np.int64)
            layout = FlatLayout.of(rows[chosen_np], position[chosen_np], lengths_np)
            done = np.flatnonzero(position[chosen_np] + lengths_np == ends[chosen_np])
            tokens = self._forward(batch, layout, layout.last_indices[done], [masks.get(chosen[d]) for d in done])
            for index, token in zip(done, tokens):
                first[chosen[index]] = token
            position[chosen_np] += lengths_np

    def _forward(
        self, batch: InputBatch, layout: FlatLayout, sample_indices: np.ndarray, masks: list[np.ndarray | None]
    ) -> list[int]:
        """One draft forward over ``layout`` (its KV written); the argmax at ``sample_indices``,
        each under its grammar's mask row where ``masks`` gives one."""
        flat = flat_inputs(batch, layout, self.block_size, self.device, [np.asarray(sample_indices, dtype=np.int64)])
        # A token the draft does not know reads as id 0: its drafts there are poor, never wrong.
        flat.input_ids.masked_fill_(flat.input_ids >= self.vocab_size, 0)
        hidden = self.model(flat.input_ids, flat.positions, self.kv_cache, flat.attn_metadata)
        if not len(sample_indices):
            return []
        logits = self.model.compute_logits(hidden[flat.extra[0]], upcast=False)
        return masked_argmax(logits, masks, self.argmax_kernels)


def _table_span(batch: InputBatch, rows: np.ndarray, first: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The block ids of each row's table entries ``first[i] .. end[i] - 1``, all rows at once."""
    columns = np.arange(int(end.max(initial=0)))
    within = (columns >= first[:, None]) & (columns < end[:, None])
    return batch.block_table[rows[:, None], columns][within]
