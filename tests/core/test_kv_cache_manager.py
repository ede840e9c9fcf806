"""KV cache manager: blocks handed out only when needed, all returned on free."""

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sequence import Sequence
from pagellm.sampling_params import SamplingParams


def make_request(rid: str, num_prompt: int) -> Sequence:
    return Sequence(rid, list(range(num_prompt)), SamplingParams(), max_tokens=100)


def test_allocate_on_demand_one_block_at_a_time():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", 5)
    assert manager.allocate_slots(req, 5)  # 5 tokens -> 2 blocks
    assert manager.get_block_ids("a") == [0, 1]
    req.num_computed_tokens = 5
    assert manager.allocate_slots(req, 1)  # token 6 fits in block 1
    assert manager.get_block_ids("a") == [0, 1]
    req.num_computed_tokens = 8
    assert manager.num_blocks_needed(req, 1) == 1
    assert manager.allocate_slots(req, 1)  # token 9 needs a third block
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.num_free_blocks == 7


def test_allocation_is_all_or_nothing():
    manager = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request("a", 8), make_request("b", 8)
    assert manager.allocate_slots(a, 8)
    assert not manager.allocate_slots(b, 8)
    assert manager.get_block_ids("b") == []
    assert manager.num_free_blocks == 1


def test_free_returns_all_blocks_in_reverse_order():
    manager = KVCacheManager(num_blocks=6, block_size=2)
    a, b = make_request("a", 5), make_request("b", 2)
    manager.allocate_slots(a, 5)
    manager.allocate_slots(b, 2)
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.get_block_ids("b") == [3]
    manager.free(a)
    # Tail blocks of a request are reused first.
    assert manager.block_pool.free_queue.block_ids() == [4, 5, 2, 1, 0]
    manager.free(b)
    assert manager.num_free_blocks == 6
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    manager.free(b)  # freeing twice is harmless: the request holds nothing
    assert manager.num_free_blocks == 6


def _refs(manager: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in manager.block_pool.blocks]


def _step(manager: KVCacheManager, req: Sequence, num_new: int) -> None:
    """Schedule ``num_new`` tokens of ``req`` and mark them computed (as a step does)."""
    assert manager.allocate_slots(req, num_new)
    req.num_computed_tokens += num_new


def test_a_sliding_window_releases_the_blocks_before_it():
    """Window 6, blocks of 4: a block is released once the step's first query no longer reaches it."""
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, sliding_window=6)
    req = make_request("a", 10)
    _step(manager, req, 10)  # positions 0-9: the first query (0) reads from position 0 on
    assert manager.get_block_ids("a") == [0, 1, 2] and _refs(manager) == [1, 1, 1, 0, 0, 0]
    for _ in range(2):  # queries at 10 and 11 read from 5 and 6 on: block 0 (positions 0-3) is released
        _step(manager, req, 1)
    assert manager.get_block_ids("a") == [0, 1, 2] and _refs(manager) == [0, 1, 1, 0, 0, 0]
    assert manager.num_held_blocks("a") == 2 and manager.num_free_blocks == 4
    for _ in range(4):  # 12-15: block 1 (4-7) goes at query 14 (reads from 9); block 3 is taken at 12
        _step(manager, req, 1)
    assert manager.get_block_ids("a") == [0, 1, 2, 3] and _refs(manager) == [0, 0, 1, 1, 0, 0]
    manager.free(req)  # only what it still holds: nothing is freed twice
    assert _refs(manager) == [0] * 6 and manager.num_free_blocks == 6


def test_a_released_block_goes_to_another_request_and_a_fork_shares_only_live_blocks():
    manager = KVCacheManager(num_blocks=5, block_size=2, enable_caching=False, sliding_window=2)
    a = make_request("a", 6)
    _step(manager, a, 6)  # blocks 0, 1, 2
    _step(manager, a, 1)  # the query at 6 reads 5 and 6: blocks 0, 1 released; block 3 for position 6
    assert manager.get_block_ids("a") == [0, 1, 2, 3] and _refs(manager) == [0, 0, 1, 1, 0]
    b = make_request("b", 2)
    _step(manager, b, 2)  # the free queue's head: block 4, then the released ones
    assert manager.get_block_ids("b") == [4]
    child = make_request("a#1", 6)
    manager.fork(a, child)
    assert manager.get_block_ids("a#1") == [0, 1, 2, 3] and _refs(manager) == [0, 0, 2, 2, 1]
    manager.free(a)
    manager.free(child)
    assert _refs(manager) == [0, 0, 0, 0, 1]


def test_prefix_hits_before_the_window_enter_the_table_released():
    """A repeated prompt: its hits before the first new token's window enter the table as
    released entries, not revived, so only the window's blocks count against the pool (a
    prompt longer than the pool then fits)."""
    manager = KVCacheManager(num_blocks=8, block_size=2, sliding_window=3)
    a = make_request("a", 11)
    for _ in range(11):  # one token a step: each block is cached when it fills, released behind
        _step(manager, a, 1)
    assert manager.get_block_ids("a") == [0, 1, 2, 3, 4, 5] and manager.num_held_blocks("a") == 2
    manager.free(a)
    b = make_request("b", 11)  # the same tokens: positions 0-9 (5 full blocks) are hits
    hits = manager.get_computed_blocks(b)
    assert [block.block_id for block in hits] == [0, 1, 2, 3, 4]
    assert manager.allocate_slots(b, 1, hits)
    # Position 10's window reads 8-10: blocks 0-3 (positions 0-7) are released at once.
    assert manager.get_block_ids("b") == [0, 1, 2, 3, 4, 6] and manager.tables["b"].num_released == 4
    assert b.num_computed_tokens == 10 and manager.num_held_blocks("b") == 2
    assert _refs(manager) == [0, 0, 0, 0, 1, 0, 1, 0] and manager.num_free_blocks == 6
    manager.free(b)
    assert manager.num_free_blocks == 8 and _refs(manager) == [0] * 8


def test_released_entries_are_never_cached_under_the_request_s_hashes():
    """A released block may now hold another request's tokens: the request's later prefix-cache
    registrations skip it (blocks are registered when they fill, before they are released)."""
    manager = KVCacheManager(num_blocks=4, block_size=2, sliding_window=2)
    a = make_request("a", 4)
    _step(manager, a, 4)  # blocks 0, 1 full and cached
    a.append_output_token(7)
    _step(manager, a, 1)  # the query at 4 reads 3 and 4: block 0 released (still cached, free); block 2
    assert _refs(manager) == [0, 1, 1, 0]
    other = Sequence("b", [90, 91, 92], SamplingParams(), max_tokens=10)
    _step(manager, other, 3)  # takes block 3, then block 0 (its cache entry evicted)
    assert manager.get_block_ids("b") == [3, 0] and manager.block_pool.blocks[0].block_hash is None
    a.append_output_token(8)
    _step(manager, a, 1)  # position 5 fills a's third block: registered; entry 0 (b's block now) is not
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.block_pool.blocks[2].block_hash is not None and manager.block_pool.blocks[0].block_hash is None
