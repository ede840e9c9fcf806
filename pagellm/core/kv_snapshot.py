"""A read-only picture of the scheduler and the KV block pool, for the server's live page.

Built between steps (never inside one) from the core's own state: one pass over the blocks
requests hold and one over the prefix-cache map (attribute reads in C, then array operations),
never a pass over the free blocks or over requests' tokens. ``build_seconds`` says what it cost,
so a caller can space its calls out (the server's feed does). The picture is bounded, whatever
the load:

- requests: at most ``max_requests`` are listed (running first, then waiting and preempted, each
  in queue order, then samples waiting for their fork); blocks held only by unlisted requests
  show the owner ``OWNER_UNLISTED``;
- block tables: at most ``max_table_blocks`` entries per listed request (``num_blocks`` says how
  many there are);
- the pool: at most ``max_cells`` cells. A bigger pool is shown in cells of
  ``blocks_per_cell`` consecutive blocks, each cell taking its most telling block (owned by a
  listed request > owned by an unlisted one > cached and free > free) and its highest
  reference count; ``position`` is then -1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_cache_utils import KVCacheBlock
from pagellm.core.sequence import Sequence, SequenceStatus
from pagellm.core.scheduler import Scheduler

# Owner codes of a cell that no listed request holds.
OWNER_FREE = -1  # free, no cached KV
OWNER_CACHED_FREE = -2  # free, but its KV is in the prefix cache (a later prompt may revive it)
OWNER_UNLISTED = -3  # held by a request beyond the listed ones

DEFAULT_MAX_REQUESTS = 64
DEFAULT_MAX_TABLE_BLOCKS = 256
DEFAULT_MAX_CELLS = 16384

_BLOCK_ID = attrgetter("block_id")
_REF_CNT = attrgetter("ref_cnt")
_NO_HOLDER = np.iinfo(np.int64).max

_STATUS_NAMES = {
    SequenceStatus.RUNNING: "running",
    SequenceStatus.WAITING: "waiting",
    SequenceStatus.PREEMPTED: "preempted",
    SequenceStatus.WAITING_FOR_FORK: "forking",
}


@dataclass
class SequenceView:
    """One listed sequence (a request's; each sample of an n > 1 request is its own)."""

    seq_id: str
    status: str  # running, waiting, preempted or forking (a sample waiting for its prompt's prefill)
    num_computed_tokens: int  # tokens whose K/V are in the cache
    num_tokens: int  # prompt + generated
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache at admission (-1: not admitted yet)
    num_preemptions: int
    num_blocks: int  # block-table entries (the released ones of a sliding window included)
    num_released: int  # leading entries released (outside the sliding window)
    block_ids: list[int]  # the table, logical -> physical, its first ``max_table_blocks`` entries
    priority: int = 0  # its effective priority (the priority policy: lower first, raised by waiting)


@dataclass
class KVSnapshot:
    """The pool cell by cell (arrays of ``num_cells``) and the listed sequences.

    ``owner``: index into ``sequences`` of the oldest listed holder, else an ``OWNER_*`` code;
    ``ref_cnt``: holders of the block (saturating at 255), more than one: shared (a prefix hit or
    a fork); ``cached``: the block's KV is registered in the prefix cache; ``position``: the
    block's index in its owner's table (its tokens are ``position * block_size`` onwards), -1
    where there is none.
    """

    block_size: int
    num_blocks: int
    blocks_per_cell: int
    owner: np.ndarray  # int16
    ref_cnt: np.ndarray  # uint8
    cached: np.ndarray  # uint8, 0 or 1
    position: np.ndarray  # int32
    num_free_blocks: int  # cached-free ones included
    num_cached_free_blocks: int
    num_shared_blocks: int
    num_running: int
    num_waiting: int  # preempted ones included
    num_preempted: int
    num_forking: int
    sequences: list[SequenceView]
    build_seconds: float = 0.0  # what taking it cost the engine
    # The disk tier under the pool (``core/disk_tier.py``): blocks it holds, and the most it may (0: none).
    disk_tier_blocks: int = 0
    disk_tier_capacity: int = 0

    @property
    def num_cells(self) -> int:
        return int(self.owner.shape[0])


def listed_sequences(scheduler: Scheduler, max_requests: int) -> list[Sequence]:
    """Running, then waiting (preempted ones in their place), then pending samples; at most ``max_requests``."""
    listed: list[Sequence] = []
    parents = (*scheduler.running, *scheduler.waiting)
    for queue in (scheduler.running, scheduler.waiting, *(p.pending_forks for p in parents if p.pending_forks)):
        for seq in queue:
            if len(listed) >= max_requests:
                return listed
            listed.append(seq)
    return listed


def take_kv_snapshot(
    scheduler: Scheduler,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    max_table_blocks: int = DEFAULT_MAX_TABLE_BLOCKS,
    max_cells: int = DEFAULT_MAX_CELLS,
) -> KVSnapshot:
    """The snapshot (see the module docstring); reads the scheduler and its KV manager, changes nothing."""
    if max_requests < 0 or max_table_blocks < 0 or max_cells < 1:
        raise ValueError("snapshot bounds must be >= 0 (max_cells >= 1)")
    started = time.perf_counter()
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    num_blocks = pool.num_blocks
    per_cell = -(-num_blocks // max_cells)
    num_cells = -(-num_blocks // per_cell)
    owner = np.full(num_cells, OWNER_FREE, dtype=np.int16)
    ref_cnt = np.zeros(num_cells, dtype=np.int32)
    cached = np.zeros(num_cells, dtype=np.uint8)
    position = np.full(num_cells, -1, dtype=np.int32)

    cached_blocks = list(pool.cached_blocks.values())
    cached_ids = np.fromiter(map(_BLOCK_ID, cached_blocks), dtype=np.int64, count=len(cached_blocks))
    cached_free = np.fromiter(map(_REF_CNT, cached_blocks), dtype=np.int32, count=len(cached_blocks)) == 0
    cached[cached_ids // per_cell] = 1
    owner[cached_ids[cached_free] // per_cell] = OWNER_CACHED_FREE  # held cells are overwritten below

    listed = listed_sequences(scheduler, max_requests)
    _mark_holders(manager, {r.seq_id: i for i, r in enumerate(listed)}, per_cell, owner, ref_cnt, position)
    views = [_sequence_view(manager, seq, max_table_blocks) for seq in listed]
    preempted = sum(1 for r in scheduler.waiting if r.status == SequenceStatus.PREEMPTED)
    return KVSnapshot(
        block_size=manager.block_size,
        num_blocks=num_blocks,
        blocks_per_cell=per_cell,
        owner=owner,
        ref_cnt=np.minimum(ref_cnt, 255).astype(np.uint8),
        cached=cached,
        position=position,
        num_free_blocks=pool.num_free_blocks,
        num_cached_free_blocks=int(np.count_nonzero(cached_free)),
        num_shared_blocks=pool.num_shared_blocks,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preempted=preempted,
        num_forking=sum(len(r.pending_forks) for queue in (scheduler.running, scheduler.waiting) for r in queue),
        sequences=views,
        build_seconds=time.perf_counter() - started,
        disk_tier_blocks=0 if manager.disk_tier is None else len(manager.disk_tier),
        disk_tier_capacity=0 if manager.disk_tier is None else manager.disk_tier.capacity,
    )


def _mark_holders(
    manager: KVCacheManager, index: dict[str, int], per_cell: int, owner: np.ndarray, ref_cnt: np.ndarray,
    position: np.ndarray,
) -> None:
    """Write each held cell's owner (the oldest listed holder of its blocks, else ``OWNER_UNLISTED``),
    highest reference count and (one block per cell) position, from one flat array of the held
    blocks' ids (no sort by holder: one ``minimum.at`` over (holder, position) keys)."""
    unlisted = len(index)
    held: list[KVCacheBlock] = []
    keys: list[int] = []  # per holder: its listed index (unlisted: after every listed one)
    lengths: list[int] = []
    starts: list[int] = []  # per holder: the table index of its first held block
    for seq_id, table in manager.tables.items():
        blocks, released = table.blocks, table.num_released
        if len(blocks) <= released:
            continue
        held.extend(blocks[released:])
        keys.append(index.get(seq_id, unlisted))
        lengths.append(len(blocks) - released)
        starts.append(released)
    if not held:
        return
    count = len(held)
    ids = np.fromiter(map(_BLOCK_ID, held), dtype=np.int64, count=count)
    # A block's reference count is the number of table entries that hold it (the allocator's
    # invariant: every reference is one), so it comes from the ids alone.
    blocks, references = np.unique(ids, return_counts=True)
    np.maximum.at(ref_cnt, blocks // per_cell, references.astype(np.int32))
    repeat = np.asarray(lengths)
    entry_position = np.zeros(count, dtype=np.int64)
    if per_cell == 1:
        offsets = np.cumsum(repeat) - repeat
        entry_position = np.arange(count) - np.repeat(offsets - np.asarray(starts), repeat)
    # Per cell, the smallest (holder key, position): the oldest listed holder wins.
    ranked = (np.repeat(np.asarray(keys, dtype=np.int64), repeat) << 32) | entry_position
    best = np.full(owner.shape[0], _NO_HOLDER, dtype=np.int64)
    np.minimum.at(best, ids // per_cell, ranked)
    held_cells = np.flatnonzero(best != _NO_HOLDER)
    winner = best[held_cells] >> 32
    owner[held_cells] = np.where(winner < unlisted, winner, OWNER_UNLISTED)
    if per_cell == 1:
        position[held_cells] = best[held_cells] & 0xFFFFFFFF


def _sequence_view(manager: KVCacheManager, seq: Sequence, max_table_blocks: int) -> SequenceView:
    table = manager.tables.get(seq.seq_id)
    blocks = table.blocks if table is not None else []
    return SequenceView(
        seq_id=seq.seq_id,
        status=_STATUS_NAMES.get(seq.status, seq.status.name.lower()),
        num_computed_tokens=seq.num_computed_tokens,
        num_tokens=seq.num_tokens,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        num_preemptions=seq.num_preemptions,
        num_blocks=len(blocks),
        num_released=table.num_released if table is not None else 0,
        block_ids=list(map(_BLOCK_ID, blocks[:max_table_blocks])),
        priority=seq.effective_priority,
    )
