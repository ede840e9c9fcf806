"""A/B: the integer GEMM of two source trees, in one process, alternating, on real-shape layers.

    git worktree add /tmp/base main
    python benchmarks/qgemm_ab.py /tmp/base . [--shape smollm2-135m|llama-1b|llama-3b] [--format q4k] \\
        [--rows 1,4,16,64,128] [--layers 2] [--rounds 5] [--threads 2] [--isa auto|avx2|...]

Each tree's kernel library is built (or taken from the kernel cache) by that tree's own code in a
child process, then both are loaded here and called on the same packed weights and activations,
round after round, so that a shared machine's slow and fast phases fall on both alike. Prints the
median rate per row count (multiply-adds a second) for each tree, the ratio, and whether the two
builds' outputs are bit-equal. Each tree packs the same weights with its own ``quant_formats``
(so a change of the packed layout is measured too). Used for the kernel figures in
benchmarks/NOTES.md (61).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm.kernels import build  # noqa: E402
from pagellm.kernels import quant_formats as qf  # noqa: E402
from pagellm.kernels.library import KernelLibrary  # noqa: E402

# One decoder layer's linears, (out features, in features): q/k/v, o, gate/up, down.
SHAPES = {
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "llama-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    "llama-3b": [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)],
    "llama-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}
_LIBRARY_PATH = (
    "import sys; from pagellm import kernels; from pagellm.config import KernelConfig; "
    "lib = kernels.load(KernelConfig(isa=sys.argv[1])); print(lib._lib._name if lib else '')"
)


def tree_library(tree: Path, isa: str) -> KernelLibrary:
    """The kernel library ``tree``'s code builds for ``isa``, loaded into this process."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", _LIBRARY_PATH, isa], env=env, cwd=tree, capture_output=True, text=True)
    path = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    if not path:
        raise SystemExit(f"{tree}: no kernel library was built\n{done.stderr[-2000:]}")
    lib = ctypes.CDLL(path)
    build._declare(lib)
    return KernelLibrary(lib, (f"isa={isa}",))


def tree_packer(tree: Path):  # noqa: ANN201 (that tree's module)
    """``tree``'s ``quant_formats`` module (numpy and torch only), loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"quant_formats_{abs(hash(tree))}", tree / "pagellm/kernels/quant_formats.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--format", default="q4k", choices=sorted(qf.FORMAT_CODES))
    parser.add_argument("--rows", default="1,4,16,64,128")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trees = [args.base.resolve(), args.new.resolve()]
    libs = [tree_library(tree, args.isa) for tree in trees]
    packers = [tree_packer(tree) for tree in trees]
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES[args.shape] * args.layers
    unpacked = [(n, k, qf.random_weight(args.format, n, k, gen)) for n, k in shapes]
    packed = [[(n, k, packer.pack(w)) for n, k, w in unpacked] for packer in packers]
    macs = sum(n * k for n, k in shapes)
    megabytes = sum(w.numel() for _, _, w in packed[0]) / 1e6
    print(f"{args.format}, {args.shape} x {args.layers} layers ({megabytes:.0f} MB packed), {args.threads} threads")
    print(f"{'rows':>5} {'base GMAC/s':>12} {'new GMAC/s':>12} {'new/base':>9}  bit-equal")
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k, generator=gen).bfloat16() for _, k in SHAPES[args.shape]}
        outputs = [[lib.gemm_q(inputs[k], w, args.format, n) for n, k, w in weights] for lib, weights in zip(libs, packed)]
        equal = all(torch.equal(a, b) for a, b in zip(*outputs))
        reps = max(1, 256 // m)
        times: list[list[float]] = [[], []]
        for _ in range(args.rounds):
            for lib, weights, spent in zip(libs, packed, times):
                start = time.perf_counter()
                for _ in range(reps):
                    for n, k, w in weights:
                        lib.gemm_q(inputs[k], w, args.format, n)
                spent.append((time.perf_counter() - start) / reps)
        base, new = (statistics.median(t) for t in times)
        print(f"{m:>5} {m * macs / base / 1e9:>12.1f} {m * macs / new / 1e9:>12.1f} {base / new:>8.3f}x  {equal}")


if __name__ == "__main__":
    main()
