"""Per-sequence grammar state for the engine: compiled off the step loop, one matcher per
sequence, a packed mask per sampling row each step, advanced by every accepted token.

The engine owns one manager. Its life cycle for a request:

1. ``submit``: compilation starts on the compiler's thread; the manager keeps the request (the
   engine's sequences for it, an opaque payload) until ``poll`` hands them back ready for the
   scheduler (or reports the request failed, or past its deadline): the one record of a
   request waiting for its grammar.
2. ``masks``: before a step runs, one bitmask row per sampling sequence with a grammar. Samples
   2..n of a request (forks) get a copy of their parent's matcher the step they are born, so
   each fork carries its own state from then on.
3. ``accept``: each token the scheduler appended advances its sequence's matcher. Preemption
   keeps the matcher: recompute rebuilds the KV of the same tokens, the grammar state is theirs.
4. ``remove``: finished and aborted sequences drop their matcher.

A sequence whose document is complete (nothing but EOS could follow) ends at once with "stop";
one that ``max_tokens`` cuts first ends with "length" (its text is then a truncated document).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher
# llguidance.numpy, not llguidance.torch: the same calls, without the torch.compile that imports
# torch's compiler stack (about 3 s of every start-up).
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par
from transformers import PreTrainedTokenizerBase

from pagellm.step import GrammarBitmask, ScheduledSequence
from pagellm.structured_output.grammar import GrammarCompiler, llguidance_tokenizer
from pagellm.structured_outputs_params import StructuredOutputsParams


Waiting = TypeVar("Waiting")  # what the engine schedules once a request's grammar is ready


@dataclass
class _Pending(Generic[Waiting]):
    future: Future[LLMatcher]
    first_seq_id: str
    deadline: float
    waiting: Waiting


class StructuredOutputManager(Generic[Waiting]):
    """Grammar matchers of the engine's constrained sequences (see the module docstring)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_id: int | None, compile_timeout_s: float
    ) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.compiler = GrammarCompiler(lambda: llguidance_tokenizer(tokenizer, vocab_size, eos_token_id))
        self._executor: LLExecutor | None = None
        self._pending: dict[str, _Pending[Waiting]] = {}
        self._matchers: dict[str, LLMatcher] = {}
        self.mask_seconds = 0.0  # cumulative time filling masks (benchmarks report it per step)

    # ---- compile -------------------------------------------------------------------------

    def submit(self, request_id: str, first_seq_id: str, params: StructuredOutputsParams, waiting: Waiting) -> None:
        """Start compiling ``params`` for a request whose first sequence is ``first_seq_id``;
        ``poll`` hands ``waiting`` back once the grammar is ready."""
        future = self.compiler.submit(params)
        self._pending[request_id] = _Pending(future, first_seq_id, time.monotonic() + self.compile_timeout_s, waiting)

    @property
    def num_pending(self) -> int:
        """Requests still waiting for their grammar."""
        return len(self._pending)

    def poll(self) -> tuple[list[Waiting], dict[str, str]]:
        """What was submitted with each request whose grammar is ready (its first sequence now
        has its matcher), and the requests that failed or ran past the deadline, with why."""
        ready: list[Waiting] = []
        failed: dict[str, str] = {}
        now = time.monotonic()
        for request_id, pending in list(self._pending.items()):
            if pending.future.done():
                del self._pending[request_id]
                try:
                    self._matchers[pending.first_seq_id] = pending.future.result()
                    ready.append(pending.waiting)
                except ValueError as exc:
                    failed[request_id] = str(exc)
                except Exception as exc:  # noqa: BLE001 - the compile thread's failure is this request's alone
                    failed[request_id] = f"structured_outputs failed to compile: {exc!r}"
            elif now > pending.deadline:
                del self._pending[request_id]
                pending.future.cancel()
                failed[request_id] = (
                    f"structured_outputs is too slow to compile (over {self.compile_timeout_s:g} s); simplify it"
                )
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block until some pending compile finishes (or ``timeout_s``): for an engine with nothing
        else to run."""
        if self._pending:
            wait([p.future for p in self._pending.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)

    # ---- each step -----------------------------------------------------------------------

    def masks(self, scheduled: list[ScheduledSequence]) -> GrammarBitmask | None:
        """The allowed tokens of every constrained sequence that samples this step; None when
        none does (unconstrained batches pay nothing). A sequence verifying drafts gets a row
        for each position, from its own row on: the grammar's state after the drafts before it."""
        if not self._matchers:
            return None
        rows: dict[str, int] = {}
        matchers: list[tuple[LLMatcher, int]] = []
        drafted: list[tuple[LLMatcher, int, list[int]]] = []
        num_rows = 0
        for item in scheduled:
            matcher = self._matchers.get(item.seq_id)
            if matcher is None or not item.sample:
                continue
            if item.draft_token_ids:
                rows[item.seq_id] = num_rows
                drafted.append((matcher, num_rows, item.draft_token_ids))
                num_rows += 1 + len(item.draft_token_ids)
                continue
            for seq_id in [item.seq_id, *(fork.seq_id for fork in item.forks)]:
                if seq_id != item.seq_id:
                    self._matchers[seq_id] = matcher.deep_copy()  # the fork's own state from here
                rows[seq_id] = num_rows
                matchers.append((self._matchers[seq_id], num_rows))
                num_rows += 1
        if not num_rows:
            return None
        start = time.perf_counter()
        bitmask = torch.empty(num_rows, (self.vocab_size + 31) // 32, dtype=torch.int32)
        words = bitmask.numpy()
        if len(matchers) == 1:
            fill_next_token_bitmask(matchers[0][0], words, matchers[0][1])
        elif matchers:
            if self._executor is None:
                self._executor = LLExecutor()
            fill_next_token_bitmask_par(self._executor, matchers, words)
        for matcher, first, drafts in drafted:
            self._fill_draft_rows(matcher, words, first, drafts)
        self.mask_seconds += time.perf_counter() - start
        return GrammarBitmask(rows=rows, bitmask=bitmask)

    @staticmethod
    def _fill_draft_rows(matcher: LLMatcher, words: np.ndarray, first: int, drafts: list[int]) -> None:
        """Rows ``first .. first + len(drafts)``: the state now, then after each draft (the drafts
        were checked against the grammar when proposed: ``valid_drafts``); the state is restored."""
        fill_next_token_bitmask(matcher, words, first)
        consumed = 0
        for offset, token in enumerate(drafts, start=1):
            if not matcher.consume_token(token):
                words[first + offset : first + len(drafts) + 1] = 0  # (checked drafts never) nothing past it
                break
            consumed += 1
            fill_next_token_bitmask(matcher, words, first + offset)
        matcher.rollback(consumed)

    def valid_drafts(self, seq_id: str, drafts: list[int]) -> int:
        """How many leading ``drafts`` the sequence's grammar allows from its state now, short of
        one that would complete the document: the target samples that token itself, so that the
        sequence ends on it as without drafts (no token after it)."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return 0
        valid = int(matcher.validate_tokens(drafts))
        consumed = 0
        for token in drafts[:valid]:
            matcher.consume_token(token)
            consumed += 1
            if matcher.is_stopped():
                valid = consumed - 1
                break
        matcher.rollback(consumed)
        return valid

    def mask_after(self, seq_id: str, drafts: list[int], words: np.ndarray, row: int) -> bool:
        """``DraftGrammar``: the sequence's mask after ``drafts`` into ``words[row]``, or False where a
        draft is not allowed or completes the document; the state is restored."""
        matcher = self._matchers.get(seq_id)
        if matcher is None or (drafts and int(matcher.validate_tokens(drafts)) < len(drafts)):
            return False
        consumed = 0
        try:
            for token in drafts:
                if not matcher.consume_token(token):
                    return False
                consumed += 1
            if matcher.is_stopped():
                return False
            fill_next_token_bitmask(matcher, words, row)
            return True
        finally:
            matcher.rollback(consumed)

    def accept(self, tokens: Iterable[tuple[str, list[int]]]) -> tuple[list[str], dict[str, str]]:
        """Advance each constrained sequence by the tokens appended to it (several where it
        accepted drafts). Returns the sequences whose document is now complete (nothing but EOS
        could follow: they end here, also with ``ignore_eos``), and those whose matcher refused a
        token its mask allowed (a constraint needing bytes the vocabulary cannot spell: the
        request's failure), with why."""
        complete: list[str] = []
        failed: dict[str, str] = {}
        for seq_id, token_ids in tokens:
            matcher = self._matchers.get(seq_id)
            if matcher is None:
                continue
            for token_id in token_ids:
                if not matcher.consume_token(token_id):
                    # The mask allowed it: the constraint needs bytes this vocabulary cannot spell.
                    reason = matcher.get_error().strip().splitlines()[0][:200]
                    failed[seq_id] = f"structured_outputs is impossible with this model's vocabulary ({reason})"
                    break
                if matcher.is_stopped():
                    complete.append(seq_id)
                    break
        return complete, failed

    def fork(self, parent_seq_id: str, child_seq_id: str) -> None:
        """A new sequence continuing from ``parent_seq_id``'s tokens so far (a beam chosen twice)
        gets a copy of its grammar state; a no-op for an unconstrained parent."""
        matcher = self._matchers.get(parent_seq_id)
        if matcher is not None:
            self._matchers[child_seq_id] = matcher.deep_copy()

    def remove(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def abort(self, request_id: str) -> bool:
        """Forget a request still compiling (its compile finishes into the cache regardless);
        False when it was not waiting."""
        return self._pending.pop(request_id, None) is not None

    @property
    def num_sequences(self) -> int:
        return len(self._matchers)
