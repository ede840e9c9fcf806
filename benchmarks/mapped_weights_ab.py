"""A/B: a decode pass over packed weights mapped from the packed-weights cache against the same
bytes in huge-page memory, in one process, alternating (docs/models.md, "Packed weights kept
between starts").

    python benchmarks/mapped_weights_ab.py --model llama-8b-q4km.gguf [--rounds 12] [--threads 2]

Loads the GGUF file through an engine (run it once before, or this run writes the cache and
the next one maps it), copies every packed linear's weight into huge-page memory, then times one
token's pass through every packed linear (one activation row, the integer GEMM as a decode step
calls it) over the mapped weights and over the copies, round after round in alternating order,
so that a shared machine's bandwidth swings fall on both alike. Prints each side's read rate
(packed bytes over seconds, medians) and how much of each is on 2 MB pages.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM  # noqa: E402
from pagellm.kernels.weight_memory import empty_weight  # noqa: E402
from pagellm.model.quant_linear import QuantizedLinear  # noqa: E402


def _pass(parts: list[tuple[QuantizedLinear, str, int, torch.Tensor]], inputs: dict[int, torch.Tensor]) -> float:
    """Seconds for one row through every part (each part's rows, as the layer's forward runs it)."""
    start = time.perf_counter()
    for layer, fmt, rows, weight in parts:
        epilogue = "silu_mul" if layer.silu_mul else "none"
        out_features = layer.out_features if layer.silu_mul else rows
        layer.kernels.gemm_q(inputs[layer.in_features], weight, fmt, out_features, epilogue, layer.tiles(1))
    return time.perf_counter() - start


def _huge_kib() -> dict[str, int]:
    with open("/proc/self/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {name: int(fields.get(name, "0 kB").split()[0]) for name in ("FilePmdMapped", "AnonHugePages")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GGUF file of 256 MiB or more")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model, num_kv_blocks=64, num_threads=args.threads)
    worker = llm.llm_engine.executor
    if not worker.mapped_weight_bytes:
        sys.exit("no weights were mapped: this run wrote the packed-weights cache (run again), or it is off")
    layers = [m for m in worker.model_runner.model.modules() if isinstance(m, QuantizedLinear)]
    mapped = [(layer, part.format, part.rows, part.packed) for layer in layers for part in layer.parts]
    copied = [(layer, fmt, rows, empty_weight(tuple(w.shape)).copy_(w)) for layer, fmt, rows, w in mapped]
    nbytes = sum(w.numel() for *_, w in mapped)
    inputs = {layer.in_features: torch.randn(1, layer.in_features, dtype=torch.bfloat16) for layer in layers}
    _pass(mapped, inputs), _pass(copied, inputs)  # (first touch)
    rates: dict[str, list[float]] = {"mapped": [], "memory": []}
    for i in range(args.rounds):
        for name in ("mapped", "memory") if i % 2 else ("memory", "mapped"):
            rates[name].append(nbytes / _pass(mapped if name == "mapped" else copied, inputs) / 1e9)
    print(f"{args.model}: {len(mapped)} packed parts, {nbytes / 1e9:.2f} GB; {args.rounds} rounds alternated")
    for name, values in rates.items():
        print(f"{name:7s} GB/s median {statistics.median(values):5.1f}  ({' '.join(f'{v:.0f}' for v in values)})")
    print(f"ratio mapped / memory: {statistics.median(rates['mapped']) / statistics.median(rates['memory']):.3f}")
    print(f"on 2 MB pages (KiB): {_huge_kib()}")
    llm.llm_engine.close()


if __name__ == "__main__":
    main()
