"""The ranks of one engine joined into a ``torch.distributed`` process group: where this
process stands among them (its tensor-parallel share, its pipeline stage) and the groups and
shared-memory regions that joins.

Ranks are numbered stage by stage: rank ``r`` is tensor-parallel rank ``r % tp`` of pipeline
stage ``r // tp``. Each stage's tensor-parallel ranks sum their partial results in their own
group (through shared memory where the kernel library is built: one region per stage, made by
the stage's first rank before the rendezvous and unlinked once every rank has it mapped); the
stages pass hidden states from rank ``r`` to rank ``r + tp``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagellm.distributed.pipeline import PipelineLink, PipelineStage, pipeline_stage
from pagellm.distributed.shm_all_reduce import SharedMemoryAllReduce, create_region, region_path
from pagellm.distributed.tensor_parallel import TensorParallel
from pagellm.kernels.library import KernelLibrary

STEP_TIMEOUT_S = 120.0  # a shared-memory all-reduce waits this long for a live but stuck peer
IDLE_TIMEOUT = timedelta(days=365)  # a node waiting for the next step (a dead peer still raises at once)


@dataclass(frozen=True)
class ParallelRank:
    """This process's place among the ranks of one engine."""

    rank: int
    tp_size: int
    pp_size: int
    tp: TensorParallel | None  # None: one rank per stage (every layer whole)
    nodes: Any = None  # several nodes: the group of each node's first rank (steps out, answers back)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def stage_index(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def samples(self) -> bool:
        """This rank's logits are the step's: the first tensor-parallel rank of the last stage
        (the others' would only be thrown away)."""
        return self.tp_rank == 0 and self.stage_index == self.pp_size - 1

    def stage(self, num_layers: int) -> PipelineStage | None:
        """This rank's pipeline stage of a model with ``num_layers`` layers (None: no pipeline)."""
        return pipeline_stage(self.stage_index, self.pp_size, num_layers) if self.pp_size > 1 else None

    def link(self, hidden_size: int, dtype: torch.dtype, num_layers: int) -> PipelineLink | None:
        """This rank's sends and receives between stages (None: no pipeline)."""
        stage = self.stage(num_layers)
        if stage is None:
            return None
        prev_rank = None if stage.is_first else self.rank - self.tp_size
        next_rank = None if stage.is_last else self.rank + self.tp_size
        return PipelineLink(stage, prev_rank, next_rank, hidden_size, dtype)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _region_key(port: int, stage: int, pp_size: int) -> int | str:
    return port if pp_size == 1 else f"{port}-{stage}"


def init_parallel(
    rank: int, tp_size: int, pp_size: int, port: int, lib: KernelLibrary | None = None,
    timeout_s: float = 600.0, master_addr: str = "127.0.0.1", nnodes: int = 1,
) -> ParallelRank:
    """Join the engine's ranks (gloo; every rank calls this with the same sizes, address, port,
    node count and ``lib`` choice: with a kernel library, tensor-parallel sums go through shared
    memory, so each tensor-parallel group must be on one node). One engine of several ranks per
    process: torch.distributed has one default group."""
    if dist.is_initialized():
        raise RuntimeError("this process already runs a multi-rank engine (close it first)")
    stage, tp_rank = divmod(rank, tp_size)
    key = _region_key(port, stage, pp_size)
    shared = lib is not None and tp_size > 1
    if shared and tp_rank == 0:
        create_region(lib, key, tp_size)  # before the rendezvous: the stage's other ranks open it after
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=tp_size * pp_size,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        # Every rank creates every stage's group, in the same order (torch.distributed's rule).
        groups = None
        if pp_size > 1 and tp_size > 1:
            groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        nodes = None
        if nnodes > 1:  # waits between steps may be long: an idle server is not a failure
            per_node = tp_size * pp_size // nnodes
            nodes = dist.new_group([n * per_node for n in range(nnodes)], timeout=IDLE_TIMEOUT)
        tp = None
        if tp_size > 1:
            shm = SharedMemoryAllReduce(lib, key, tp_rank, tp_size, STEP_TIMEOUT_S) if shared else None  # type: ignore[arg-type]
            tp = TensorParallel(tp_rank, tp_size, group=groups[stage] if groups else None, shm=shm)
        dist.barrier()  # every rank has its region mapped
    finally:
        if shared and tp_rank == 0:
            region_path(key).unlink(missing_ok=True)
    return ParallelRank(rank, tp_size, pp_size, tp, nodes)


def close_parallel() -> None:
    """Leave the process group (a new multi-rank engine may then start here)."""
    if dist.is_initialized():
        dist.destroy_process_group()
