"""The executor on a Ray cluster (``--distributed-executor-backend ray``): every rank is a Ray
actor, placed by Ray on the cluster's nodes, for users who already run one (``ray start
--head`` on one node, ``ray start --address HEAD:6379`` on the others, then ``pagellm serve``
on any node of it; without a cluster, ``ray.init`` starts one on this machine).

One placement-group bundle per pipeline stage holds that stage's tensor-parallel ranks, so each
tensor-parallel group is on one node (its all-reduce goes through shared memory) while stages
may spread over nodes. The ranks meet in ``torch.distributed`` (gloo) at rank 0's node; each
step goes to every actor as bytes of the pickle-free step codec (one object in Ray's store for
all of them), and the sampling rank answers with the step's output. An actor that dies fails
the step (the engine is then dead, as with a rank process on one node).

Liveness: ``check_health`` pings every actor in a concurrency group of its own (so a step in
progress does not hold the answer back: start and steps keep to the default group's one thread);
an actor Ray reports dead, or one silent past ``HEARTBEAT_TIMEOUT_S``, raises ``DeadRankError``.
The engine pings while idle; a step's wait pings too, every ``HEARTBEAT_PERIOD_S``, so a hung
actor cannot hold a step forever.

``ray`` is an optional dependency (``pip install 'pagellm[ray]'``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pagellm.config import EngineConfig, split_threads
from pagellm.distributed.heartbeat import HEARTBEAT_PERIOD_S, HEARTBEAT_TIMEOUT_S
from pagellm.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagellm.step_codec import decode_output, decode_step, encode_output, encode_step
from pagellm.worker.errors import DeadRankError, RankError

logger = logging.getLogger(__name__)

HEALTH_GROUP = "health"  # the actors' concurrency group for pings (a thread beside the steps')


def _first_line(exc: BaseException) -> str:
    """Ray's errors run to many lines; the first says what happened."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError("--distributed-executor-backend ray needs Ray: pip install 'pagellm[ray]'") from exc
    return ray


class RayRank:
    """One rank, as a Ray actor (the class is wrapped by ``ray.remote`` when the executor starts)."""

    def __init__(self, config: EngineConfig, tokenizer_eos_token_id: int | None, rank: int) -> None:
        self.config, self.eos, self.rank = config, tokenizer_eos_token_id, rank
        self.worker: Any = None
        self.samples = False

    def address(self) -> tuple[str, int]:
        """This actor's node address and a port free there (rank 0's: the rendezvous)."""
        import ray

        from pagellm.distributed.parallel_state import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, master_addr: str, port: int) -> dict[str, Any]:
        """Join the ranks and build this rank's worker; the facts the engine reads (rank 0's)."""
        import ray

        from pagellm import kernels
        from pagellm.distributed.parallel_state import init_parallel
        from pagellm.worker.worker import Worker

        device = self.config.device
        parallel = init_parallel(self.rank, device.tensor_parallel_size, device.pipeline_parallel_size, port,
                                 kernels.load(self.config.kernels), master_addr=master_addr)  # fmt: skip
        self.worker = Worker(self.config, self.eos, parallel, micro_batches=device.pipeline_parallel_size)
        self.samples = parallel.samples
        w = self.worker
        return {"arch": w.arch, "eos_token_ids": w.eos_token_ids, "kernel_plan_info": w.kernel_plan_info,
                "kv_cache_dtype": w.kv_cache_dtype, "num_blocks": w.num_blocks, "max_model_len": w.max_model_len,
                "pid": os.getpid(), "node": ray.util.get_node_ip_address()}  # fmt: skip

    def ping(self) -> bool:
        """Alive (called in the health concurrency group: answered even during a step)."""
        return True

    def execute(self, message: bytes) -> bytes:
        """One step (codec bytes in); this rank's answer (codec bytes out)."""
        try:
            output = self.worker.execute(*decode_step(message))
            return encode_output(output if self.samples else None)
        except Exception as exc:  # noqa: BLE001 -- the driver fails the step
            return encode_output(None, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        from pagellm.distributed.parallel_state import close_parallel

        close_parallel()


class RayExecutor:
    """Every rank of the engine as a Ray actor (see the module docstring)."""

    def __init__(self, config: EngineConfig, tokenizer_eos_token_id: int | None = None) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        device = config.device
        tp, pp = device.tensor_parallel_size, device.pipeline_parallel_size
        config = split_threads(config, device.world_size)
        threads = config.device.num_threads or 1
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        self._ray, self._remove_group = ray, remove_placement_group
        self._group = placement_group([{"CPU": threads * tp} for _ in range(pp)], strategy="PACK")
        self._actors: list[Any] = []
        try:
            ray.get(self._group.ready(), timeout=600)
            actor_class = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(RayRank)
            for rank in range(tp * pp):
                strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=rank // tp)
                self._actors.append(actor_class.options(num_cpus=threads, scheduling_strategy=strategy)
                                    .remote(config, tokenizer_eos_token_id, rank))  # fmt: skip
            master_addr, port = ray.get(self._actors[0].address.remote())
            started = self._get([actor.start.remote(master_addr, port) for actor in self._actors], "start")
            for rank, answer in enumerate(started):
                logger.info("rank %d: Ray actor started (pid %d on %s)", rank, answer["pid"], answer["node"])
            facts = started[0]
        except BaseException:
            self.close()
            raise
        self.arch, self.eos_token_ids = facts["arch"], facts["eos_token_ids"]
        self.kernel_plan_info = facts["kernel_plan_info"]
        self.kv_cache_dtype, self.num_blocks = facts["kv_cache_dtype"], facts["num_blocks"]
        self.pipeline_depth = 1  # one step at a time, in micro-batches (steps in flight: not on Ray yet)
        self.disk_tier = None  # (the disk tier runs in a one-process engine only, so far)
        self.max_model_len = facts["max_model_len"]
        self.model_runner = None  # every rank runs in an actor
        self._sampler = (pp - 1) * tp

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        """Each actor's answer, in rank order (``refs``: one call per actor)."""
        return [self._get_one(rank, ref, what) for rank, ref in enumerate(refs)]

    def _get_one(self, rank: int, ref: Any, what: str) -> Any:
        """Rank ``rank``'s answer; an actor that died raises ``DeadRankError`` naming it."""
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayActorError as exc:
            raise DeadRankError(f"the Ray actor of rank {rank}", f"it died during {what}: {_first_line(exc)}") from exc
        except self._ray.exceptions.RayError as exc:
            raise RankError(f"a Ray rank of the engine failed during {what}: {exc}") from exc

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """One step on every actor; the sampling rank's tokens."""
        message = self._ray.put(encode_step(scheduler_output, grammar_bitmask))
        refs = [actor.execute.remote(message) for actor in self._actors]
        while self._ray.wait(refs, num_returns=len(refs), timeout=HEARTBEAT_PERIOD_S)[1]:
            self.check_health()  # a long step, or one held by a hung actor: which is it?
        answers = [decode_output(a) for a in self._get(refs, "step")]
        for rank, (_, error) in enumerate(answers):
            if error is not None:
                raise RankError(f"Ray rank {rank} failed the step: {error}")
        output = answers[self._sampler][0]
        return output if output is not None else ModelRunnerOutput()

    def sentinels(self) -> list[int]:
        """Actors are not processes of this one: ``check_health`` pings them instead."""
        return []

    def check_health(self) -> None:
        """Ping every actor; one Ray reports dead, or one silent for ``HEARTBEAT_TIMEOUT_S``,
        raises ``DeadRankError`` (safe from another thread while a step runs)."""
        refs = [actor.ping.options(concurrency_group=HEALTH_GROUP).remote() for actor in self._actors]
        if not refs:
            return
        ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=HEARTBEAT_TIMEOUT_S)
        answered = set(ready)
        for rank, ref in enumerate(refs):  # a dead actor's ping fails at once: it is named first
            if ref in answered:
                self._get_one(rank, ref, "a ping")
        for rank, ref in enumerate(refs):
            if ref not in answered:
                raise DeadRankError(f"the Ray actor of rank {rank}", f"it did not answer a ping within {HEARTBEAT_TIMEOUT_S:g}s")

    def close(self) -> None:
        """Stop the actors and give their CPUs back to the cluster."""
        for actor in self._actors:
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 -- already gone
                pass
        self._actors = []
        if self._group is not None:
            try:
                self._remove_group(self._group)
            except Exception:  # noqa: BLE001
                pass
            self._group = None
