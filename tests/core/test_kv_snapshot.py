"""The read-only snapshot of the queues and the KV pool (the server's live page), with exact block ids."""

import numpy as np
import pytest

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_snapshot import OWNER_CACHED_FREE, OWNER_FREE, OWNER_UNLISTED, take_kv_snapshot
from pagellm.core.sequence import Sequence, SequenceStatus
from pagellm.core.scheduler import Scheduler
from pagellm.sampling_params import SamplingParams
from pagellm.step import ModelRunnerOutput, SchedulerOutput

B = 4  # block size
SYSTEM = list(range(100, 108))  # two full blocks every prompt below starts with


def make_scheduler(num_blocks=12, max_num_seqs=8, budget=64):
    return Scheduler(KVCacheManager(num_blocks, B, enable_caching=True), max_num_seqs, budget, max_model_len=64)


def make_request(rid, tokens, max_tokens=8):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = {seq: token for r in out.scheduled if r.sample for seq in [r.seq_id, *(f.seq_id for f in r.forks)]}
    scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    return out


def test_shared_prefix_shows_ref_count_two_owners_and_positions():
    s = make_scheduler()
    s.add_sequence(make_request("a", [*SYSTEM, 1, 2]))  # blocks 0 1 2
    step(s)
    s.add_sequence(make_request("b", [*SYSTEM, 3]))  # hits 0 1, then block 3
    step(s)
    assert s.kv_cache_manager.get_block_ids("b") == [0, 1, 3]
    snap = take_kv_snapshot(s)
    assert [r.seq_id for r in snap.sequences] == ["a", "b"]
    assert snap.owner.tolist() == [0, 0, 0, 1] + [OWNER_FREE] * 8  # shared blocks: the oldest holder
    assert snap.ref_cnt.tolist() == [2, 2, 1, 1] + [0] * 8
    assert snap.position.tolist()[:4] == [0, 1, 2, 2]
    assert snap.cached.tolist()[:4] == [1, 1, 0, 0]  # the full prompt blocks are in the prefix cache
    assert (snap.num_blocks, snap.num_cells, snap.blocks_per_cell, snap.block_size) == (12, 12, 1, B)
    assert (snap.num_shared_blocks, snap.num_free_blocks, snap.num_cached_free_blocks) == (2, 8, 0)
    a, b = snap.sequences
    assert (a.status, a.num_computed_tokens, a.num_tokens, a.num_prompt_tokens, a.block_ids) == (
        "running", 11, 12, 10, [0, 1, 2])
    assert (b.status, b.num_cached_tokens, b.num_computed_tokens, b.num_tokens, b.block_ids) == (
        "running", 8, 9, 10, [0, 1, 3])
    assert (snap.num_running, snap.num_waiting, snap.num_preempted) == (2, 0, 0)


def test_finished_request_leaves_cached_free_blocks():
    s = make_scheduler()
    s.add_sequence(make_request("a", [*SYSTEM, 1, 2]))
    step(s)
    s.finish_sequences(["a"], SequenceStatus.FINISHED_ABORTED)
    snap = take_kv_snapshot(s)
    assert snap.sequences == []
    assert snap.owner.tolist() == [OWNER_CACHED_FREE, OWNER_CACHED_FREE] + [OWNER_FREE] * 10
    assert snap.ref_cnt.tolist() == [0] * 12 and snap.cached.tolist()[:3] == [1, 1, 0]
    assert (snap.num_free_blocks, snap.num_cached_free_blocks, snap.num_shared_blocks) == (12, 2, 0)
    # A new prompt with the same prefix revives them: owned again, by the new request.
    s.add_sequence(make_request("c", [*SYSTEM, 9]))
    step(s)
    snap = take_kv_snapshot(s)
    assert snap.owner.tolist()[:3] == [0, 0, OWNER_FREE] and snap.ref_cnt.tolist()[:2] == [1, 1]


def test_waiting_and_preempted_requests_are_listed_after_running_ones():
    s = make_scheduler(num_blocks=4, budget=64)
    s.add_sequence(make_request("a", range(8), max_tokens=20))  # 2 blocks
    s.add_sequence(make_request("b", range(20, 28), max_tokens=20))  # 2 blocks: the pool is full
    step(s)
    s.add_sequence(make_request("c", range(40, 44)))
    step(s)  # a's 9th token needs a block: b (the youngest) is preempted
    snap = take_kv_snapshot(s)
    assert [(r.seq_id, r.status) for r in snap.sequences] == [("a", "running"), ("b", "preempted"),
                                                                  ("c", "waiting")]
    assert (snap.num_running, snap.num_waiting, snap.num_preempted) == (1, 2, 1)
    b = snap.sequences[1]
    assert (b.num_computed_tokens, b.num_preemptions, b.block_ids) == (0, 1, [])
    assert (snap.owner >= 0).sum() == 3 and set(snap.owner[snap.owner >= 0].tolist()) == {0}


def test_unlisted_holders_and_table_bounds():
    s = make_scheduler(num_blocks=12)
    for i in range(3):
        s.add_sequence(make_request(f"r{i}", range(10 * i, 10 * i + 6)))  # 2 blocks each, no sharing
    step(s)
    snap = take_kv_snapshot(s, max_requests=1, max_table_blocks=1)
    assert [r.seq_id for r in snap.sequences] == ["r0"]
    assert snap.sequences[0].block_ids == [0] and snap.sequences[0].num_blocks == 2
    assert snap.owner.tolist()[:6] == [0, 0, OWNER_UNLISTED, OWNER_UNLISTED, OWNER_UNLISTED, OWNER_UNLISTED]


def test_fork_shares_every_block_of_the_parent():
    s = make_scheduler()
    parent = make_request("p#0", range(6))
    child = Sequence("p#1", list(range(6)), SamplingParams(max_tokens=8), max_tokens=8)
    s.add_sequence(parent, [child])
    assert [r.status for r in take_kv_snapshot(s).sequences] == ["waiting", "forking"]
    step(s)  # the prompt is computed, then the sample forks
    snap = take_kv_snapshot(s)
    assert [(r.seq_id, r.block_ids) for r in snap.sequences] == [("p#0", [0, 1]), ("p#1", [0, 1])]
    assert snap.ref_cnt.tolist()[:2] == [2, 2] and snap.owner.tolist()[:2] == [0, 0]
    step(s)  # both write their 8th token into the shared, partly full block 1: the first to write copies it
    snap = take_kv_snapshot(s)
    assert [r.block_ids for r in snap.sequences] == [[0, 2], [0, 1]]
    pool = s.kv_cache_manager.block_pool
    assert snap.ref_cnt.tolist() == [b.ref_cnt for b in pool.blocks]  # counted from the tables: the same


def test_big_pool_is_aggregated_into_cells():
    s = make_scheduler(num_blocks=10)
    s.add_sequence(make_request("a", [*SYSTEM, 1, 2]))  # blocks 0 1 2
    step(s)
    s.add_sequence(make_request("b", [*SYSTEM, 3]))  # 0 1 shared, block 3
    step(s)
    s.finish_sequences(["a"], SequenceStatus.FINISHED_ABORTED)  # block 2 free; 0 1 still b's
    snap = take_kv_snapshot(s, max_cells=4)  # 10 blocks in cells of 3: [0 1 2] [3 4 5] [6 7 8] [9]
    assert (snap.blocks_per_cell, snap.num_cells) == (3, 4)
    assert snap.owner.tolist() == [0, 0, OWNER_FREE, OWNER_FREE]
    assert snap.ref_cnt.tolist() == [1, 1, 0, 0] and snap.position.tolist() == [-1] * 4
    assert snap.num_cached_free_blocks == 0 and snap.build_seconds > 0
    s.finish_sequences(["b"], SequenceStatus.FINISHED_ABORTED)  # blocks 0 1 (cached) free: cell 0 cached-free
    snap = take_kv_snapshot(s, max_cells=4)
    assert snap.owner.tolist() == [OWNER_CACHED_FREE, OWNER_FREE, OWNER_FREE, OWNER_FREE]
    assert snap.cached.tolist() == [1, 0, 0, 0] and snap.num_cached_free_blocks == 2


def test_snapshot_changes_nothing_and_rejects_bad_bounds():
    s = make_scheduler()
    s.add_sequence(make_request("a", [*SYSTEM, 1]))
    step(s)
    pool = s.kv_cache_manager.block_pool
    before = ([b.ref_cnt for b in pool.blocks], pool.free_queue.block_ids(), dict(pool.cached_blocks))
    take_kv_snapshot(s)
    assert before == ([b.ref_cnt for b in pool.blocks], pool.free_queue.block_ids(), dict(pool.cached_blocks))
    with pytest.raises(ValueError):
        take_kv_snapshot(s, max_cells=0)
    assert np.asarray(take_kv_snapshot(s, max_requests=0).owner).tolist()[:3] == [OWNER_UNLISTED] * 3
