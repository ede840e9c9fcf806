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
vectorized code); pairs the kernel does not take use :class:`TorchSDPAAttention`. A sliding
window gives each row its first position (``_KernelRows.start_for``): positions before it are
never read, so blocks the block manager released behind the window may name anyone's data.
Capped scores (Gemma 2) pass through ``cap * tanh(score / cap)`` in the kernel.

``ReferenceAttention`` stays the test oracle; the kernel plan decides whether this backend is
used (it needs a kernel library: ``"auto"`` falls back to ``torch_sdpa`` without one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.kernels.arg_checks import check_block_tables, check_slots
from pagellm.kernels.library import KernelLibrary
from pagellm.attention.backend import AttentionBackend, AttentionMetadata, attention_dtype, write_kv
from pagellm.attention.torch_sdpa import TorchSDPAAttention
from pagellm.speculative_config import MAX_VERIFY_TOKENS


# (compute dtype, cache dtype) pairs the kernel takes; an fp8 cache under bf16 is read and
# widened in place, under float32 it goes through the torch path; an int8 cache's codes are
# widened in place under either, its scales applied to the scores and weights.
_KERNEL_PAIRS = frozenset({
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float32),
    (torch.bfloat16, torch.int8), (torch.float32, torch.int8),
})

# Head dims whose prefill rows the kernel takes (AMX tiles of a chunk's rows, AVX-512 and AVX2
# paths). For any other, each prefill row walks its context alone, and SDPA's blocked GEMMs win:
# Gemma's 256 with a window of 512, one 512-token prefill 13.6 ms in SDPA against 24.8 in the
# kernel (benchmarks/NOTES.md 49); the decode rows stay on the kernel (6.2 against 19.2 ms).
_PREFILL_HEAD_DIMS = frozenset({64, 128})
# Requests with this few new tokens stay on the kernel whatever the head dim (a speculating
# sequence's: ``MAX_VERIFY_TOKENS``); SDPA takes the longer prefills.
KERNEL_QUERY_LEN = MAX_VERIFY_TOKENS


def prefill_on_kernel(head_dim: int) -> bool:
    """Whether the kernel takes prefill rows of this head dim (else they go to SDPA)."""
    return head_dim in _PREFILL_HEAD_DIMS


@dataclass
class _KernelRows:
    """Per-step index tensors for the kernel, shared by every layer of the step."""

    num_tokens: int
    row_token: torch.Tensor  # int32 [N]: token row of each kernel row, 0 .. N - 1
    row_req: torch.Tensor  # int32 [N]: its request (row of block_tables), 0 .. R - 1
    row_ctx: torch.Tensor  # int32 [N]: context positions it attends to (causal limit), 1 .. max_context
    block_tables: torch.Tensor  # int64 [R, max_blocks], contiguous
    max_context: int  # the longest seq_len
    longest_query: int  # the most new tokens of one request
    # What the rows were built from (the metadata's own objects), so a changed metadata is noticed.
    source: tuple[torch.Tensor, torch.Tensor, list[int], list[int]]
    checked_for: tuple[int, int] | None = None  # (num_blocks, block_size) the indices were checked against
    starts: dict[int, torch.Tensor] = field(default_factory=dict)  # per sliding window: int32 [N] first positions
    short_subset: _KernelRows | None = None  # the rows of requests of few new tokens (built on first use)

    def short_rows(self) -> _KernelRows:
        """The rows of requests with at most ``KERNEL_QUERY_LEN`` new tokens (decodes,
        verifications), built once a step; checked as the whole step's rows were."""
        if self.short_subset is None:
            query_lens = np.diff(np.searchsorted(self.row_req.numpy(), np.arange(self.block_tables.shape[0] + 1)))
            keep = query_lens[self.row_req.numpy()] <= KERNEL_QUERY_LEN
            self.short_subset = _KernelRows(
                int(keep.sum()), self.row_token[keep], self.row_req[keep], self.row_ctx[keep], self.block_tables,
                self.max_context, int(query_lens[query_lens <= KERNEL_QUERY_LEN].max(initial=0)), self.source,
                self.checked_for,
            )  # fmt: skip
        return self.short_subset

    def start_for(self, window: int | None) -> torch.Tensor | None:
        """Each row's first position under a sliding ``window`` (its last ``window`` positions,
        its own included: in [0, row_ctx)), built once a step per window; None without one."""
        if window is None:
            return None
        start = self.starts.get(window)
        if start is None:
            start = torch.from_numpy(np.maximum(self.row_ctx.numpy() - window, 0).astype(np.int32))
            self.starts[window] = start
        return start

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
    """One kernel row per new token (its request and causal limit), built with array ops only
    (numpy: torch's small ops cost ~10 us each, a step's worth at batch 1)."""
    query_lens = np.asarray(metadata.query_lens, dtype=np.int64)
    seq_lens = np.asarray(metadata.seq_lens, dtype=np.int64)
    if query_lens.shape != seq_lens.shape or bool(((query_lens < 0) | (query_lens > seq_lens)).any()):
        raise ValueError("every query_len must be in [0, seq_len]")
    num_tokens = int(query_lens.sum())
    row_req = np.repeat(np.arange(len(query_lens), dtype=np.int32), query_lens)
    row_token = np.arange(num_tokens, dtype=np.int32)
    # Token t of request r (its offset among the request's new tokens: t - start_r) sees the
    # context up to seq_len - query_len + offset + 1.
    first_ctx = seq_lens - query_lens - (np.cumsum(query_lens) - query_lens) + 1
    row_ctx = (first_ctx[row_req] + row_token).astype(np.int32)
    block_tables = metadata.block_tables
    if block_tables.dtype != torch.int64 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int64).contiguous()
    source = (metadata.slot_mapping, metadata.block_tables, list(metadata.query_lens), list(metadata.seq_lens))
    return _KernelRows(
        num_tokens, torch.from_numpy(row_token), torch.from_numpy(row_req), torch.from_numpy(row_ctx), block_tables,
        int(seq_lens.max(initial=0)), int(query_lens.max(initial=0)), source,
    )


def checked_kernel_rows(metadata: AttentionMetadata, key_cache: torch.Tensor) -> _KernelRows:
    """The step's kernel rows (built once a step, cached on the metadata), every index in them
    and the slots checked against this cache's shape (once a step per cache shape). The rows
    lie in range by construction (:func:`build_kernel_rows`); what can still be wrong is the
    block tables and slots the scheduler sent."""
    rows = metadata.derived.get("cpu_paged")
    if not isinstance(rows, _KernelRows) or not rows.matches(metadata):
        rows = build_kernel_rows(metadata)
        metadata.derived["cpu_paged"] = rows
    cache_id = (key_cache.shape[0], key_cache.shape[1])
    if rows.checked_for != cache_id:
        if rows.block_tables.shape[0] != len(metadata.query_lens):
            raise ValueError(f"block_tables has {rows.block_tables.shape[0]} rows for {len(metadata.query_lens)} requests")
        check_slots(metadata.slot_mapping, key_cache)
        check_block_tables(rows.block_tables, key_cache, rows.max_context)
        rows.checked_for = cache_id
    return rows


class CPUPagedAttention(AttentionBackend):
    """Every row of a step through the C++ paged kernel (bf16, float32, an fp8 cache under bf16),
    sliding windows and capped scores included; other dtype pairs through the SDPA backend it
    holds (composed, through its public calls), and so are the prefill rows of head dims the
    kernel has no fast path for (``_PREFILL_HEAD_DIMS``)."""

    name = "cpu_paged"

    def __init__(self, lib: KernelLibrary | None) -> None:
        """``lib``: the kernel library of the engine's plan (required: this backend is the kernel)."""
        if lib is None:
            raise RuntimeError(
                "attention backend 'cpu_paged' needs the pagellm CPU kernels, which could not be built "
                "(is a C++ compiler installed? are CPU kernels turned off: PAGELLM_CPU_KERNELS=0?)"
            )
        self.kernels = lib
        self.sdpa = TorchSDPAAttention()  # the rows the kernel does not take

    def route(self, metadata: AttentionMetadata, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> str:
        """``cpu_paged``, ``torch_sdpa`` (a dtype pair the kernel does not take), or both (the
        prefill rows of a head dim the kernel has no fast path for on SDPA)."""
        if (attention_dtype(dtype, cache_dtype), cache_dtype) not in _KERNEL_PAIRS:
            return self.sdpa.name
        if not prefill_on_kernel(head_dim) and max(metadata.query_lens, default=0) > KERNEL_QUERY_LEN:
            return f"{self.name}+{self.sdpa.name}-prefill"
        return self.name

    def forward(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale,
                window=None, softcap=None, sinks=None):  # fmt: skip
        cdtype = attention_dtype(query.dtype, key_cache.dtype)
        if query.device.type != "cpu" or (cdtype, key_cache.dtype) not in _KERNEL_PAIRS:
            return self.sdpa.forward(query, key, value, key_cache, value_cache, metadata, scale, window, softcap, sinks)
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
        split = plan.longest_query > KERNEL_QUERY_LEN and not prefill_on_kernel(head_dim)
        rows = plan.short_rows() if split else plan
        if rows.num_tokens:
            self.kernels.paged_attention(
                q, out, key_cache, value_cache, rows.block_tables, rows.row_token, rows.row_req, rows.row_ctx, scale,
                row_start=rows.start_for(window), softcap=softcap, sinks=None if sinks is None else sinks.float().contiguous(),
                rows_checked=True,
            )  # fmt: skip
        if split:  # the longer prefills through SDPA (their K/V are in the cache already)
            self.sdpa.prefill_rows(q, key, value, key_cache, value_cache, metadata, out, scale, window, softcap, sinks,
                                   min_query_len=KERNEL_QUERY_LEN + 1)  # fmt: skip
        return out if out.dtype == query.dtype else out.to(query.dtype)
