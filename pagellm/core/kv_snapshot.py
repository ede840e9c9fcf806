"""A read-only picture of the scheduler and the KV block pool, for the server's live page.

Built between steps (never inside one) from the core's own state, with array operations where
the work grows with the pool: the cost is one pass over the blocks requests hold plus one over
the prefix-cache map, never a pass over every request's tokens. The picture is bounded, whatever
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

from dataclasses import dataclass

import numpy as np

from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import Scheduler

# Owner codes of a cell that no listed request holds.
OWNER_FREE = -1  # free, no cached KV
OWNER_CACHED_FREE = -2  # free, but its KV is in the prefix cache (a later prompt may revive it)
OWNER_UNLISTED = -3  # held by a request beyond the listed ones

DEFAULT_MAX_REQUESTS = 64
DEFAULT_MAX_TABLE_BLOCKS = 256
DEFAULT_MAX_CELLS = 16384

_STATUS_NAMES = {
    RequestStatus.RUNNING: "running",
    RequestStatus.WAITING: "waiting",
    RequestStatus.PREEMPTED: "preempted",
    RequestStatus.WAITING_FOR_FORK: "forking",
}


@dataclass
class RequestView:
    """One listed request (a sequence: each sample of an n > 1 request is its own)."""

    request_id: str
    status: str  # running, waiting, preempted or forking (a sample waiting for its prompt's prefill)
    num_computed_tokens: int  # tokens whose K/V are in the cache
    num_tokens: int  # prompt + generated
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache at admission (-1: not admitted yet)
    num_preemptions: int
    num_blocks: int  # block-table entries (the released ones of a sliding window included)
    num_released: int  # leading entries released (outside the sliding window)
    block_ids: list[int]  # the table, logical -> physical, its first ``max_table_blocks`` entries


@dataclass
class KVSnapshot:
    """The pool cell by cell (arrays of ``num_cells``) and the listed requests.

    ``owner``: index into ``requests`` of the oldest listed holder, else an ``OWNER_*`` code;
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
    requests: list[RequestView]

    @property
    def num_cells(self) -> int:
        return int(self.owner.shape[0])


def listed_requests(scheduler: Scheduler, max_requests: int) -> list[Request]:
    """Running, then waiting (preempted ones in their place), then pending samples; at most ``max_requests``."""
    listed: list[Request] = []
    for queue in (scheduler.running, scheduler.waiting, *scheduler.pending_forks.values()):
        for request in queue:
            if len(listed) >= max_requests:
                return listed
            listed.append(request)
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
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    num_blocks = pool.num_blocks
    owner = np.full(num_blocks, OWNER_FREE, dtype=np.int16)
    ref_cnt = np.zeros(num_blocks, dtype=np.int32)
    cached = np.zeros(num_blocks, dtype=np.uint8)
    position = np.full(num_blocks, -1, dtype=np.int32)

    cached_ids = np.fromiter((b.block_id for b in pool.cached_blocks.values()), dtype=np.int64)
    cached[cached_ids] = 1
    owner[cached_ids] = OWNER_CACHED_FREE  # those in use are overwritten below

    listed = listed_requests(scheduler, max_requests)
    index = {request.request_id: i for i, request in enumerate(listed)}
    # Unlisted holders first, then listed ones youngest first: the oldest listed holder is written last.
    holders = sorted(manager.req_to_blocks.items(), key=lambda item: -index.get(item[0], len(listed)))
    for request_id, blocks in holders:
        released = manager.num_released.get(request_id, 0)
        held = blocks[released:]
        if not held:
            continue
        ids = np.fromiter((b.block_id for b in held), dtype=np.int64, count=len(held))
        owner[ids] = index.get(request_id, OWNER_UNLISTED)
        ref_cnt[ids] = np.fromiter((b.ref_cnt for b in held), dtype=np.int32, count=len(held))
        position[ids] = np.arange(released, len(blocks), dtype=np.int32)

    views = [_request_view(scheduler, request, max_table_blocks) for request in listed]
    num_cached_free = int(np.count_nonzero(owner == OWNER_CACHED_FREE))
    per_cell = -(-num_blocks // max_cells)
    if per_cell > 1:
        owner, ref_cnt, cached = _aggregate(owner, ref_cnt, cached, per_cell)
        position = np.full(owner.shape[0], -1, dtype=np.int32)
    preempted = sum(1 for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED)
    return KVSnapshot(
        block_size=manager.block_size,
        num_blocks=num_blocks,
        blocks_per_cell=per_cell,
        owner=owner,
        ref_cnt=np.minimum(ref_cnt, 255).astype(np.uint8),
        cached=cached,
        position=position,
        num_free_blocks=pool.num_free_blocks,
        num_cached_free_blocks=num_cached_free,
        num_shared_blocks=pool.num_shared_blocks,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preempted=preempted,
        num_forking=sum(len(children) for children in scheduler.pending_forks.values()),
        requests=views,
    )


def _request_view(scheduler: Scheduler, request: Request, max_table_blocks: int) -> RequestView:
    manager = scheduler.kv_cache_manager
    blocks = manager.req_to_blocks.get(request.request_id, ())
    return RequestView(
        request_id=request.request_id,
        status=_STATUS_NAMES.get(request.status, request.status.name.lower()),
        num_computed_tokens=request.num_computed_tokens,
        num_tokens=request.num_tokens,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        num_blocks=len(blocks),
        num_released=manager.num_released.get(request.request_id, 0),
        block_ids=[block.block_id for block in blocks[:max_table_blocks]],
    )


def _aggregate(
    owner: np.ndarray, ref_cnt: np.ndarray, cached: np.ndarray, per_cell: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cells of ``per_cell`` consecutive blocks: the most telling owner, the highest count, any cached."""
    num_cells = -(-owner.shape[0] // per_cell)
    pad = num_cells * per_cell - owner.shape[0]
    # Rank owners so that max() picks: listed (>= 0) > unlisted > cached-free > free.
    rank = np.where(owner >= 0, owner, np.select(
        [owner == OWNER_UNLISTED, owner == OWNER_CACHED_FREE], [-1, -2], default=-3)).astype(np.int16)
    rank = np.pad(rank, (0, pad), constant_values=-3).reshape(num_cells, per_cell).max(axis=1)
    cell_owner = np.select([rank >= 0, rank == -1, rank == -2], [rank, OWNER_UNLISTED, OWNER_CACHED_FREE],
                           default=OWNER_FREE).astype(np.int16)  # fmt: skip
    cell_ref = np.pad(ref_cnt, (0, pad)).reshape(num_cells, per_cell).max(axis=1)
    cell_cached = np.pad(cached, (0, pad)).reshape(num_cells, per_cell).max(axis=1)
    return cell_owner, cell_ref, cell_cached
