"""Micro-benchmark: what one web-page snapshot costs the engine (``take_kv_snapshot``, between
two steps) and the API server (encoding the payload), by pool size and running requests.

Each case admits ``requests`` prompts of a shared 256-token system prompt plus 64 tokens of
their own (21 blocks of 16 each, 16 of them shared), runs one step, then times ``--calls``
snapshots and payload encodings; prints the median milliseconds of each and the payload size.

    python benchmarks/ui_snapshot_micro.py [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm.core.kv_cache_manager import KVCacheManager  # noqa: E402
from pagellm.core.kv_snapshot import take_kv_snapshot  # noqa: E402
from pagellm.core.sequence import Sequence  # noqa: E402
from pagellm.core.scheduler import Scheduler  # noqa: E402
from pagellm.engine.llm_engine import EngineStats  # noqa: E402
from pagellm.entrypoints.ui.payload import build_payload  # noqa: E402
from pagellm.sampling_params import SamplingParams  # noqa: E402
from pagellm.step import ModelRunnerOutput  # noqa: E402

# (KV blocks, running requests): the default model's 1 GiB pool (2,912 blocks), and bigger ones.
CASES = [(2912, 1), (2912, 16), (2912, 128), (65536, 128), (1 << 20, 128)]


def busy_scheduler(num_blocks: int, num_requests: int) -> Scheduler:
    scheduler = Scheduler(KVCacheManager(num_blocks, 16), 256, 1 << 20, 1 << 20)
    system = list(range(1000, 1256))
    for i in range(num_requests):
        prompt = system + list(range(10_000 + 100 * i, 10_000 + 100 * i + 64))
        scheduler.add_sequence(Sequence(str(i), prompt, SamplingParams(max_tokens=4), max_tokens=4))
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(sampled={r.seq_id: 7 for r in out.scheduled if r.sample}))
    return scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(f"{'blocks':>8} {'requests':>8} {'snapshot ms':>12} {'encode ms':>10} {'payload B':>10}")
    for num_blocks, num_requests in CASES:
        scheduler = busy_scheduler(num_blocks, num_requests)
        take, encode = [], []
        for _ in range(args.calls):
            start = time.perf_counter()
            snapshot = take_kv_snapshot(scheduler)
            middle = time.perf_counter()
            body = json.dumps(build_payload(snapshot, EngineStats(), 0, 1, "m", {}, 0.0), separators=(",", ":"))
            take.append(middle - start)
            encode.append(time.perf_counter() - middle)
        print(f"{num_blocks:>8} {num_requests:>8} {statistics.median(take) * 1e3:>12.3f} "
              f"{statistics.median(encode) * 1e3:>10.3f} {len(body):>10}")


if __name__ == "__main__":
    main()
