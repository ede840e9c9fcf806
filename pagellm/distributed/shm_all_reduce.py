"""The tensor-parallel all-reduce through shared memory, for ranks on one host
(``csrc/shm_all_reduce.cpp`` does the exchange; this module owns the region).

gloo's all-reduce crosses the TCP loopback: ~1.3 ms a call on the 2-core VMs (NOTES 44), two
calls a layer. Through a region every rank maps, a call costs a copy, a flag and a sum.

The group's first rank creates the region file (``/dev/shm`` where there is one) before the
ranks meet; the others open it after the rendezvous, and it unlinks it once every rank has it mapped, so no
file outlives the engine, whatever way it ends. A peer that dies mid-call (or never arrives
within ``timeout_s``) makes the call raise instead of hang.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from pagellm.kernels.library import KernelLibrary

SLOT_BYTES = 4 << 20  # per rank and slot: bigger tensors go through in pieces


def region_path(key: int | str) -> Path:
    """The region file ``key`` names: the rendezvous port of the engine whose ranks use it,
    with the pipeline stage where there are several (unique on this host while the engine
    runs: its rendezvous holds the port)."""
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return folder / f"pagellm-tp-{os.getuid()}-{key}"


def create_region(lib: KernelLibrary, key: int | str, size: int) -> Path:
    """The group's first rank, before the rendezvous: a fresh, zeroed region file (a stale
    one is replaced)."""
    path = region_path(key)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, lib.shm_region_bytes(size, SLOT_BYTES // 4))
    finally:
        os.close(fd)
    return path


class SharedMemoryAllReduce:
    """Sum float32 tensors across the ranks of one host (every rank calls in the same order)."""

    def __init__(self, lib: KernelLibrary, key: int | str, rank: int, size: int, timeout_s: float) -> None:
        self.lib, self.rank, self.size, self.timeout_s = lib, rank, size, timeout_s
        self.slot_elems = SLOT_BYTES // 4
        nbytes = lib.shm_region_bytes(size, self.slot_elems)
        self.region = torch.from_file(str(region_path(key)), shared=True, size=nbytes, dtype=torch.uint8)
        lib.shm_register(self.region, rank, os.getpid())
        # The sequence number of the last call, the same on every rank; a tensor, so that the
        # one-call decoder stack (csrc/decoder_stack.cpp) counts its own calls in it too.
        self.counter = torch.zeros(1, dtype=torch.int64)

    @property
    def calls(self) -> int:
        """All-reduce calls so far (each piece of a big tensor counts)."""
        return int(self.counter[0])

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a contiguous float32 tensor over the ranks, in place."""
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"the shared-memory all-reduce takes contiguous float32 tensors, got {tensor.dtype}")
        flat = tensor.view(-1)
        for start in range(0, max(flat.numel(), 1), self.slot_elems):
            seq = self.calls + 1
            self.counter[0] = seq
            piece = flat[start : start + self.slot_elems]
            self.lib.shm_all_reduce_(self.region, self.rank, self.size, piece, self.slot_elems, seq, self.timeout_s)
        return tensor
