"""Hand-written CPU kernels (C++, built on first use) behind small, checked Python wrappers.

:func:`load` builds (once per ``-march``) and loads the library a :class:`KernelConfig` asks
for, or returns ``None`` where it cannot be built: callers then use their PyTorch paths. The
engine calls it once, through its kernel plan (:mod:`pagellm.kernels.plan`), and hands the
:class:`KernelLibrary` to the modules that use it; :func:`default` is the library the
environment's configuration gives, for tests and benchmarks.
"""

from __future__ import annotations

from functools import lru_cache

from pagellm.config import KernelConfig
from pagellm.kernels.build import load_library, target_flags
from pagellm.kernels.isa import host_cpu_flags, usable_cpu_flags
from pagellm.kernels.arg_checks import CACHE_CODES, DTYPE_CODES, check_paged_attention_rows, check_slots
from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.packing import (
    GEMM_AMX_K_MULTIPLE,
    GEMM_AMX_PANEL_COLS,
    GEMM_PANEL_COLS,
    SILU_MUL_HALF_COLS,
    pack_avx2_silu_mul_weight,
    pack_avx2_weight,
    pack_gemm_weight,
    pack_silu_mul_weight,
)


def kernel_target(config: KernelConfig) -> tuple[str, ...]:
    """The compiler ``-march`` flags the kernels are built with under ``config``."""
    return target_flags(usable_cpu_flags(config.isa_cap), host_cpu_flags(), config.march)


@lru_cache(maxsize=None)
def load(config: KernelConfig) -> KernelLibrary | None:
    """The kernel library for ``config`` (built on first use), or None where there is none."""
    if not config.cpu_kernels:
        return None
    usable = usable_cpu_flags(config.isa_cap)
    march = target_flags(usable, host_cpu_flags(), config.march)
    lib = load_library(march, " ".join(sorted(usable)))
    return None if lib is None else KernelLibrary(lib, march)


def default() -> KernelLibrary | None:
    """The library the environment's :class:`KernelConfig` gives (tests, benchmarks)."""
    return load(KernelConfig.from_env())


def supports_dtype(dtype: object) -> bool:
    """Whether the elementwise kernels (norm, rotary, argmax) take tensors of ``dtype``."""
    return dtype in DTYPE_CODES


__all__ = [
    "CACHE_CODES",
    "GEMM_AMX_K_MULTIPLE",
    "GEMM_AMX_PANEL_COLS",
    "GEMM_PANEL_COLS",
    "SILU_MUL_HALF_COLS",
    "KernelLibrary",
    "check_paged_attention_rows",
    "check_slots",
    "default",
    "kernel_target",
    "load",
    "pack_avx2_silu_mul_weight",
    "pack_avx2_weight",
    "pack_gemm_weight",
    "pack_silu_mul_weight",
    "supports_dtype",
]
