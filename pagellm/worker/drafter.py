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
target's distribution for n-gram drafts keeps it here too (``sample/rejection.py``). A sequence
that shares prefix-cached blocks computes their draft KV again on its first draft (the same
values): which blocks' draft KV another sequence left complete is not tracked.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagellm.model.interface import CausalLM
from pagellm.sample.sampler import greedy_sample
from pagellm.step import ModelRunnerOutput, ScheduledSequence
from pagellm.worker.flat_batch import FlatLayout, flat_inputs
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.kv_cache import KVCache


class Drafter:
    """The draft model, its KV cache (the target's block ids) and its proposals.
    ``max_tokens``: the most tokens one catch-up forward takes (the step's token budget);
    ``vocab_size``: the draft's ids (the target's may go further: padded or added rows)."""

    def __init__(
        self, model: CausalLM, kv_cache: KVCache, block_size: int, device: torch.device, argmax_kernels: object,
        max_tokens: int, vocab_size: int,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.argmax_kernels = argmax_kernels
        self.max_tokens = max_tokens

    def propose(
        self, batch: InputBatch, scheduled: list[ScheduledSequence], output: ModelRunnerOutput
    ) -> list[ScheduledSequence]:
        """The step with every ``num_model_drafts`` filled in as ``draft_token_ids`` (written
        past each row's tokens, where the target's inputs read them); the drafts also go into
        ``output.drafts``."""
        wanted = [i for i, item in enumerate(scheduled) if item.num_model_drafts]
        if not wanted:
            return scheduled
        items = [scheduled[i] for i in wanted]
        rows = batch.rows([item.seq_id for item in items])
        counts = np.fromiter((item.num_model_drafts for item in items), np.int64, len(items))
        known = batch.num_tokens[rows].copy()
        starts = batch.num_draft_computed[rows].copy()
        output.draft_catch_up = max(output.draft_catch_up, int((known - starts).max()))
        batch.reserve_tokens(int((known + counts).max()))  # drafts go past the rows' tokens
        drafts = [[token] for token in self._catch_up(batch, rows, starts, known)]
        batch.token_ids[rows, known] = [d[0] for d in drafts]
        for j in range(1, int(counts.max())):
            live = np.flatnonzero(counts > j)
            layout = FlatLayout.of(rows[live], known[live] + j - 1, np.ones(len(live), dtype=np.int64))
            tokens = self._forward(batch, layout, layout.last_indices)
            batch.token_ids[rows[live], known[live] + j] = tokens
            for i, token in zip(live, tokens):
                drafts[i].append(token)
        # The last draft's K/V is never written: computed up to the one before it.
        batch.num_draft_computed[rows] = known + counts - 1
        filled = list(scheduled)
        for n, i in enumerate(wanted):
            output.drafts[items[n].seq_id] = drafts[n]
            filled[i] = dataclasses.replace(items[n], draft_token_ids=drafts[n], num_model_drafts=0)
        return filled

    def _catch_up(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> list[int]:
        """Compute the draft KV of each row's positions ``starts .. ends - 1`` (at most
        ``max_tokens`` a forward, long spans cut into chunks); the greedy token after each
        row's last position."""
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
            tokens = self._forward(batch, layout, layout.last_indices[done])
            for index, token in zip(done, tokens):
                first[chosen[index]] = token
            position[chosen_np] += lengths_np

    def _forward(self, batch: InputBatch, layout: FlatLayout, sample_indices: np.ndarray) -> list[int]:
        """One draft forward over ``layout`` (its KV written); the argmax at ``sample_indices``."""
        flat = flat_inputs(batch, layout, self.block_size, self.device, [np.asarray(sample_indices, dtype=np.int64)])
        # A token the draft does not know reads as id 0: its drafts there are poor, never wrong.
        flat.input_ids.masked_fill_(flat.input_ids >= self.vocab_size, 0)
        hidden = self.model(flat.input_ids, flat.positions, self.kv_cache, flat.attn_metadata)
        if not len(sample_indices):
            return []
        logits = self.model.compute_logits(hidden[flat.extra[0]], upcast=False)
        return greedy_sample(logits, self.argmax_kernels).tolist()
