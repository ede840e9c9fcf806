"""Load-test a running ``pagellm serve`` (kept for old command lines; the code now lives in
``pagellm/benchmarks/serve.py``, which adds Poisson arrivals, ITL/TPOT percentiles and workloads:
``python -m pagellm.benchmarks serve --help``).

    pagellm serve &                     # default model on 127.0.0.1:8000
    python benchmarks/serve_load.py --num-requests 64 --concurrency 64 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm.benchmarks.serve import LoadResult, run_load  # noqa: E402,F401


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
