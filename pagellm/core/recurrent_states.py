"""A hybrid model's recurrent states as the scheduler sees them: the slot each running sequence
holds (``state_slots.py``), the prefix cache's snapshots where scan layers keep them apart
(``state_snapshots.py``), and what the worker does with both around the next step's forward:
slots copied (a sample born from its parent, a beam forked), started from a snapshot (a prefix
hit), saved into a snapshot (a point reached). Tensor-free; the scheduler owns one for a hybrid
model.

A beam search keeps as many slots as it has beams from the admission of its first beam until its
last beam lets go of one: the slots its beams do not hold are kept free for it (``_SearchSlots``),
so that a fork always finds one and a search never waits on another's slots halfway."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_cache_utils import KVCacheBlock
from pagellm.core.sequence import Sequence
from pagellm.core.state_slots import StateSlotPool
from pagellm.core.state_snapshots import StateSnapshots


@dataclass
class _SearchSlots:
    """A beam search's slots: those its beams hold, and those kept free for its forks and its
    beams admitted again after a preemption (together its width)."""

    held: int = 0
    kept: int = 0


class RecurrentStates:
    def __init__(self, slots: StateSlotPool, snapshots: StateSnapshots | None, manager: KVCacheManager) -> None:
        self.slots = slots
        self.snapshots = snapshots  # None: a state a KV block (short convolutions), or no prefix cache
        self._manager = manager
        # What the next step's worker does: before the forward, copies (slot -> slot) and then
        # loads ((source, slot): a cached block's snapshot, its block id or, with ``snapshots``, its
        # row); after it, saves ((slot, snapshot row)).
        self._copies: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._saves: list[tuple[int, int]] = []
        self._searches: dict[str, _SearchSlots] = {}
        self._kept = 0  # free slots kept for beam searches, all of them together

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """(copies, loads, saves) for the step being sent; the lists start afresh."""
        taken = self._copies, self._loads, self._saves
        self._copies, self._loads, self._saves = [], [], []
        return taken

    def slots_needed(self, seq: Sequence) -> int:
        """The free slots admitting ``seq`` takes: its own and one for each of its samples; the
        first beam of a search, as many as the search has beams; a later beam, none (one its
        search keeps)."""
        group = seq.beam_group
        if group is None:
            return 1 + len(seq.pending_forks)
        return 0 if group.key in self._searches else group.width

    def has_room(self, seq: Sequence) -> bool:
        return self.slots.num_free - self._kept >= self.slots_needed(seq)

    def usable_hits(
        self, seq: Sequence, cached: list[KVCacheBlock], step: int
    ) -> tuple[list[KVCacheBlock], int | None]:
        """The leading ``cached`` blocks ``seq`` may resume after (as far as a state is kept),
        and where that state is (their last block's id, or a snapshot row; None: no hit). Where
        more blocks are cached than a state is kept for, ``seq`` keeps the state at their end."""
        if self.snapshots is None:
            return cached, cached[-1].block_id if cached else None
        num, row = self.snapshots.ready(seq.block_hashes, len(cached), step)
        seq.state_junction = len(cached) * self._manager.block_size if len(cached) > num else 0
        return cached[:num], row

    def admit(self, seq: Sequence, source: int | None) -> None:
        """Slots for ``seq`` and its samples; it starts from the state kept at ``source`` (None:
        from zeros, the worker's fresh start at position 0)."""
        if seq.beam_group is not None:
            self._hold_for(seq)
        for holder in (seq, *seq.pending_forks):
            holder.state_slot = self.slots.allocate()
        if source is not None:
            assert seq.state_slot is not None
            self._loads.append((source, seq.state_slot))

    def release(self, seq: Sequence) -> None:
        """Give back the slots of ``seq`` and of its samples not yet born (taken again with its own
        when it is admitted again)."""
        for holder in (seq, *seq.pending_forks):
            if holder.state_slot is not None:
                slot = holder.state_slot
                self.slots.free(slot)
                holder.state_slot, holder.state_slot_sent = None, False
                # (a copy into it not yet made would land on whoever takes the slot next)
                self._copies = [c for c in self._copies if c[1] != slot]
                if holder.beam_group is not None:
                    self._let_go_for(holder)

    def _checkpoint(self, seq: Sequence) -> None:
        """``seq`` verifies drafts this step: keep its state from before them (from where a copy
        due before the same forward takes it, as a sample just born: copies read before any
        writes)."""
        assert seq.state_slot is not None
        source = next((src for src, dst in self._copies if dst == seq.state_slot), seq.state_slot)
        self._copies.append((source, self.slots.checkpoint_row(seq.state_slot)))

    def roll_back(self, seq: Sequence) -> None:
        """``seq``'s drafts were not all accepted: its state goes back to the checkpoint before
        the next forward (which computes the accepted tokens again)."""
        assert seq.state_slot is not None
        self._copies.append((self.slots.checkpoint_row(seq.state_slot), seq.state_slot))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A beam forked from ``parent``: a slot its search keeps, starting from the parent's
        state. A parent without a slot (preempted) gives none: the child waits and is computed
        from its first token, as the parent will be."""
        if parent.beam_group is None or parent.beam_group.key not in self._searches or parent.state_slot is None:
            return
        self._hold_for(child)
        child.state_slot = self.slots.allocate()
        assert child.state_slot is not None  # (kept free for the search)
        self._copies.append((parent.state_slot, child.state_slot))

    def _hold_for(self, beam: Sequence) -> None:
        """``beam`` takes one of the slots its search keeps (the first beam: the search starts,
        keeping as many as it has beams)."""
        assert beam.beam_group is not None
        search = self._searches.get(beam.beam_group.key)
        if search is None:
            search = self._searches[beam.beam_group.key] = _SearchSlots(kept=beam.beam_group.width)
            self._kept += beam.beam_group.width
        if search.kept < 1:
            raise RuntimeError(f"beam {beam.seq_id!r} would hold more slots than its search has beams")
        search.kept, search.held = search.kept - 1, search.held + 1
        self._kept -= 1

    def _let_go_for(self, beam: Sequence) -> None:
        """``beam`` gave its slot back: its search keeps it, or, where none of its beams holds
        one any more (ended, or all preempted), lets all of them go."""
        assert beam.beam_group is not None
        search = self._searches[beam.beam_group.key]
        search.held -= 1
        if search.held:
            search.kept += 1
            self._kept += 1
        else:
            del self._searches[beam.beam_group.key]
            self._kept -= search.kept

    def born(self, parent: Sequence, child: Sequence) -> None:
        """A sample born from its parent's prompt starts from the parent's state (slots taken with the parent's)."""
        if parent.state_slot is None or child.state_slot is None:
            raise RuntimeError(f"sample {child.seq_id!r} is born without a state slot")
        self._copies.append((parent.state_slot, child.state_slot))

    def cut(self, seq: Sequence, start: int, num_new: int) -> int:
        """A chunk ends where its state is to be kept (a snapshot point), so that the step's forward
        leaves that state in the slot."""
        if self.snapshots is None or num_new <= 1:
            return num_new
        return self.snapshots.chunk_end(start, start + num_new, seq.num_prompt_tokens, seq.state_junction) - start

    def scheduled(self, seq: Sequence, end: int, step: int, num_drafts: int = 0) -> None:
        """``seq`` computes up to ``end`` tokens this step: keep the state it then has where that
        is a point, or the end of a block its answer filled (replacing its last such state); with
        drafts among them, keep its state from before them instead (never a snapshot past its
        known tokens)."""
        if num_drafts:
            self._checkpoint(seq)
            return
        snapshots, block_size = self.snapshots, self._manager.block_size
        if snapshots is None or seq.state_slot is None:
            return
        point = snapshots.is_point(end, seq.num_prompt_tokens, seq.state_junction)
        answer = end > seq.num_prompt_tokens and end % block_size == 0
        if not (point or answer):
            return
        self._manager.update_block_hashes(seq)
        index = end // block_size - 1
        if index >= len(seq.block_hashes):
            return
        block_hash = seq.block_hashes[index]
        row = snapshots.reserve(block_hash, step)
        if row is not None:
            self._saves.append((seq.state_slot, row))
        if answer:  # (its last answer-block state goes; one at a point, or kept before by another, stays)
            if seq.answer_snapshot is not None:
                snapshots.drop(seq.answer_snapshot)
            seq.answer_snapshot = block_hash if row is not None and not point else None
