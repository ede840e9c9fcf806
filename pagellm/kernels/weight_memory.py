"""Memory for packed weights: 2 MB pages where the OS gives them.

Why: a batch-1 decode step streams every weight once a token. On 4 KB pages each weight stream
crosses a page (a TLB entry, a restart of the hardware prefetcher's stream) every 4 KB; on
transparent huge pages every 2 MB. Packed weights in huge pages streamed 10-17% faster through
the integer GEMM on a 2-core Zen 4, and touching 4.9 GB of them first took 2.1-5.3 s against
4.1-9.2 s on small pages (benchmarks/NOTES.md, 56). Linux with transparent huge pages in
``madvise`` or ``always`` mode (``/sys/kernel/mm/transparent_hugepage/enabled``); elsewhere, or for
buffers below two huge pages, plain torch memory.
"""

from __future__ import annotations

import functools
import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_MIN_BYTES = 2 * HUGE_PAGE
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def huge_pages_available() -> bool:
    """Whether this kernel hands out transparent huge pages to a region that asks for them."""
    if getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return False
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def empty_weight(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``shape`` for packed weights: anonymous memory advised
    as huge pages (zero-filled on first touch; unmapped when the tensor is freed) where
    :func:`huge_pages_available`, else ``torch.empty``."""
    nbytes = math.prod(shape)
    if nbytes < _MIN_BYTES or not huge_pages_available():
        return torch.empty(shape, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared: shmem, no THP)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # refused (a container's seccomp, an old kernel): small pages, same bytes
        pass
    return torch.frombuffer(region, dtype=torch.uint8).view(shape)
