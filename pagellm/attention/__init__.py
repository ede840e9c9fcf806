"""Attention backends: the paged-KV attention seam and its implementations.

``get_attention_backend(name)`` picks one by name:

* ``"reference"`` -- :class:`ReferenceAttention`, the slow dense-gather oracle;
* ``"torch_sdpa"`` -- :class:`TorchSDPAAttention`, batched paged attention on SDPA;
* ``"auto"`` -- currently ``"torch_sdpa"``.
"""

from __future__ import annotations

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, write_kv
from pagellm.attention.reference import ReferenceAttention
from pagellm.attention.torch_sdpa import TorchSDPAAttention

_BACKENDS: dict[str, type[AttentionBackend]] = {
    ReferenceAttention.name: ReferenceAttention,
    TorchSDPAAttention.name: TorchSDPAAttention,
}
_AUTO = TorchSDPAAttention.name
ATTENTION_BACKEND_CHOICES: tuple[str, ...] = ("auto", *_BACKENDS)


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """A new instance of the backend called ``name`` ("auto", "reference" or "torch_sdpa")."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key == "auto":
        key = _AUTO
    cls = _BACKENDS.get(key) if isinstance(key, str) else None
    if cls is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKEND_CHOICES)}")
    return cls()


__all__ = [
    "ATTENTION_BACKEND_CHOICES",
    "AttentionBackend",
    "AttentionMetadata",
    "ReferenceAttention",
    "TorchSDPAAttention",
    "get_attention_backend",
    "write_kv",
]
