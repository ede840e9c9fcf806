"""The shared-memory all-reduce of tensor-parallel ranks on one host (``distributed.shm_all_reduce``):
sums equal to a plain sum on every rank, tensors bigger than a slot, and a peer that dies or
never arrives gives an error, not a hang."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from multiprocessing.connection import Connection

import pytest
import torch

from pagellm import kernels
from pagellm.distributed.shm_all_reduce import SLOT_BYTES, SharedMemoryAllReduce, create_region, region_path
from pagellm.distributed.parallel_state import free_port

SIZES = [1, 576, 64 * 576, SLOT_BYTES // 4 + 1000]  # the last one goes in two pieces


@pytest.fixture(scope="module")
def lib():
    library = kernels.default()
    if library is None:
        pytest.skip("no C++ compiler: the kernels cannot be built")
    return library


def _data(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank * 7919 + numel))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _peer(port: int, rank: int, size: int, mode: str, conn: Connection) -> None:
    """A rank in a child process: ``sum`` runs the calls of ``SIZES``, ``stall`` registers and
    then waits on the pipe without ever calling."""
    shm = SharedMemoryAllReduce(kernels.default(), port, rank, size, timeout_s=60.0)  # type: ignore[arg-type]
    conn.send("ready")
    if mode == "stall":
        conn.recv()
        return
    conn.send([_digest(shm.all_reduce_(_data(rank, numel))) for numel in SIZES])


def _start(port: int, size: int, mode: str) -> list[tuple[mp.Process, Connection]]:
    ctx = mp.get_context("spawn")
    peers = []
    for rank in range(1, size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_peer, args=(port, rank, size, mode, child), daemon=True)
        proc.start()
        peers.append((proc, parent))
    for _, conn in peers:
        assert conn.recv() == "ready"
    return peers


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_sum(lib, size: int) -> None:
    port = free_port()
    create_region(lib, port, size)
    try:
        shm = SharedMemoryAllReduce(lib, port, 0, size, timeout_s=60.0)
        peers = _start(port, size, "sum")
    finally:
        region_path(port).unlink(missing_ok=True)
    mine = [shm.all_reduce_(_data(0, numel)) for numel in SIZES]
    for numel, got in zip(SIZES, mine):
        expected = _data(0, numel)
        for rank in range(1, size):
            expected += _data(rank, numel)  # rank order, as the kernel sums
        assert torch.equal(got, expected)
    for proc, conn in peers:
        assert conn.recv() == [_digest(t) for t in mine]  # the same bits on every rank
        proc.join(30)
    assert shm.calls == len(SIZES) + 1  # the biggest took two slots' worth


def _with_stalled_peer(lib, timeout_s: float) -> tuple[SharedMemoryAllReduce, mp.Process, Connection]:
    """Rank 0 of two, its peer registered but never calling."""
    port = free_port()
    create_region(lib, port, 2)
    try:
        shm = SharedMemoryAllReduce(lib, port, 0, 2, timeout_s=timeout_s)
        [(proc, conn)] = _start(port, 2, "stall")
    finally:
        region_path(port).unlink(missing_ok=True)
    return shm, proc, conn


def test_a_dead_peer_is_an_error_not_a_hang(lib) -> None:
    shm, proc, _ = _with_stalled_peer(lib, timeout_s=600.0)
    proc.kill()  # a zombie until joined: still noticed as gone
    with pytest.raises(RuntimeError, match="process is gone"):
        shm.all_reduce_(torch.ones(16))
    proc.join(30)


def test_a_peer_that_never_arrives_times_out(lib) -> None:
    shm, proc, conn = _with_stalled_peer(lib, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="did not arrive"):
        shm.all_reduce_(torch.ones(16))
    conn.send("done")
    proc.join(30)


def test_bad_tensors_are_refused(lib) -> None:
    port = free_port()
    create_region(lib, port, 2)
    shm = SharedMemoryAllReduce(lib, port, 0, 2, timeout_s=1.0)
    region_path(port).unlink()
    with pytest.raises(ValueError, match="float32"):
        shm.all_reduce_(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        shm.all_reduce_(torch.ones(4, 4).t())
