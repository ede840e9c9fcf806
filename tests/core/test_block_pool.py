"""Block pool and free queue: exact block ids, ref counts and eviction order."""

import pytest

from pagellm.core.block_pool import BlockPool
from pagellm.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens


def test_free_queue_popleft_append_remove_in_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[3])  # O(1) removal from the middle
    assert queue.block_ids() == [1, 2, 4]
    assert queue.num_free_blocks == 3
    queue.append(blocks[0])
    assert queue.block_ids() == [1, 2, 4, 0]
    with pytest.raises(ValueError):
        queue.append(blocks[0])
    with pytest.raises(ValueError):
        queue.remove(blocks[3])


def test_free_queue_popleft_empty_raises():
    queue = FreeKVCacheBlockQueue([])
    with pytest.raises(ValueError, match="no free"):
        queue.popleft()


def test_get_new_blocks_takes_from_head_with_ref_one():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.free_queue.block_ids() == [3]
    with pytest.raises(ValueError, match="only 1"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # a failed request takes nothing


def test_free_blocks_appends_to_tail_and_refcount_never_negative():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # a second owner
    assert a.ref_cnt == 2
    pool.free_blocks([b, a])
    assert b.ref_cnt == 0 and a.ref_cnt == 1
    assert pool.free_queue.block_ids() == [2, 3, 1]
    pool.free_blocks([a])
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a])
    assert a.ref_cnt == 0


def test_cached_block_is_revived_by_touch_and_evicted_when_reused():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_block(block, h)
    pool.free_blocks([block])
    # Free but still cached: a prefix hit revives it without allocating.
    assert pool.get_cached_block(h) is block
    pool.touch([block])
    assert block.ref_cnt == 1 and not block.in_free_queue
    pool.free_blocks([block])
    # Reused as a new block once it reaches the head: its cache entry goes (lazy eviction).
    assert pool.free_queue.block_ids() == [1, 2, 0]
    taken = pool.get_new_blocks(3)
    assert [b.block_id for b in taken] == [1, 2, 0]
    assert pool.get_cached_block(h) is None and block.block_hash is None


def test_usage():
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    assert pool.usage() == pytest.approx(0.25)


def test_hash_chain_depends_on_parent():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(h1, [3, 4]) == hash_block_tokens(h1, (3, 4))
    assert hash_block_tokens(None, [1, 2], "salt") != h1


def test_shared_block_count_follows_ref_counts():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.touch([a, b])
    pool.touch([a])
    assert pool.num_shared_blocks == 2  # a: 3 owners, b: 2
    pool.free_blocks([b])
    assert pool.num_shared_blocks == 1
    pool.free_blocks([a, a])
    assert pool.num_shared_blocks == 0 and a.ref_cnt == 1
