"""Benchmarks: offline throughput (against HF static batching / vLLM), paged-KV memory,
a concurrency sweep with a summary plot, and an online load generator for OpenAI servers.

Run ``python -m pagellm.benchmarks {throughput,latency,memory,sweep,serve} --help``
(``pagellm bench ...`` once wired into the main CLI).
"""

from pagellm.benchmarks.cli import add_bench_subparser, bench_main

__all__ = ["add_bench_subparser", "bench_main"]
