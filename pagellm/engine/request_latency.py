"""What the step loop measures of each request: TTFT, TPOT, end-to-end latency and finish reasons,
from the outputs it hands over. Apart from ``async_engine`` so the loop keeps only its own job
(moving commands in and outputs out); this is touched by the engine thread only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from pagellm.engine.protocol import RequestMetrics
from pagellm.outputs import RequestOutput


class NoMetrics:
    """The ``RequestMetrics`` of a loop nobody scrapes: every observation is dropped."""

    def observe_time_to_first_token(self, seconds: float) -> None:
        pass

    def observe_time_per_output_token(self, seconds: float) -> None:
        pass

    def observe_e2e_latency(self, seconds: float) -> None:
        pass

    def count_finished(self, finish_reason: str) -> None:
        pass

    def count_rejected(self, reason: str) -> None:
        pass

    def count_engine_restart(self) -> None:
        pass


@dataclass
class RequestTiming:
    """Latency bookkeeping of one request (kept in the step loop's record of it)."""

    arrival: float
    first_token: float | None = None
    num_tokens: dict[int, int] = field(default_factory=lambda: defaultdict(int))


class RequestLatency:
    """Turns a request's arrival and first-token times into observations of ``metrics`` as its
    outputs go by (the timings live with the request, not here)."""

    def __init__(self, metrics: RequestMetrics) -> None:
        self._metrics = metrics

    def record(self, timing: RequestTiming, output: RequestOutput, now: float) -> None:
        """Observe TTFT on the first tokens; TPOT, latency and finish reasons at the end (the
        caller drops ``timing`` with the finished request)."""
        if timing.first_token is None and any(o.token_ids for o in output.outputs):
            timing.first_token = now
            self._metrics.observe_time_to_first_token(now - timing.arrival)
        for sample in output.outputs:
            timing.num_tokens[sample.index] += len(sample.token_ids)
        if not output.finished:
            return
        self._metrics.observe_e2e_latency(now - timing.arrival)
        longest = max(timing.num_tokens.values(), default=0)
        if timing.first_token is not None and longest > 1:
            self._metrics.observe_time_per_output_token((now - timing.first_token) / (longest - 1))
        for sample in output.outputs:
            self._metrics.count_finished(sample.finish_reason or "abort")
