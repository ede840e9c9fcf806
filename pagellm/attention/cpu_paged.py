"""Paged attention on CPU with a hand-written kernel that reads K/V in place.

The PyTorch path (:mod:`torch_sdpa`) must first gather every decode row's context out of the
paged cache into a dense workspace and then multiply it: the cache is read twice and written
once per layer, which is most of a decode step's attention time. The C++ kernel
(``pagellm/kernels/csrc/attention.cpp``) walks each request's block table instead and
reads every K/V row exactly once, with no padding between requests of different lengths.

Every token row of the step is one kernel row with its own causal limit: decode rows, chunked
prefills, prefix-cache hits and fresh prompts alike (measured here, bf16, 2 threads, one layer:
16 x 128-token prompts 2.9 ms vs 6.5 ms with SDPA's flash kernel, 2 x 1024 18.7 vs 25.6 ms,
1 x 4096 149 vs 156 ms). The new K/V are stored by the kernel library too. An fp8 (e4m3) cache
under a bf16 model is read in place, each row widened to bf16 as it is loaded. float32 runs
through the kernel too (head_dim 64/128 on its AVX2 path on any AVX2 CPU, else compiler-
vectorized code); pairs the kernel does not take use :class:`TorchSDPAAttention`.

``ReferenceAttention`` stays the test oracle; the kernel plan decides whether this backend is
used (it needs a kernel library: ``"auto"`` falls back to ``torch_sdpa`` without one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.kernels.library import KernelLibrary, check_paged_attention_rows, check_slots
from pagellm.attention.backend import AttentionMetadata, attention_dtype, write_kv
from pagellm.attention.torch_sdpa import TorchSDPAAttention


# (compute dtype, cache dtype) pairs the kernel takes; an fp8 cache under bf16 is read and
# widened in place, under float32 it goes through the torch path.
_KERNEL_PAIRS = frozenset({
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float32)
})


@dataclass
class _KernelRows:
    """Per-step index tensors for the kernel, shared by every layer of the step."""

    num_tokens: int
    row_token: torch.Tensor  # int32 [N]: token row of each kernel row
    row_req: torch.Tensor  # int32 [N]: its request (row of block_tables)
    row_ctx: torch.Tensor  # int32 [N]: context positions it attends to (causal limit)
    block_tables: torch.Tensor  # int64 [R, max_blocks], contiguous
    # What the rows were built from (the metadata's own objects), so a changed metadata is noticed.
    source: tuple[torch.Tensor, torch.Tensor, list[int], list[int]]
    checked_for: tuple[int, int] | None = None  # (num_blocks, block_size) the indices were checked against

    def matches(self, metadata: AttentionMetadata) -> bool:
        """Still built from ``metadata``'s slots, block tables and lengths (the indices it checked)."""
        slots, tables, query_lens, seq_lens = self.source
        return (
            slots is metadata.slot_mapping
            and tables is metadata.block_tables
            and query_lens == metadata.query_lens
            and seq_lens == metadata.seq_lens
        )


def build_kernel_rows(metadata: AttentionMetadata) -> _KernelRows:
    """One kernel row per new token (its request and causal limit), built with tensor ops only."""
    query_lens = torch.tensor(metadata.query_lens, dtype=torch.int64)
    seq_lens = torch.tensor(metadata.seq_lens, dtype=torch.int64)
    if bool(((query_lens < 0) | (query_lens > seq_lens)).any()):
        raise ValueError("every query_len must be in [0, seq_len]")
    num_tokens = int(query_lens.sum())
    row_req = torch.repeat_interleave(torch.arange(len(metadata.query_lens)), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    row_token = torch.arange(num_tokens)
    offset = row_token - starts[row_req]  # position among the request's new tokens
    row_ctx = seq_lens[row_req] - query_lens[row_req] + offset + 1
    block_tables = metadata.block_tables
    if block_tables.dtype != torch.int64 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int64).contiguous()
    source = (metadata.slot_mapping, metadata.block_tables, list(metadata.query_lens), list(metadata.seq_lens))
    return _KernelRows(
        num_tokens, row_token.to(torch.int32), row_req.to(torch.int32), row_ctx.to(torch.int32), block_tables, source
    )


def checked_kernel_rows(metadata: AttentionMetadata, key_cache: torch.Tensor) -> _KernelRows:
    """The step's kernel rows (built once a step, cached on the metadata), every index in them
    and the slots checked against this cache's shape (once a step per cache shape)."""
    rows = metadata.derived.get("cpu_paged")
    if not isinstance(rows, _KernelRows) or not rows.matches(metadata):
        rows = build_kernel_rows(metadata)
        metadata.derived["cpu_paged"] = rows
    cache_id = (key_cache.shape[0], key_cache.shape[1])
    if rows.checked_for != cache_id:
        check_slots(metadata.slot_mapping, key_cache)
        check_paged_attention_rows(
            rows.num_tokens, key_cache, rows.block_tables, rows.row_token, rows.row_req, rows.row_ctx
        )
        rows.checked_for = cache_id
    return rows


class CPUPagedAttention(TorchSDPAAttention):
    """Every row of a step through the C++ paged kernel (bf16, float32, an fp8 cache under bf16);
    other dtype pairs through SDPA."""

    name = "cpu_paged"

    def __init__(self, lib: KernelLibrary | None) -> None:
        """``lib``: the kernel library of the engine's plan (required: this backend is the kernel)."""
        super().__init__()
        if lib is None:
            raise RuntimeError(
                "attention backend 'cpu_paged' needs the pagellm CPU kernels, which could not be built "
                "(is a C++ compiler installed? are CPU kernels turned off: PAGELLM_CPU_KERNELS=0?)"
            )
        self.kernels = lib

    def forward(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale):
        cdtype = attention_dtype(query.dtype, key_cache.dtype)
        if query.device.type != "cpu" or (cdtype, key_cache.dtype) not in _KERNEL_PAIRS:
            return super().forward(query, key, value, key_cache, value_cache, metadata, scale)
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[-2]
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        # Indices are range-checked once per step (per cache shape), not once per layer.
        plan = checked_kernel_rows(metadata, key_cache)
        if plan.num_tokens != num_tokens:
            raise ValueError(f"query has {num_tokens} tokens but metadata.query_lens sum to {plan.num_tokens}")
        k = key if key.dtype == cdtype else key.to(cdtype)
        v = value if value.dtype == cdtype else value.to(cdtype)
        if k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(-2) == head_dim and v.stride(-2) == head_dim:
            self.kernels.write_kv(k, v, key_cache, value_cache, metadata.slot_mapping, slots_checked=True)
        else:
            write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        q = query if query.dtype == cdtype else query.to(cdtype)
        if q.stride(-1) != 1 or q.stride(-2) != head_dim:
            q = q.contiguous()
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=cdtype)
        if num_tokens:
            self.kernels.paged_attention(
                q, out, key_cache, value_cache, plan.block_tables, plan.row_token, plan.row_req, plan.row_ctx, scale,
                rows_checked=True,
            )
        return out if out.dtype == query.dtype else out.to(query.dtype)
