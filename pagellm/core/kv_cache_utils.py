"""KV cache blocks and the free-block queue (an intrusive doubly linked list).

The free queue is also the eviction order: blocks whose reference count drops to
zero join its tail, and new blocks are taken from its head, so a cached block that
nobody uses is reclaimed least-recently-freed first. A cached block that is hit
again is unlinked from the middle in O(1).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = int


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """Metadata of one physical KV block (the tensors live in the worker)."""

    block_id: int
    ref_cnt: int = 0
    # Set only while the block is full and registered in the prefix cache.
    block_hash: BlockHash | None = None
    # Written to the disk tier when it is evicted: registered with a disk tier by a step that has
    # run (its K/V computed), and no adapter's.
    spill: bool = False
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    @property
    def in_free_queue(self) -> bool:
        return self.prev_free is not None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free KV cache block left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.in_free_queue:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (next to be reused) to tail; for tests and debugging."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


_NO_PARENT = b"\x00" * 16


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Iterable[int], extra_key: str | None = None) -> BlockHash:
    """Key of a full block: a 128-bit digest of (parent key, token ids, extra key).

    Chaining the parent's key makes equal keys mean equal whole prefixes; a
    cryptographic digest makes a collision (two prefixes sharing KV) practically impossible.
    """
    digest = hashlib.sha256(_NO_PARENT if parent_hash is None else parent_hash.to_bytes(16, "little"))
    digest.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        digest.update(b"\x01" + extra_key.encode())
    return int.from_bytes(digest.digest()[:16], "little")
