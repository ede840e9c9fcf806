"""The executor seam: how the engine drives its worker(s), whatever their number.

The engine keeps the scheduler and the KV bookkeeping; an executor takes each step's plain
data and returns the sampled tokens. :class:`~pagellm.worker.worker.Worker` is the executor of a
one-process engine; :class:`~pagellm.worker.multiproc_executor.MultiprocExecutor` runs one
worker per rank (tensor and pipeline parallelism) behind the same calls, and
:class:`~pagellm.worker.multinode.MultiNodeExecutor` those of several nodes, and
:class:`~pagellm.worker.ray_executor.RayExecutor` ranks as actors of a Ray cluster.

Liveness: a rank, node or actor may die between steps, when no step would notice. The engine
calls ``check_health`` while idle (every second), and an engine in its own
process also from a watchdog thread during steps (a step blocked on a silent node cannot notice
by itself); a lost one raises :class:`~pagellm.worker.errors.DeadRankError` naming it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagellm.config import EngineConfig
from pagellm.disk_tier_files import TierLayout
from pagellm.model.arch_config import ModelArchConfig
from pagellm.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagellm.worker.model_runner import ModelRunner


class Executor(Protocol):
    """What the engine reads of its workers (every rank has the same facts) and the two calls."""

    arch: ModelArchConfig
    eos_token_ids: frozenset[int]
    kernel_plan_info: dict[str, str]  # KernelPlan.as_dict() of the ranks' plan (the same on each)
    kv_cache_dtype: torch.dtype
    num_blocks: int
    max_model_len: int
    pipeline_depth: int  # steps the engine may keep in flight (``submit``/``collect``); 1: ``execute`` only
    model_runner: ModelRunner | None  # this process's (rank 0's), for tests and diagnostics (None: no rank here)
    disk_tier: TierLayout | None  # where the disk tier's entries are (None: no disk tier)

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """Run one step on every rank; the step's sampled tokens."""

    def sentinels(self) -> list[int]:
        """Handles that become ready when a rank's process ends (none in one process)."""

    def check_health(self) -> None:
        """Raise ``DeadRankError`` if a rank, node or Ray actor is gone (else return). Takes at
        most about ``HEARTBEAT_TIMEOUT_S`` and is safe to call from another thread while a step
        runs."""

    def close(self) -> None:
        """Release the ranks (a no-op in one process)."""


class PipelinedExecutor(Executor, Protocol):
    """An executor that keeps several steps in flight (``pipeline_depth`` > 1): while the
    last pipeline stage finishes one step, the first already runs the next."""

    def submit(self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None) -> None:
        """Start a step; :meth:`collect` returns its tokens (steps come back in order)."""

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's sampled tokens."""


def make_executor(config: EngineConfig, tokenizer_eos_token_id: int | None = None) -> Executor:
    """The executor ``config`` asks for: one worker here, one per rank, or one per rank of
    several nodes (this being node 0: the others run ``multinode.run_node``)."""
    if config.device.distributed_executor_backend == "ray" and config.device.world_size > 1:
        from pagellm.worker.ray_executor import RayExecutor

        return RayExecutor(config, tokenizer_eos_token_id)
    if config.device.nnodes > 1:
        if config.device.node_rank != 0:
            raise ValueError("only node 0 runs the engine; the other nodes run `pagellm serve ... --node-rank R` headless")
        from pagellm.worker.multinode import MultiNodeExecutor

        return MultiNodeExecutor(config, tokenizer_eos_token_id)
    if config.device.world_size > 1:
        from pagellm.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, tokenizer_eos_token_id)
    from pagellm.worker.worker import Worker

    return Worker(config, tokenizer_eos_token_id)
