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
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagellm.config import EngineConfig
from pagellm.engine.beam_search import BeamSearchParams
from pagellm.engine.input_processor import InputProcessor
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pagellm.engine.engine_process import EngineProcess
    from pagellm.engine.llm_engine import EngineStats, LLMEngine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop is not running: it crashed, or the server is shutting down."""


class RequestMetrics(Protocol):
    """Where per-request latencies go (``pagellm.metrics.prometheus.PrometheusMetrics``)."""

    def observe_time_to_first_token(self, seconds: float) -> None: ...

    def observe_time_per_output_token(self, seconds: float) -> None: ...

    def observe_e2e_latency(self, seconds: float) -> None: ...

    def count_finished(self, finish_reason: str) -> None: ...


class _NoMetrics:
    def observe_time_to_first_token(self, seconds: float) -> None:
        pass

    def observe_time_per_output_token(self, seconds: float) -> None:
        pass

    def observe_e2e_latency(self, seconds: float) -> None:
        pass

    def count_finished(self, finish_reason: str) -> None:
        pass


StreamItem = RequestOutput | BaseException


@dataclass
class _Stream:
    """The consumer side of one request: its event loop and the queue it awaits."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)


@dataclass
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    stream: _Stream
    arrival: float
    deltas: bool
    cache_salt: str | None


@dataclass
class _Abort:
    request_id: str


_Command = _Add | _Abort


@dataclass
class _Timing:
    """Latency bookkeeping of one request, kept by the engine thread."""

    arrival: float
    first_token: float | None = None
    num_tokens: dict[int, int] = field(default_factory=lambda: defaultdict(int))


def _put_all(items: list[tuple[asyncio.Queue[StreamItem], StreamItem]]) -> None:
    """Runs on the event loop: hand one step's outputs to their requests' queues."""
    for queue, item in items:
        queue.put_nowait(item)


class AsyncLLMEngine:
    """Serve many concurrent requests from one ``LLMEngine`` without blocking the event loop."""

    def __init__(self, engine: LLMEngine | EngineProcess, metrics: RequestMetrics | None = None) -> None:
        self.engine = engine
        self._metrics: RequestMetrics = metrics or _NoMetrics()
        # RLock: shutdown may be requested from a signal handler that interrupted _submit.
        self._cond = threading.Condition(threading.RLock())
        self._inbox: list[_Command] = []
        self._stopping = False
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # Touched only by the engine thread.
        self._batch: list[_Command] = []  # the commands being applied (failed too if the loop dies)
        self._streams: dict[str, _Stream] = {}
        self._timings: dict[str, _Timing] = {}

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
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def is_running(self) -> bool:
        """True while the step loop is alive and accepting requests (what /health reports)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stopping and self._error is None

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the step loop, if one did."""
        return self._error

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

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        prompt: str | None = None,
        *,
        stream: bool = True,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its delta outputs until the one with ``finished`` set.

        ``stream=False``: a single output with everything, at the end (as ``LLMEngine``).
        A beam search (``BeamSearchParams``) always yields one final output, its beams best first.

        Leaving early (break, cancellation, client disconnect) aborts the request in the engine,
        which frees its KV blocks. Raises ValueError if the engine rejects the request and
        EngineDeadError if the loop stops first.
        """
        channel = _Stream(asyncio.get_running_loop())
        self._submit(
            _Add(request_id, prompt, prompt_token_ids, params, channel, time.monotonic(), stream, cache_salt)
        )
        done = False
        try:
            while not done:
                item = await channel.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks at the top of the next loop iteration."""
        try:
            self._submit(_Abort(request_id))
        except EngineDeadError:
            pass  # the loop is gone and has already dropped every request

    def _submit(self, command: _Command) -> None:
        with self._cond:
            if self._closed or self._stopping or self._error is not None:
                raise EngineDeadError(self._dead_message())
            self._inbox.append(command)
            self._cond.notify()

    def _dead_message(self) -> str:
        if self._error is not None:
            return f"the engine loop died: {self._error!r}"
        return "the server is shutting down"

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                commands = self._next_commands()
                if commands is None:
                    break
                self._batch = commands
                for command in commands:
                    self._apply(command)
                self._batch = []
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as exc:  # any failure must reach every waiting request
            logger.exception("the engine loop died")
            with self._cond:
                self._error = exc
        finally:
            self._close()

    def _next_commands(self) -> list[_Command] | None:
        """Block while idle; then take the whole inbox (None: shut down)."""
        with self._cond:
            while not (self._inbox or self._stopping or self.engine.has_unfinished_requests()):
                self._cond.wait()
            if self._stopping:
                return None
            commands, self._inbox = self._inbox, []
            return commands

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Abort):
            stream = self._streams.pop(command.request_id, None)
            if stream is not None:
                now = time.monotonic()
                outputs = self.engine.abort_request(command.request_id)
                for output in outputs:
                    self._record(output, now)
                self._post({stream.loop: [(stream.queue, o) for o in outputs]})
            return
        try:
            if isinstance(command.params, BeamSearchParams):
                self.engine.add_beam_search_request(
                    command.request_id, command.prompt, command.prompt_token_ids, command.params
                )
            else:
                self.engine.add_tokenized_request(
                    command.request_id,
                    command.prompt,
                    command.prompt_token_ids,
                    command.params,
                    stream=command.deltas,
                    cache_salt=command.cache_salt,
                )
        except ValueError as exc:
            self._post({command.stream.loop: [(command.stream.queue, exc)]})
            return
        self._streams[command.request_id] = command.stream
        self._timings[command.request_id] = _Timing(command.arrival)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Send one step's outputs to their streams: one wake-up per event loop, not per request."""
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[StreamItem], StreamItem]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            self._record(output, now)
            if output.finished:
                del self._streams[output.request_id]
            batches.setdefault(stream.loop, []).append((stream.queue, output))
        self._post(batches)

    @staticmethod
    def _post(batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[StreamItem], StreamItem]]]) -> None:
        for loop, items in batches.items():
            if items:
                try:
                    loop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:
                    pass  # that event loop is closed: nobody is listening any more

    def _record(self, output: RequestOutput, now: float) -> None:
        """Observe TTFT on the first tokens; TPOT, latency and finish reasons at the end."""
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        if timing.first_token is None and any(o.token_ids for o in output.outputs):
            timing.first_token = now
            self._metrics.observe_time_to_first_token(now - timing.arrival)
        for sample in output.outputs:
            timing.num_tokens[sample.index] += len(sample.token_ids)
        if not output.finished:
            return
        del self._timings[output.request_id]
        self._metrics.observe_e2e_latency(now - timing.arrival)
        longest = max(timing.num_tokens.values(), default=0)
        if timing.first_token is not None and longest > 1:
            self._metrics.observe_time_per_output_token((now - timing.first_token) / (longest - 1))
        for sample in output.outputs:
            self._metrics.count_finished(sample.finish_reason or "abort")

    def _close(self) -> None:
        """Fail every waiting request and free the engine's blocks; runs once, on the way out."""
        with self._cond:
            self._closed = True
            leftovers, self._inbox = self._inbox, []
        message = self._dead_message()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[StreamItem], StreamItem]]] = {}
        # Running requests, plus any not registered yet: a request that already has its answer
        # never reads its queue again, so an extra error there is harmless.
        pending = [c.stream for c in self._batch + leftovers if isinstance(c, _Add)]
        streams = {id(s): s for s in [*self._streams.values(), *pending]}
        for stream in streams.values():
            batches.setdefault(stream.loop, []).append((stream.queue, EngineDeadError(message)))
        self._post(batches)
        request_ids = list(self._streams)
        self._streams.clear()
        self._timings.clear()
        if request_ids:
            try:
                self.engine.abort_request(request_ids)
            except Exception:  # a crashed engine may fail here too; nothing is left to do
                logger.exception("could not abort requests while closing the engine loop")
