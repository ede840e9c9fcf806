"""Micro-benchmark: one tensor-parallel all-reduce on this host, gloo (TCP loopback) against the
shared-memory path (``pagellm.distributed.shm_all_reduce``), per tensor shape.

Starts ``--ranks`` processes of one thread each, joined as a tensor-parallel engine's ranks are;
each times ``--calls`` all-reduces per shape after a warm-up; rank 0 prints the median and
90th-percentile microseconds per call, and the bytes a call moves.

    python benchmarks/all_reduce_micro.py [--ranks 2] [--calls 500] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import kernels  # noqa: E402
from pagellm.distributed.tensor_parallel import close_tensor_parallel, free_port, init_tensor_parallel  # noqa: E402

SHAPES = [(1, 576), (8, 576), (64, 576), (256, 576), (1, 4096), (64, 4096)]


def _time(fn, calls: int) -> tuple[float, float]:
    for _ in range(max(10, calls // 10)):
        fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.9)]


def _rank(rank: int, ranks: int, port: int, calls: int, out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, ranks, port, kernels.default())
    rows = []
    for shape in SHAPES:
        x = torch.randn(*shape)
        gloo = _time(lambda: dist.all_reduce(x), calls)
        shm = _time(lambda: tp.all_reduce_(x), calls) if tp.shm is not None else (float("nan"), float("nan"))
        rows.append(dict(shape=list(shape), bytes=x.numel() * 4, gloo_us=gloo, shm_us=shm))
    close_tensor_parallel()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "rows.json"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.calls, str(result))) for r in range(args.ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        rows = json.loads(result.read_text())
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))
    print(f"{args.ranks} ranks, 1 thread each, {args.calls} calls per shape; microseconds per call (median / p90)")
    print(f"{'shape':<12} {'bytes':>9} {'gloo':>16} {'shared memory':>16} {'speed-up':>9}")
    for r in rows:
        ratio = r["gloo_us"][0] / r["shm_us"][0]
        print(f"{str(tuple(r['shape'])):<12} {r['bytes']:>9} {r['gloo_us'][0]:>7.1f} / {r['gloo_us'][1]:>6.1f} "
              f"{r['shm_us'][0]:>7.1f} / {r['shm_us'][1]:>6.1f} {ratio:>8.1f}x")


if __name__ == "__main__":
    main()
