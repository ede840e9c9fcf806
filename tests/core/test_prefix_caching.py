"""Sharing in the KV cache manager: prefix hits, LRU eviction, fork and copy-on-write.

Every test asserts exact block ids, reference counts and free-queue (eviction) order.
"""

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sequence import Sequence
from pagellm.sampling_params import SamplingParams

B = 4  # block size


def make_request(rid, tokens, salt=None, **params):
    return Sequence(rid, list(tokens), SamplingParams(**params), max_tokens=16, cache_salt=salt)


def admit(manager, seq):
    """What the scheduler does for a waiting request: prefix lookup, then allocate the rest."""
    hits = manager.get_computed_blocks(seq)
    num_new = seq.num_tokens - len(hits) * B
    assert manager.allocate_slots(seq, num_new, hits)
    manager.record_prefix_lookup(seq.num_tokens, len(hits) * B)
    seq.num_computed_tokens += num_new
    return [b.block_id for b in hits]


def refs(manager):
    return [b.ref_cnt for b in manager.block_pool.blocks]


def free_order(manager):
    return manager.block_pool.free_queue.block_ids()


def test_shared_prefix_reuses_full_blocks_and_counts_hits():
    m = KVCacheManager(num_blocks=10, block_size=B)
    a = make_request("a", range(10))  # blocks: [0..3] [4..7] [8 9]
    assert admit(m, a) == []
    assert m.get_block_ids("a") == [0, 1, 2]
    b = make_request("b", [*range(8), 50, 51, 52])  # same first two blocks
    assert admit(m, b) == [0, 1]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert refs(m)[:4] == [2, 2, 1, 1]
    assert (m.stats.queries, m.stats.hits) == (10 + 11, 8)


def test_last_token_always_computed_even_on_full_hit():
    m = KVCacheManager(num_blocks=10, block_size=B)
    admit(m, make_request("a", range(8)))
    b = make_request("b", range(8))  # identical prompt, exactly two blocks
    assert admit(m, b) == [0]  # the second block holds the last token: recomputed
    assert b.num_computed_tokens == 8
    assert m.get_block_ids("b") == [0, 2]


def test_cache_salt_isolates_tenants():
    m = KVCacheManager(num_blocks=10, block_size=B)
    admit(m, make_request("a", range(9), salt="tenant-1"))
    assert admit(m, make_request("b", range(9), salt="tenant-2")) == []
    assert admit(m, make_request("c", range(9), salt="tenant-1")) == [0, 1]


def test_prompt_logprobs_requests_skip_the_cache():
    m = KVCacheManager(num_blocks=10, block_size=B)
    admit(m, make_request("a", range(9)))
    assert admit(m, make_request("b", range(9), prompt_logprobs=1)) == []


def test_caching_off_never_hits():
    m = KVCacheManager(num_blocks=10, block_size=B, enable_caching=False)
    admit(m, make_request("a", range(9)))
    assert admit(m, make_request("b", range(9))) == []
    assert m.block_pool.cached_blocks == {}


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    m = KVCacheManager(num_blocks=6, block_size=B)
    a = make_request("a", range(9))  # blocks 0, 1 full (cached), 2 partial
    admit(m, a)
    m.free(a)
    # Freed in reverse: the partial tail first, so it is reused first.
    assert free_order(m) == [3, 4, 5, 2, 1, 0]
    assert refs(m) == [0] * 6
    b = make_request("b", [*range(8), 77])
    assert admit(m, b) == [0, 1]  # revived from the free queue, not recomputed
    assert refs(m) == [1, 1, 0, 1, 0, 0] and m.get_block_ids("b") == [0, 1, 3]
    assert free_order(m) == [4, 5, 2]
    m.free(b)
    assert free_order(m) == [4, 5, 2, 3, 1, 0]
    # A new prompt needing 5 blocks evicts from the head: 4, 5, 2, 3 and then cached block 1.
    c = make_request("c", range(100, 118))
    admit(m, c)
    assert m.get_block_ids("c") == [4, 5, 2, 3, 1]
    assert free_order(m) == [0]
    m.free(c)
    assert free_order(m) == [0, 1, 3, 2, 5, 4]
    # Block 0 still holds the cached first block of "a"; block 1's old entry was evicted.
    d = make_request("d", [*range(8), 5])
    assert admit(m, d) == [0]
    assert m.get_block_ids("d") == [0, 1, 3]


def test_fork_shares_blocks_and_copy_on_write_copies_only_the_written_block():
    m = KVCacheManager(num_blocks=10, block_size=B)
    parent = make_request("p", range(6))  # block 0 full, block 1 holds 2 tokens
    admit(m, parent)
    child = make_request("c", range(6))
    m.fork(parent, child)
    assert m.get_block_ids("c") == [0, 1] and refs(m)[:2] == [2, 2]
    assert child.num_computed_tokens == 6
    # The parent writes token 6 into shared block 1: it gets a private copy first.
    assert m.allocate_slots(parent, 1)
    assert m.get_block_ids("p") == [0, 2]
    assert m.take_block_copies() == [(1, 2)]
    assert refs(m)[:3] == [2, 1, 1]
    # The child is now block 1's only owner: it writes in place, no copy.
    assert m.allocate_slots(child, 1)
    assert m.get_block_ids("c") == [0, 1]
    assert m.take_block_copies() == []
    assert m.stats.cow_copies == 1 and m.stats.forks == 1
    # Both need a new block for token 8: fresh blocks, no copies.
    parent.num_computed_tokens = child.num_computed_tokens = 7
    assert m.allocate_slots(parent, 2) and m.allocate_slots(child, 2)
    assert m.get_block_ids("p") == [0, 2, 3] and m.get_block_ids("c") == [0, 1, 4]
    assert m.take_block_copies() == []
    # Blocks are freed only when the last owner lets go.
    m.free(parent)
    assert refs(m)[:5] == [1, 1, 0, 0, 1]
    m.free(child)
    assert refs(m) == [0] * 10 and m.num_free_blocks == 10


def test_fork_at_block_boundary_needs_no_copy():
    m = KVCacheManager(num_blocks=10, block_size=B)
    parent = make_request("p", range(8))
    admit(m, parent)
    child = make_request("c", range(8))
    m.fork(parent, child)
    assert m.allocate_slots(parent, 1) and m.allocate_slots(child, 1)
    assert m.take_block_copies() == []
    assert m.get_block_ids("p") == [0, 1, 2] and m.get_block_ids("c") == [0, 1, 3]


def test_copy_on_write_is_all_or_nothing():
    m = KVCacheManager(num_blocks=2, block_size=B)
    parent = make_request("p", range(6))
    admit(m, parent)
    child = make_request("c", range(6))
    m.fork(parent, child)
    assert not m.allocate_slots(parent, 1)  # no free block for the private copy
    assert m.get_block_ids("p") == [0, 1] and m.take_block_copies() == []
    assert refs(m) == [2, 2]


def test_allocation_counts_revived_blocks_against_free_space():
    m = KVCacheManager(num_blocks=3, block_size=B)
    a = make_request("a", range(9))
    admit(m, a)
    m.free(a)  # blocks 0, 1 cached and free; 3 free in all
    b = make_request("b", [*range(8), *range(200, 206)])  # hits 2 blocks, needs 2 more: 4 > 3
    hits = m.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert not m.allocate_slots(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 0 and refs(m) == [0, 0, 0] and m.num_free_blocks == 3
