"""Recurrent-state slots: where each running sequence of a hybrid model keeps the state its
recurrent layers carry from one token to the next (LFM2's short convolutions' last inputs).

A KV block holds a fixed span of tokens; a recurrent layer's state is one fixed-size record a
sequence, whatever its length. The scheduler hands each sequence a slot when it is admitted and
takes it back when it finishes or is preempted (a preempted sequence is recomputed from its
first token, into whatever slot it gets next); the worker holds the state tensors, one row a
slot (``worker/kv_cache.py``), and starts a row afresh when a sequence computes from position 0.
Tensor-free, like the block pool.
"""

from __future__ import annotations

import heapq


class StateSlotPool:
    """``num_slots`` slot ids, 0 .. num_slots - 1, each held by at most one sequence."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state slot pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
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

    def free(self, slot: int) -> None:
        """Give ``slot`` back; freeing a slot that is not held is an error (a double free)."""
        if slot not in self._held:
            raise ValueError(f"state slot {slot} is not held")
        self._held.remove(slot)
        heapq.heappush(self._free, slot)
