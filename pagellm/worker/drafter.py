"""Speculative drafts from a draft model, proposed at the start of the step that verifies them.

The scheduler asks for ``num_model_drafts`` drafts of a sequence and reserves their slots; here,
before the target's forward, the draft model continues each such sequence greedily:

1. catch-up: one forward over the sequence's known tokens whose draft KV it does not hold yet
   (the whole prompt the first time, then the one or two tokens the last step added), whose
   last position gives the first draft;
2. then one single-token forward per further draft, all sequences batched.

The draft's KV cache has the target's blocks (its own tensors, the same block ids and slots), so
the block tables, the slots reserved for drafts, copy-on-write and the release of rejected
drafts' blocks serve both models. Draft ``i``'s KV is written at the position the target
verifies it at; where the target rejects it, the next step computes that position again
(``InputBatch.num_draft_computed`` never passes the position a step starts from).

A greedy draft is a deterministic function of the sequence, so the verification that keeps the
target's distribution for n-gram drafts keeps it here too (``sample/rejection.py``).

A sequence that shares prefix-cached blocks (the next turn of a chat, a shared system prompt)
starts its catch-up past those whose draft KV is complete: ``complete`` marks a block once a
catch-up has computed the draft KV of all its tokens, and forgets it when the block's contents
may change (the target computes into it, it is copied over or loaded from the disk tier), so a
block's draft KV is trusted exactly while its tokens are the ones it was computed for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import torch

from pagellm.model.interface import CausalLM
from pagellm.sample.grammar_mask import apply_token_bitmask
from pagellm.sample.sampler import greedy_sample
from pagellm.step import DraftGrammar, ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from pagellm.worker.flat_batch import FlatLayout, flat_inputs
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.kv_cache import KVCache


class Drafter:
    """The draft model, its KV cache (the target's block ids) and its proposals.
    ``max_tokens``: the most tokens one catch-up forward takes (the step's token budget);
    ``vocab_size``: the draft's ids (the target's may go further: padded or added rows)."""

    def __init__(
        self, model: CausalLM, kv_cache: KVCache, block_size: int, device: torch.device, argmax_kernels: object,
        max_tokens: int, vocab_size: int, num_blocks: int,
    ) -> None:
        self.model = model
        # Blocks whose draft KV holds every one of the block's tokens (see the module docstring).
        self.complete = np.zeros(num_blocks, dtype=bool)
        # The constrained sequences' grammars, where the engine runs this drafter in its process.
        self.grammar: DraftGrammar | None = None
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.argmax_kernels = argmax_kernels
        self.max_tokens = max_tokens

    def observe(self, step: SchedulerOutput, batch: InputBatch) -> None:
        """Forget the blocks whose contents ``step`` changes (after the batch took it, before
        :meth:`propose`): copies' targets take their source's mark, loaded blocks and every
        scheduled row's blocks from the first position the target computes lose theirs."""
        for source, target in step.block_copies:
            self.complete[target] = self.complete[source]
        for load in step.kv_loads:
            self.complete[load.block_ids] = False
        if step.scheduled:
            rows = batch.rows([item.seq_id for item in step.scheduled])
            first = np.fromiter((item.start_position for item in step.scheduled), np.int64, len(rows)) // self.block_size
            self.complete[_table_span(batch, rows, first, batch.num_blocks[rows])] = False

    def propose(
        self, batch: InputBatch, scheduled: list[ScheduledSequence], output: ModelRunnerOutput
    ) -> tuple[list[ScheduledSequence], dict[str, np.ndarray]]:
        """The step with every ``num_model_drafts`` filled in as ``draft_token_ids`` (written
        past each row's tokens, where the target's inputs read them); the drafts also go into
        ``output.drafts``. A constrained sequence's drafts are masked by its grammar and cut
        before one it forbids or one that completes its document (its step then verifies fewer);
        its mask rows (before each draft and after the last) are returned for the verification."""
        wanted = [i for i, item in enumerate(scheduled) if item.num_model_drafts]
        if not wanted:
            return scheduled, {}
        items = [scheduled[i] for i in wanted]
        rows = batch.rows([item.seq_id for item in items])
        requested = np.fromiter((item.num_model_drafts for item in items), np.int64, len(items))
        counts = requested.copy()
        known = batch.num_tokens[rows].copy()
        masks = self._first_masks(batch, items, rows, counts)
        starts = self._past_complete_blocks(batch, rows, batch.num_draft_computed[rows].copy(), known)
        output.draft_catch_up = max(output.draft_catch_up, int((known - starts).max()))
        batch.reserve_tokens(int((known + counts).max()))  # drafts go past the rows' tokens
        drafts = [[token] for token in self._catch_up(batch, rows, starts, known, {i: m[0] for i, m in masks.items()})]
        # Every known token's draft KV is computed now.
        self.complete[_table_span(batch, rows, np.zeros_like(known), known // self.block_size)] = True
        batch.token_ids[rows, known] = [d[0] for d in drafts]
        self._check(items, drafts, counts, masks, range(len(items)), 0)
        for j in range(1, int(counts.max(initial=0))):
            live = np.flatnonzero(counts > j)
            if not len(live):  # (every row cut by its grammar)
                break
            layout = FlatLayout.of(rows[live], known[live] + j - 1, np.ones(len(live), dtype=np.int64))
            tokens = self._forward(batch, layout, layout.last_indices, [masks[i][j] if i in masks else None for i in live])
            batch.token_ids[rows[live], known[live] + j] = tokens
            for i, token in zip(live, tokens):
                drafts[i].append(token)
            self._check(items, drafts, counts, masks, live, j)
        # The last draft's K/V is never written: computed up to the one before it (the catch-up's
        # last known position where no draft is left).
        batch.num_draft_computed[rows] = known + np.maximum(counts - 1, 0)
        drafts = [tokens[:count] for tokens, count in zip(drafts, counts)]
        filled = list(scheduled)
        for n, i in enumerate(wanted):
            output.drafts[items[n].seq_id] = drafts[n]
            fewer = int(requested[n] - counts[n])
            filled[i] = dataclasses.replace(items[n], draft_token_ids=drafts[n], num_model_drafts=0,
                                            num_tokens=items[n].num_tokens - fewer)  # fmt: skip
        return filled, {items[i].seq_id: words[: counts[i] + 1] for i, words in masks.items() if counts[i]}

    def _first_masks(
        self, batch: InputBatch, items: list[ScheduledSequence], rows: np.ndarray, counts: np.ndarray
    ) -> dict[int, np.ndarray]:
        """Each constrained row's mask rows (one before each draft, one after the last), the
        first filled (its grammar's state now); a row whose grammar allows nothing more drafts
        nothing (``counts`` cut to 0)."""
        masks: dict[int, np.ndarray] = {}
        for i, row in enumerate(rows):
            if batch.params[row].structured_outputs is None:
                continue
            if self.grammar is None:
                raise RuntimeError("a constrained sequence was given model drafts without its grammar")
            words = np.zeros((int(counts[i]) + 1, -(-self.grammar.vocab_size // 32)), dtype=np.int32)
            if self.grammar.mask_after(items[i].seq_id, [], words, 0):
                masks[i] = words
            else:
                counts[i] = 0
        return masks

    def _check(
        self, items: list[ScheduledSequence], drafts: list[list[int]], counts: np.ndarray,
        masks: dict[int, np.ndarray], live: Iterable[int], j: int,
    ) -> None:
        """Draft ``j`` of each live constrained row: its grammar's state after it into mask row
        ``j + 1``, or the row's drafts cut before it (``counts``: not allowed, or completing the
        document)."""
        for i in live:
            if i in masks and counts[i] > j and not self.grammar.mask_after(  # type: ignore[union-attr]
                items[i].seq_id, drafts[i], masks[i], j + 1
            ):
                counts[i] = j

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
        present = [mask for mask in masks if mask is not None]
        if present:
            mask_rows, n = [], 0
            for mask in masks:
                mask_rows.append(None if mask is None else n)
                n += mask is not None
            apply_token_bitmask(logits, torch.from_numpy(np.stack(present)), mask_rows, self.argmax_kernels)  # type: ignore[arg-type]
        return greedy_sample(logits, self.argmax_kernels).tolist()


def _table_span(batch: InputBatch, rows: np.ndarray, first: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The block ids of each row's table entries ``first[i] .. end[i] - 1``, all rows at once."""
    columns = np.arange(int(end.max(initial=0)))
    within = (columns >= first[:, None]) & (columns < end[:, None])
    return batch.block_table[rows[:, None], columns][within]
