"""The KV cache tensors: sizing from a memory budget, allocation, block copies; and a hybrid
model's recurrent states, one tensor a recurrent layer, one row a state slot."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.attention.backend import indexable
from pagellm.kv_layout import kv_bytes_per_token, kv_row_width
from pagellm.model.arch_config import ModelArchConfig

# Per layer: (key_cache, value_cache) for an attention layer; a recurrent layer's state tensor.
KVCache = list[tuple[torch.Tensor, torch.Tensor] | torch.Tensor]


def bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Memory one block takes across all layers, keys and values (an int8 row holds its scale too)."""
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {budget_bytes} bytes holds no block; one block needs {block_bytes} bytes"
        )
    return num_blocks


_ALIGN = 64  # bytes: one cache line / one AVX-512 vector


def _zeroed_cpu_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages are only touched when first written.

    ``numpy.zeros`` uses ``calloc``, which for large sizes maps fresh (already zero) pages
    instead of writing zeros, so a 1 GiB KV budget costs neither start-up time (~2 s to zero)
    nor resident memory until blocks are used. The bytes are reinterpreted as ``dtype``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    np_dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    # calloc returns page start + 16 bytes: over-allocate and start on a 64-byte boundary,
    # or every 128-byte K/V row straddles three cache lines instead of two.
    pad = _ALIGN // itemsize
    raw = torch.from_numpy(np.zeros(numel + pad, dtype=np_dtype)).view(dtype)
    skip = (-raw.data_ptr() % _ALIGN) // itemsize
    return raw[skip : skip + numel]


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    """Zero-filled, so slots never written hold no NaNs that masked attention could touch
    (an int8 row's zero scale reads back as zeros). Rows are ``kv_row_width`` wide.

    On CPU all layers' K and V live in one lazily zeroed buffer (see ``_zeroed_cpu_buffer``).
    """
    shape = (num_blocks, block_size, num_kv_heads, kv_row_width(head_dim, dtype))
    if device.type != "cpu":
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
    per_tensor = num_blocks * block_size * num_kv_heads * shape[-1]
    flat = _zeroed_cpu_buffer(2 * num_layers * per_tensor, dtype)
    views = flat.view(num_layers, 2, *shape)
    return [(views[i, 0], views[i, 1]) for i in range(num_layers)]


def copy_blocks(kv_cache: KVCache, copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer (copy-on-write), one indexed copy per tensor."""
    if not copies:
        return
    pairs = [pair for pair in kv_cache if not isinstance(pair, torch.Tensor)]  # (a state has no blocks)
    device = pairs[0][0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
    for key_cache, value_cache in pairs:
        for cache in (indexable(key_cache), indexable(value_cache)):
            cache.index_copy_(0, dst, cache.index_select(0, src))


def copy_states(caches: KVCache, copies: list[tuple[int, int]]) -> None:
    """Copy recurrent-state slots src -> dst in every recurrent layer (all read before any is written)."""
    if not copies:
        return
    states = [cache for cache in caches if isinstance(cache, torch.Tensor)]
    if not states:
        raise ValueError("state copies for a model without recurrent layers")
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=states[0].device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=states[0].device)
    for state in states:
        state.index_copy_(0, dst, state.index_select(0, src))


def with_recurrent_states(
    arch: ModelArchConfig, attention: KVCache, num_slots: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """Every layer's cache in layer order: ``attention``'s K/V pairs (one an attention layer, in
    order) and, for each recurrent layer, its zeroed state: ``[num_slots, conv_kernel - 1,
    hidden]`` (a short convolution's last inputs; ``model/short_conv.py``)."""
    recurrent = set(arch.recurrent_layers)
    if not recurrent:
        return attention
    pairs = iter(attention)
    shape = (num_slots, arch.conv_kernel - 1, arch.hidden_size)
    return [torch.zeros(shape, dtype=dtype, device=device) if i in recurrent else next(pairs)
            for i in range(arch.num_hidden_layers)]  # fmt: skip


def recurrent_state_bytes(arch: ModelArchConfig, num_slots: int, dtype: torch.dtype) -> int:
    """The memory of every recurrent layer's states (``with_recurrent_states``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return len(arch.recurrent_layers) * num_slots * (arch.conv_kernel - 1) * arch.hidden_size * itemsize
