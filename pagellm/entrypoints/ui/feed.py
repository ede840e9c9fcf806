"""The latest snapshot per replica, taken at most ``max_rate_hz`` times a second however many
pages watch it: every open page reads the same encoded payload, so ten pages cost the engine
what one does (one snapshot call between two steps per period, and only while someone reads).

The engine's share is capped too: each snapshot says what it cost to build, and the next one is
not asked for before ``cost / max_engine_share`` has passed (1 ms at 0.5%: 0.2 s), so a huge pool
or thousands of requests slow the page down rather than the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.entrypoints.openai.errors import BadRequestError, ServiceUnavailableError
from pagellm.entrypoints.ui.payload import build_payload, latency_summary
from pagellm.metrics.histogram import HistogramCounts
from pagellm.metrics.prometheus import PrometheusMetrics


@dataclass(frozen=True)
class FeedOptions:
    """How often the engine is asked, how much it lists, how far back the latency percentiles look."""

    max_rate_hz: float = 4.0
    max_engine_share: float = 0.005  # of the engine's time spent building snapshots, at most
    max_requests: int = 64
    latency_window_s: float = 60.0
    snapshot_timeout_s: float = 10.0  # a step can be long (a big prefill); beyond this, 503

    def __post_init__(self) -> None:
        if not self.max_rate_hz > 0 or self.max_requests < 0 or not self.latency_window_s > 0:
            raise ValueError("the feed's rate and window must be > 0 and max_requests >= 0")
        if not 0 < self.max_engine_share <= 1:
            raise ValueError(f"max_engine_share must be in (0, 1], got {self.max_engine_share}")

    @property
    def period_s(self) -> float:
        return 1.0 / self.max_rate_hz


class SnapshotFeed:
    """Serves encoded snapshot payloads (JSON bytes), refreshed at most once per period per replica."""

    def __init__(
        self, engine: AsyncLLMEngine, metrics: PrometheusMetrics, model: str, options: FeedOptions | None = None
    ) -> None:
        self.engine = engine
        self.options = options or FeedOptions()
        self._metrics = metrics
        self._model = model
        self._latest: dict[int, tuple[float, bytes]] = {}  # replica -> (monotonic time it expires, payload)
        self._last_cost: dict[int, float] = {}  # replica -> what its last snapshot cost the engine (s)
        self._locks: dict[int, asyncio.Lock] = {}
        self._latency_readings: deque[tuple[float, dict[str, HistogramCounts]]] = deque()

    def check_replica(self, replica: int) -> None:
        """400 for a replica this server does not have."""
        if not 0 <= replica < self.engine.num_replicas:
            raise BadRequestError(
                f"replica must be in [0, {self.engine.num_replicas - 1}], got {replica}", param="replica"
            )

    async def payload(self, replica: int = 0) -> bytes:
        """The replica's latest payload; a new snapshot only when the last is older than the period.
        Raises ``BadRequestError`` (bad replica) or ``ServiceUnavailableError`` (engine down or busy)."""
        self.check_replica(replica)
        fresh = self._fresh(replica)
        if fresh is not None:
            return fresh
        lock = self._locks.setdefault(replica, asyncio.Lock())
        async with lock:  # concurrent readers wait for the one refresh instead of asking again
            fresh = self._fresh(replica)
            if fresh is not None:
                return fresh
            body, build_seconds = await self._take(replica)
            # The cheaper of the last two builds sets the spacing: a steadily costly snapshot is
            # spaced out, one slow build (a pause of the engine process) does not stall the page.
            cost = min(build_seconds, self._last_cost.get(replica, build_seconds))
            self._last_cost[replica] = build_seconds
            wait = max(self.options.period_s, cost / self.options.max_engine_share)
            self._latest[replica] = (time.monotonic() + wait, body)
            return body

    def _fresh(self, replica: int) -> bytes | None:
        latest = self._latest.get(replica)
        if latest is not None and time.monotonic() < latest[0]:
            return latest[1]
        return None

    async def _take(self, replica: int) -> tuple[bytes, float]:
        """A new payload, and what its snapshot cost the engine (seconds)."""
        try:
            snapshot = await asyncio.wait_for(
                self.engine.snapshot(self.options.max_requests, replica), self.options.snapshot_timeout_s
            )
        except asyncio.TimeoutError as exc:
            raise ServiceUnavailableError("the engine did not answer the snapshot in time", code="engine_busy") from exc
        except ValueError as exc:
            raise BadRequestError(str(exc), param="replica") from exc
        except Exception as exc:  # noqa: BLE001 -- engine down or restarting: the page shows it and retries
            raise ServiceUnavailableError(f"no snapshot: {exc}", code="engine_unavailable") from exc
        stats = self.engine.replica_stats
        payload = build_payload(
            snapshot, stats[replica] if replica < len(stats) else self.engine.stats, replica,
            self.engine.num_replicas, self._model, self._latency(), time.time(),
        )  # fmt: skip
        return json.dumps(payload, separators=(",", ":")).encode(), snapshot.build_seconds

    def _latency(self) -> dict[str, object]:
        """TTFT/TPOT percentiles over the last ``latency_window_s`` (the server's histograms, not a copy)."""
        now = time.monotonic()
        counts = self._metrics.latency_counts()
        readings = self._latency_readings
        if not readings or now - readings[-1][0] >= 1.0:  # one reading a second is plenty
            readings.append((now, counts))
        while len(readings) > 1 and now - readings[1][0] >= self.options.latency_window_s:
            readings.popleft()
        oldest = readings[0][1] if now - readings[0][0] >= self.options.latency_window_s else None
        window = {name: c.since(oldest[name]) if oldest else c for name, c in counts.items()}
        summary = latency_summary(window, counts)
        summary["window_s"] = self.options.latency_window_s
        return summary
