"""Drafts from the target's own multi-token-prediction layer (speculative method "mtp",
``model/mtp.py``).

After each target step (:meth:`MtpSource.after_target`) the layer runs over every position the
step computed and kept (a prefill chunk's; a verification's accepted positions and the one
after them, never a rejected draft's), from the target's final hidden state there and the token
after it: its K/V is written at those positions and each sequence's last output is kept. In
the next step that verifies drafts of the sequence, that output gives the first draft through
the model's LM head (:meth:`first`); each further draft runs the layer once more, from its own
last output and the draft before it, at the next position (:meth:`next`; those K/V rows are
written again by ``after_target`` once the target has checked their tokens).

The layer's K/V is one more attention layer in the target's blocks: copied on write with them,
and kept in the disk tier's entries with the target's. A prefix-cache hit reuses it with the
blocks: computed from the same tokens, except that a block's last row saw the token that
followed it in the request that computed it (a draft's quality, never the output's exactness).
A sequence with no output kept at its last computed position (a fork's first step) drafts
nothing in that step.

A step of more sequences than speculation's ``disable_by_batch_size`` drafts nothing, and skips
the layer too (it would cost a layer's share of every big step: 1/17 at the 16-layer ``mla-1b``
shape). A sequence that lived through such steps drafts again once the batch is small, from its
next step on, its layer's K/V rows of those steps never written: worse drafts (the adaptive
speculation then drafts less for it), never another output.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from pagellm.model.interface import MultiTokenPredictor
from pagellm.step import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from pagellm.worker.drafter import masked_argmax
from pagellm.worker.flat_batch import FlatLayout, flat_inputs
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.kv_cache import KVCache


class MtpSource:
    """The MTP layer's drafts (see the module docstring); ``kv_cache``: its one K/V pair."""

    def __init__(
        self, model: MultiTokenPredictor, kv_cache: KVCache, block_size: int, device: torch.device, argmax_kernels: object,
        busy_above: int | None = None,
    ) -> None:
        self.model = model
        # A step of more sequences than this (speculation's ``disable_by_batch_size``) skips the
        # layer (None: every step runs it). The scheduler drafts only while its running sequences
        # are that few, so a step it drafts in never skips: the test here runs the layer in a few
        # steps more than needed (some running sequences unscheduled), never in fewer.
        self.busy_above = busy_above
        self.kv_cache = kv_cache
        self.pair = cast(tuple[torch.Tensor, torch.Tensor], kv_cache[0])  # (the layer's one K/V pair)
        self.block_size = block_size
        self.device = device
        self.argmax_kernels = argmax_kernels
        # seq id -> (the position of its last kept output, that output [hidden])
        self.last: dict[str, tuple[int, torch.Tensor]] = {}
        self._chain: torch.Tensor | None = None  # the drafting rows' latest outputs, during a proposal

    def observe(self, step: SchedulerOutput, batch: InputBatch) -> None:
        for seq_id in step.finished_seq_ids:
            self.last.pop(seq_id, None)

    def first(
        self, batch: InputBatch, rows: np.ndarray, known: np.ndarray, masks: dict[int, np.ndarray],
        output: ModelRunnerOutput,
    ) -> list[int | None]:
        """From each row's output kept at its last computed position (``known - 2``)."""
        have, outputs = [], []
        for i, row in enumerate(rows.tolist()):
            last = self.last.get(batch.seq_ids[row])
            if last is not None and last[0] == known[i] - 2:
                have.append(i)
                outputs.append(last[1])
        firsts: list[int | None] = [None] * len(rows)
        if not have:
            return firsts
        hidden = torch.stack(outputs)
        self._chain = hidden.new_zeros((len(rows), hidden.shape[1]))
        self._chain[have] = hidden
        tokens = masked_argmax(self.model.mtp_logits(hidden, upcast=False), [masks.get(i) for i in have],
                               self.argmax_kernels)  # fmt: skip
        for i, token in zip(have, tokens):
            firsts[i] = token
        return firsts

    def next(
        self, batch: InputBatch, rows: np.ndarray, live: np.ndarray, last: np.ndarray, masks: list[np.ndarray | None]
    ) -> list[int]:
        """The layer at the position before each latest draft, from the row's latest output and
        that draft."""
        assert self._chain is not None
        layout = FlatLayout.of(rows[live], last - 1, np.ones(len(live), dtype=np.int64))
        flat = flat_inputs(batch, layout, self.block_size, self.device, token_offset=1)
        hidden = self.model.mtp_hidden(flat.input_ids, flat.positions, self._chain[live], self.pair, flat.attn_metadata)
        self._chain[live] = hidden
        return masked_argmax(self.model.mtp_logits(hidden, upcast=False), masks, self.argmax_kernels)

    def finish(self, batch: InputBatch, rows: np.ndarray, known: np.ndarray, counts: np.ndarray) -> None:
        self._chain = None

    def after_target(
        self, hidden: torch.Tensor, scheduled: list[ScheduledSequence], batch: InputBatch, output: ModelRunnerOutput
    ) -> None:
        """The layer over the positions each scheduled sequence computed and kept (see the
        module docstring), their next tokens read from the batch (the step's sampled token
        written there first)."""
        if self.busy_above is not None and len(scheduled) > self.busy_above:
            return
        rows, starts, kept, flat = [], [], [], []
        offset = 0
        for item in scheduled:
            row = batch.row_of.get(item.seq_id)
            count = 0 if row is None else self._kept(item, row, batch, output)
            if count:
                rows.append(row)
                starts.append(item.start_position)
                kept.append(count)
                flat.append(np.arange(offset, offset + count))
            offset += item.num_tokens
        if not rows:
            return
        layout = FlatLayout.of(np.asarray(rows, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                               np.asarray(kept, dtype=np.int64))  # fmt: skip
        inputs = flat_inputs(batch, layout, self.block_size, self.device, [np.concatenate(flat)], token_offset=1)
        out = self.model.mtp_hidden(inputs.input_ids, inputs.positions, hidden[inputs.extra[0]], self.pair,
                                    inputs.attn_metadata)  # fmt: skip
        lasts = out[torch.from_numpy(layout.last_indices).to(out.device)]
        for j, row in enumerate(rows):
            self.last[batch.seq_ids[row]] = (starts[j] + kept[j] - 1, lasts[j])

    @staticmethod
    def _kept(item: ScheduledSequence, row: int, batch: InputBatch, output: ModelRunnerOutput) -> int:
        """How many of the item's positions the step keeps whose next token is known now; the
        token it sampled written past the row's tokens (where the next step puts it too)."""
        seq_id, start = item.seq_id, item.start_position
        if seq_id in output.failed:
            return 0
        sampled = output.sampled.get(seq_id)
        if sampled is None:  # (a prompt's chunk: its next token is the prompt's, unless it is the last)
            return item.num_tokens if start + item.num_tokens < batch.num_tokens[row] else item.num_tokens - 1
        count = output.num_accepted.get(seq_id, 0) + 1 if item.draft_token_ids else item.num_tokens
        batch.reserve_tokens(start + count + 1)
        batch.token_ids[row, start + count] = sampled
        return count
