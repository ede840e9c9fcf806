"""The server's engine: ``LLMEngine`` stepped in its own thread, one async stream per request.

``LLMEngine`` is synchronous and not thread-safe, so exactly one thread (``pagellm-engine``)
ever touches it. The event loop talks to that thread through an inbox of add/abort
commands, drained at the top of every loop iteration; outputs travel back through
``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per request. The thread sleeps on a
condition variable while there is nothing to do, so an idle server burns no CPU.

Requests normally run in the engine's delta mode (``stream=True``): each output carries only
the new text, token ids and logprobs of each sample, and the last one has ``finished`` set;
callers that want whole answers concatenate the deltas. ``stream=False`` (needed by
``best_of``, whose winners are known only at the end) yields one whole, final output.

A request is the unit of failure: a request the engine fails alone (``RequestOutput.error``)
raises ``RequestFailedError`` in its own stream and nowhere else. The engine is kept alive:
the loop checks it at least once a second, also while idle (``check_health``); when it dies
every in-flight request gets ``EngineDeadError`` (naming the rank, node or Ray actor whose
loss killed it, when that was the cause: ``DeadRankError``) and, while ``max_restarts`` allows, the
engine is restarted (``engine.restart()``, an engine process started anew); otherwise the loop
stops for good and ``on_dead`` is called (the server then exits non-zero for its supervisor).
Admission is bounded: beyond ``max_requests`` admitted and unfinished requests, new ones get
``EngineOverloadedError`` at once.

``snapshot`` (the server's live page) rides the same inbox: the engine thread takes the picture
between two steps, never inside one, and a snapshot that fails fails only its caller.

This module is the loop itself; its parts live beside it: the event-loop side of a request
(``request_stream``), what the loop measures of each request (``request_latency``) and the
snapshot call (``snapshot_call``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pagellm.config import EngineConfig
from pagellm.engine.beam_search import BeamSearchParams
from pagellm.engine.input_processor import InputProcessor
from pagellm.engine.protocol import (
    EngineDeadError,
    EngineOverloadedError,
    EngineRequest,
    RequestFailedError,
    RequestMetrics,
    RequestRejectedError,
    EngineClient,
    EngineStats,
    KVSnapshot,
)
from pagellm.engine.request_latency import NoMetrics, RequestLatency, RequestTiming
from pagellm.engine.request_stream import Channel, Deliveries, RequestStream, StreamItem, post_error
from pagellm.engine.snapshot_call import SnapshotCall
from pagellm.lora_request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.worker.errors import dead_rank_in

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "AsyncLLMEngine",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineRequest",
    "LoopOptions",
    "RequestFailedError",
    "RequestRejectedError",
    "RequestStream",
    "EngineClient",
]

logger = logging.getLogger(__name__)


# How often the loop checks the engine while it waits for work (a dead engine process, rank,
# node or Ray actor is noticed within this long, plus the check's own bound, even when no
# request is running).
HEALTH_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class LoopOptions:
    """How the loop guards the engine: admission bound, restarts, what to do when it is dead for good."""

    max_requests: int | None = None  # admitted and unfinished requests; None: unbounded
    max_restarts: int = 0  # engine restarts allowed over the server's life
    on_dead: Callable[[], None] | None = None  # called once when the loop stops for good after a failure

    def __post_init__(self) -> None:
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.max_restarts < 0:
            raise ValueError(f"engine restarts must be >= 0, got {self.max_restarts}")


@dataclass
class _Add:
    request: EngineRequest  # its arrival_time set
    stream: Channel

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def arrival(self) -> float:
        assert self.request.arrival_time is not None
        return self.request.arrival_time


@dataclass
class _Abort:
    request_id: str


_Command = _Add | _Abort | SnapshotCall


@dataclass
class _Running:
    """The step loop's one record of a request the engine holds: where its outputs go, and its
    latency bookkeeping."""

    stream: Channel
    timing: RequestTiming


class AsyncLLMEngine:
    """Serve many concurrent requests from one engine without blocking the event loop."""

    def __init__(
        self, engine: EngineClient, metrics: RequestMetrics | None = None, options: LoopOptions | None = None
    ) -> None:
        self.engine = engine
        self._metrics: RequestMetrics = metrics or NoMetrics()
        self._options = options or LoopOptions()
        # RLock: shutdown may be requested from a signal handler that interrupted _submit.
        self._cond = threading.Condition(threading.RLock())
        # Guarded by _cond.
        self._inbox: list[_Command] = []
        self._stopping = False
        self._closed = False
        self._restarting = False
        self._error: BaseException | None = None
        self._lost: str | None = None  # the rank, node or actor whose loss failed the engine last
        self._admitted = 0  # requests submitted and not yet finished
        self._restarts_left = self._options.max_restarts
        self._thread: threading.Thread | None = None
        # Touched only by the engine thread.
        self._batch: list[_Command] = []  # the commands being applied (failed too if the engine dies)
        self._running: dict[str, _Running] = {}  # each request given to the engine, until it finishes
        self._latency = RequestLatency(self._metrics)

    @classmethod
    def from_config(cls, config: EngineConfig, metrics: RequestMetrics | None = None) -> AsyncLLMEngine:
        from pagellm.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), metrics)

    # ---- read-only views (safe from any thread) -----------------------------------------

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.input_processor

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def kernel_plan_info(self) -> dict[str, str]:
        return self.engine.kernel_plan_info

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def replica_stats(self) -> list[EngineStats]:
        """Each replica's stats (one engine: its own, alone)."""
        return self.engine.replica_stats

    @property
    def num_replicas(self) -> int:
        """Engine replicas (data parallelism), each with its own KV pool and queues."""
        return self.engine.num_replicas

    @property
    def is_running(self) -> bool:
        """True while the loop is alive, its engine serving and requests accepted (what /health reports)."""
        thread = self._thread
        alive = thread is not None and thread.is_alive()
        return alive and not (self._stopping or self._restarting or self._error is not None)

    @property
    def is_closing(self) -> bool:
        """True once shutdown began: long-lived streams (the live page's) end then."""
        return self._stopping or self._closed

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the loop for good, if one did."""
        return self._error

    @property
    def status_message(self) -> str:
        """Why requests are refused now, in words fit for a client (no internals)."""
        with self._cond:
            return self._dead_message()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        self._thread = threading.Thread(target=self._run, name="pagellm-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Ask the loop to abort everything and exit; returns at once (safe in signal handlers)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort in-flight requests (their streams raise EngineDeadError) and stop the thread."""
        self.begin_shutdown()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0fs", timeout)

    # ---- requests (event loop side) -------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams | PoolingParams,
        request_id: str,
        prompt: str | None = None,
        *,
        stream: bool = True,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """``submit_all`` for one request."""
        request = EngineRequest(request_id, prompt_token_ids, params, prompt, cache_salt, stream, priority=priority,
                                lora_request=lora_request)  # fmt: skip
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[EngineRequest]) -> list[RequestStream]:
        """Queue requests now, all or none (call on the event loop); their outputs as async iterators.

        Raises at once, before anything is sent to a client: ``EngineOverloadedError`` when they
        do not all fit the admission bound now, ValueError when they could never fit it together,
        ``EngineDeadError`` when the loop cannot take requests. Outputs are deltas until the one
        with ``finished`` set (``stream=False``: one whole output); a beam search yields one final
        output, its beams best first. Leaving early (closing the iterator, cancellation, client
        disconnect, or never iterating at all) aborts the request, which frees its KV blocks. An
        iterator raises ValueError if the engine rejects its request, ``RequestFailedError`` if the
        engine fails it, EngineDeadError if the engine dies first.
        """
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        adds = [_Add(replace(r, arrival_time=now) if r.arrival_time is None else r, Channel(loop)) for r in requests]
        self._submit_adds(adds)
        return [RequestStream(add.stream, add.request_id, self.abort) for add in adds]

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams | PoolingParams,
        request_id: str,
        prompt: str | None = None,
        *,
        stream: bool = True,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``submit`` on first iteration: the async-generator form (errors arrive while iterating)."""
        outputs = self.submit(prompt_token_ids, params, request_id, prompt, stream=stream, cache_salt=cache_salt,
                              priority=priority, lora_request=lora_request)  # fmt: skip
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()

    async def snapshot(self, max_requests: int, replica: int = 0) -> KVSnapshot:
        """A picture of one replica's queues and KV pool, taken by the engine thread between two
        steps. Raises EngineDeadError when the loop cannot serve, ValueError for a bad replica,
        and whatever the engine raised while taking it (the engine itself goes on)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[KVSnapshot] = loop.create_future()
        self._submit(SnapshotCall(max_requests, replica, loop, future))
        return await future

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks at the top of the next loop iteration."""
        try:
            self._submit(_Abort(request_id))
        except EngineDeadError:
            pass  # the loop is gone (or restarting) and has already dropped every request

    def _submit(self, command: _Command) -> None:
        with self._cond:
            self._check_accepting()
            self._inbox.append(command)
            self._cond.notify()

    def _submit_adds(self, adds: list[_Add]) -> None:
        with self._cond:
            self._check_accepting()
            limit = self._options.max_requests
            if limit is not None and len(adds) > limit:
                raise ValueError(
                    f"prompt must hold at most {limit} prompts (the server's capacity), got {len(adds)}."
                )
            if limit is not None and self._admitted + len(adds) > limit:
                self._metrics.count_rejected("overloaded")
                raise EngineOverloadedError(
                    f"the server is at capacity ({self._admitted} of {limit} requests in flight); retry shortly"
                )
            self._admitted += len(adds)
            self._inbox.extend(adds)
            self._cond.notify()

    def _check_accepting(self) -> None:
        if self._closed or self._stopping or self._restarting or self._error is not None:
            raise EngineDeadError(self._dead_message())

    def _dead_message(self) -> str:
        lost = f" ({self._lost} is gone)" if self._lost else ""
        if self._restarting:
            return f"the engine failed{lost} and is restarting; retry shortly"
        if self._error is not None:
            return f"the engine stopped after a failure{lost} (the server log has the details)"
        return "the server is shutting down"

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._serve()
                break  # asked to stop
            except BaseException as exc:  # any failure must reach every waiting request
                logger.exception("the engine failed")
                dead = dead_rank_in(exc)
                with self._cond:
                    self._lost = dead.who if dead is not None else None
                restarting = not self._stopping and self._take_restart()
                if not restarting:
                    with self._cond:
                        self._error = exc  # before the requests hear of it: /health agrees with them
                self._fail_in_flight()
                if restarting and self._restart():
                    continue
                with self._cond:
                    self._error, self._restarting = exc, False
                break
        self._close()
        if self._error is not None and self._options.on_dead is not None:
            self._options.on_dead()

    def _serve(self) -> None:
        while True:
            commands = self._next_commands()
            if commands is None:
                return
            self._batch = commands  # what is left of it if the engine dies while applying it
            while self._batch:
                applied = self._apply(self._batch)
                del self._batch[:applied]
            if self.engine.has_unfinished_requests():
                self._deliver(self.engine.step())

    def _next_commands(self) -> list[_Command] | None:
        """Block while idle, checking the engine every ``HEALTH_CHECK_INTERVAL_S``; then take the
        whole inbox (None: shut down). The check runs outside the lock: it may take a round trip
        (Ray's pings), and requests must still be submitted meanwhile."""
        while True:
            with self._cond:
                if self._cond.wait_for(self._has_work, HEALTH_CHECK_INTERVAL_S):
                    if self._stopping:
                        return None
                    commands, self._inbox = self._inbox, []
                    return commands
            self.engine.check_health()

    def _has_work(self) -> bool:
        return bool(self._inbox or self._stopping or self.engine.has_unfinished_requests())

    def _take_restart(self) -> bool:
        """Claim one of the restarts left; requests are refused (503) until ``_restart`` ends."""
        with self._cond:
            if self._restarts_left <= 0:
                return False
            self._restarts_left -= 1
            self._restarting = True
            return True

    def _restart(self) -> bool:
        """Replace the dead engine with a fresh one; False if that failed."""
        logger.warning("restarting the engine (%d restart(s) left after this one)", self._restarts_left)
        try:
            restarted = self.engine.restart()
        except Exception:  # noqa: BLE001 -- a failed restart leaves the engine dead for good
            logger.exception("the engine could not be restarted")
            restarted = False
        if restarted:
            self._metrics.count_engine_restart()
            logger.warning("the engine was restarted")
            with self._cond:
                self._restarting, self._lost = False, None
        return restarted

    def _apply(self, commands: list[_Command]) -> int:
        """Apply the run of adds, or of aborts, that starts the batch in one engine call (one
        round trip to an engine process); returns how many commands that took."""
        kind = type(commands[0])
        run: list[_Command] = []
        for command in commands:
            if type(command) is not kind:
                break
            run.append(command)
        if kind is _Abort:
            self._apply_aborts([c.request_id for c in run])
        elif kind is SnapshotCall:
            for command in run:
                command.answer(self.engine)  # type: ignore[union-attr]
        else:
            self._apply_adds(run)  # type: ignore[arg-type]
        return len(run)

    def _apply_adds(self, adds: list[_Add]) -> None:
        errors = self.engine.add_requests([add.request for add in adds])
        for add, error in zip(adds, errors, strict=True):  # a short answer is an engine failure
            if error is not None:
                self._release(1)
                post_error([add.stream], error)
                continue
            self._running[add.request_id] = _Running(add.stream, RequestTiming(add.arrival))

    def _apply_aborts(self, request_ids: list[str]) -> None:
        """Abort the requests still running (a finished one has no stream left) and send each its final output."""
        running = {rid: self._running[rid] for rid in dict.fromkeys(request_ids) if rid in self._running}
        if not running:
            return
        now = time.monotonic()
        outputs = self.engine.abort_request(list(running))
        deliveries = Deliveries()
        for output in outputs:
            entry = running.get(output.request_id)
            if entry is not None:
                self._latency.record(entry.timing, output, now)
                deliveries.add(entry.stream, output)
        for request_id in running:
            self._forget(request_id)
        deliveries.post()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Send one step's outputs to their streams: one wake-up per event loop, not per request."""
        now = time.monotonic()
        deliveries = Deliveries()
        for output in outputs:
            entry = self._running.get(output.request_id)
            if entry is None:
                continue
            self._latency.record(entry.timing, output, now)
            item: StreamItem = output
            if output.error is not None:
                item = (RequestRejectedError if output.error_is_request else RequestFailedError)(output.error)
            if output.finished or output.error is not None:
                self._forget(output.request_id)
            deliveries.add(entry.stream, item)
        deliveries.post()

    def _forget(self, request_id: str) -> None:
        """A request left the engine: drop its stream and free its admission slot."""
        if self._running.pop(request_id, None) is not None:
            self._release(1)

    def _release(self, count: int) -> None:
        with self._cond:
            self._admitted -= count

    def _fail_in_flight(self) -> None:
        """The engine died: every request it held, and every request of the batch being applied
        (given to it or not yet), ends with EngineDeadError.

        Requests still in the inbox were not taken yet; a restarted engine takes them.
        """
        pending = [c.stream for c in self._batch if isinstance(c, _Add)]
        self._fail_snapshots(self._batch, EngineDeadError("the engine failed"))
        self._batch = []
        streams = [*(r.stream for r in self._running.values()), *pending]
        with self._cond:
            lost = f" ({self._lost} is gone)" if self._lost else ""
        post_error(streams, EngineDeadError(f"the engine failed while running this request{lost}; retry it"))
        self._release(len(streams))
        self._running.clear()

    @staticmethod
    def _fail_snapshots(commands: list[_Command], error: BaseException) -> None:
        for command in commands:
            if isinstance(command, SnapshotCall):
                command.settle(error)

    def _close(self) -> None:
        """Fail every waiting request and free the engine's blocks; runs once, on the way out."""
        with self._cond:
            self._closed = True
            leftovers, self._inbox = self._inbox, []
            message = self._dead_message()
        # Running requests, plus any not registered yet: a request that already has its answer
        # never reads its queue again, so an extra error there is harmless.
        pending = [c.stream for c in self._batch + leftovers if isinstance(c, _Add)]
        self._fail_snapshots(self._batch + leftovers, EngineDeadError(message))
        post_error([*(r.stream for r in self._running.values()), *pending], EngineDeadError(message))
        request_ids = list(self._running)
        self._running.clear()
        if request_ids and self._error is None:
            try:
                self.engine.abort_request(request_ids)
            except Exception:  # an engine shutting down may fail here too; nothing is left to do
                logger.exception("could not abort requests while closing the engine loop")
