"""Micro-benchmark: pagellm's integer GEMM (q4 layers, q8 LM head) against its bf16 GEMM on
SmolLM2-135M's linear shapes, per row count: where the kernel plan's ``quant_max_rows`` sits.

One weight per shape (warm in cache after the first call), the model's 30 layers counted by
multiplying each layer shape's time by 30, the LM head once. Prints ms per shape and per model
for each ``--rows``, integer (dot products; and on AMX tiles where usable) against bf16 (AMX
tiles where usable, else AVX-512 BF16 dot products, else the AVX2 GEMM), in one run.

    python benchmarks/qgemm_micro.py [--rows 1,2,4,8,12,16,64] [--threads 2] [--shape llama-3b --format q4k]

Where the process may use AMX tiles, two more columns: the integer GEMM on AMX-INT8 tiles, and
the quantized weight dequantized to bf16 on AMX-BF16 tiles (``tiles="bf16"``). ``--shape llama-3b``
(or ``llama-8b``) times a Llama-3.2-3B layer's shapes (28 layers; Llama-3-8B's: 32, the default model's 49,152-token LM head) and
``--format`` the layers' format (the LM head stays q8).

``--formats q4s,q4,q4f,q5f,q6k,q8`` instead times every layer (LM head included) in each weight
format on the integer GEMM's dot products, model ms per row count, with the bytes a format
reads per weight: what GGUF's Q4_0, Q4_1, Q5_0/Q5_1/Q5_K, Q6_K and Q8_0 files cost (q4f: Q4_K
widened; Q4_K's own q4k needs widths that are multiples of 256, which SmolLM2's 576 is not).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import kernels  # noqa: E402
from pagellm.kernels import quant_formats as qf  # noqa: E402
from pagellm.model.cpu_linear import KernelLinear  # noqa: E402

# name -> (out features, in features, per model)
SHAPES = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30), "down": (576, 1536, 30),
          "lm_head": (49152, 576, 1)}  # fmt: skip
MODEL_SHAPES = {
    "smollm2": SHAPES,
    "llama-3b": {"qkv": (5120, 3072, 28), "o": (3072, 3072, 28), "gate_up": (16384, 3072, 28), "down": (3072, 8192, 28),
                 "lm_head": (49152, 3072, 1)},
    "llama-8b": {"qkv": (6144, 4096, 32), "o": (4096, 4096, 32), "gate_up": (28672, 4096, 32), "down": (4096, 14336, 32),
                 "lm_head": (49152, 4096, 1)},
}  # fmt: skip


def _ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def _quantized(name: str, weight: torch.Tensor, fmt: str) -> qf.QuantizedWeight:
    if name == "lm_head":
        return qf.quantize_q8(weight)
    n, k = weight.shape
    if fmt != "q4":
        return qf.random_weight(fmt, n, k)
    blocks = k // qf.BLOCK
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    return qf.QuantizedWeight("q4", k, codes, torch.rand(n, blocks).half() * 0.01, torch.rand(n, blocks).half() * 0.01)


def compare_formats(lib: kernels.KernelLibrary, formats: list[str], rows_list: list[int]) -> None:
    """Model ms per format and row count, every linear in that format (dot products)."""
    packed = {(fmt, name): qf.pack(qf.random_weight(fmt, n, k)) for fmt in formats for name, (n, k, _) in SHAPES.items()}
    print("format  bits/weight  " + "  ".join(f"rows={r:<5}" for r in rows_list))
    for fmt in formats:
        times = []
        for rows in rows_list:
            total = 0.0
            for name, (n, k, count) in SHAPES.items():
                x, weight = torch.randn(rows, k).bfloat16(), packed[fmt, name]
                total += _ms(lambda: lib.gemm_q(x, weight, fmt, n), 20 if name == "lm_head" else 100) * count
            times.append(total)
        bits = qf.RECORD_BYTES[fmt] * 8 / (qf.BLOCK * qf.TILE_COLS)
        print(f"{fmt:<7} {bits:11.2f}  " + "  ".join(f"{t:10.2f}" for t in times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,12,16,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--formats", default=None, help="compare weight formats (comma-separated) instead")
    parser.add_argument("--shape", default="smollm2", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--format", default="q4", choices=sorted(qf.FORMAT_CODES), help="the layers' weight format")
    args = parser.parse_args()
    shapes = MODEL_SHAPES[args.shape]
    torch.set_num_threads(args.threads)
    lib = kernels.default()
    if lib is None or lib.gemm_q_path == "none":
        raise SystemExit("no integer GEMM on this machine (needs the C++ kernels and AVX2)")
    if args.formats:
        print(f"integer GEMM: {lib.gemm_q_path}; {args.threads} threads; model ms (30 layers + lm_head)")
        compare_formats(lib, args.formats.split(","), [int(r) for r in args.rows.split(",")])
        return
    path = "amx" if lib.gemm_amx_available else "avx512-bf16" if lib.gemm_bf16_available else "avx2"
    amx = lib.gemm_q_amx_available
    print(f"integer GEMM: {lib.gemm_q_path}{' and amx' if amx else ''}; bf16 GEMM: {path}; {args.threads} threads; ms")
    layers = {}
    for name, (n, k, _) in shapes.items():
        weight = torch.randn(n, k)
        quantized = _quantized(name, weight, args.format)
        linear = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        linear.weight.data.copy_(weight)
        layers[name] = (quantized.format, qf.pack(quantized), KernelLinear(linear, lib, path))
    for rows in (int(r) for r in args.rows.split(",")):
        total_q = total_a = total_t = total_b = 0.0
        for name, (n, k, count) in shapes.items():
            fmt, packed, dense = layers[name]
            x = torch.randn(rows, k).bfloat16()
            reps = max(2, (20 if name == "lm_head" else 200) * 576 // k)
            tq = _ms(lambda: lib.gemm_q(x, packed, fmt, n), reps)
            int8_tiles = amx and fmt in qf.AMX_FORMATS
            ta = _ms(lambda: lib.gemm_q(x, packed, fmt, n, tiles="int8"), reps) if int8_tiles else float("nan")
            tt = _ms(lambda: lib.gemm_q(x, packed, fmt, n, tiles="bf16"), reps) if amx else float("nan")
            tb = _ms(lambda: dense(x), reps)
            total_q, total_a, total_t, total_b = (total_q + tq * count, total_a + ta * count, total_t + tt * count,
                                                  total_b + tb * count)  # fmt: skip
            print(f"rows={rows:<4} {name:<8} integer {tq:7.3f}  int8-amx {ta:7.3f}  dequant-bf16-amx {tt:7.3f}  bf16 {tb:7.3f}")
        print(f"rows={rows:<4} model    integer {total_q:7.1f}  int8-amx {total_a:7.1f}  dequant-bf16-amx {total_t:7.1f}  "
              f"bf16 {total_b:7.1f}")


if __name__ == "__main__":
    main()
