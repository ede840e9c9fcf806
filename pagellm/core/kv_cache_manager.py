"""Maps requests to their KV blocks: the scheduler-facing API of the block pool.

A request holding ``k`` tokens owns ``ceil(k / block_size)`` blocks: a new block is
taken only when the last one is full, so at most one block per request is partly empty.

Sharing comes in two kinds, both by reference count:
- prefix caching: every full block is keyed by a hash chain of its tokens; a new
  request starts with all leading blocks whose keys are already in the pool;
- forks: a child sequence points at its parent's blocks. Before a sequence writes
  into a block someone else also holds, it gets a private copy (copy-on-write); the
  (src, dst) pairs are handed to the worker, which copies K/V before the forward pass.

Block table of one request, and what ``allocate_slots`` does to it::

    | cached/computed (read only) | partial last block | new blocks ...
                                  ^ num_computed_tokens: writes start here;
                                    if this block is shared, it is copied first

With a sliding window that every layer keeps (``sliding_window``: each query attends to its
last W positions), the blocks wholly before the window of the step's first query are
released as the request moves on: no later query reads them. Their entries stay in the
block table (positions keep their index) but are no longer the request's; the attention
masks those positions, so what another request writes there later is never used::

    | released (stale ids) | blocks the window still reads | partial last block | new ...

Prefix-cache hits before the window of a request's first new token are taken as released
entries at once (never revived): a prompt longer than the pool then fits, as the request
never holds more than its window and one step's tokens span.
"""

from __future__ import annotations

from collections.abc import Sequence as ReadOnlyList
from dataclasses import dataclass, field

from pagellm.core.block_pool import BlockPool
from pagellm.core.disk_tier import DiskTierIndex
from pagellm.core.kv_cache_utils import KVCacheBlock, hash_block_tokens
from pagellm.core.sequence import Sequence
from pagellm.step import DiskTierReport, KVLoad
from pagellm.utils import cdiv


@dataclass
class PrefixCacheStats:
    """Cumulative counters, in tokens and blocks."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from cached blocks
    cow_copies: int = 0  # blocks copied because a sequence wrote into a shared block
    forks: int = 0


@dataclass(eq=False, slots=True)
class BlockTable:
    """One sequence's blocks: its table, and how many leading entries it has released behind
    a sliding window (their stale ids stay in the table; the sequence holds the rest)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_released: int = 0

    @property
    def held(self) -> list[KVCacheBlock]:
        return self.blocks[self.num_released :]


_EMPTY = BlockTable()  # what a sequence holding no block reads (never written)


class KVCacheManager:
    """``disk_tier``: the index of a disk tier under the prefix cache (``core/disk_tier.py``;
    None: none): cached blocks are written to it as the pool reuses them (and all of them as the
    engine stops), and read back from it where a prefix lookup ends in the pool."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, sliding_window: int | None = None,
        disk_tier: DiskTierIndex | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks)
        self.tables: dict[str, BlockTable] = {}  # sequence id -> its blocks
        self.stats = PrefixCacheStats()
        self._pending_copies: list[tuple[int, int]] = []
        # Blocks registered since ``begin_step``: the step being scheduled computes them.
        self._cached_this_step: set[int] = set()
        if disk_tier is not None and (sliding_window is not None or not enable_caching):
            raise ValueError("a disk tier needs prefix caching, and blocks no sliding window releases")
        self.disk_tier = disk_tier
        # Blocks registered by the step being scheduled or run, until its output is back
        # (``steps_done``): then marked ``spill`` for the disk tier (not an adapter's); those of a
        # step that failed leave the prefix cache (``forget_unconfirmed``).
        self._unconfirmed: set[int] = set()
        self._adapter_blocks: set[int] = set()  # (of those, an adapter's)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def num_shared_blocks(self) -> int:
        """Blocks held by more than one sequence right now."""
        return self.block_pool.num_shared_blocks

    # ---- prefix cache ---------------------------------------------------------------

    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend the request's hash chain over every full block of its known tokens."""
        hashes = seq.block_hashes
        size = self.block_size
        for i in range(len(hashes), seq.num_tokens // size):
            parent = hashes[-1] if hashes else None
            extra = seq.block_extra_key(i, size)
            hashes.append(hash_block_tokens(parent, seq.all_token_ids[i * size : (i + 1) * size], extra))

    def begin_step(self) -> None:
        """A new step is being scheduled: blocks registered before now are computed by earlier steps."""
        self._cached_this_step.clear()

    def steps_done(self) -> None:
        """The steps scheduled so far have run: the blocks they filled hold their K/V."""
        if self.disk_tier is not None:
            blocks = self.block_pool.blocks
            for block_id in self._unconfirmed - self._adapter_blocks:
                if blocks[block_id].block_hash is not None:  # (still registered)
                    blocks[block_id].spill = True
        self._unconfirmed.clear()
        self._adapter_blocks.clear()

    def forget_unconfirmed(self) -> None:
        """A step failed: the blocks registered since the last step that returned may hold
        half-computed K/V. They leave the prefix cache (a sequence still holding one registers it
        again as it computes it again), and are never written to the disk tier."""
        for block_id in self._unconfirmed:
            self.block_pool.uncache(self.block_pool.blocks[block_id])
        self._unconfirmed.clear()
        self._adapter_blocks.clear()

    def _max_hit_blocks(self, seq: Sequence) -> int:
        """The most leading blocks a hit may cover: its last token is always computed (its logits)."""
        return (seq.num_tokens - 1) // self.block_size

    def _may_share(self, seq: Sequence) -> bool:
        """Whether ``seq`` may start from cached blocks: not where it asks for every prompt token's
        logprobs, or pools an embedding over every token (those compute everything)."""
        every_token = seq.pooling is not None and seq.pooling.needs_every_token
        return self.enable_caching and seq.sampling_params.prompt_logprobs is None and not every_token

    def get_computed_blocks(self, seq: Sequence, computed_before: bool = False) -> list[KVCacheBlock]:
        """Leading blocks of ``request`` already in the pool (not yet referenced).

        At least the last token is always left to compute: its logits are needed.
        Requests asking for prompt logprobs, and embeddings pooled over every token, compute everything.
        ``computed_before``: only blocks an earlier step computed, not those the step being
        scheduled fills (a hybrid model's block keeps a state the forward writes; K/V are written
        before any attention reads them, so other models share those blocks at once).
        """
        if not self._may_share(seq):
            return []
        self.update_block_hashes(seq)
        max_blocks = self._max_hit_blocks(seq)
        hits: list[KVCacheBlock] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None or (computed_before and block.block_id in self._cached_this_step):
                break
            hits.append(block)
        if self.disk_tier is not None:  # (a prefix in use stays on disk longest)
            self.disk_tier.touch(seq.block_hashes[: len(hits)])
        return hits

    # ---- disk tier ----------------------------------------------------------------------

    def disk_hits(self, seq: Sequence, num_cached_blocks: int) -> int:
        """How many blocks after its ``num_cached_blocks`` pool hits ``seq`` finds in the disk tier
        (the last token is always left to compute). Not for a request with a LoRA adapter: an
        adapter's files may change under the same name between runs, its cache key would not."""
        if not self._uses_disk_tier(seq):
            return 0
        assert self.disk_tier is not None
        return self.disk_tier.lookup(seq.block_hashes[num_cached_blocks : self._max_hit_blocks(seq)])

    def _uses_disk_tier(self, seq: Sequence) -> bool:
        return self.disk_tier is not None and seq.lora is None and self._may_share(seq)

    def record_disk_lookup(self, seq: Sequence, num_cached_blocks: int, num_hits: int = 0) -> None:
        """Count an admitted request's lookup in the disk tier (its hits marked used)."""
        if not self._uses_disk_tier(seq):
            return
        assert self.disk_tier is not None
        self.disk_tier.record_lookup(self._max_hit_blocks(seq) - num_cached_blocks,
                                     seq.block_hashes[num_cached_blocks : num_cached_blocks + num_hits])  # fmt: skip

    def start_load(self, seq: Sequence, cached: ReadOnlyList[KVCacheBlock], num_disk: int) -> KVLoad | None:
        """Take ``cached`` (pool hits) and ``num_disk`` fresh blocks for entries of the disk tier, in
        ``seq``'s table; the load the worker makes into the fresh ones. None (nothing changed) if
        the pool has too few free blocks. They join the prefix cache once loaded (``finish_load``)."""
        assert self.disk_tier is not None
        first = len(cached)
        if not self.allocate_slots(seq, num_disk * self.block_size, cached, register=False):
            return None
        hashes = seq.block_hashes[first : first + num_disk]
        self.record_disk_lookup(seq, first, num_disk)
        block_ids = [block.block_id for block in self.tables[seq.seq_id].blocks[first : first + num_disk]]
        return KVLoad(seq.seq_id, block_ids, list(hashes))

    def finish_load(self, seq: Sequence, load: KVLoad, num_loaded: int) -> None:
        """The worker loaded the first ``num_loaded`` blocks of ``load``: they count as computed and
        join the prefix cache; ``seq`` computes the rest into the blocks it holds."""
        assert self.disk_tier is not None
        self.disk_tier.stats.loaded += num_loaded
        blocks = self.tables[seq.seq_id].blocks
        first = seq.num_computed_tokens // self.block_size
        for block, block_hash in zip(blocks[first : first + num_loaded], load.hashes):
            self.block_pool.cache_full_block(block, block_hash)
            block.spill = True  # (written again when evicted, should the tier have dropped it meanwhile)
        seq.num_computed_tokens += num_loaded * self.block_size

    def take_disk_ops(self, everything: bool = False) -> tuple[list[tuple[int, int]], list[int]]:
        """The step's writes to the disk tier: (block id, hash) of the cached blocks taken for
        reuse while it was scheduled (the worker writes them before its forward overwrites them)
        that the tier lacks; with ``everything`` (the engine stops), of every cached block whose
        K/V is computed. And the entries the tier drops (over its size, or refused)."""
        tier, pool = self.disk_tier, self.block_pool
        if tier is None:
            return [], []
        candidates, pool.evicted = pool.evicted, []
        if everything:
            candidates += [(block.block_id, block_hash) for block_hash, block in pool.cached_blocks.items() if block.spill]
        stores = [(block_id, block_hash) for block_id, block_hash in candidates if tier.add(block_hash)]
        return stores, tier.take_deletes()

    def apply_disk_report(self, report: DiskTierReport | None) -> None:
        """Forget the entries the worker could not write, or read and refused."""
        if self.disk_tier is None or report is None:
            return
        stats = self.disk_tier.stats
        stats.bytes_read += report.bytes_read
        stats.read_seconds += report.read_seconds
        stats.bytes_written += report.bytes_written
        stats.write_seconds += report.write_seconds
        stats.failed_writes += len(report.failed_writes)
        stats.load_failures += len(report.refused)
        for block_hash in (*report.failed_writes, *report.refused):
            self.disk_tier.drop(block_hash)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (a lookup retried while the pool is full counts once)."""
        if self.enable_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the request's blocks that are full once its first ``num_tokens`` are computed.

        Called when the step that computes them is scheduled, so a request admitted later
        in the same step can share them: every backend writes the step's K/V before any
        attention reads it.
        """
        if not self.enable_caching:
            return
        self.update_block_hashes(seq)
        table = self.tables.get(seq.seq_id, _EMPTY)
        blocks = table.blocks
        num_full = min(num_tokens // self.block_size, len(seq.block_hashes))
        start = table.num_released  # (released: cached when they filled)
        for block, block_hash in zip(blocks[start:num_full], seq.block_hashes[start:num_full]):
            if block.block_hash is None:
                self._cached_this_step.add(block.block_id)
                self._unconfirmed.add(block.block_id)
                if seq.lora is not None:  # (never read back from disk: never written there)
                    self._adapter_blocks.add(block.block_id)
            self.block_pool.cache_full_block(block, block_hash)

    # ---- allocation -------------------------------------------------------------------

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: ReadOnlyList[KVCacheBlock] = (),
        register: bool = True,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request``; all or nothing.

        ``computed_blocks`` (a prefix hit, only for a request holding no block) are
        taken first and advance ``seq.num_computed_tokens``. Returns False and
        changes nothing when the pool has too few free blocks. ``register``: the blocks the new
        tokens fill join the prefix cache now (not blocks a disk load fills: once it held).
        """
        blocks = self.tables.get(seq.seq_id, _EMPTY).blocks
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_held = len(blocks) + len(computed_blocks)
        num_new_blocks = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - num_held)
        cow_index = self._cow_index(blocks, num_computed, num_new_tokens)
        # Hits before the window of the first new token enter the table released (not held).
        skipped = self._blocks_before_window(num_computed) if computed_blocks else 0
        live_hits = computed_blocks[skipped:]
        # Reviving a cached block takes it out of the free queue too.
        num_revived = sum(1 for block in live_hits if block.ref_cnt == 0)
        if num_new_blocks + (cow_index is not None) + num_revived > self.block_pool.num_free_blocks:
            return False

        table = self.tables.get(seq.seq_id)
        if table is None:
            table = self.tables[seq.seq_id] = BlockTable()
        if computed_blocks:
            self.block_pool.touch(live_hits)
            seq.num_computed_tokens = num_computed
            table.num_released = skipped
        blocks = table.blocks
        blocks.extend(computed_blocks)
        if cow_index is not None:
            self._copy_on_write(blocks, cow_index)
        if num_new_blocks:
            blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        if register:
            self.cache_blocks(seq, num_computed + num_new_tokens)
        self._release_outside_window(table, num_computed)
        return True

    def _blocks_before_window(self, first_query: int) -> int:
        """How many leading blocks lie wholly before the window of position ``first_query`` (0
        without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def _release_outside_window(self, table: BlockTable, first_query: int) -> None:
        """Release the blocks wholly before the window of position ``first_query`` (the step's
        first query; later queries see even less)."""
        end = min(self._blocks_before_window(first_query), len(table.blocks))
        if end > table.num_released:
            self.block_pool.free_blocks(table.blocks[table.num_released : end])
            table.num_released = end

    def _cow_index(self, blocks: list[KVCacheBlock], num_computed: int, num_new_tokens: int) -> int | None:
        """Index of the partly written block this step writes into, if another sequence shares it."""
        index = num_computed // self.block_size
        if num_new_tokens > 0 and index < len(blocks) and blocks[index].ref_cnt > 1:
            return index
        return None

    def _copy_on_write(self, blocks: list[KVCacheBlock], index: int) -> None:
        shared = blocks[index]
        (private,) = self.block_pool.get_new_blocks(1)
        self.block_pool.free_blocks([shared])
        blocks[index] = private
        self._pending_copies.append((shared.block_id, private.block_id))
        self.stats.cow_copies += 1

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies the worker must make before this step's forward pass."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` (its computed tokens included)."""
        if child.seq_id in self.tables:
            raise ValueError(f"sequence {child.seq_id!r} already holds blocks; only a new sequence can fork")
        parent_table = self.tables.get(parent.seq_id, _EMPTY)
        table = BlockTable(list(parent_table.blocks), parent_table.num_released)
        self.block_pool.touch(table.held)
        self.tables[child.seq_id] = table
        child.num_computed_tokens = parent.num_computed_tokens
        # Only blocks inside the shared (computed) prefix have keys valid for both.
        child.block_hashes = parent.block_hashes[: parent.num_computed_tokens // self.block_size]
        self.stats.forks += 1

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past those its known tokens need (slots taken for speculative
        drafts that were rejected), last block first. Never cached: a block is keyed only when
        its tokens are all known."""
        table = self.tables.get(seq.seq_id)
        if table is None:
            return
        keep = max(cdiv(seq.num_tokens, self.block_size), table.num_released)
        if len(table.blocks) > keep:
            self.block_pool.free_blocks(reversed(table.blocks[keep:]))
            del table.blocks[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop all of a request's blocks, last block first so tails are reused first."""
        table = self.tables.pop(seq.seq_id, _EMPTY)
        self.block_pool.free_blocks(reversed(table.held))

    def get_block_ids(self, seq_id: str) -> list[int]:
        """The request's block table (released entries keep their stale ids: masked positions)."""
        return [block.block_id for block in self.tables.get(seq_id, _EMPTY).blocks]

    def block_ids_from(self, seq_id: str, start: int) -> list[int]:
        """The request's block table from entry ``start`` on (what a step sends of it)."""
        return [block.block_id for block in self.tables.get(seq_id, _EMPTY).blocks[start:]]

    def num_held_blocks(self, seq_id: str) -> int:
        """Blocks the request holds a reference to (its table less the released entries)."""
        table = self.tables.get(seq_id, _EMPTY)
        return len(table.blocks) - table.num_released

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """How many more blocks ``request`` needs to also hold ``num_new_tokens`` tokens."""
        held = len(self.tables.get(seq.seq_id, _EMPTY).blocks)
        return max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - held)
