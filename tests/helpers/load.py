"""Helpers the reliability tests share: reading /metrics and polling with a deadline (never sleeping blind)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "pagellm:kv_cache_usage_perc"
RUNNING = "pagellm:num_requests_running"
WAITING = "pagellm:num_requests_waiting"
PREEMPTIONS = "pagellm:num_preemptions_total"
ABORTED = "pagellm:request_success_total[abort]"
LENGTH = "pagellm:request_success_total[length]"


def scrape(http: httpx.Client) -> dict[str, float]:
    """/metrics as {sample name: value}; a (finish) reason label is folded into the name (``x[abort]``).

    Histogram buckets and ``_created`` timestamps are left out: they would collide under one name.
    """
    response = http.get("/metrics")
    assert response.status_code == 200, response.text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            reason = sample.labels.get("finished_reason") or sample.labels.get("reason")
            values[f"{sample.name}[{reason}]" if reason else sample.name] = sample.value
    return values


def poll_metrics(
    http: httpx.Client, done: Callable[[dict[str, float]], bool], timeout: float = 30.0, interval: float = 0.1
) -> dict[str, float]:
    """Scrape until ``done(values)`` or the deadline; returns the last scrape either way (the caller asserts)."""
    deadline = time.monotonic() + timeout
    while True:
        values = scrape(http)
        if done(values) or time.monotonic() > deadline:
            return values
        time.sleep(interval)


def is_idle(values: dict[str, float]) -> bool:
    """No KV block held, nothing running or waiting."""
    return values[KV_USAGE] == 0.0 and values[RUNNING] == 0 and values[WAITING] == 0


def load(values: dict[str, float]) -> dict[str, float]:
    """The gauges ``is_idle`` reads, for assertion messages."""
    return {name: values[name] for name in (KV_USAGE, RUNNING, WAITING)}


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
