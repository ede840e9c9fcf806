"""MLA's long prefills through the expanded keys and values (``model/mla.py`` runs the rest).

With ``kv_b_proj`` absorbed, each head attends in the latent's space: a score and a value sum
cost ``kv_lora_rank + qk_rope_head_dim`` and ``kv_lora_rank`` multiply-adds a (query, position)
pair (576 and 512 for DeepSeek-V3). Expanding the context's latents into each head's keys and
values once (``kv_lora_rank x (qk_nope_head_dim + v_head_dim)`` a position and head) brings the
pair's cost down to ``qk_head_dim`` and ``v_head_dim`` (192 and 128): worth it where a request
has many new tokens over its context (:func:`expands`), as DeepSeek's reference and vLLM
compute prompts. A request's new latent rows are written to the cache first, and its context is
read back from it (prefix-cache hits and earlier chunks included), as decode rows read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.attention.backend import AttentionMetadata, from_cache_rows, indexable
from pagellm.model.mla_shape import MlaShape


# The most one request's expanded context may take (keys and padded values, float32): a longer
# context attends in the latent's space (its expansion would cost more memory than it saves time).
MAX_EXPANDED_BYTES = 256 << 20


def expands(shape: MlaShape, query_len: int, seq_len: int, heads: int) -> bool:
    """Whether a request of ``query_len`` new tokens over ``seq_len`` positions attends through
    the expanded keys and values (``heads``: this rank's): where its pairs' savings,
    ``query_len * (2 * kv_lora_rank - qk_nope_head_dim - v_head_dim)`` a position, pass the
    expansion's ``kv_lora_rank * (qk_nope_head_dim + v_head_dim)`` (170 tokens at DeepSeek-V3's
    shape; 32 at the tests' tiny one), and the expanded context fits ``MAX_EXPANDED_BYTES``."""
    saved = 2 * shape.kv_lora_rank - shape.qk_nope_head_dim - shape.v_head_dim
    fits = seq_len * heads * 2 * max(shape.qk_head_dim, shape.v_head_dim) * 4 <= MAX_EXPANDED_BYTES
    return fits and query_len * saved > shape.kv_lora_rank * (shape.qk_nope_head_dim + shape.v_head_dim)


@dataclass(frozen=True)
class LongPrefill:
    """One request attending through the expanded keys and values."""

    tokens: slice  # its rows in the step's flat batch
    context_slots: torch.Tensor  # [seq_len] int64: the cache slot of each of its positions
    mask: torch.Tensor | None  # [query_len, seq_len] bool, causal with its context; None: is_causal


@dataclass(frozen=True)
class MlaStepSplit:
    """A step's requests split between the two forms (built once a step, shared by every layer)."""

    absorbed: torch.Tensor | None  # int64 token rows of the requests attending in the latent's space
    absorbed_metadata: AttentionMetadata | None  # their metadata
    long: tuple[LongPrefill, ...]
    long_rows: torch.Tensor  # int64 token rows of the long prefills
    long_slots: torch.Tensor  # their new rows' cache slots


def step_split(metadata: AttentionMetadata, shape: MlaShape, heads: int) -> MlaStepSplit | None:
    """The step's split (cached on its metadata), or None where no request expands."""
    key = ("mla_split", shape, heads)
    cached = metadata.derived.get(key)
    if cached is None:
        cached = metadata.derived[key] = _build_split(metadata, shape, heads) or False
    return cached or None


def _build_split(metadata: AttentionMetadata, shape: MlaShape, heads: int) -> MlaStepSplit | None:
    if not any(expands(shape, n, s, heads) for n, s in zip(metadata.query_lens, metadata.seq_lens)):
        return None
    device, block_size = metadata.slot_mapping.device, metadata.block_size
    starts = [0]
    for n in metadata.query_lens:
        starts.append(starts[-1] + n)
    long, absorbed = [], []
    for r, (n, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens)):
        if not expands(shape, n, seq_len, heads):
            absorbed.append(r)
            continue
        positions = torch.arange(seq_len, device=device)
        table = metadata.block_tables[r].to(device)
        slots = table[positions // block_size] * block_size + positions % block_size
        query_positions = torch.arange(seq_len - n, seq_len, device=device)
        mask = None if n == seq_len else positions[None, :] <= query_positions[:, None]
        long.append(LongPrefill(slice(starts[r], starts[r] + n), slots, mask))
    long_rows = torch.cat([torch.arange(p.tokens.start, p.tokens.stop, device=device) for p in long])
    rows = _token_rows(absorbed, starts, device)
    sub = _sub_metadata(metadata, absorbed, rows) if absorbed else None
    return MlaStepSplit(rows if absorbed else None, sub, tuple(long), long_rows, metadata.slot_mapping[long_rows])


def _token_rows(requests: list[int], starts: list[int], device: torch.device) -> torch.Tensor:
    """The flat-batch rows of ``requests``' new tokens, in order."""
    ranges = [torch.arange(starts[r], starts[r + 1], device=device) for r in requests]
    return torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.long, device=device)


def _sub_metadata(metadata: AttentionMetadata, requests: list[int], rows: torch.Tensor) -> AttentionMetadata:
    """``metadata`` of ``requests`` alone (their tokens ``rows``)."""
    index = torch.tensor(requests, device=metadata.block_tables.device)
    query_lens = [metadata.query_lens[r] for r in requests]
    starts = torch.tensor([0, *query_lens], device=metadata.query_start_loc.device).cumsum(0)
    return AttentionMetadata(
        slot_mapping=metadata.slot_mapping[rows], block_tables=metadata.block_tables.index_select(0, index),
        query_lens=query_lens, seq_lens=[metadata.seq_lens[r] for r in requests], query_start_loc=starts,
        seq_lens_tensor=metadata.seq_lens_tensor.index_select(0, index.to(metadata.seq_lens_tensor.device)),
        block_size=metadata.block_size,
    )  # fmt: skip


def expanded_values(
    q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, prefill: LongPrefill, expansion: torch.Tensor,
    shape: MlaShape, scale: float,
) -> torch.Tensor:
    """One long prefill's attention output, each head's value: ``[query_len, heads * v_head_dim]``.
    ``q_nope`` / ``q_pe``: its queries' parts ([n, heads, nope], rotated [n, heads, rope]);
    ``cache``: the layer's latent rows (the request's new ones written); ``expansion``:
    ``kv_b_proj``'s weight (this rank's heads)."""
    heads, nope, latent = q_nope.shape[1], shape.qk_nope_head_dim, shape.kv_lora_rank
    stored = indexable(cache).view(-1, cache.shape[-1]).index_select(0, prefill.context_slots)
    rows = from_cache_rows(stored.view(cache.dtype), cache.dtype, q_nope.dtype)  # [L, latent + rope]
    expanded = F.linear(rows[:, :latent], expansion).view(rows.shape[0], heads, nope + shape.v_head_dim)
    keys = torch.cat((expanded[..., :nope], rows[:, None, latent:].expand(-1, heads, -1)), dim=-1)
    queries = torch.cat((q_nope, q_pe), dim=-1)
    # Values zero-padded to the keys' width: torch's CPU flash kernel takes one head dim for all
    # three (with two it falls back to materializing every score: 2.5x slower at 2,048 tokens).
    values = F.pad(expanded[..., nope:], (0, max(0, shape.qk_head_dim - shape.v_head_dim)))
    out = F.scaled_dot_product_attention(
        queries.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=prefill.mask, is_causal=prefill.mask is None, scale=scale,
    )  # fmt: skip
    return out[0, :, :, : shape.v_head_dim].transpose(0, 1).reshape(q_nope.shape[0], heads * shape.v_head_dim)
