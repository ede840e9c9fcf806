"""Load-test a running ``pagellm serve``: N concurrent streaming completions, throughput and TTFT.

    pagellm serve &                     # default model on 127.0.0.1:8000
    python benchmarks/serve_load.py --num-requests 64 --concurrency 64 --max-tokens 128

The client is kept lean (raw httpx, no OpenAI SDK) because on a small machine it shares the
CPUs with the server. ``run_load`` is importable for scripted sweeps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass

import httpx


@dataclass
class RequestResult:
    ttft_s: float  # send -> first non-empty text chunk
    latency_s: float  # send -> [DONE]
    completion_tokens: int


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
    tpot_median_s: float  # per request: (latency - ttft) / (tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def _one_request(client: httpx.AsyncClient, body: dict) -> RequestResult:
    start = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if ttft is None and any(c.get("text") for c in event["choices"]):
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    latency = time.perf_counter() - start
    return RequestResult(ttft_s=ttft if ttft is not None else latency, latency_s=latency, completion_tokens=tokens)


async def run_load_async(
    base_url: str = "http://127.0.0.1:8000",
    num_requests: int = 64,
    concurrency: int = 64,
    max_tokens: int = 128,
    prompt: str = "Write a short story about a robot who learns to paint. Robot number {i} begins:",
    model: str | None = None,
    temperature: float = 0.8,
    api_key: str | None = None,
) -> LoadResult:
    """Send ``num_requests`` streaming completions, at most ``concurrency`` at a time.

    ``ignore_eos`` makes every request produce exactly ``max_tokens`` tokens, so runs compare.
    """
    limit = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def bounded(client: httpx.AsyncClient, i: int) -> RequestResult:
        body = {
            "prompt": prompt.format(i=i), "max_tokens": max_tokens, "temperature": temperature, "seed": i,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
        }
        if model is not None:
            body["model"] = model
        async with limit:
            return await _one_request(client, body)

    pool = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=pool, headers=headers) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(client, i) for i in range(num_requests)))
        wall = time.perf_counter() - start
    ttfts = [r.ttft_s for r in results]
    tokens = sum(r.completion_tokens for r in results)
    tpots = [(r.latency_s - r.ttft_s) / (r.completion_tokens - 1) for r in results if r.completion_tokens > 1]
    return LoadResult(
        num_requests=num_requests,
        concurrency=concurrency,
        wall_s=wall,
        output_tokens=tokens,
        output_tokens_per_s=tokens / wall,
        requests_per_s=num_requests / wall,
        ttft_median_s=statistics.median(ttfts),
        ttft_p99_s=percentile(ttfts, 99),
        latency_median_s=statistics.median(r.latency_s for r in results),
        tpot_median_s=statistics.median(tpots) if tpots else 0.0,
    )


def run_load(**kwargs: object) -> LoadResult:
    """Synchronous wrapper of ``run_load_async`` (same keyword arguments)."""
    return asyncio.run(run_load_async(**kwargs))  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--model", default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = run_load(
        base_url=args.base_url, num_requests=args.num_requests, concurrency=args.concurrency,
        max_tokens=args.max_tokens, temperature=args.temperature, model=args.model, api_key=args.api_key,
    )
    if args.json:
        print(json.dumps(asdict(result), indent=2))
        return
    print(f"{result.num_requests} requests x {args.max_tokens} tokens, concurrency {result.concurrency}")
    print(f"  wall {result.wall_s:.1f}s, {result.output_tokens_per_s:.1f} output tok/s, "
          f"{result.requests_per_s:.2f} req/s")
    print(f"  TTFT median {result.ttft_median_s * 1000:.0f} ms, p99 {result.ttft_p99_s * 1000:.0f} ms")
    print(f"  latency median {result.latency_median_s:.1f}s, TPOT median {result.tpot_median_s * 1000:.1f} ms")


if __name__ == "__main__":
    main()
