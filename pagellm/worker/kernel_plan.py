"""Choosing the kernel plan: the CPU's features, the kernel configuration and the dtype in,
one :class:`KernelPlan` out (see :mod:`pagellm.kernels.plan`).

Every choice between pagellm's kernels and PyTorch's is made here, once per engine:
:func:`plan_kernels` is the only caller of :func:`pagellm.kernels.load` in the engine besides the
tensor-parallel ranks' start, which takes the same (cached) library for its all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagellm import kernels
from pagellm.config import KernelConfig
from pagellm.kernels.isa import feature_summary, usable_cpu_flags
from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.plan import OWN_GEMM_PATHS, KernelPlan, WeightRequest
from pagellm.model.cpu_linear import packed_ops_supported
from pagellm.worker.device import available_memory_bytes, cuda_native_bf16

_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# Where AMX tiles multiply bf16, quantized linears keep a dense bf16 copy for batches of more
# rows than this: the integer dot products win below (benchmarks/qgemm_micro.py, the default
# model's linears, warm: 1 row 2.3 against 5.1 ms, 4 rows 3.6 against 5.4), AMX above (8 rows
# 5.8 against 5.5, 16 rows 9.9 against 5.2); cold weights favour the integer path up to 8
# (benchmarks/NOTES.md, 37).
QUANT_MAX_ROWS_AMX = 8
# ... but only while that copy takes at most this share of the memory available at start-up:
# a 7B model's copy is ~14 GB, which quantized weights are chosen to avoid.
DENSE_COPY_MEMORY_SHARE = 0.25
# Without the copy, batches of more rows than this run on AMX tiles: in a bf16 model the weights
# dequantized to bf16 a column panel at a time ("dequant-amx"), else the integer GEMM on
# AMX-INT8 tiles, whose int32 tile is stored and scaled in fp32 after each block of 32
# (benchmarks/NOTES.md, 38). benchmarks/qgemm_micro.py, the default model's linears, ms, dot
# products / int8 tiles / dequantized bf16 tiles / the copy: 8 rows 8.1 / 11.1 / 11.9 / 7.0,
# 16 rows 17.2 / 16.1 / 13.1 / 7.5, 64 rows 52.0 / 43.2 / 23.7 / 16.9; a Llama-3.2-3B shape in
# Q4_K at 128 rows 1,937 / 2,156 / 798 / 786 (NOTES 58).
QUANT_MAX_ROWS_AMX_TILES = 12


def _dense_copy_fits(request: WeightRequest) -> bool:
    """Whether the dense bf16 copy of quantized linears fits the memory share."""
    available = available_memory_bytes()
    return available is not None and request.dense_copy_bytes <= DENSE_COPY_MEMORY_SHARE * available


def bf16_gemm_path(choice: str, lib: KernelLibrary | None, flags: frozenset[str]) -> str:
    """Which GEMM bf16 linears take (``choice`` as in :class:`KernelConfig` ``gemm``).

    ``auto``: pagellm's GEMM on AMX tiles where this process may use them, else on AVX-512 BF16
    dot products; but a CPU with AMX that the kernels cannot use (an OS without the permission)
    goes to oneDNN, then 3-4x faster than dot products (``benchmarks/NOTES.md``, 19). On a CPU
    without AVX-512, pagellm's AVX2 GEMM (torch would emulate bf16 at ~1 GFLOP/s there); with
    AVX-512 but not its BF16 instructions, oneDNN's bf16 kernels. Without any, ``F.linear``.
    """
    onednn = "onednn" if packed_ops_supported(torch.bfloat16) else "torch"
    if choice in ("torch", "onednn"):
        return "torch" if choice == "torch" else onednn
    if lib is not None and lib.gemm_amx_available:
        return "amx"
    if lib is not None and lib.gemm_bf16_available and (choice == "pagellm" or "amx_bf16" not in flags):
        return "avx512-bf16"
    if lib is not None and lib.gemm_avx2_available and (choice == "pagellm" or "avx512f" not in flags):
        return "avx2"
    return onednn


def _gemm_path(dtype: torch.dtype, choice: str, lib: KernelLibrary | None, flags: frozenset[str]) -> str:
    if dtype == torch.bfloat16:
        return bf16_gemm_path(choice, lib, flags)
    if dtype == torch.float16 and choice != "torch" and packed_ops_supported(torch.float16):
        return "onednn"
    if dtype == torch.float32 and choice in ("auto", "pagellm") and lib is not None and lib.gemm_avx2_available:
        # float32 on a CPU without AVX-512: pagellm's AVX2 GEMM, 1.2-4.5x torch's at decode
        # batch sizes (MKL runs well below the FMA peak there, and slower still on AMD).
        if choice == "pagellm" or "avx512f" not in flags:
            return "avx2"
    return "torch"  # float32 elsewhere: torch's own GEMM (MKL / oneDNN), the reference numerics


def _resolve_attention(name: str, device: torch.device, lib: KernelLibrary | None) -> str:
    """"auto": the C++ paged kernel on CPU where it was built, else SDPA; names pass through."""
    key = name.strip().lower()
    if key == "cpu_paged" and device.type != "cpu":
        raise ValueError(f"attention backend 'cpu_paged' runs on CPU only, not on {device.type}; use torch_sdpa")
    if key != "auto":
        return key
    return "cpu_paged" if device.type == "cpu" and lib is not None else "torch_sdpa"


def _weights(request: WeightRequest, lib: KernelLibrary | None, device: torch.device, dtype: torch.dtype) -> str:
    """The weight format the plan holds: the request where the integer GEMM runs here, else
    dense (or an error naming why, for a required one). A request that is not required (auto)
    is dropped under float32: float32 means the exact, dequantized reference path."""
    if request.weights == "dense" or (not request.required and dtype == torch.float32):
        return "dense"
    if device.type == "cpu" and lib is not None and lib.gemm_q_path != "none":
        return request.weights
    if request.required:
        why = f"the device is {device.type}" if device.type != "cpu" else (
            "the CPU kernels are off or failed to build" if lib is None else "this CPU lacks AVX2, FMA or F16C")
        raise ValueError(f"quantization {request.weights!r} needs pagellm's integer CPU GEMM, unavailable here: {why}")
    return "dense"


def plan_kernels(
    config: KernelConfig, device: torch.device, attention: str, choose_dtype: Callable[[bool], torch.dtype],
    weights: WeightRequest = WeightRequest(),
) -> KernelPlan:
    """The engine's plan. ``choose_dtype(bf16_is_fast)`` gives the compute dtype (the user's,
    or "auto" resolved knowing whether this machine multiplies bf16 fast); ``weights`` how the
    linears' weights are wanted."""
    if device.type != "cpu":
        backend = _resolve_attention(attention, device, None)
        dtype = choose_dtype(cuda_native_bf16(device))
        _weights(weights, None, device, dtype)
        return KernelPlan(device.type, "-", dtype, backend, "torch")
    flags = usable_cpu_flags(config.isa_cap)
    lib = kernels.load(config)
    bf16_path = bf16_gemm_path(config.gemm, lib, flags)
    dtype = choose_dtype(bf16_path in OWN_GEMM_PATHS or bool(_NATIVE_BF16_FLAGS & flags))
    elementwise = "kernel" if lib is not None and kernels.supports_dtype(dtype) else "torch"
    gemm = _gemm_path(dtype, config.gemm, lib, flags)
    held = _weights(weights, lib, device, dtype)
    backend = _resolve_attention(attention, device, lib)
    fused = (held != "dense" or gemm in OWN_GEMM_PATHS) and backend == "cpu_paged" and elementwise == "kernel"
    copy = held != "dense" and gemm == "amx" and _dense_copy_fits(weights)
    tiles = held != "dense" and not copy and lib is not None and lib.gemm_q_amx_available
    return KernelPlan(
        device="cpu",
        cpu=feature_summary(flags),
        dtype=dtype,
        attention=backend,
        gemm=gemm,
        norm=elementwise,
        rotary=elementwise,
        argmax=elementwise,
        scan=elementwise,
        weights=held,
        qgemm=lib.gemm_q_path if held != "dense" and lib is not None else "none",
        quant_max_rows=QUANT_MAX_ROWS_AMX if copy else QUANT_MAX_ROWS_AMX_TILES if tiles else None,
        quant_large=("dequant-amx" if dtype == torch.bfloat16 else "integer-amx") if tiles else "dense",
        decoder="fused" if fused else "layers",
        kernels=lib,
    )
