"""How a KV cache's rows are laid out, per storage dtype: what the attention backends, the
kernels and the pool sizing all read, declared once.

A cache tensor is ``[num_blocks, block_size, num_kv_heads, row]``. For float32, bf16 and fp8
caches a (token, head) row is the head's ``head_dim`` values. An int8 cache's row is the head's
``head_dim`` codes in [-127, 127] then the 4 bytes of its float32 scale (value = code * scale,
scale = amax / 127): one tensor still holds everything a block needs, so blocks are copied,
shared and swapped whole.
"""

from __future__ import annotations

import torch

INT8_KV_DTYPE = torch.int8
KV_SCALE_BYTES = 4


def kv_row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements a (token, head) row takes in a cache of ``cache_dtype``: an int8 row holds its scale too."""
    return head_dim + KV_SCALE_BYTES if cache_dtype == INT8_KV_DTYPE else head_dim


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head dim of the rows a cache holds (its last dim, less an int8 row's scale)."""
    width = cache.shape[-1]
    return width - KV_SCALE_BYTES if cache.dtype == INT8_KV_DTYPE else width


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype, values: bool = True
) -> int:
    """K+V bytes one token takes across ``num_layers`` layers in a cache of ``cache_dtype``
    (``values=False``: keys only, whose rows hold the values too: MLA's latent rows)."""
    element_size = torch.empty((), dtype=cache_dtype).element_size()
    tensors = 2 if values else 1
    return tensors * num_layers * num_kv_heads * kv_row_width(head_dim, cache_dtype) * element_size
