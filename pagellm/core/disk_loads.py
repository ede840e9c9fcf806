"""The sequences loading blocks from the disk tier, between the step that starts their load and
the step whose output says it is in (``core/disk_tier.py``).

Such a sequence is running: it holds a seat and its blocks, and is neither scheduled nor
preempted meanwhile (the worker copies into its blocks at the start of some later step). One that
ends while loading has its load dropped with the next step, before the worker copies anything:
its blocks may be another sequence's by then.
"""

from __future__ import annotations

from collections.abc import KeysView

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_cache_utils import KVCacheBlock
from pagellm.core.sequence import Sequence
from pagellm.step import KVLoad, ModelRunnerOutput


class DiskLoads:
    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self._loading: dict[str, KVLoad] = {}
        self._hashes: set[int] = set()  # the blocks being loaded (a request needing one waits for them)
        self._starting: list[KVLoad] = []  # loads the next step starts
        # Loads the next steps drop, sent with every step until one returns (a step that fails
        # before the worker reads them must not lose them; a drop it already made is ignored).
        self._cancels: list[str] = []

    @property
    def seq_ids(self) -> KeysView[str]:
        return self._loading.keys()

    def start(self, seq: Sequence, cached: list[KVCacheBlock], num_disk: int, headroom: int) -> bool:
        """Take ``seq``'s pool hits and blocks for its first ``num_disk`` entries on disk (as many
        as are free beyond ``headroom``: the blocks the running sequences and its own rest need
        next); False (nothing changed) if none is, or if another request is loading the first of
        them (they will be pool hits once in: read once, shared)."""
        free = self.manager.num_free_blocks - sum(1 for b in cached if b.ref_cnt == 0)
        num_disk = min(num_disk, free - headroom)
        if num_disk < 1 or seq.block_hashes[len(cached)] in self._hashes:
            return False
        load = self.manager.start_load(seq, cached, num_disk)
        if load is None:
            return False
        self.manager.record_prefix_lookup(seq.num_tokens, len(cached) * self.manager.block_size)
        self._loading[seq.seq_id] = load
        self._hashes.update(load.hashes)
        self._starting.append(load)
        return True

    def end(self, seq_id: str) -> None:
        """``seq_id`` ended (whatever its state): a load of its in progress is dropped."""
        load = self._loading.pop(seq_id, None)
        if load is not None:
            self._hashes.difference_update(load.hashes)
            if load in self._starting:  # (never sent: nothing to drop)
                self._starting.remove(load)
            else:
                self._cancels.append(seq_id)

    def take(self) -> tuple[list[KVLoad], list[str]]:
        """The loads the next step starts, and those it drops."""
        starting, self._starting = self._starting, []
        return starting, list(self._cancels)

    def finish(self, sequences: dict[str, Sequence], runner_output: ModelRunnerOutput) -> None:
        """Advance the sequences whose loads the step copied in (they compute the rest next)."""
        self.manager.apply_disk_report(runner_output.disk_tier)
        self._cancels.clear()  # (the worker has made them)
        for seq_id, num_loaded in runner_output.kv_loaded.items():
            load = self._loading.pop(seq_id, None)
            if load is None:
                continue  # (ended meanwhile: the worker dropped it at the next step)
            self._hashes.difference_update(load.hashes)
            seq = sequences[seq_id]
            self.manager.finish_load(seq, load, num_loaded)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
