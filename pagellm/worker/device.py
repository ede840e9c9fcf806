"""The single CPU/CUDA seam: everything device-specific is decided here."""

from __future__ import annotations

import torch

from pagellm.utils import cpu_flags


def resolve_device(name: str) -> torch.device:
    """Check the requested device exists and return it."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; choose 'cpu' or 'cuda'")
    return device


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively (AVX-512 BF16 or AMX on CPU)."""
    if device.type == "cuda":
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.3 has no including_emulation
            return torch.cuda.is_bf16_supported()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def configure_threads(device: torch.device, num_threads: int | None) -> None:
    """Set intra-op threads for CPU inference (one per core is best for GEMMs)."""
    if device.type == "cpu" and num_threads is not None:
        torch.set_num_threads(num_threads)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (only for timing; the step itself never needs it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
