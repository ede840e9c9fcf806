"""The ranks of a tensor-parallel engine: rank 0 is a :class:`Worker` in this process, ranks
1..N-1 are workers in child processes; all hold their share of every layer and of each KV
block's heads (``pagellm.distributed.tensor_parallel``).

The engine above sees one worker (:class:`TensorParallelWorkers` has the facts it reads and
``execute``): each step's plain-data ``SchedulerOutput`` (and grammar masks) goes to every
child first, then rank 0 runs it; the ranks meet in each layer's all-reduces and every rank
computes the same logits, so rank 0's sampled tokens are the step's. The block manager does
not change: block ids are the same on every rank, only the heads inside a block differ.

A child that fails or dies is noticed at the end of the step (or within the collective
timeout, if it dies mid-step), and the step fails: the engine is then unhealthy as a whole.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

from pagellm import kernels
from pagellm.config import EngineConfig, split_threads
from pagellm.distributed.cpu_affinity import bind_process, bind_rank
from pagellm.distributed.tensor_parallel import close_tensor_parallel, free_port, init_tensor_parallel
from pagellm.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagellm.worker.worker import Worker

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A rank failed or died."""


def _rank_main(config: EngineConfig, eos: int | None, rank: int, port: int, conn: Connection) -> None:
    """A child rank: build its worker, then run every step it is sent until told to stop."""
    conn.send(("ok", None))  # started: rank 0 may now wait for it in the rendezvous
    try:
        if config.device.cpu_bind == "auto":
            bind_rank(rank, config.device.tensor_parallel_size)
        tp = init_tensor_parallel(rank, config.device.tensor_parallel_size, port, kernels.load(config.kernels))
        worker = Worker(config, eos, tp)
        conn.send(("ok", None))
    except BaseException as exc:  # noqa: BLE001 -- reported to rank 0, which fails the engine
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # rank 0's process is gone
            message = None
        if message is None:
            return
        try:
            worker.execute(*message)
            conn.send(("ok", None))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class TensorParallelWorkers:
    """The ranks of one engine behind a worker's interface (see the module docstring)."""

    def __init__(self, config: EngineConfig, tokenizer_eos_token_id: int | None = None) -> None:
        size = config.device.tensor_parallel_size
        config = split_threads(config, size)  # each rank's share of the threads
        port = free_port()
        ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP/torch threads
        self._ranks: list[tuple[Any, Connection]] = []
        self._unbound: set[int] | None = None  # this process's CPUs before rank 0 was bound
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(config, tokenizer_eos_token_id, rank, port, child),
                                   name=f"pagellm-tp-rank{rank}", daemon=True)  # fmt: skip
                proc.start()
                child.close()
                self._ranks.append((proc, parent))
            # A child that fails before joining (say, its interpreter cannot start) would leave
            # rank 0 in the rendezvous until its timeout: wait for each to be running first.
            self._collect("start-up")
            if config.device.cpu_bind == "auto":  # after the children started: they split the same CPUs
                self._unbound = bind_rank(0, size)
            tp = init_tensor_parallel(0, size, port, kernels.load(config.kernels))
            self.driver = Worker(config, tokenizer_eos_token_id, tp)
            self._collect("start")
        except BaseException:
            self.close()
            raise
        # What the engine reads, from rank 0 (every rank has the same).
        self.arch = self.driver.arch
        self.eos_token_ids = self.driver.eos_token_ids
        self.kernel_plan = self.driver.kernel_plan
        self.kv_cache_dtype = self.driver.kv_cache_dtype
        self.num_blocks = self.driver.num_blocks
        self.max_model_len = self.driver.max_model_len
        self.model_runner = self.driver.model_runner

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """One step on every rank; rank 0's sampled tokens."""
        for proc, conn in self._ranks:
            try:
                conn.send((scheduler_output, grammar_bitmask))
            except (BrokenPipeError, OSError) as exc:
                raise TensorParallelError(f"tensor-parallel rank {proc.name} died (exit code {proc.exitcode})") from exc
        output = self.driver.execute(scheduler_output, grammar_bitmask)
        self._collect("step")
        return output

    def _collect(self, what: str) -> None:
        """Every child's answer to the last call; the first failure raises."""
        for proc, conn in self._ranks:
            try:
                status, message = conn.recv()
            except (EOFError, OSError) as exc:
                raise TensorParallelError(f"tensor-parallel rank {proc.name} died during {what} "
                                          f"(exit code {proc.exitcode})") from exc  # fmt: skip
            if status != "ok":
                raise TensorParallelError(f"tensor-parallel rank {proc.name} failed during {what}: {message}")

    def close(self) -> None:
        """Stop the children (politely, then by force)."""
        for proc, conn in self._ranks:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, conn in self._ranks:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
            conn.close()
        self._ranks = []
        close_tensor_parallel()
        if self._unbound is not None:  # this process may run other work after the engine
            bind_process(sorted(self._unbound))
            self._unbound = None
