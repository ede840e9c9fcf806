"""State snapshots: where the prefix cache of a model with scan layers (Mamba-2, gated
delta-net) may resume.

An attention layer keeps a prefix's K/V in its KV blocks; a scan layer keeps one record a
sequence, the whole prefix folded into megabytes of state, too big to keep at every block (a
short convolution's few inputs are kept per block: ``model/short_conv.py``). A request may start
from cached blocks only where a copy of every scan layer's state after exactly those tokens was
kept. They are kept sparsely:

- at the grid points, every ``interval`` tokens (long shared prefixes: system prompts, documents);
  at the last full block before a prompt's last token (the same prompt again, or the next turn
  of its conversation); and at a junction: where the cached blocks a request shares with earlier
  ones end, past the last state kept for them (a system prompt shared by different questions:
  the second request keeps the state at its end, the third resumes there). The scheduler ends
  a request's chunk there (:meth:`chunk_end`), and the worker copies the request's state slot
  into a snapshot row after that step's forward. While a request decodes, the state after each
  block its answer fills is kept too, each replacing the last (the next turn of a conversation
  resumes after the answer, not only after the prompt: at most one such row a request);
- in ``num_rows`` rows after the state slots (the worker's state tensors' rows ``first_row``
  onwards), keyed by the prefix hash of the block they end: the hash names every token before
  it, so a snapshot stays right for as long as it is kept, whatever becomes of that block; the
  least recently used is dropped for a new one.

A snapshot saved by a step is usable from the next step on (its forward writes it). The worker
applies a step's loads before its forward and its saves after, so a row dropped and saved over
in the step that also loads from it is read first. Tensor-free, like the block pool.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from pagellm.core.kv_cache_utils import BlockHash


class StateSnapshots:
    """``num_rows`` snapshot rows (ids ``first_row`` .. ``first_row + num_rows - 1``)."""

    def __init__(self, num_rows: int, first_row: int, interval: int, block_size: int) -> None:
        if num_rows < 1 or first_row < 0 or block_size < 1 or interval < 1 or interval % block_size:
            raise ValueError(f"state snapshots need rows >= 1 and an interval that is a multiple of the block size, "
                             f"got {num_rows} rows, interval {interval}, block size {block_size}")  # fmt: skip
        self.num_rows = num_rows
        self.interval = interval
        self.block_size = block_size
        self._free = list(range(first_row, first_row + num_rows))  # a heap: the lowest id first
        self._kept: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()  # hash -> (row, step saved); LRU first

    def __len__(self) -> int:
        return len(self._kept)

    def is_point(self, position: int, num_prompt_tokens: int, junction: int = 0) -> bool:
        """Whether the state after ``position`` tokens is kept: a grid point, the prompt's last
        full block before its last token, or the request's ``junction`` (0: none)."""
        last_block = self._last_block(num_prompt_tokens)
        return position > 0 and (position % self.interval == 0 or position in (last_block, junction))

    def chunk_end(self, start: int, end: int, num_prompt_tokens: int, junction: int = 0) -> int:
        """Where a chunk meant to compute positions ``start`` .. ``end - 1`` stops: at the first
        point after ``start`` it would pass, else ``end``."""
        grid = (start // self.interval + 1) * self.interval
        return min(end, grid, *(p for p in (self._last_block(num_prompt_tokens), junction) if p > start))

    def _last_block(self, num_prompt_tokens: int) -> int:
        """Where the last full block before a prompt's last token ends."""
        return (num_prompt_tokens - 1) // self.block_size * self.block_size

    def ready(self, block_hashes: Sequence[BlockHash], num_hits: int, step: int) -> tuple[int, int | None]:
        """The longest of the first ``num_hits`` cached blocks a request may start from: (how
        many, the snapshot row of the state they end with), (0, None) where none has one. Only
        snapshots of steps before ``step``; the one found becomes the most recently used."""
        for num in range(num_hits, 0, -1):
            kept = self._kept.get(block_hashes[num - 1])
            if kept is not None and kept[1] < step:
                self._kept.move_to_end(block_hashes[num - 1])
                return num, kept[0]
        return 0, None

    def drop(self, block_hash: BlockHash) -> None:
        """Forget the state ending ``block_hash``'s block (its row free again), if kept."""
        kept = self._kept.pop(block_hash, None)
        if kept is not None:
            heapq.heappush(self._free, kept[0])

    def reserve(self, block_hash: BlockHash, step: int) -> int | None:
        """The row the state ending ``block_hash``'s block is saved into by step ``step`` (a free
        row, else the least recently used one's); None where that state is kept already."""
        if block_hash in self._kept:
            self._kept.move_to_end(block_hash)
            return None
        if self._free:
            row = heapq.heappop(self._free)
        else:
            _, (row, _) = self._kept.popitem(last=False)
        self._kept[block_hash] = (row, step)
        return row
