"""``LLMEngine`` in a process of its own, behind a proxy with the engine's stepping methods.

Why: in one process the engine's step loop shares the interpreter lock and the two cores
with the HTTP event loop; every torch op and kernel call releases the lock and must win it
back, and the event loop's work lands in the middle of the step's parallel regions. Measured
on the 2-core machine (4 req/s, 128/128 tokens, streaming, modes alternated): TPOT median
72-86 ms with the engine in a thread against 50-73 ms in its own process (vLLM splits its
EngineCore off for the same reason). See benchmarks/NOTES.md, entry 15.

The proxy is synchronous: each call sends one typed message (a batch of requests to add, of
ids to abort, or a step) over a pipe and blocks (without the lock) until the child answers
``("ok", (result, stats, has_unfinished))`` or ``("error", exception)``; exceptions are
re-raised here, and a batch's refused requests come back as their ``ValueError`` each, as in
process. Requests, outputs and ``EngineStats`` cross the pipe pickled between our own two
processes (no untrusted data is unpickled). The tokenizer and input checks stay in this
process; the child sends what they need (``max_model_len``, vocabulary size) once it is ready.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from pagellm.config import EngineConfig
from pagellm.core.kv_snapshot import DEFAULT_MAX_REQUESTS, KVSnapshot
from pagellm.distributed.cpu_affinity import bind_rank
from pagellm.distributed.heartbeat import HEARTBEAT_PERIOD_S
from pagellm.engine.image_processor import image_processor_for
from pagellm.engine.input_processor import InputProcessor
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.protocol import EngineRequest, EngineStats
from pagellm.model.tokenizer import load_tokenizer
from pagellm.outputs import RequestOutput
from pagellm.pooler_config import PoolerConfig
from pagellm.utils import LOG_FORMAT, release_free_memory
from pagellm.worker.executor import Executor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class EngineProcessError(RuntimeError):
    """The engine process could not start, or died."""


@dataclass
class _Ready:
    max_model_len: int
    vocab_size: int
    stats: EngineStats
    kernel_plan_info: dict[str, str]
    pooler: PoolerConfig  # the model's embedding pooler, resolved (the front end checks requests with it)
    hidden_size: int


# How often a waiting call checks that the child is still alive.
HEALTH_POLL_S = 1.0

# The calls the child serves, one message type each (anything else is refused there).


@dataclass
class _AddRequests:
    requests: list[EngineRequest]


@dataclass
class _AbortRequests:
    request_ids: list[str]


@dataclass
class _Step:
    pass


@dataclass
class _Snapshot:
    """A read-only picture of the queues and the KV pool, taken between steps."""

    max_requests: int


_Call = _AddRequests | _AbortRequests | _Step | _Snapshot


def _serve_call(engine: LLMEngine, call: _Call) -> Any:
    if isinstance(call, _AddRequests):
        return engine.add_requests(call.requests)
    if isinstance(call, _AbortRequests):
        return engine.abort_request(call.request_ids)
    if isinstance(call, _Step):
        return engine.step()
    if isinstance(call, _Snapshot):
        return engine.snapshot(call.max_requests)
    raise TypeError(f"the engine process does not serve {type(call).__name__}")


def _engine_main(config: EngineConfig, conn: Connection, log_level: int) -> None:
    """The child: build the engine, then serve calls until the pipe closes or ``None`` arrives."""
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        if config.device.cpu_bind == "auto" and config.device.cpu_share[1] > 1:
            bind_rank(*config.device.cpu_share)  # a data-parallel replica: its share of the CPUs
        engine = LLMEngine(config)
    except BaseException as exc:  # start-up failures travel to the parent, which raises them
        conn.send(("error", exc))
        return
    closing = threading.Event()
    send_lock = threading.Lock()  # the watchdog's last answer must not cut into one of the loop's
    if config.device.world_size > 1:  # the engine's other ranks: one gone, even while idle, takes it down
        watchdog = threading.Thread(target=_watch_ranks, args=(engine.executor, conn, send_lock, closing),
                                    name="pagellm-rank-watch", daemon=True)  # fmt: skip
        watchdog.start()
    processor = engine.input_processor
    conn.send(("ok", _Ready(engine.max_model_len, processor.vocab_size, engine.stats, engine.kernel_plan_info,
                            processor.pooler, processor.hidden_size)))  # fmt: skip
    # Ctrl-C reaches the whole process group: the child leaves shutdown to the parent (which
    # closes the pipe), so a shutdown is never mistaken for a crash and restarted.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    busy = False
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            call = None
        if call is None:
            closing.set()
            engine.close()
            return
        try:
            answer: tuple[str, Any] = ("ok", (_serve_call(engine, call), engine.stats, engine.has_unfinished_requests()))
        except Exception as exc:  # noqa: BLE001 -- re-raised in the parent
            answer = ("error", exc)
        with send_lock:
            conn.send(answer)
        was_busy, busy = busy, engine.has_unfinished_requests()
        if was_busy and not busy:  # idle now: what the finished requests took goes back to the OS
            release_free_memory()


def _watch_ranks(executor: Executor, conn: Connection, send_lock: threading.Lock, closing: threading.Event) -> None:
    """Check the ranks every ``HEARTBEAT_PERIOD_S`` (a local rank's end at once, by its sentinel)
    until shutdown; once one is gone, send the error naming it as this process's last answer
    and exit. The parent then sees a dead engine (``/health`` 503, in-flight requests failed with
    that error, a restart), as when this process itself dies, not an engine that looks idle and
    healthy or a step that waits out gloo's timeout on a node that will never answer."""
    sentinels = executor.sentinels()
    while not closing.is_set():
        if sentinels:
            wait(sentinels, HEARTBEAT_PERIOD_S)
        else:
            closing.wait(HEARTBEAT_PERIOD_S)
        if closing.is_set():
            return
        try:
            executor.check_health()
            continue
        except Exception as exc:  # noqa: BLE001 -- whatever it is, the engine cannot go on
            error = exc
        if closing.is_set():  # the ranks were being stopped: no loss
            return
        logger.error("%s: the engine process exits", error)
        with send_lock:  # held until the end: no answer of the loop's follows this one
            try:
                conn.send(("error", error))
            except Exception:  # noqa: BLE001 -- the parent still sees the exit
                pass
            os._exit(1)


class EngineProcess:
    """The ``EngineClient`` of an ``LLMEngine`` running in a child process.

    Not thread-safe: like ``LLMEngine``, exactly one thread (the step loop) may call it;
    ``tokenizer``, ``input_processor``, ``max_model_len`` and ``stats`` may be read anywhere.
    A call that gets no answer within ``call_timeout_s`` (a stuck child) kills the child and
    raises ``EngineProcessError``, as does a child that died; ``restart`` starts a fresh one.
    """

    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0, call_timeout_s: float = 600.0) -> None:
        if not call_timeout_s > 0:
            raise ValueError(f"the engine call timeout must be > 0 seconds, got {call_timeout_s}")
        self.config = config
        self._start_timeout_s = start_timeout_s
        self._call_timeout_s = call_timeout_s
        self._tokenizer: PreTrainedTokenizerBase | None = None  # loaded by the first start, while the child loads
        ready = self._start()
        self.max_model_len = ready.max_model_len
        self.kernel_plan_info = ready.kernel_plan_info
        self.stats = ready.stats
        self.input_processor = InputProcessor(
            self.tokenizer, ready.vocab_size, ready.max_model_len, config.limits, config.scheduler.max_num_seqs,
            config.scheduler.scheduling_policy, ready.pooler, ready.hidden_size,
            image_processor_for(config.model.model, self.tokenizer, config.limits, ready.kernel_plan_info),
        )

    def _start(self) -> _Ready:
        """Spawn the child and wait until its engine is built."""
        ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP/torch threads
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_engine_main,
            args=(self.config, child_conn, logging.getLogger().getEffectiveLevel()),
            name="pagellm-engine",
            # A daemon may not start processes: an engine of several ranks needs a plain child (which
            # still ends when this process goes: its pipe closes).
            daemon=self.config.device.world_size == 1,
        )
        self._proc.start()
        child_conn.close()
        logger.info("engine process started (pid %d)", self._proc.pid)
        self._unfinished = False  # the child's state changes only through this proxy's calls
        try:
            if self._tokenizer is None:  # while the child loads
                self._tokenizer = load_tokenizer(self.config.model.model, self.config.model.chat_template)
            ready: _Ready = self._receive(self._start_timeout_s, "start")
        except BaseException:
            self.close()
            raise
        return ready

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        assert self._tokenizer is not None  # loaded before __init__ returns
        return self._tokenizer

    @property
    def replica_stats(self) -> list[EngineStats]:
        """One engine is one replica: its own counters, alone."""
        return [self.stats]

    @property
    def num_replicas(self) -> int:
        return 1

    def check_health(self) -> None:
        """Raise if the child has exited (the loop calls this while idle): the error the child
        sent on its way out (a ``DeadRankError`` naming a lost rank), else ``EngineProcessError``."""
        if not self._proc.is_alive():
            raise self._last_words() or EngineProcessError(f"the engine process exited (exit code {self._proc.exitcode})")

    def _last_words(self) -> BaseException | None:
        """The error a dead child sent before it exited, if it sent one nobody read yet."""
        try:
            if self._conn.poll():
                status, payload = self._conn.recv()
                if status == "error" and isinstance(payload, BaseException):
                    return payload
        except (EOFError, OSError):
            pass
        return None

    def restart(self) -> bool:
        """Replace the child with a fresh engine (same configuration); its requests are gone."""
        self.close(timeout_s=5.0)
        ready = self._start()
        self.stats = ready.stats
        return True

    def _receive(self, timeout_s: float, what: str) -> Any:
        """The child's answer; a child that dies or stays silent past ``timeout_s`` raises."""
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(min(HEALTH_POLL_S, max(deadline - time.monotonic(), 0.0))):
            if not self._proc.is_alive() and not self._conn.poll():
                raise EngineProcessError(f"the engine process died (exit code {self._proc.exitcode})")
            if time.monotonic() >= deadline:
                self._kill()
                raise EngineProcessError(f"the engine process did not answer {what} within {timeout_s:.0f}s")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EngineProcessError(f"the engine process died (exit code {self._proc.exitcode})") from exc
        if status == "error":
            raise payload
        return payload

    def _call(self, call: _Call) -> Any:
        self._send(call)
        return self._answer(type(call).__name__)

    def _send(self, call: _Call) -> None:
        try:
            self._conn.send(call)
        except (BrokenPipeError, OSError) as exc:
            self._proc.join(1.0)  # its exit code
            died = EngineProcessError(f"the engine process died (exit code {self._proc.exitcode})")
            raise self._last_words() or died from exc

    def _answer(self, what: str) -> Any:
        result, self.stats, self._unfinished = self._receive(self._call_timeout_s, what)
        return result

    # ---- EngineClient: one round trip per call ---------------------------------------------

    def step(self) -> list[RequestOutput]:
        return self._call(_Step())

    def send_step(self) -> None:
        """The first half of :meth:`step`: the child starts its step (several children then
        compute at once: data parallelism); :meth:`receive_step` must follow."""
        self._send(_Step())

    def receive_step(self) -> list[RequestOutput]:
        return self._answer("_Step")

    def has_unfinished_requests(self) -> bool:
        return self._unfinished

    def add_requests(self, requests: list[EngineRequest]) -> list[ValueError | None]:
        return self._call(_AddRequests(requests))

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        return self._call(_AbortRequests([request_ids] if isinstance(request_ids, str) else list(request_ids)))

    def snapshot(self, max_requests: int = DEFAULT_MAX_REQUESTS, replica: int = 0) -> KVSnapshot:
        """The child engine's snapshot (``LLMEngine.snapshot``): one round trip between steps."""
        if replica != 0:
            raise ValueError(f"replica must be 0 (one engine), got {replica}")
        return self._call(_Snapshot(max_requests))

    def _kill(self) -> None:
        if self._proc.is_alive():
            logger.error("killing the engine process (pid %s)", self._proc.pid)
            self._proc.kill()
            self._proc.join(10.0)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the child (politely, then by force)."""
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout_s)
        if self._proc.is_alive():
            logger.warning("the engine process did not stop; terminating it")
            self._proc.terminate()
            self._proc.join(timeout_s)
        self._kill()
        self._conn.close()
