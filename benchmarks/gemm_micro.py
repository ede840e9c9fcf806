"""Micro-benchmark: pagellm's GEMM (AMX, AVX-512 BF16 or AVX2) vs oneDNN on SmolLM2-135M's linear shapes.

For each shape, 30 layers with distinct random weights (so, as in the model, the weights do
not stay in cache) are run back to back: pagellm's GEMM (AMX tiles where available, else
AVX-512 BF16 dot products), oneDNN with the weight packed once (``PackedLinear``,
``PackedSiluAndMulLinear``) and plain ``F.linear``. Prints ms per 30 layers and GFLOP/s.

    python benchmarks/gemm_micro.py [--rows 1,16,64,128,2048] [--threads N] [--shape llama-1b --layers 8]

``--shape llama-1b`` times a Llama-3.2-1B layer's linears instead (k up to 8192: the down
projection), ``--layers`` how many distinct weights each shape cycles through.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import kernels  # noqa: E402
from pagellm.model.cpu_linear import (  # noqa: E402
    KernelLinear,
    KernelSiluAndMulLinear,
    PackedLinear,
    PackedSiluAndMulLinear,
    packed_ops_supported,
)

KERNELS = kernels.default()  # this machine's kernel library (None: no compiler)
GEMM_BF16 = KERNELS is not None and KERNELS.gemm_bf16_available
GEMM_AMX = KERNELS is not None and KERNELS.gemm_amx_available

LAYERS = 30
SHAPES = {
    "smollm2": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)},
    "llama-1b": {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)},
}


def _time(fns: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, reps: int) -> float:
    for f in fns[:2]:
        f(x)
    start = time.perf_counter()
    for _ in range(reps):
        for f in fns:
            f(x)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,64,128,2048", help="comma-separated M values")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="whose linear shapes")
    parser.add_argument("--layers", type=int, default=LAYERS, help="distinct weights per shape")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if KERNELS is None or not (GEMM_BF16 or KERNELS.gemm_avx2_available):
        sys.exit("pagellm's GEMM is not available here (needs a C++ compiler and AVX2 or AVX-512 BF16)")
    path = "amx" if GEMM_AMX else "avx512-bf16" if GEMM_BF16 else "avx2"
    onednn = packed_ops_supported(torch.bfloat16)
    print(f"threads {torch.get_num_threads()}, pagellm GEMM path: {path} (PAGELLM_ISA picks a lower one)")
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, (k, n) in SHAPES[args.shape].items():
            linears = [nn.Linear(k, n, bias=False).to(torch.bfloat16) for _ in range(args.layers)]
            systems: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
            if name == "gate_up":
                systems["pagellm"] = [KernelSiluAndMulLinear(lin, n // 2, KERNELS, path) for lin in linears]
                if onednn:
                    systems["onednn_packed"] = [PackedSiluAndMulLinear(lin, n // 2) for lin in linears]
            else:
                systems["pagellm"] = [KernelLinear(lin, KERNELS, path) for lin in linears]
                if onednn:
                    systems["onednn_packed"] = [PackedLinear(lin, 64) for lin in linears]
                systems["F.linear"] = [lambda x, w=lin.weight: F.linear(x, w) for lin in linears]
            for m in [int(v) for v in args.rows.split(",")]:
                x = torch.randn(m, k).to(torch.bfloat16)
                reps = max(1, 200 // max(m, 8))
                flop = 2 * m * k * n * args.layers
                cells = []
                for system, fns in systems.items():
                    seconds = _time(fns, x, reps)
                    cells.append(f"{system}: {seconds * 1e3:7.2f} ms {flop / seconds / 1e9:6.0f} GF/s")
                print(f"{name:8s} M={m:5d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
