"""Attention backends: the paged-KV attention seam and its implementations.

``get_attention_backend(name)`` picks one by name:

* ``"reference"`` -- :class:`ReferenceAttention`, the slow dense-gather oracle;
* ``"torch_sdpa"`` -- :class:`TorchSDPAAttention`, batched paged attention on SDPA;
* ``"cpu_paged"`` -- :class:`CPUPagedAttention`, the C++ kernel reading K/V in place (CPU);
* ``"auto"`` -- ``"cpu_paged"`` on CPU given a kernel library, else ``"torch_sdpa"``.

The engine passes the name its kernel plan chose, with the plan's kernel library.
"""

from __future__ import annotations

import torch

from pagellm.kernels.library import KernelLibrary
from pagellm.attention.backend import AttentionBackend, AttentionMetadata, write_kv
from pagellm.attention.cpu_paged import CPUPagedAttention
from pagellm.attention.reference import ReferenceAttention
from pagellm.attention.torch_sdpa import TorchSDPAAttention

_BACKENDS: dict[str, type[AttentionBackend]] = {
    ReferenceAttention.name: ReferenceAttention,
    TorchSDPAAttention.name: TorchSDPAAttention,
    CPUPagedAttention.name: CPUPagedAttention,
}
ATTENTION_BACKEND_CHOICES: tuple[str, ...] = ("auto", *_BACKENDS)


def get_attention_backend(
    name: str = "auto", device: torch.device | str | None = None, lib: KernelLibrary | None = None
) -> AttentionBackend:
    """A new instance of the backend called ``name`` (see the module docstring) for ``device``
    (default CPU), with kernel library ``lib`` for ``cpu_paged``."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key == "auto":
        device_type = torch.device(device).type if device is not None else "cpu"
        paged = device_type == "cpu" and lib is not None
        key = CPUPagedAttention.name if paged else TorchSDPAAttention.name
    cls = _BACKENDS.get(key) if isinstance(key, str) else None
    if cls is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKEND_CHOICES)}")
    if cls is CPUPagedAttention:
        return CPUPagedAttention(lib)
    return cls()


__all__ = [
    "ATTENTION_BACKEND_CHOICES",
    "AttentionBackend",
    "AttentionMetadata",
    "CPUPagedAttention",
    "ReferenceAttention",
    "TorchSDPAAttention",
    "get_attention_backend",
    "write_kv",
]
