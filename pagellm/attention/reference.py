"""Dense-gather reference attention: the test oracle for every faster path.

For each request: gather its whole context from the paged cache through its block
table into dense tensors, then run plain softmax attention with a causal offset.
Slow (a Python loop over requests) but obviously right.
"""

from __future__ import annotations

import torch

from pagellm.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    dequantize_int8_rows,
    indexable,
    write_kv,
)
from pagellm.kv_layout import INT8_KV_DTYPE


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request's K or V: [seq_len, H_kv, D], as the cache
    holds them; an int8 cache's rows dequantized to float32 (exact: code * scale in float32),
    so the oracle sees the stored values, not their codes."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    rows = indexable(cache).view(-1, *cache.shape[2:])[slots].view(cache.dtype)
    return dequantize_int8_rows(rows, torch.float32) if cache.dtype == INT8_KV_DTYPE else rows


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q ([Q, H, D], the last Q positions) over k, v ([S, H_kv, D]); with a
    ``window``, over each query's last ``window`` positions only; with a ``softcap``, scores
    capped by ``softcap * tanh(score / softcap)``; with ``sinks`` ([H]), one more logit per head
    in the softmax, over no value."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink_column = sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


class ReferenceAttention(AttentionBackend):
    name = "reference"

    def forward(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale,
                window=None, softcap=None, sinks=None):  # fmt: skip
        write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        start = 0
        for r, (q_len, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens)):
            k = gather_context(key_cache, metadata.block_tables[r], seq_len)
            v = gather_context(value_cache, metadata.block_tables[r], seq_len)
            out[start : start + q_len] = dense_attention(query[start : start + q_len], k, v, scale, window, softcap, sinks)
            start += q_len
        return out
