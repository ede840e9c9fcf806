"""Micro-benchmark: ReferenceAttention vs TorchSDPAAttention vs the C++ paged kernel
(CPUPagedAttention, where the kernels build), by default on the default model's head shape.

Cases (9 query heads, 3 KV heads, head_dim 64, block_size 16, shuffled blocks; ``--heads`` and
``--head-dim`` change the shape, e.g. ``--heads 8,4 --head-dim 256`` for Gemma 2 2B):
  decode64x256  -- 64 decode rows, each with seq_len 256 (255 cached + 1 new token)
  prefill512    -- one fresh 512-token prefill (no cached context)
  chunk256+256  -- a 256-token prefill chunk on top of 256 cached tokens
  decode32x2048 -- 32 decode rows of 2048 positions (a long context; with --window, a windowed layer's)

For torch_sdpa, "warm" reuses the per-step plan (what layers 2..N of a model see) and
"cold" rebuilds it every call (what layer 1 sees). Times are per layer call, in ms.

With ``--window W`` every call is a windowed layer's (each query over its last W positions):
run with and without it to see what a window saves at the same context. ``--softcap C`` caps
the scores as Gemma 2 does.

    python benchmarks/attention_micro.py [--dtype float32|bfloat16|both] [--iters N] [--threads N]
        [--window W] [--softcap C] [--heads H,KV] [--head-dim D] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import kernels  # noqa: E402
from pagellm.attention import (  # noqa: E402
    AttentionMetadata,
    CPUPagedAttention,
    ReferenceAttention,
    TorchSDPAAttention,
)

BLOCK_SIZE = 16


def build(reqs: list[tuple[int, int]], dtype: torch.dtype, heads: tuple[int, int], head_dim: int, seed: int = 0):
    """reqs: (cached context, new tokens) per request -> (args for forward, metadata)."""
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    nblk = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(nblk) + 8
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(reqs), max(nblk), dtype=torch.long)
    off = 0
    for r, n in enumerate(nblk):
        block_tables[r, :n] = perm[off : off + n]
        off += n
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    slots = []
    for r, (c, q) in enumerate(reqs):
        pos = torch.arange(c, c + q)
        slots.append(block_tables[r, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    query_lens = [q for _, q in reqs]
    t = sum(query_lens)
    qsl = torch.tensor([0] + query_lens).cumsum(0)
    md = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=block_tables,
        query_lens=query_lens,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        seq_lens_tensor=torch.tensor(seq_lens),
        block_size=BLOCK_SIZE,
    )
    q = torch.randn(t, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    return (q, k, v, key_cache, value_cache, md, head_dim**-0.5)


def time_ms(fn, iters: int) -> tuple[float, float]:
    for _ in range(max(2, iters // 10)):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return min(ts), statistics.median(ts)


CASES = {
    "decode64x256": [(255, 1)] * 64,
    "prefill512": [(0, 512)],
    "chunk256+256": [(256, 256)],
    "decode32x2048": [(2047, 1)] * 32,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--window", type=int, default=None, help="each query over its last W positions")
    ap.add_argument("--softcap", type=float, default=None, help="scores capped by C * tanh(score / C)")
    ap.add_argument("--heads", default="9,3", help="query heads,KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print JSON to stdout instead of a table")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]

    heads = tuple(int(h) for h in args.heads.split(","))
    lib = kernels.default()
    ref, sdpa = ReferenceAttention(), TorchSDPAAttention()
    paged = CPUPagedAttention(lib) if lib is not None else None
    rows = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for case, reqs in CASES.items():
            fargs = (*build(reqs, dtype, heads, args.head_dim), args.window, args.softcap)
            out_ref = ref.forward(*fargs)
            out_sdpa = sdpa.forward(*fargs)
            err = (out_ref.float() - out_sdpa.float()).abs().max().item()
            ref_min, ref_med = time_ms(lambda: ref.forward(*fargs), args.iters)
            warm_min, warm_med = time_ms(lambda: sdpa.forward(*fargs), args.iters)
            kernel_med, kernel_err = None, None
            if paged is not None:
                kernel_err = (out_ref.float() - paged.forward(*fargs).float()).abs().max().item()
                kernel_med = round(time_ms(lambda: paged.forward(*fargs), args.iters)[1], 3)

            def cold():
                fargs[5].derived.clear()  # the step plan kept on the metadata: built again
                sdpa.forward(*fargs)

            cold_min, cold_med = time_ms(cold, args.iters)
            rows.append(
                dict(
                    case=case,
                    dtype=dname,
                    tokens=sum(q for _, q in reqs),
                    ref_ms=round(ref_med, 3),
                    sdpa_warm_ms=round(warm_med, 3),
                    sdpa_cold_ms=round(cold_med, 3),
                    ref_min_ms=round(ref_min, 3),
                    sdpa_warm_min_ms=round(warm_min, 3),
                    sdpa_cold_min_ms=round(cold_min, 3),
                    speedup_warm=round(ref_med / warm_med, 2),
                    max_abs_diff=err,
                    kernel_ms=kernel_med,
                    kernel_max_abs_diff=kernel_err,
                )
            )
    meta = dict(
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        iters=args.iters,
        window=args.window,
        softcap=args.softcap,
        kernels=None if lib is None else " ".join(lib.march),
        shape=dict(num_heads=heads[0], num_kv_heads=heads[1], head_dim=args.head_dim, block_size=BLOCK_SIZE),
    )
    if args.json:
        print(json.dumps(dict(meta=meta, results=rows), indent=2))
        return
    window = f", window {args.window}" if args.window else ""
    window += f", softcap {args.softcap}" if args.softcap else ""
    print(f"torch {meta['torch']}, {meta['threads']} threads, median of {args.iters} (ms per layer call){window}, "
          f"heads {args.heads}, head_dim {args.head_dim}")  # fmt: skip
    hdr = (f"{'case':14s} {'dtype':9s} {'tokens':>6s} {'ref':>9s} {'sdpa warm':>10s} {'sdpa cold':>10s} {'speedup':>8s} "
           f"{'max|diff|':>10s} {'kernel':>9s} {'kernel diff':>11s}")  # fmt: skip
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['case']:14s} {r['dtype']:9s} {r['tokens']:6d} {r['ref_ms']:9.3f} {r['sdpa_warm_ms']:10.3f} "
            f"{r['sdpa_cold_ms']:10.3f} {r['speedup_warm']:7.1f}x {r['max_abs_diff']:10.2e} "
            f"{r['kernel_ms'] if r['kernel_ms'] is not None else '-':>9} "
            f"{r['kernel_max_abs_diff'] if r['kernel_max_abs_diff'] is not None else float('nan'):11.2e}"
        )


if __name__ == "__main__":
    main()
