"""The executor of an engine of several ranks (tensor and pipeline parallelism): rank 0 is a
:class:`Worker` in this process, ranks 1..N-1 are workers in child processes joined by
``torch.distributed`` (``pagellm.distributed.parallel_state``); each holds the layers of its
pipeline stage, its tensor-parallel share of each of them, and that part of each KV block.

The engine above sees one executor (the facts it reads and ``execute``): each step's
``SchedulerOutput`` (and grammar masks), encoded once by ``step_codec`` as remote nodes and Ray
actors receive it (no pickle), goes to every child first, then rank 0 runs
its part; the ranks meet in each layer's all-reduces and at the stage boundaries, and one rank
(the first of the last stage) samples: its tokens are the step's. The block manager does not
change: block ids are the same on every rank, only the heads and layers inside a block differ.

A child that fails or dies is noticed at the end of the step (or within the collective
timeout, if it dies mid-step), and the step fails: the engine is then unhealthy as a whole. A
child that dies between steps is noticed by ``check_health`` (its process's sentinel), which the
engine calls while idle; either way the error is a ``DeadRankError`` naming the rank.
"""

from __future__ import annotations

import logging
from collections import deque
import multiprocessing as mp
from multiprocessing.connection import Connection, wait
from typing import Any

from pagellm import kernels
from pagellm.config import EngineConfig, split_threads
from pagellm.distributed.cpu_affinity import bind_process, bind_rank
from pagellm.distributed.parallel_state import ParallelRank, close_parallel, free_port, init_parallel
from pagellm.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagellm.step_codec import decode_output, decode_step, encode_output, encode_step
from pagellm.worker.errors import DeadRankError, RankError
from pagellm.worker.worker import Worker

__all__ = ["DeadRankError", "MultiprocExecutor", "RankError"]

logger = logging.getLogger(__name__)


def _join(config: EngineConfig, rank: int, port: int) -> ParallelRank:
    """Join the engine's ranks as rank ``rank``; this process's place among them."""
    device = config.device
    return init_parallel(rank, device.tensor_parallel_size, device.pipeline_parallel_size, port,
                         kernels.load(config.kernels), master_addr=device.master_addr, nnodes=device.nnodes)  # fmt: skip


def _rank_main(config: EngineConfig, eos: int | None, rank: int, port: int, micro_batches: int, conn: Connection) -> None:
    """A child rank: build its worker, then run every step it is sent (``step_codec`` bytes)
    until told to stop (empty bytes), answering each with its output where it samples, else
    with None, or with what failed."""
    conn.send_bytes(encode_output(None))  # started: the node's first rank may now wait for it in the rendezvous
    try:
        if config.device.cpu_bind == "auto":
            bind_rank(rank % config.device.local_world_size, config.device.local_world_size)
        parallel = _join(config, rank, port)
        worker = Worker(config, eos, parallel, micro_batches)
        samples = parallel.samples
        conn.send_bytes(encode_output(None))
    except BaseException as exc:  # noqa: BLE001 -- reported to rank 0, which fails the engine
        conn.send_bytes(encode_output(None, f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # rank 0's process is gone
            message = b""
        if not message:
            return
        try:
            output = worker.execute(*decode_step(message))
            conn.send_bytes(encode_output(output if samples else None))
        except BaseException as exc:  # noqa: BLE001
            conn.send_bytes(encode_output(None, f"{type(exc).__name__}: {exc}"))


class MultiprocExecutor:
    """This node's ranks of one engine behind a worker's interface (see the module docstring):
    the node's first rank in this process, the others in child processes. ``samples``: whether
    the step's sampling rank is on this node (else ``execute`` returns an empty output)."""

    def __init__(
        self, config: EngineConfig, tokenizer_eos_token_id: int | None = None, steps_in_flight: bool = True
    ) -> None:
        device = config.device
        # Pipeline stages overlap through steps in flight (the engine submits the next step while
        # the last stage finishes one: ``pipeline_depth``), else through micro-batches of each step.
        self.pipeline_depth = device.pipeline_parallel_size if steps_in_flight else 1
        self.disk_tier = None  # (the disk tier runs in a one-process engine only, so far)
        micro_batches = 1 if steps_in_flight else device.pipeline_parallel_size
        size = device.local_world_size
        first = device.node_rank * size  # this node's ranks: first .. first + size - 1
        self._first = first
        config = split_threads(config, size)  # each rank's share of the node's threads
        port = device.master_port if device.master_port is not None else free_port()
        ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP/torch threads
        self._ranks: list[tuple[Any, Connection]] = []
        self._unbound: set[int] | None = None  # this process's CPUs before it was bound
        try:
            for rank in range(first + 1, first + size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(config, tokenizer_eos_token_id, rank, port, micro_batches, child),
                                   name=f"pagellm-rank{rank}", daemon=True)  # fmt: skip
                proc.start()
                child.close()
                logger.info("rank %d started (pid %d)", rank, proc.pid)
                self._ranks.append((proc, parent))
            # A child that fails before joining (say, its interpreter cannot start) would leave
            # this rank in the rendezvous until its timeout: wait for each to be running first.
            self._collect("start-up")
            if config.device.cpu_bind == "auto":  # after the children started: they split the same CPUs
                self._unbound = bind_rank(0, size)
            self.parallel = _join(config, first, port)
            self.driver = Worker(config, tokenizer_eos_token_id, self.parallel, micro_batches)
            self._collect("start")
        except BaseException:
            self.close()
            raise
        # The rank whose output is the step's: the first of the last stage (here, a child, or elsewhere).
        sampler = device.world_size - device.tensor_parallel_size
        self.samples = first <= sampler < first + size
        self._sampler = sampler - first - 1 if self.samples and sampler != first else None
        # What the engine reads, from this node's first rank (every rank has the same).
        self.arch = self.driver.arch
        self.eos_token_ids = self.driver.eos_token_ids
        self.kernel_plan = self.driver.kernel_plan
        self.kernel_plan_info = self.driver.kernel_plan_info
        self.kv_cache_dtype = self.driver.kv_cache_dtype
        self.num_blocks = self.driver.num_blocks
        self.max_model_len = self.driver.max_model_len
        self.model_runner = self.driver.model_runner
        self._outputs: deque[ModelRunnerOutput] = deque()  # this rank's output of each step in flight

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """One step on every rank; the sampling rank's tokens."""
        self.submit(scheduler_output, grammar_bitmask)
        return self.collect()

    def execute_encoded(self, message: bytes) -> ModelRunnerOutput:
        """``execute`` for a step already in ``step_codec`` bytes (a remote node's, from node 0):
        the children get the same bytes, decoded once here for this rank."""
        self.submit(*decode_step(message), encoded=message)
        return self.collect()

    def submit(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None,
        encoded: bytes | None = None,
    ) -> None:
        """Start a step on every rank and run this rank's part (under pipeline parallelism
        stage 0's: the later stages go on with it while the caller schedules the next step).
        ``encoded``: the step's ``step_codec`` bytes, where the caller has them."""
        if encoded is None:
            encoded = encode_step(scheduler_output, grammar_bitmask) if self._ranks else b""
        for index, (proc, conn) in enumerate(self._ranks):
            try:
                conn.send_bytes(encoded)
            except (BrokenPipeError, OSError) as exc:
                raise self._dead(index, "step") from exc
        try:
            self._outputs.append(self.driver.execute(scheduler_output, grammar_bitmask))
        except RuntimeError as exc:  # a collective broken by a child that died names that child
            ended = wait(self.sentinels(), 1.0)
            if ended:
                raise self._dead(self.sentinels().index(ended[0]), "step") from exc
            raise

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's sampled tokens, once every rank has finished it."""
        output = self._outputs.popleft()
        answers = self._collect("step")
        if self._sampler is None:
            return output
        answer = answers[self._sampler]
        if answer is None:
            raise RankError(f"rank {self._first + 1 + self._sampler} samples but sent no output")
        return answer

    def _collect(self, what: str) -> list[ModelRunnerOutput | None]:
        """Every child's answer to the last call; the first failure raises."""
        answers = []
        for index, (proc, conn) in enumerate(self._ranks):
            try:
                output, error = decode_output(conn.recv_bytes())
            except (EOFError, OSError) as exc:
                raise self._dead(index, what) from exc
            if error is not None:
                raise RankError(f"{proc.name} failed during {what}: {error}")
            answers.append(output)
        return answers

    def _dead(self, index: int, what: str = "") -> DeadRankError:
        """The error naming child ``index`` gone (its process ended, ``what`` it was doing then)."""
        proc = self._ranks[index][0]
        proc.join(1.0)  # its exit code, once the process is reaped
        during = f" during {what}" if what else ""
        return DeadRankError(f"rank {self._first + 1 + index}",
                             f"its process {proc.name} (pid {proc.pid}) ended{during} (exit code {proc.exitcode})")  # fmt: skip

    def sentinels(self) -> list[int]:
        """Handles that become ready when a child rank's process ends (``multiprocessing.connection.wait``)."""
        return [proc.sentinel for proc, _ in self._ranks]

    def check_health(self) -> None:
        """Raise ``DeadRankError`` naming a child rank whose process ended (cheap; safe from
        another thread while a step runs)."""
        sentinels = self.sentinels()
        ended = wait(sentinels, 0) if sentinels else []
        if ended:
            raise self._dead(sentinels.index(ended[0]))

    def kill(self) -> None:
        """Kill the children at once: this process is about to exit without its usual shutdown
        (a headless node that lost node 0, from its heartbeat's thread)."""
        for proc, _ in list(self._ranks):
            if proc.is_alive():
                proc.kill()

    def close(self) -> None:
        """Stop the children (politely, then by force)."""
        for proc, conn in self._ranks:
            try:
                conn.send_bytes(b"")
            except (BrokenPipeError, OSError):
                pass
        for proc, conn in self._ranks:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
            conn.close()
        self._ranks = []
        close_parallel()
        if self._unbound is not None:  # this process may run other work after the engine
            bind_process(sorted(self._unbound))
            self._unbound = None
