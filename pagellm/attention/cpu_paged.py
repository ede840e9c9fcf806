"""Paged attention on CPU with a hand-written kernel that reads K/V in place.

The PyTorch path (:mod:`torch_sdpa`) must first gather every decode row's context out of the
paged cache into a dense workspace and then multiply it: the cache is read twice and written
once per layer, which is most of a decode step's attention time. The C++ kernel
(``pagellm/kernels/csrc/cpu_kernels.cpp``) walks each request's block table instead and
reads every K/V row exactly once, with no padding between requests of different lengths.

Rows served by the kernel: every decode row and every prefill row that has cached context
(chunked prefill, prefix-cache hits), each with its own causal limit. Prefills without cached
context keep SDPA's causal flash kernel (:class:`TorchSDPAAttention`), which is GEMM-bound and
faster there. The new K/V are stored by the kernel library too.

``ReferenceAttention`` stays the test oracle; :func:`pagellm.kernels.available` decides
whether this backend can be used (``"auto"`` falls back to ``torch_sdpa`` otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm import kernels
from pagellm.attention.backend import AttentionMetadata, write_kv
from pagellm.attention.torch_sdpa import TorchSDPAAttention, _PrefillPlan


@dataclass
class _KernelPlan:
    """Per-step index tensors for the kernel, shared by every layer of the step."""

    metadata: AttentionMetadata  # strong ref: identity checks stay sound
    num_tokens: int
    row_token: torch.Tensor  # int32 [N]: token row of each kernel row
    row_req: torch.Tensor  # int32 [N]: its request (row of block_tables)
    row_ctx: torch.Tensor  # int32 [N]: context positions it attends to (causal limit)
    block_tables: torch.Tensor  # int64 [R, max_blocks], contiguous
    fresh_prefills: list[_PrefillPlan]  # prefills without cached context, for SDPA


def build_kernel_plan(metadata: AttentionMetadata) -> _KernelPlan:
    """Split the step into kernel rows and fresh prefills, with tensor ops only."""
    query_lens = torch.tensor(metadata.query_lens, dtype=torch.int64)
    seq_lens = torch.tensor(metadata.seq_lens, dtype=torch.int64)
    if bool(((query_lens < 0) | (query_lens > seq_lens)).any()):
        raise ValueError("every query_len must be in [0, seq_len]")
    starts = torch.cumsum(query_lens, 0) - query_lens
    fresh = (query_lens > 1) & (query_lens == seq_lens)
    in_kernel = (query_lens > 0) & ~fresh
    reqs = torch.nonzero(in_kernel).flatten()
    q_k = query_lens[reqs]
    rep = torch.repeat_interleave(torch.arange(reqs.numel()), q_k)
    first = torch.cumsum(q_k, 0) - q_k
    offset = torch.arange(rep.numel()) - first[rep]
    row_req = reqs[rep]
    row_token = starts[row_req] + offset
    row_ctx = seq_lens[row_req] - query_lens[row_req] + offset + 1
    fresh_prefills = [
        _PrefillPlan(int(starts[r]), metadata.query_lens[r], metadata.seq_lens[r], None, None)
        for r in torch.nonzero(fresh).flatten().tolist()
    ]
    block_tables = metadata.block_tables
    if block_tables.dtype != torch.int64 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int64).contiguous()
    return _KernelPlan(
        metadata,
        int(query_lens.sum()),
        row_token.to(torch.int32),
        row_req.to(torch.int32),
        row_ctx.to(torch.int32),
        block_tables,
        fresh_prefills,
    )


class CPUPagedAttention(TorchSDPAAttention):
    """Decode and cached-context rows through the C++ paged kernel; fresh prefills through SDPA."""

    name = "cpu_paged"

    _kernel_plan: _KernelPlan | None = None  # class-level: one plan per step for all layers

    def __init__(self, float32_kernel: bool = False) -> None:
        """``float32_kernel``: run float32 caches through the kernel too. Off by default: float32
        is the reference-precision mode, kept on torch's kernels so it matches HF's float32
        arithmetic as closely as before (the kernel's sums run in another order)."""
        self.kernel_dtypes = (torch.bfloat16, torch.float32) if float32_kernel else (torch.bfloat16,)
        if not kernels.available():
            raise RuntimeError(
                "attention backend 'cpu_paged' needs the pagellm CPU kernels, which could not be built "
                "(is a C++ compiler installed? is PAGELLM_CPU_KERNELS=0 set?)"
            )

    @classmethod
    def _get_kernel_plan(cls, metadata: AttentionMetadata) -> _KernelPlan:
        plan = CPUPagedAttention._kernel_plan
        if plan is None or plan.metadata is not metadata:
            plan = build_kernel_plan(metadata)
            CPUPagedAttention._kernel_plan = plan
        return plan

    @classmethod
    def clear_plan_cache(cls) -> None:
        CPUPagedAttention._kernel_plan = None
        super().clear_plan_cache()

    @classmethod
    def release_memory(cls) -> None:
        CPUPagedAttention._kernel_plan = None
        super().release_memory()

    def forward(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale):
        cdtype = key_cache.dtype
        if query.device.type != "cpu" or cdtype not in self.kernel_dtypes:
            return super().forward(query, key, value, key_cache, value_cache, metadata, scale)
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[-2]
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        plan = self._get_kernel_plan(metadata)
        if plan.num_tokens != num_tokens:
            raise ValueError(f"query has {num_tokens} tokens but metadata.query_lens sum to {plan.num_tokens}")
        k = key if key.dtype == cdtype else key.to(cdtype)
        v = value if value.dtype == cdtype else value.to(cdtype)
        if k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(-2) == head_dim and v.stride(-2) == head_dim:
            kernels.write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        else:
            write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        q = query if query.dtype == cdtype else query.to(cdtype)
        if q.stride(-1) != 1 or q.stride(-2) != head_dim:
            q = q.contiguous()
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=cdtype)
        if plan.row_token.numel():
            kernels.paged_attention(
                q, out, key_cache, value_cache, plan.block_tables, plan.row_token, plan.row_req, plan.row_ctx, scale
            )
        group = num_heads // num_kv_heads
        for p in plan.fresh_prefills:
            self._prefill(q, k, v, key_cache, value_cache, p, out, num_kv_heads, group, head_dim, scale)
        return out if out.dtype == query.dtype else out.to(query.dtype)
