"""Online load generator for any OpenAI-compatible server (``pagellm serve``, vLLM, llama.cpp).

Sends a workload's requests as streaming ``/v1/completions`` calls, either at a Poisson
arrival rate (``request_rate`` requests/s; ``inf`` sends them all at once) and/or capped at
``max_concurrency`` requests in flight, and measures per request:

* TTFT: send -> first streamed token chunk;
* ITL: the gaps between successive token chunks;
* TPOT: (latency - TTFT) / (output tokens - 1), output tokens from the final usage chunk;
* E2E latency: send -> ``[DONE]``;

then mean / median / p99 of each, request and token throughput over the whole run. Against a
pagellm server it also reads ``/metrics`` before and after the run: what its prefix cache and
disk tier did meanwhile (``SERVER_COUNTERS``; a peer's server has none).

Prompts are token ids (``prompt: [ids]``); the default ``fixed`` workload ignores EOS so that
every request produces exactly ``max_tokens`` tokens and runs compare. The client is lean
(raw ``httpx``, no OpenAI SDK) because on a small machine it shares the CPUs with the server.
Folded in from the original ``benchmarks/serve_load.py`` (``run_load`` keeps its interface).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pagellm.benchmarks._common import bench_extra, format_table, machine_info, mean, percentile
from pagellm.benchmarks.workloads import BenchRequest, Workload


# pagellm's counters the report gives the run's share of (the disk tier's where it has one).
SERVER_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "disk_tier_hits", "disk_tier_loaded_blocks",
                   "disk_tier_stored_blocks", "disk_tier_write_failures", "disk_tier_read_bytes",
                   "disk_tier_read_seconds", "disk_tier_written_bytes", "disk_tier_write_seconds")


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0  # send -> first token chunk
    latency_s: float = 0.0  # send -> [DONE]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between token chunks
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


async def _one_request(client: Any, body: dict[str, Any]) -> RequestResult:
    start = time.perf_counter()
    first = last = None
    itl: list[float] = []
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return RequestResult(ok=False, error=str(event["error"]))
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("choices"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
    except Exception as exc:  # connection refused, timeouts, bad JSON: count and go on
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - start
    return RequestResult(
        ok=True,
        ttft_s=(first - start) if first is not None else latency,
        latency_s=latency,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", len(itl) + (first is not None))),
        itl_s=itl,
    )


def _body(r: BenchRequest, model: str | None, temperature: float, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": r.prompt_token_ids,
        "max_tokens": r.max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": r.ignore_eos,
    }
    if model is not None:
        body["model"] = model
    return body


def arrival_delays(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each request: Poisson process at ``request_rate`` (inf: all at 0)."""
    if request_rate == float("inf") or request_rate <= 0:
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, delays = 0.0, []
    for _ in range(num_requests):
        delays.append(t)
        t += rng.expovariate(request_rate)
    return delays


async def run_serve_async(
    workload: Workload,
    base_url: str = "http://127.0.0.1:8000",
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    model: str | None = None,
    temperature: float = 0.0,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
    timeout_s: float = 600.0,
    transport: Any = None,  # an httpx transport (tests: httpx.ASGITransport(app))
) -> dict[str, Any]:
    httpx = bench_extra("httpx", "pagellm bench serve")
    from tqdm.auto import tqdm

    n = len(workload)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    delays = arrival_delays(n, request_rate, seed)
    bar = tqdm(total=n, desc="requests", disable=not progress, dynamic_ncols=True)
    pool = httpx.Limits(max_connections=max_concurrency or n, max_keepalive_connections=max_concurrency or n)

    client_kwargs: dict[str, Any] = dict(base_url=base_url, timeout=timeout_s, limits=pool, headers=headers)
    if transport is not None:
        client_kwargs["transport"] = transport
    async with httpx.AsyncClient(**client_kwargs) as client:
        counters_before = await server_counters(client)
        start = time.perf_counter()

        done = [asyncio.Event() for _ in range(n)]

        async def one(i: int) -> RequestResult:
            after = workload.requests[i].after
            if after is None:
                await asyncio.sleep(max(0.0, start + delays[i] - time.perf_counter()))
            else:  # (a conversation's next turn: sent once the last one finished)
                await done[after].wait()
            body = _body(workload.requests[i], model, temperature, seed + i)
            try:
                if limit is None:
                    result = await _one_request(client, body)
                else:
                    async with limit:
                        result = await _one_request(client, body)
            finally:
                done[i].set()
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(i) for i in range(n)))
        duration = time.perf_counter() - start
        counters_after = await server_counters(client)
    bar.close()
    report = summarize(results, duration, workload, dict(base_url=base_url, request_rate=request_rate,
                                                         max_concurrency=max_concurrency, temperature=temperature))
    if counters_after:
        report["server_counters"] = {k: v - counters_before.get(k, 0.0) for k, v in counters_after.items()}
    return report


async def server_counters(client: Any) -> dict[str, float]:
    """``SERVER_COUNTERS`` from the server's ``/metrics`` (summed over its engines); empty where
    it has none of them (another engine's server, or no metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get("/metrics")
    except Exception:  # noqa: BLE001 -- no metrics to read: the run is measured all the same
        return {}
    if response.status_code != 200:
        return {}
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(response.text):
            name = family.name.removeprefix("pagellm:")
            if family.name.startswith("pagellm:") and name in SERVER_COUNTERS:
                found[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    except ValueError:  # (not Prometheus text)
        return {}
    return found


def summarize(results: list[RequestResult], duration: float, workload: Workload, config: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [t for t in (r.tpot_s for r in ok) if t is not None]
    itl = [g for r in ok for g in r.itl_s]
    e2e = [r.latency_s for r in ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok) or sum(
        req.prompt_len for req, r in zip(workload.requests, results) if r.ok
    )

    def stats(name: str, values: list[float]) -> dict[str, float]:
        return {
            f"{name}_mean_ms": 1000 * mean(values),
            f"{name}_median_ms": 1000 * percentile(values, 50),
            f"{name}_p99_ms": 1000 * percentile(values, 99),
        }

    summary: dict[str, Any] = dict(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration if duration > 0 else float("nan"),
        output_tokens=out_tokens,
        output_throughput=out_tokens / duration if duration > 0 else float("nan"),
        total_token_throughput=(out_tokens + prompt_tokens) / duration if duration > 0 else float("nan"),
    )
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        summary.update(stats(name, values))
    turns = sorted({req.turn for req in workload.requests if req.turn is not None})
    if turns:  # (multi-turn: each turn's time to first token)
        summary["ttft_by_turn"] = {
            turn: stats("ttft", [r.ttft_s for req, r in zip(workload.requests, results) if r.ok and req.turn == turn])
            for turn in turns
        }  # fmt: skip
    errors = sorted({r.error for r in results if r.error})[:5]
    return dict(
        benchmark="serve",
        workload=workload.describe(),
        config=config,
        machine=machine_info(),
        summary=summary,
        errors=errors,
    )


def run_serve(workload: Workload, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(run_serve_async(workload, **kwargs))


def format_report(report: dict[str, Any]) -> str:
    s, c, w = report["summary"], report["config"], report["workload"]
    rate = c["request_rate"]
    lines = [
        f"serve {c['base_url']}: workload {w['name']} ({w['num_requests']} requests), "
        f"rate {'inf' if rate == float('inf') else f'{rate:g} req/s'}, max concurrency {c['max_concurrency'] or '-'}",
        f"completed {s['completed']}, failed {s['failed']}, duration {s['duration_s']:.1f}s, "
        f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s",
    ]
    rows = [
        dict(metric=name.upper(), mean=s[f"{name}_mean_ms"], median=s[f"{name}_median_ms"], p99=s[f"{name}_p99_ms"])
        for name in ("ttft", "tpot", "itl", "e2el")
    ]
    lines.append(format_table(rows, [("metric", "ms", ""), ("mean", "mean", ".1f"), ("median", "median", ".1f"),
                                     ("p99", "p99", ".1f")]))
    by_turn = s.get("ttft_by_turn")
    if by_turn:
        turns = [dict(turn=turn, mean=t["ttft_mean_ms"], median=t["ttft_median_ms"], p99=t["ttft_p99_ms"])
                 for turn, t in by_turn.items()]  # fmt: skip
        lines.append(format_table(turns, [("turn", "TTFT by turn", ""), ("mean", "mean ms", ".1f"),
                                          ("median", "median ms", ".1f"), ("p99", "p99 ms", ".1f")]))  # fmt: skip
    counters = report.get("server_counters")
    if counters:
        lines.append(format_server_counters(counters))
    for err in report.get("errors", []):
        lines.append(f"  error: {err}")
    return "\n".join(lines)


def format_server_counters(c: dict[str, float]) -> str:
    """The server's prefix cache and disk tier over the run, one line."""
    queries = c.get("prefix_cache_queries", 0.0)
    hit = f"{100 * c.get('prefix_cache_hits', 0.0) / queries:.1f}%" if queries else "-"
    line = f"server: prefix cache {hit} of {queries:.0f} prompt tokens looked up"
    if any(name.startswith("disk_tier_") for name in c):
        d = {name.removeprefix("disk_tier_"): value for name, value in c.items() if name.startswith("disk_tier_")}
        get = lambda name: d.get(name, 0.0)  # noqa: E731
        line += (f"; disk tier {get('loaded_blocks'):.0f} blocks loaded ({get('read_bytes') / 2**20:.0f} MiB in "
                 f"{get('read_seconds'):.2f} s), {get('stored_blocks'):.0f} written ({get('write_failures'):.0f} "
                 f"refused; {get('written_bytes') / 2**20:.0f} MiB in {get('write_seconds'):.2f} s)")  # fmt: skip
    return line


# ---- the original serve_load interface ---------------------------------------------------


@dataclass
class LoadResult:
    num_requests: int
    concurrency: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_median_s: float
    ttft_p99_s: float
    latency_median_s: float
    tpot_median_s: float


def run_load(
    base_url: str = "http://127.0.0.1:8000",
    num_requests: int = 64,
    concurrency: int = 64,
    max_tokens: int = 128,
    prompt: str = "Write a short story about a robot who learns to paint. Robot number {i} begins:",
    model: str | None = None,
    temperature: float = 0.8,
    api_key: str | None = None,
) -> LoadResult:
    """``num_requests`` text prompts at fixed concurrency (the former ``benchmarks/serve_load.py``)."""

    async def go() -> tuple[list[RequestResult], float]:
        httpx = bench_extra("httpx", "the load client")

        limit = asyncio.Semaphore(concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        pool = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=pool, headers=headers) as client:

            async def bounded(i: int) -> RequestResult:
                body = {"prompt": prompt.format(i=i), "max_tokens": max_tokens, "temperature": temperature,
                        "seed": i, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
                if model is not None:
                    body["model"] = model
                async with limit:
                    return await _one_request(client, body)

            start = time.perf_counter()
            results = await asyncio.gather(*(bounded(i) for i in range(num_requests)))
            return results, time.perf_counter() - start

    results, wall = asyncio.run(go())
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(failed[0].error)
    tokens = sum(r.completion_tokens for r in results)
    tpots = [t for t in (r.tpot_s for r in results) if t is not None]
    return LoadResult(
        num_requests=num_requests,
        concurrency=concurrency,
        wall_s=wall,
        output_tokens=tokens,
        output_tokens_per_s=tokens / wall,
        requests_per_s=num_requests / wall,
        ttft_median_s=percentile([r.ttft_s for r in results], 50),
        ttft_p99_s=percentile([r.ttft_s for r in results], 99),
        latency_median_s=percentile([r.latency_s for r in results], 50),
        tpot_median_s=percentile(tpots, 50) if tpots else 0.0,
    )


def load_result_dict(result: LoadResult) -> dict[str, Any]:
    return asdict(result)
