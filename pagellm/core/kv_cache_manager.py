"""Maps requests to their KV blocks: the scheduler-facing API of the block pool."""

from __future__ import annotations

from pagellm.core.block_pool import BlockPool
from pagellm.core.kv_cache_utils import KVCacheBlock
from pagellm.core.request import Request
from pagellm.utils import cdiv


class KVCacheManager:
    """Gives each request the blocks its tokens need, on demand, and takes them back.

    A request holding ``k`` tokens owns ``ceil(k / block_size)`` blocks: a new block is
    taken only when the last one is full, so at most one block per request is partly empty.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """How many more blocks ``request`` needs to also hold ``num_new_tokens`` tokens."""
        held = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - held)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request``; all or nothing.

        Returns False (and changes nothing) when the pool has too few free blocks.
        """
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > self.block_pool.num_free_blocks:
            return False
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if needed:
            blocks.extend(self.block_pool.get_new_blocks(needed))
        return True

    def free(self, request: Request) -> None:
        """Return all of a request's blocks, last block first so tails are reused first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
