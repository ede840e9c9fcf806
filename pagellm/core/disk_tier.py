"""The disk tier's index: which full KV blocks are on disk, in least-recently-used order.

The tier sits under the pool's prefix cache (``--kv-offload-dir``). A cached block is written
when the pool takes it for reuse (by the step that reuses it, before its forward overwrites it),
and every cached block when the engine stops, each once; a prefix lookup that ends in the pool
goes on here, and the blocks found are read into fresh pool blocks before the request computes
the rest. This index decides; the worker (``worker/disk_tier_io.py``) moves the bytes and reports
which loads held. Entries past ``capacity_bytes`` are dropped oldest-used first.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagellm.core.kv_cache_utils import BlockHash
from pagellm.disk_tier_files import HEADER, TierLayout, make_room, scan_entries

logger = logging.getLogger(__name__)


@dataclass
class DiskTierStats:
    """Cumulative counters, in blocks."""

    queries: int = 0  # blocks looked up on disk (past an admitted request's pool hits)
    hits: int = 0  # of those, found in the index (and sent to be loaded)
    loaded: int = 0  # blocks loaded into the pool (the worker read and checked them)
    load_failures: int = 0  # entries the worker refused (missing, short, corrupt): recomputed
    stored: int = 0  # blocks sent to be written
    dropped: int = 0  # entries dropped to keep within the size, or refused
    failed_writes: int = 0  # blocks the worker could not write (disk full, read-only, writes behind)
    # What the worker's files did (bytes; seconds of its reader and writer threads).
    bytes_read: int = 0
    read_seconds: float = 0.0
    bytes_written: int = 0
    write_seconds: float = 0.0


class DiskTierIndex:
    """The hashes on disk, least recently used first; ``entry_bytes`` each, at most ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, entry_bytes: int, existing: Iterable[BlockHash] = ()) -> None:
        if entry_bytes < 1:
            raise ValueError(f"entry_bytes must be >= 1, got {entry_bytes}")
        self.capacity = capacity_bytes // entry_bytes  # entries
        if self.capacity < 1:
            raise ValueError(f"kv_offload_size of {capacity_bytes} bytes holds no block; one takes {entry_bytes} bytes")
        self.entry_bytes = entry_bytes
        self._entries: OrderedDict[BlockHash, None] = OrderedDict((h, None) for h in existing)
        self._deletes: dict[BlockHash, None] = {}  # (ordered: the files to remove with the next step)
        self.stats = DiskTierStats()
        self._trim()

    @classmethod
    def open(cls, layout: TierLayout, size: int) -> DiskTierIndex:
        """The index of the entries already in ``layout``'s folder (an earlier run's), within what
        ``size`` leaves it beside other configurations' folders (``make_room``)."""
        start = time.monotonic()
        room = make_room(layout, size)
        existing = scan_entries(layout)
        entry_bytes = HEADER.size + layout.payload_bytes
        if room < entry_bytes:
            others = f" beside the {size - room} bytes other engines' folders in it hold" if room < size else ""
            raise ValueError(f"kv_offload_size of {size} bytes leaves {room} for this model's KV blocks{others}; one "
                             f"takes {entry_bytes} bytes")  # fmt: skip
        index = cls(room, entry_bytes, existing)
        logger.info("disk tier %s: %d entries of %d bytes found in %.2fs (room for %d)", layout.folder, len(existing),
                    index.entry_bytes, time.monotonic() - start, index.capacity)  # fmt: skip
        return index

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.entry_bytes

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` are on disk (nothing is marked: the request may not be admitted)."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._entries:
                break
            count += 1
        return count

    def record_lookup(self, num_queried: int, hits: Sequence[BlockHash]) -> None:
        """Count an admitted request's lookup, and mark the entries it loads used."""
        self.stats.queries += num_queried
        self.stats.hits += len(hits)
        self.touch(hits)

    def touch(self, hashes: Iterable[BlockHash]) -> None:
        """Mark entries used (their blocks were hit in the pool)."""
        for block_hash in hashes:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)

    def add(self, block_hash: BlockHash) -> bool:
        """Record a block sent to be written; False if it is there already (nothing to write)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return False
        self._entries[block_hash] = None
        self._deletes.pop(block_hash, None)  # (dropped, then computed again: written, not removed)
        self.stats.stored += 1
        self._trim()
        return True

    def drop(self, block_hash: BlockHash) -> None:
        """Forget an entry the worker could not write or read (its file is removed)."""
        if self._entries.pop(block_hash, False) is None:
            self.stats.dropped += 1
            self._deletes[block_hash] = None

    def take_deletes(self) -> list[BlockHash]:
        """The entries whose files the worker removes with the next step."""
        deletes, self._deletes = list(self._deletes), {}
        return deletes

    def _trim(self) -> None:
        while len(self._entries) > self.capacity:
            block_hash, _ = self._entries.popitem(last=False)
            self._deletes[block_hash] = None
            self.stats.dropped += 1
