"""An engine over several nodes: node 0 runs the engine (scheduler, API) and its share of the
ranks; every other node runs its share headless (``pagellm serve ... --node-rank R``).

Each node's ranks are a :class:`MultiprocExecutor` (its first rank in the node's main process,
the others in child processes, as on one node). The nodes' first ranks form one more
``torch.distributed`` group: node 0 broadcasts each step there as bytes of the pickle-free
codec (``step_codec``: a port open to the network must never unpickle), each node runs it on its
ranks, and each answers with its status and, on the node of the sampling rank, the step's output.
An empty message tells the nodes to stop. A node whose process dies breaks the group: the step
raises on node 0 (the engine is then dead, as with a rank on one node) and the other nodes exit.

Beside the group, every other node keeps a heartbeat with node 0 (``distributed.heartbeat``):
node 0's ``check_health`` then finds a node gone while the engine is idle (at once if its process
ended, within ``HEARTBEAT_TIMEOUT_S`` if it hung or was cut off), a failed step names the node
that broke it, and a node that loses node 0 (or a rank of its own) exits instead of waiting in
gloo for a step that never comes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from pagellm.config import EngineConfig
from pagellm.distributed.heartbeat import HEARTBEAT_PERIOD_S, HEARTBEAT_TIMEOUT_S, Loss, NodeBeat, NodeWatch
from pagellm.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagellm.step_codec import decode_output, encode_output, encode_step
from pagellm.worker.errors import DeadRankError, RankError
from pagellm.worker.multiproc_executor import MultiprocExecutor

logger = logging.getLogger(__name__)

STOP = b""  # the message that ends the headless nodes


class NodeLink:
    """Bytes between node 0's first rank and the other nodes' first ranks (``group``: theirs)."""

    def __init__(self, group: Any, leaders: list[int]) -> None:
        self.group, self.leaders = group, leaders

    def broadcast(self, payload: bytes | None = None) -> bytes:
        """Node 0 sends ``payload``; every other node gets it (its call passes None)."""
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=self.leaders[0], group=self.group)
        data = torch.empty(int(size[0]), dtype=torch.uint8)
        if payload is not None:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else data
        if data.numel():
            dist.broadcast(data, src=self.leaders[0], group=self.group)
        return bytes(data.numpy()) if payload is None else payload

    def reply(self, payload: bytes) -> None:
        """A node's answer to node 0."""
        dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst=self.leaders[0], group=self.group)
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=self.leaders[0], group=self.group)

    def replies(self) -> list[bytes]:
        """Node 0: every other node's answer, in node order."""
        answers = []
        for leader in self.leaders[1:]:
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, src=leader, group=self.group)
            data = torch.empty(int(size[0]), dtype=torch.uint8)
            dist.recv(data, src=leader, group=self.group)
            answers.append(bytes(data.numpy()))
        return answers


def _link(config: EngineConfig, local: MultiprocExecutor) -> NodeLink:
    per_node = config.device.local_world_size
    return NodeLink(local.parallel.nodes, [n * per_node for n in range(config.device.nnodes)])


class MultiNodeExecutor:
    """Node 0's executor: its own ranks, and the other nodes' through :class:`NodeLink`."""

    def __init__(self, config: EngineConfig, tokenizer_eos_token_id: int | None = None) -> None:
        self.local = MultiprocExecutor(config, tokenizer_eos_token_id, steps_in_flight=False)
        self.link = _link(config, self.local)
        watch: NodeWatch | None = None
        try:  # the heartbeat's port goes out as the group's first message; every node then connects
            watch = NodeWatch(config.device.master_addr)
            self.link.broadcast(str(watch.port).encode())
            watch.accept(config.device.nnodes)
        except BaseException as exc:
            if watch is not None:
                watch.close()
            self.local.close()
            raise RankError(f"the nodes could not open their heartbeat: {exc}") from exc
        self.watch = watch
        self.arch = self.local.arch
        self.eos_token_ids = self.local.eos_token_ids
        self.kernel_plan_info = self.local.kernel_plan_info
        self.kv_cache_dtype = self.local.kv_cache_dtype
        self.num_blocks = self.local.num_blocks
        self.pipeline_depth = 1  # one step at a time, in micro-batches (steps in flight: not across nodes yet)
        self.disk_tier = None  # (the disk tier runs in a one-process engine only, so far)
        self.max_model_len = self.local.max_model_len
        self.model_runner = self.local.model_runner
        self._closed = False

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """One step on every node's ranks; the sampling rank's tokens."""
        try:
            self.link.broadcast(encode_step(scheduler_output, grammar_bitmask))
        except RuntimeError as exc:
            raise self._gone(HEARTBEAT_TIMEOUT_S) or RankError(f"a node of the engine is gone: {exc}") from exc
        try:
            output = self.local.execute(scheduler_output, grammar_bitmask)
        except DeadRankError:
            raise
        except RuntimeError as exc:  # a send to a later stage's node that is gone, say
            dead = self._gone(2 * HEARTBEAT_PERIOD_S)
            if dead is None:
                raise
            raise dead from exc
        try:
            answers = [decode_output(answer) for answer in self.link.replies()]
        except RuntimeError as exc:
            raise self._gone(HEARTBEAT_TIMEOUT_S) or RankError(f"a node of the engine is gone: {exc}") from exc
        for node, (remote, error) in enumerate(answers, start=1):
            if error is not None:
                raise self._gone(2 * HEARTBEAT_PERIOD_S) or RankError(f"node {node} failed the step: {error}")
            if remote is not None:
                output = remote
        return output

    def _gone(self, wait_s: float) -> DeadRankError | None:
        """The node (or rank of one) the heartbeat finds gone within ``wait_s``: what a broken
        link or a failed step is reported as, when it is one (the heartbeat tells them apart)."""
        loss = self.watch.loss(wait_s)
        return DeadRankError(loss.who, loss.detail) if loss is not None else None

    def sentinels(self) -> list[int]:
        return self.local.sentinels()

    def check_health(self) -> None:
        """This node's ranks, then the other nodes' heartbeats: a gone one raises ``DeadRankError``."""
        self.local.check_health()
        loss = self.watch.loss()
        if loss is not None:
            raise DeadRankError(loss.who, loss.detail)

    def close(self) -> None:
        """Tell the other nodes to stop (where they still listen), then stop this node's ranks."""
        if not self._closed:
            self._closed = True
            self.watch.close()  # first: a node's heartbeat then ends quietly, not as a loss
            try:
                self.link.broadcast(STOP)
            except RuntimeError:
                pass
        self.local.close()


def run_node(config: EngineConfig, tokenizer_eos_token_id: int | None = None) -> int:
    """A node other than 0: join the engine with this node's ranks, run every step node 0
    broadcasts until it says stop (0) or the engine's group breaks (1); exits 1 from its
    heartbeat's thread once node 0 or a rank of this node is gone."""
    local = MultiprocExecutor(config, tokenizer_eos_token_id, steps_in_flight=False)
    link = _link(config, local)

    def check() -> Loss | None:
        try:
            local.check_health()
        except DeadRankError as exc:
            return Loss(exc.who, exc.detail)
        return None

    def lost(loss: Loss) -> None:
        # From the heartbeat's thread: the main thread may be blocked in gloo for good.
        logger.error("%s is gone (%s): node %d exits", loss.who, loss.detail, config.device.node_rank)
        local.kill()
        os._exit(1)

    try:
        port = int(link.broadcast())  # node 0's heartbeat, the group's first message
        beat = NodeBeat(config.device.master_addr, port, config.device.node_rank, check, lost)
    except (RuntimeError, ValueError, OSError) as exc:
        logger.error("could not open the heartbeat with node 0: %s", exc)
        local.close()
        return 1
    logger.info("node %d of %d: ranks joined, serving steps", config.device.node_rank, config.device.nnodes)
    try:
        while True:
            try:
                message = link.broadcast()
            except RuntimeError as exc:
                logger.error("the engine's group broke (node 0 gone?): %s", exc)
                return 1
            if message == STOP:
                return 0
            try:
                output = local.execute_encoded(message)
                answer = encode_output(output if local.samples else None)
            except Exception as exc:  # noqa: BLE001 -- node 0 fails the step (and the engine)
                answer = encode_output(None, f"{type(exc).__name__}: {exc}")
            link.reply(answer)
    finally:
        beat.close()  # first: this node's ranks stopping below is no loss
        local.close()
