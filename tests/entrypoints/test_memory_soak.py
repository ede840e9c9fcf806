"""Memory comes back: after rounds of the heaviest requests the server takes (15 MB bodies of
millions of small values, refused; a thousand prompts at once, served), the idle RSS of the API
process and of its engine returns near the level it had after the warm-up rounds (issue 40)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.helpers.server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

WARM_UP_ROUNDS, ROUNDS = 2, 3
# What the idle RSS may stay above its level after the warm-up rounds: a guard against memory
# kept per request, which grows with every round (before the request bounds, one refused
# 3-million-prompt request left the API process 5.4 GB larger), not a measure of the heap's
# noise. Measured on this test's server alone (NOTES 50): +37 MiB over three rounds with the heap
# trimmed, +60 without; inside the whole suite (a server many tests used before) +139 once.
MARGIN_BYTES = 256 << 20
SETTLE_S = 30.0  # the trims run once a request ends or the engine goes idle: wait for them

HEAVY: list[tuple[str, bytes, int]] = [
    ("/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": ["x"] * 3_000_000, "max_tokens": 1}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": "word " * 6_000_000, "max_tokens": 1}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1,
                                    "guided_choice": [f"c{i}" for i in range(200_000)]}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": [f"hello {i} " * 8 for i in range(1024)],
                                    "max_tokens": 2}).encode(), 200),
    ("/v1/chat/completions", json.dumps({"model": MODEL_NAME, "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "hello " * 2000}]}).encode(), 400),
]


def rss(pid: int) -> int:
    """Resident bytes of one process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its children (the server and its engine process)."""
    children = [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]
    return rss(pid) + sum(rss(child) for child in children)


def settled(measure: Callable[[], int], bound: int) -> int:
    """The RSS once it is at most ``bound``, or the last reading after SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    value = measure()
    while value > bound and time.monotonic() < deadline:
        time.sleep(0.2)
        value = measure()
    return value


def steady(measure: Callable[[], int]) -> int:
    """The RSS once four readings a quarter second apart agree within 2 MiB (at most SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    readings = [measure()]
    while time.monotonic() < deadline and (len(readings) < 4 or max(readings[-4:]) - min(readings[-4:]) > 2 << 20):
        time.sleep(0.25)
        readings.append(measure())
    return readings[-1]


def one_round(http: httpx.Client) -> None:
    for path, body, status in HEAVY:
        response = http.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, response.text[:300]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_idle_rss_returns_after_heavy_requests(server: RemoteServer, http: httpx.Client) -> None:
    pid = server.proc.pid
    for _ in range(WARM_UP_ROUNDS):  # caches, thread pools and touched KV blocks reach their size
        one_round(http)
    baseline, api_before = steady(lambda: tree_rss(pid)), rss(pid)
    for _ in range(ROUNDS):
        one_round(http)
    after = settled(lambda: tree_rss(pid), baseline + MARGIN_BYTES)
    mib = 1 << 20
    assert after <= baseline + MARGIN_BYTES, (
        f"idle RSS {after / mib:.0f} MiB after {ROUNDS} more rounds, {baseline / mib:.0f} MiB after the warm-up "
        f"(the API process {api_before / mib:.0f} -> {rss(pid) / mib:.0f} MiB; {os.cpu_count()} CPUs)"
    )
