"""The pool of all KV blocks: allocation, reference counts, freeing and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable

from pagellm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """Owns every ``KVCacheBlock``.

    A block is in exactly one of three states: in use (ref_cnt > 0, not in the free
    queue); free and cached (ref_cnt == 0, in the free queue, still has a hash and can
    be revived by a prefix hit); free and empty (ref_cnt == 0, in the free queue, no hash).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.num_shared_blocks = 0  # blocks with ref_cnt > 1, kept up to date for metrics
        # (block id, hash) of the cached blocks marked ``spill`` taken for reuse, for a disk tier to
        # write before they are overwritten (``KVCacheManager`` takes them).
        self.evicted: list[tuple[int, BlockHash]] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cache entries."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} KV blocks but only {self.num_free_blocks} are free")
        new_blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds join the free queue's tail."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 1:
                self.num_shared_blocks -= 1
            elif block.ref_cnt == 0:
                self.free_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a prefix hit or a fork), reviving free cached ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            elif block.ref_cnt == 1:
                self.num_shared_blocks += 1
            block.ref_cnt += 1

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a block that just became full under its prefix hash."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, block)

    def uncache(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the prefix cache (its K/V cannot be trusted)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if block.spill:
            self.evicted.append((block.block_id, block.block_hash))
            block.spill = False
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
