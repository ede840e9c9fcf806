"""Recurrent-state slots: where each running sequence of a hybrid model keeps the state its
recurrent layers carry from one token to the next (LFM2's short convolutions' last inputs).

A KV block holds a fixed span of tokens; a recurrent layer's state is one fixed-size record a
sequence, whatever its length. The scheduler hands each sequence a slot when it is admitted and
takes it back when it finishes or is preempted (a preempted sequence is recomputed from its
first token, into whatever slot it gets next); the worker holds the state tensors, one row a
slot (``worker/kv_cache.py``), and starts a row afresh when a sequence computes from position 0.
Under speculative decoding each slot has a checkpoint row too (after the slots and the snapshot
rows), where its state before a step's drafts is kept: drafts rejected, the state goes back to it
and the accepted tokens are computed again (``recurrent_states.py``). Tensor-free, like the block
pool.
"""

from __future__ import annotations

import heapq


class StateSlotPool:
    """``num_slots`` slot ids, 0 .. num_slots - 1, each held by at most one sequence; with
    ``checkpoints_from``, slot s's checkpoint row is ``checkpoints_from + s``."""

    def __init__(self, num_slots: int, checkpoints_from: int | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a state slot pool needs at least one slot, got {num_slots}")
        if checkpoints_from is not None and checkpoints_from < num_slots:
            raise ValueError(f"checkpoint rows start after the slots, not at {checkpoints_from}")
        self.num_slots = num_slots
        self.checkpoints_from = checkpoints_from
        self._free = list(range(num_slots))  # a heap: the lowest id first
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot's id (the lowest), or None when every slot is held."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._held.add(slot)
        return slot

    def checkpoint_row(self, slot: int) -> int:
        """The row keeping ``slot``'s state from before a step's drafts."""
        if self.checkpoints_from is None:
            raise ValueError("this pool keeps no checkpoints (no speculative decoding)")
        return self.checkpoints_from + slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back; freeing a slot that is not held is an error (a double free)."""
        if slot not in self._held:
            raise ValueError(f"state slot {slot} is not held")
        self._held.remove(slot)
        heapq.heappush(self._free, slot)
