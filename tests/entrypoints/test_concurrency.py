"""Many clients at once, clients that vanish, and the metrics that show the engine is clean after."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server import MODEL_NAME
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow

LONG = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 240, "ignore_eos": True}


def metrics(http: httpx.Client) -> dict[str, float]:
    """Samples by name, with the finish-reason label folded into the name where present."""
    response = http.get("/metrics")
    assert response.status_code == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            values[f"{sample.name}[{reason}]" if reason else sample.name] = sample.value
    return values


def wait_until_idle(http: httpx.Client, timeout: float = 30.0) -> dict[str, float]:
    """KV usage back to 0 and nothing running or waiting."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(http)
        idle = (
            values["pagellm:kv_cache_usage_perc"] == 0.0
            and values["pagellm:num_requests_running"] == 0
            and values["pagellm:num_requests_waiting"] == 0
        )
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def test_metrics_exposition(http: httpx.Client, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    values = wait_until_idle(http)
    for name in (
        "pagellm:num_requests_running", "pagellm:num_requests_waiting", "pagellm:kv_cache_usage_perc",
        "pagellm:num_preemptions_total", "pagellm:prompt_tokens_total", "pagellm:generation_tokens_total",
        "pagellm:time_to_first_token_seconds_count", "pagellm:time_per_output_token_seconds_count",
        "pagellm:e2e_request_latency_seconds_count", "pagellm:request_success_total[length]",
        "pagellm:prefix_cache_queries_total", "pagellm:prefix_cache_hits_total",
    ):
        assert name in values, name
    assert values["pagellm:prompt_tokens_total"] > 0 and values["pagellm:generation_tokens_total"] >= 3
    assert values["pagellm:time_to_first_token_seconds_count"] >= 1
    assert values["pagellm:kv_cache_usage_perc"] == 0.0


def test_32_concurrent_streams_complete(server: RemoteServer, http: httpx.Client) -> None:
    before = metrics(http).get("pagellm:request_success_total[length]", 0.0)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str | None]:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=f"Request number {i}:", max_tokens=32, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, usage, reason = "", 0, None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                reason = choice.finish_reason or reason
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage, reason

    async def run() -> list[tuple[str, int, str | None]]:
        async with server.async_client(timeout=120.0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run())
    assert all(usage == 32 and reason == "length" and text for text, usage, reason in results)
    values = wait_until_idle(http)
    assert values["pagellm:request_success_total[length]"] - before == 32
    assert values["pagellm:kv_cache_usage_perc"] == 0.0


def test_stream_disconnect_aborts_and_frees_kv(server: RemoteServer, http: httpx.Client) -> None:
    aborted_before = metrics(http).get("pagellm:request_success_total[abort]", 0.0)
    with httpx.Client(base_url=server.base_url, timeout=30.0) as own:
        with own.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # leaving the block closes the connection mid-stream
    values = wait_until_idle(http)
    assert values["pagellm:kv_cache_usage_perc"] == 0.0
    assert values["pagellm:request_success_total[abort]"] == aborted_before + 1


def test_non_streaming_disconnect_aborts(server: RemoteServer, http: httpx.Client) -> None:
    aborted_before = metrics(http).get("pagellm:request_success_total[abort]", 0.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json={**LONG, "n": 4}, timeout=0.2)
    values = wait_until_idle(http)
    assert values["pagellm:kv_cache_usage_perc"] == 0.0
    assert values["pagellm:request_success_total[abort]"] == aborted_before + 4


def test_bad_requests_do_not_disturb_running_ones(server: RemoteServer) -> None:
    async def good(client: httpx.AsyncClient, i: int) -> int:
        body = {**LONG, "prompt": f"Good {i}", "max_tokens": 48, "stream": True,
                "stream_options": {"include_usage": True}}
        usage = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if '"usage":{' in line:
                    usage = int(line.split('"completion_tokens":')[1].split(",")[0])
        return usage

    async def bad(client: httpx.AsyncClient, i: int) -> int:
        body = [{**LONG, "temperature": -1}, {**LONG, "model": "nope"}, {"prompt": 5}][i % 3]
        response = await client.post("/v1/completions", json=body)
        return response.status_code

    async def run() -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0) as client:
            goods = [asyncio.ensure_future(good(client, i)) for i in range(8)]
            bads = await asyncio.gather(*(bad(client, i) for i in range(9)))
            return list(await asyncio.gather(*goods)), list(bads)

    usages, statuses = asyncio.run(run())
    assert usages == [48] * 8
    assert sorted(set(statuses)) == [400, 404]
