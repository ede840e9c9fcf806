"""Micro-benchmark: the C++ paged-attention kernel on decode rows, caches cold or hot.

    python benchmarks/paged_attention_micro.py [--rows 64] [--ctx 192] [--layers 30]
                                               [--kv-cache-dtype auto,fp8,int8] [--reps 15]

``--rows`` decode rows of ``--ctx`` positions each, the default model's heads (9 query, 3 KV,
head_dim 64), blocks of 16 in shuffled order. "cold": ``--layers`` distinct caches in turn, as
a decode step meets them (they do not stay in cache); "hot": one layer's cache ``--layers``
times. Several cache dtypes are timed in one process, pass for pass alternated. Prints the median
ms per pass over all layers and the K/V bytes read per second; the figures of
benchmarks/NOTES.md 34-35 and 57 come from it (A/B of builds: run it on each).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import kernels  # noqa: E402
from pagellm.attention.backend import to_cache_rows  # noqa: E402
from pagellm.kv_layout import kv_row_width  # noqa: E402
from pagellm.config import resolve_kv_cache_dtype  # noqa: E402

KERNELS = kernels.default()  # this machine's kernel library (None: no compiler)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=192)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-cache-dtype", default="auto", help="one dtype, or several (auto,fp8,int8) alternated")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    if KERNELS is None:
        sys.exit("the pagellm CPU kernels are not available here")

    torch.manual_seed(0)
    cache_dtypes = [resolve_kv_cache_dtype(name, torch.bfloat16) for name in args.kv_cache_dtype.split(",")]
    blocks_per_row = -(-args.ctx // BLOCK_SIZE)
    num_blocks = args.rows * blocks_per_row + 8
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)

    def cache(dtype: torch.dtype) -> torch.Tensor:
        return to_cache_rows(torch.randn(shape), dtype)  # int8: codes and a scale a row

    cold = {dt: [(cache(dt), cache(dt)) for _ in range(args.layers)] for dt in cache_dtypes}
    tables = torch.randperm(num_blocks)[: args.rows * blocks_per_row].view(args.rows, blocks_per_row).contiguous()
    query = torch.randn(args.rows, NUM_HEADS, HEAD_DIM).to(torch.bfloat16)
    out = torch.empty_like(query)
    rows = torch.arange(args.rows, dtype=torch.int32)
    ctx = torch.full((args.rows,), args.ctx, dtype=torch.int32)

    def run(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        start = time.perf_counter()
        for k, v in caches:
            KERNELS.paged_attention(query, out, k, v, tables, rows, rows, ctx, HEAD_DIM**-0.5, rows_checked=True)
        return (time.perf_counter() - start) * 1e3

    times = {(dt, kind): [] for dt in cache_dtypes for kind in ("cold", "hot")}
    for _ in range(args.reps):  # alternated, so all meet the same spells of a shared host
        for dt in cache_dtypes:
            times[(dt, "cold")].append(run(cold[dt]))
            times[(dt, "hot")].append(run([cold[dt][0]] * args.layers))
    print(f"{args.rows} rows x {args.ctx} positions, {args.layers} layers, {torch.get_num_threads()} threads")
    first = statistics.median(times[(cache_dtypes[0], "cold")])
    for (dt, kind), ts in times.items():
        row_bytes = kv_row_width(HEAD_DIM, dt) * dt.itemsize
        gbytes = args.layers * args.rows * args.ctx * NUM_KV_HEADS * row_bytes * 2 / 1e9
        ms = statistics.median(ts)
        ratio = f", {ms / first:.2f}x the first's cold time" if kind == "cold" and len(cache_dtypes) > 1 else ""
        print(f"{str(dt).removeprefix('torch.')} {kind}: {ms:.2f} ms ({gbytes / ms * 1e3:.1f} GB/s of K/V{ratio})")


if __name__ == "__main__":
    main()
