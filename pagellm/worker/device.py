"""The single CPU/CUDA seam: everything device-specific is decided here."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch


def resolve_device(name: str) -> torch.device:
    """Check the requested device exists and return it."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; choose 'cpu' or 'cuda'")
    return device


def cuda_native_bf16(device: torch.device) -> bool:
    """Whether a CUDA ``device`` multiplies bfloat16 natively (on CPU the kernel plan decides)."""
    if device.type != "cuda":
        raise ValueError(f"cuda_native_bf16 takes a CUDA device, got {device}")
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.3 has no including_emulation
        return torch.cuda.is_bf16_supported()


def available_memory_bytes(device: torch.device | None = None) -> int | None:
    """Memory this process could still take: a CUDA ``device``'s free memory; on the host,
    ``MemAvailable`` (what the kernel could hand out without swapping) or, inside a
    memory-limited cgroup, what the limit leaves if that is less. None where neither says."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    known = [v for v in (_meminfo_available(), _cgroup_headroom()) if v is not None]
    return min(known) if known else None


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path, encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int | None:
    """What this process's cgroup may still take, if it is limited: v2's own group (named in
    ``membership``; "/" inside a container's cgroup namespace), else v1's memory controller."""
    places = ((_own_cgroup_v2(root, membership), "memory.max", "memory.current"),
              (os.path.join(root, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"))  # fmt: skip
    for folder, limit_name, usage_name in places:
        try:
            with open(os.path.join(folder, limit_name), encoding="ascii") as f:
                limit = f.read().strip()
            with open(os.path.join(folder, usage_name), encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max" (v2) or a huge number (v1): no limit
            return None
        return max(0, int(limit) - usage)
    return None


def _own_cgroup_v2(root: str, membership: str) -> str:
    """The folder of this process's v2 cgroup under ``root`` (``root`` where it cannot tell)."""
    try:
        with open(membership, encoding="ascii") as f:
            for line in f:
                if line.startswith("0::"):
                    return os.path.join(root, line[3:].strip().lstrip("/"))
    except OSError:
        pass
    return root


def auto_dtype_downcasts_float32(device: torch.device) -> bool:
    """Whether ``dtype="auto"`` runs float32 checkpoints in bfloat16 too (where bf16 is native).

    On GPUs, as vLLM does: tensor cores multiply bf16 many times faster than float32. On CPU
    float32 checkpoints stay in float32, the reference precision.
    """
    return device.type == "cuda"


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors of one dtype (a step's index tensors) on ``device``.

    On CPU they are returned as they are. On CUDA they are packed into one pinned staging
    buffer and sent with one asynchronous copy (instead of a synchronous copy each); every
    result is a view of that device buffer, shaped like its source.
    """
    if device.type == "cpu" or not tensors:
        return list(tensors)
    dtype = tensors[0].dtype
    if any(t.dtype != dtype for t in tensors):
        raise ValueError("to_device packs tensors of one dtype only")
    sizes = [t.numel() for t in tensors]
    staged = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
    torch.cat([t.reshape(-1) for t in tensors], out=staged)
    flat = staged.to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(flat.split(sizes), tensors)]


def configure_threads(device: torch.device, num_threads: int | None) -> None:
    """Set intra-op threads for CPU inference (one per core is best for GEMMs)."""
    if device.type == "cpu" and num_threads is not None:
        torch.set_num_threads(num_threads)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (only for timing; the step itself never needs it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
