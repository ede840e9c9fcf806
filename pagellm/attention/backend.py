"""The attention seam: per-step metadata and the interface every backend implements.

KV cache layout (one pair of tensors per layer):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, row]
A token at flat *slot* ``s`` lives at ``cache.view(-1, num_kv_heads, row)[s]``;
slot = block_id * block_size + offset_in_block. ``row`` is ``head_dim``, or for an int8 cache
``head_dim`` codes then the head's float32 scale (pagellm/kv_layout.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from pagellm.kv_layout import INT8_KV_DTYPE, KV_SCALE_BYTES


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flat batch of tokens.

    The batch holds ``num_reqs`` requests back to back; request ``r`` contributes
    ``query_lens[r]`` new tokens whose positions are the last ``query_lens[r]`` of
    its ``seq_lens[r]``-token context.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64, padded with 0
    query_lens: list[int]  # new tokens per request (host)
    seq_lens: list[int]  # context length per request after this step (host)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64, cumulative query_lens
    seq_lens_tensor: torch.Tensor  # [num_reqs] int64
    block_size: int
    # A hybrid model's recurrent-state slot of each request (``core/state_slots.py``); None for a
    # model without recurrent layers. A request whose context starts at 0 starts its state afresh.
    state_slots: list[int] | None = None
    # What a backend derives from this step's metadata once and every layer reuses (index
    # tensors, range checks), keyed by the backend; filled lazily, dropped with the step.
    derived: dict[object, object] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the new tokens' K/V ([T, H_kv, D]) into the paged cache at their slots."""
    num_kv_heads, width = key_cache.shape[-2:]
    for cache, new in ((key_cache, key), (value_cache, value)):
        rows = indexable(cache).view(-1, num_kv_heads, width)
        rows.index_copy_(0, slot_mapping, indexable(to_cache_rows(new, cache.dtype)))


# K/V storage formats narrower than the compute dtype: stored rounded, widened on every read.
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# int8 K/V (pagellm/kv_layout.py): code = round-half-even(x * (127 / amax)), scale amax / 127;
# amax 0 gives codes and scale 0.
_INT8_MAX = 127.0
NARROW_KV_DTYPES = (*FP8_KV_DTYPES, INT8_KV_DTYPE)


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to the cache's dtype; into fp8, finite values beyond +-448 and infinities
    saturate (as the CPU kernel and torch >= 2.13 do; older torch casts them to NaN) and NaN
    stays NaN. Not for int8, whose rows carry scales (:func:`to_cache_rows`)."""
    if x.dtype == cache_dtype:
        return x
    if cache_dtype == INT8_KV_DTYPE:
        raise ValueError("int8 K/V are stored as rows with scales: use to_cache_rows")
    if cache_dtype in FP8_KV_DTYPES:
        x = x.clamp(-_FP8_MAX, _FP8_MAX)
    return x.to(cache_dtype)


def quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ([..., D]) as int8 cache rows ([..., D + 4]): per row, codes round-half-even(x *
    (127 / amax)) then the float32 scale amax / 127 as 4 bytes (the CPU kernel's rule, bit for bit).
    Both quotients are divisions of tensors: torch divides by a Python number as a product with
    its reciprocal, which differs in the last bit."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    limit = torch.full_like(amax, _INT8_MAX)
    inv = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv).nan_to_num(0.0).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    scale = (amax / limit).contiguous().view(torch.int8)
    return torch.cat((codes, scale), dim=-1)


def dequantize_int8_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 cache rows ([..., D + 4]) back to values ([..., D]) in ``dtype``: code * scale in float32."""
    head_dim = rows.shape[-1] - KV_SCALE_BYTES
    scale_bytes = rows[..., head_dim:]
    scale = torch.empty(scale_bytes.shape, dtype=torch.int8, device=rows.device).copy_(scale_bytes)  # aligned
    scale = scale.view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def to_cache_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K/V rows ([..., D]) as a cache of ``cache_dtype`` stores them ([..., kv_row_width])."""
    return quantize_int8_rows(x) if cache_dtype == INT8_KV_DTYPE else to_cache_dtype(x, cache_dtype)


def from_cache_rows(rows: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows of ``cache_dtype`` ([..., kv_row_width]) read back as values ([..., D]) in ``dtype``."""
    if cache_dtype == INT8_KV_DTYPE:
        return dequantize_int8_rows(rows, dtype)
    return rows if rows.dtype == dtype else rows.to(dtype)


def attention_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in over a cache: the cache's own, or the query's over fp8 / int8."""
    return query_dtype if cache_dtype in NARROW_KV_DTYPES else cache_dtype


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` holds it, read back in ``dtype``."""
    return from_cache_rows(to_cache_rows(x, cache_dtype), cache_dtype, dtype)


def indexable(t: torch.Tensor) -> torch.Tensor:
    """``t`` or, for fp8, its bytes: torch's indexing ops lack float8 kernels on some builds
    (index_copy_ on every CPU build here; index_select and gathers on some CUDA ones)."""
    return t.view(torch.uint8) if t.dtype in FP8_KV_DTYPES else t


class AttentionBackend(ABC):
    """Writes the step's new K/V into the cache, then attends over each request's context."""

    name: str = "abstract"

    def route(self, metadata: AttentionMetadata, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> str:
        """Which implementation runs this step's rows (for the step route; one backend: its name)."""
        return self.name

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, H_kv, D]
        value: torch.Tensor,  # [T, H_kv, D]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        """Attention of each query over its request's context: every position up to its own,
        or with a ``window`` its last ``window`` positions (its own included); with a
        ``softcap`` the scaled scores pass through ``softcap * tanh(score / softcap)`` first
        (Gemma 2); with ``sinks`` (float32 [H]: gpt-oss) each head's softmax has one more logit,
        its sink's, over no value (the weights sum to less than 1). All are per layer: a model
        mixes windowed and global layers."""
        ...
