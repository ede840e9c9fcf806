"""Speculative drafts proposed in the worker, at the start of the step that verifies them.

The scheduler asks for ``num_model_drafts`` drafts of a sequence and reserves their slots; here,
before the target's forward, a draft source continues each such sequence greedily, a forward a
draft for all of them:

- a draft model (``worker/draft_model_source.py``): a smaller model over its own K/V;
- the target's own multi-token-prediction layer (``worker/mtp_source.py``): over the target's
  hidden states, its own K/V.

Either source's K/V lives in the target's blocks (its own tensors, the same block ids and
slots), so the block tables, the slots reserved for drafts, copy-on-write and the release of
rejected drafts' blocks serve it too. Each draft is written past its row's tokens, where the
target's inputs read it.

A greedy draft is a deterministic function of the sequence, so the verification that keeps the
target's distribution for n-gram drafts keeps it here too (``sample/rejection.py``). A
constrained sequence's drafts are masked by its grammar, where the engine runs the drafter in
its process, and cut before one it forbids or one that completes its document.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from pagellm.sample.grammar_mask import apply_token_bitmask
from pagellm.sample.sampler import greedy_sample
from pagellm.step import DraftGrammar, ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.kv_cache import KVCache


class DraftSource(Protocol):
    """What proposes the drafts: their first of a step, then each next one."""

    kv_cache: KVCache  # its K/V by the target's block ids (the step's block copies apply to it)

    def observe(self, step: SchedulerOutput, batch: InputBatch) -> None:
        """``step`` as the batch took it, before :meth:`first` (blocks whose contents change)."""

    def first(
        self, batch: InputBatch, rows: np.ndarray, known: np.ndarray, masks: dict[int, np.ndarray],
        output: ModelRunnerOutput,
    ) -> list[int | None]:
        """Each row's first draft, the token at position ``known[i]`` (its tokens' count), under
        its grammar's mask row ``masks[i]`` where it has one; None: the row drafts nothing now."""

    def next(
        self, batch: InputBatch, rows: np.ndarray, live: np.ndarray, last: np.ndarray, masks: list[np.ndarray | None]
    ) -> list[int]:
        """The draft after each live row's latest (``rows[live]``, their latest drafts at
        positions ``last``, written in the batch), each under its mask row where given."""

    def finish(self, batch: InputBatch, rows: np.ndarray, known: np.ndarray, counts: np.ndarray) -> None:
        """The step's drafts are ``counts`` a row (after the grammars' cuts)."""

    def after_target(
        self, hidden: torch.Tensor, scheduled: list[ScheduledSequence], batch: InputBatch, output: ModelRunnerOutput
    ) -> None:
        """The target's step is done: its final hidden states ``hidden`` (the flat batch of
        ``scheduled``, in that order) and what it sampled and accepted (``output``)."""


def masked_argmax(logits: torch.Tensor, masks: list[np.ndarray | None], argmax_kernels: object) -> list[int]:
    """The argmax of each row of ``logits``, under its grammar's mask row where ``masks`` gives one."""
    present = [mask for mask in masks if mask is not None]
    if present:
        mask_rows, n = [], 0
        for mask in masks:
            mask_rows.append(None if mask is None else n)
            n += mask is not None
        apply_token_bitmask(logits, torch.from_numpy(np.stack(present)), mask_rows, argmax_kernels)  # type: ignore[arg-type]
    return greedy_sample(logits, argmax_kernels).tolist()


class Drafter:
    """A draft source's proposals for the sequences the scheduler asked drafts of, masked by
    their grammars (``grammar``: set by the engine where the drafter runs in its process)."""

    def __init__(self, source: DraftSource) -> None:
        self.source = source
        self.grammar: DraftGrammar | None = None

    @property
    def kv_cache(self) -> KVCache:
        return self.source.kv_cache

    def observe(self, step: SchedulerOutput, batch: InputBatch) -> None:
        self.source.observe(step, batch)

    def after_target(
        self, hidden: torch.Tensor, scheduled: list[ScheduledSequence], batch: InputBatch, output: ModelRunnerOutput
    ) -> None:
        self.source.after_target(hidden, scheduled, batch, output)

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
        batch.reserve_tokens(int((known + counts).max()))  # drafts go past the rows' tokens
        first = self.source.first(batch, rows, known, {i: m[0] for i, m in masks.items()}, output)
        counts[[i for i, token in enumerate(first) if token is None]] = 0
        drafts = [[0 if token is None else token] for token in first]
        batch.token_ids[rows, known] = [d[0] for d in drafts]
        self._check(items, drafts, counts, masks, range(len(items)), 0)
        for j in range(1, int(counts.max(initial=0))):
            live = np.flatnonzero(counts > j)
            if not len(live):  # (every row cut by its grammar)
                break
            tokens = self.source.next(batch, rows, live, known[live] + j - 1,
                                      [masks[i][j] if i in masks else None for i in live])  # fmt: skip
            batch.token_ids[rows[live], known[live] + j] = tokens
            for i, token in zip(live, tokens):
                drafts[i].append(token)
            self._check(items, drafts, counts, masks, live, j)
        self.source.finish(batch, rows, known, counts)
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
