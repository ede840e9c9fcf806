"""Attention backends: the paged-KV attention seam and its implementations.

``get_attention_backend(name)`` picks one by name:

* ``"reference"`` -- :class:`ReferenceAttention`, the slow dense-gather oracle;
* ``"torch_sdpa"`` -- :class:`TorchSDPAAttention`, batched paged attention on SDPA;
* ``"cpu_paged"`` -- :class:`CPUPagedAttention`, the C++ kernel reading K/V in place (CPU);
* ``"auto"`` -- ``"cpu_paged"`` on CPU when its kernels build here, else ``"torch_sdpa"``.
"""

from __future__ import annotations

import torch

from pagellm import kernels
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


def resolve_auto_backend(device: torch.device | str | None = None) -> str:
    """The backend "auto" means on ``device``: the C++ kernel on CPU when it builds, else SDPA."""
    device_type = torch.device(device).type if device is not None else "cpu"
    if device_type == "cpu" and kernels.available():
        return CPUPagedAttention.name
    return TorchSDPAAttention.name


def get_attention_backend(name: str = "auto", device: torch.device | str | None = None) -> AttentionBackend:
    """A new instance of the backend called ``name`` (see the module docstring) for ``device``."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key == "auto":
        key = resolve_auto_backend(device)
    cls = _BACKENDS.get(key) if isinstance(key, str) else None
    if cls is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKEND_CHOICES)}")
    return cls()


__all__ = [
    "ATTENTION_BACKEND_CHOICES",
    "AttentionBackend",
    "AttentionMetadata",
    "CPUPagedAttention",
    "ReferenceAttention",
    "TorchSDPAAttention",
    "get_attention_backend",
    "resolve_auto_backend",
    "write_kv",
]
