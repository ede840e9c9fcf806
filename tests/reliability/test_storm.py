"""Disconnect storm: 120 concurrent streams, half cut mid-stream, must leave the server clean and serving.

A client that vanishes must abort its request (its KV blocks freed, counted as "abort") without
disturbing the others; /health must answer 200 the whole time. Every check reads server state
(/metrics, statuses, counts) and polls with a generous deadline. The one ordering assumption: a
stream cut after at most 8 of its 240 chunks is still generating when it is cut (the server would
have to run 30x ahead of the client's reads otherwise); the exact count check below would show it.
Latencies are printed for the record, never asserted.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.helpers.server import RemoteServer
from tests.helpers.load import ABORTED, LENGTH, is_idle, load, percentile, poll_metrics, scrape

pytestmark = pytest.mark.slow

MODEL = "tiny"
NUM_STREAMS = 120
FULL_TOKENS = 64  # streams read to the end
CUT_TOKENS = 240  # streams cut after 1..MAX_CUT_AFTER chunks: 30x more tokens than they ever read
MAX_CUT_AFTER = 8
PROBE_TOKENS = 16
NUM_AFTER = 40
# 120 x 256 slots fit in 2048 blocks of 16: no preemption, the storm is about disconnects only.
SERVER_ARGS = ["--served-model-name", MODEL, "--num-kv-blocks", "2048", "--max-num-seqs", "128",
               "--max-model-len", "256"]
CHAT = [{"role": "user", "content": "Say something."}]
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=None)


@dataclass
class Storm:
    """What the clients saw: streams cut, latencies of normal requests, every /health status."""

    cut: int = 0
    full_latencies: list[float] = field(default_factory=list)
    probe_latencies: list[float] = field(default_factory=list)
    probe_statuses: list[int] = field(default_factory=list)
    health: list[int | str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def server(tiny_llama_path: str) -> Iterator[RemoteServer]:
    with RemoteServer(tiny_llama_path, SERVER_ARGS) as remote:
        yield remote


def normal_request(i: int) -> tuple[str, dict[str, Any]]:
    """Alternately a completion and a chat completion, greedy, exactly PROBE_TOKENS tokens."""
    common = {"model": MODEL, "max_tokens": PROBE_TOKENS, "temperature": 0.0, "ignore_eos": True}
    if i % 2:
        return "/v1/chat/completions", {**common, "messages": CHAT}
    return "/v1/completions", {**common, "prompt": f"Normal request {i}"}


def check_shape(path: str, payload: dict[str, Any]) -> None:
    """A whole (non-streamed) answer as OpenAI shapes it."""
    [choice] = payload["choices"]
    assert choice["finish_reason"] == "length", payload
    assert payload["usage"]["completion_tokens"] == PROBE_TOKENS, payload
    if path == "/v1/completions":
        assert payload["object"] == "text_completion" and isinstance(choice["text"], str), payload
    else:
        assert payload["object"] == "chat.completion", payload
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str), payload


async def timed_normal(client: httpx.AsyncClient, i: int, storm: Storm, latencies: list[float]) -> None:
    path, body = normal_request(i)
    start = time.perf_counter()
    response = await client.post(path, json=body)
    latencies.append(time.perf_counter() - start)
    storm.probe_statuses.append(response.status_code)
    if response.status_code == 200:
        check_shape(path, response.json())
    else:
        storm.problems.append(f"{path} {body} -> {response.status_code} {response.text[:300]}")


async def stream(client: httpx.AsyncClient, i: int, cut_after: int | None, storm: Storm) -> None:
    """One streamed completion; with ``cut_after``, close the connection after that many chunks."""
    body = {"model": MODEL, "prompt": f"Stream {i} says", "stream": True, "ignore_eos": True,
            "max_tokens": CUT_TOKENS if cut_after else FULL_TOKENS, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunks, usage, done = 0, None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            storm.problems.append(f"stream {i}: {response.status_code} {(await response.aread())[:300]!r}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                storm.problems.append(f"stream {i}: in-band error {event}")
            chunks += bool(event.get("choices"))
            usage = event.get("usage") or usage
            if cut_after is not None and chunks >= cut_after:
                break  # leaving the block closes the connection mid-stream
    if cut_after is not None:
        storm.cut += not done
        if done:
            storm.problems.append(f"stream {i} ended before its cut after {cut_after} chunks")
    elif not done or usage is None or usage["completion_tokens"] != FULL_TOKENS:
        storm.problems.append(f"stream {i}: done={done} usage={usage}")
    else:
        storm.full_latencies.append(time.perf_counter() - start)


async def poll_health(base_url: str, stop: asyncio.Event, storm: Storm) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
        while not stop.is_set():
            try:
                storm.health.append((await client.get("/health")).status_code)
            except httpx.HTTPError as exc:
                storm.health.append(repr(exc))
            await asyncio.sleep(0.05)


async def probe(client: httpx.AsyncClient, stop: asyncio.Event, storm: Storm) -> None:
    """Normal requests back to back for as long as the storm lasts."""
    i = 0
    while not stop.is_set():
        await timed_normal(client, i, storm, storm.probe_latencies)
        i += 1


async def run_storm(base_url: str, seed: int) -> Storm:
    rng = random.Random(seed)
    cut = set(rng.sample(range(NUM_STREAMS), NUM_STREAMS // 2))
    storm = Storm()
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=LIMITS) as client:
        watchers = [asyncio.ensure_future(poll_health(base_url, stop, storm)),
                    *(asyncio.ensure_future(probe(client, stop, storm)) for _ in range(4))]
        try:
            await asyncio.gather(*(stream(client, i, rng.randint(1, MAX_CUT_AFTER) if i in cut else None, storm)
                                   for i in range(NUM_STREAMS)))
        finally:
            stop.set()
            await asyncio.gather(*watchers)
    return storm


async def run_after(base_url: str, storm: Storm) -> list[float]:
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
        for i in range(NUM_AFTER):
            await timed_normal(client, i, storm, latencies)
    return latencies


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_disconnect_storm(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
        before = scrape(http)
        storm = asyncio.run(run_storm(server.base_url, seed=20240607))
        after_latencies = asyncio.run(run_after(server.base_url, storm))
        total = NUM_STREAMS + len(storm.probe_statuses)  # probe_statuses: normal requests during and after

        def settled(values: dict[str, float]) -> bool:
            aborted = delta(before, values, ABORTED)
            return is_idle(values) and aborted >= storm.cut and aborted + delta(before, values, LENGTH) >= total

        final = poll_metrics(http, settled)
        assert http.get("/health").status_code == 200

    print(f"\nstorm: {NUM_STREAMS} streams, {storm.cut} cut, {len(storm.probe_latencies)} normal requests during, "
          f"{len(after_latencies)} after, {len(storm.health)} /health polls")
    print(f"storm: p99 latency of normal requests ({PROBE_TOKENS} tokens) during the storm "
          f"{percentile(storm.probe_latencies, 99):.3f} s, after it {percentile(after_latencies, 99):.3f} s")
    print(f"storm: p99 latency of the uncut streams ({FULL_TOKENS} tokens) "
          f"{percentile(storm.full_latencies, 99):.3f} s")
    assert not storm.problems, "\n".join(storm.problems[:20])
    assert storm.cut == NUM_STREAMS // 2
    assert len(storm.full_latencies) == NUM_STREAMS - NUM_STREAMS // 2
    assert storm.probe_statuses == [200] * len(storm.probe_statuses) and len(after_latencies) == NUM_AFTER
    assert storm.health and all(status == 200 for status in storm.health), sorted(set(map(str, storm.health)))
    assert is_idle(final), f"KV blocks or requests still held after the storm: {load(final)}"
    num_aborted, num_length = delta(before, final, ABORTED), delta(before, final, LENGTH)
    assert num_aborted >= storm.cut, f"{storm.cut} streams cut, {num_aborted} aborts counted"
    # Every sequence finished exactly once: aborted, or to its length (all others ignore EOS).
    assert num_aborted + num_length == total, f"{num_aborted} aborted + {num_length} length != {total} requests"
