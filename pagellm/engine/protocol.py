"""The engine boundary: a request as the engine takes it (``EngineRequest``), the interface of
every engine a caller drives (``EngineClient``), where request metrics go, and the errors that
end requests.

``KVSnapshot`` (what ``snapshot`` returns) is re-exported here for the entry points, which name
nothing below the engine.

Kept apart from ``async_engine`` so entry points and tests can name these without the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagellm.core.kv_snapshot import KVSnapshot, RequestView  # noqa: F401 -- re-exported
from pagellm.engine.beam_search import BeamSearchParams
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.engine.llm_engine import EngineStats


class EngineDeadError(RuntimeError):
    """The step loop is not running: it crashed, is restarting the engine, or the server is shutting down."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are admitted and unfinished; the client should retry later."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (the others go on); details are in the server log."""


class RequestRejectedError(ValueError):
    """The engine could not serve this one request as asked (its own fault: a client error)."""


@dataclass
class EngineRequest:
    """One tokenized request at the engine boundary, as every ``EngineClient`` takes it (and as
    it crosses to an engine process); per-request extras (a grammar, say) become fields here."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    prompt: str | None = None
    cache_salt: str | None = None  # isolates its prefix-cache entries (per tenant)
    stream: bool = True  # deltas; False: one whole output at the end (what best_of needs)
    # time.monotonic() when the request arrived (one clock for every process of a machine); the
    # scheduler serves in this order. None: when the engine takes it.
    arrival_time: float | None = None


class EngineClient(Protocol):
    """What drives an engine: ``LLMEngine`` in process, ``EngineProcess`` in a child process
    (one round trip per call, so every call takes a batch), and the tests' fakes."""

    stats: EngineStats
    max_model_len: int
    kernel_plan_info: dict[str, str]  # KernelPlan.as_dict(): what runs where (/version)

    def add_requests(self, requests: list[EngineRequest]) -> list[ValueError | None]:
        """Queue the requests in order; one refused for its input gets its ``ValueError`` in
        its place (the others are queued). Any other exception means the engine failed."""

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def check_health(self) -> None:
        """Raise if the engine can no longer serve (a dead engine process)."""

    def snapshot(self, max_requests: int, replica: int = 0) -> KVSnapshot:
        """A bounded, read-only picture of one replica's queues and KV pool, taken between
        steps (one engine: replica 0 only; ValueError for another)."""

    def restart(self) -> bool:
        """Start a fresh engine in place of a dead one; False if this engine cannot."""


class RequestMetrics(Protocol):
    """Where per-request latencies go (``pagellm.metrics.prometheus.PrometheusMetrics``)."""

    def observe_time_to_first_token(self, seconds: float) -> None: ...

    def observe_time_per_output_token(self, seconds: float) -> None: ...

    def observe_e2e_latency(self, seconds: float) -> None: ...

    def count_finished(self, finish_reason: str) -> None: ...

    def count_rejected(self, reason: str) -> None: ...

    def count_engine_restart(self) -> None: ...
