"""KV cache manager: blocks handed out only when needed, all returned on free."""

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams


def make_request(rid: str, num_prompt: int) -> Request:
    return Request(rid, list(range(num_prompt)), SamplingParams(), max_tokens=100)


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
