"""Attention test steps: random paged batches, their dense expected output, and the checks
every backend passes (shared by the attention, kernel and device tests)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagellm import kernels
from pagellm.attention import (
    AttentionMetadata,
    CPUPagedAttention,
    ReferenceAttention,
    TorchSDPAAttention,
    write_kv,
)
from pagellm.attention.backend import (
    as_stored,
    attention_dtype,
    quantize_int8_rows,
    to_cache_dtype,
    to_cache_rows,
)
from pagellm.kv_layout import INT8_KV_DTYPE, KV_SCALE_BYTES

KERNELS = kernels.default()  # this machine's kernel library (None: no compiler)

FP8 = torch.float8_e4m3fn
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
HEADS = {"mha": (4, 4), "gqa": (4, 2)}


@dataclass
class Step:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, H_kv, D] (new tokens only)
    value: torch.Tensor
    key_cache: torch.Tensor  # context already written, everything else NaN
    value_cache: torch.Tensor
    metadata: AttentionMetadata
    k_hist: list[torch.Tensor]  # per request: full [seq_len, H_kv, D] history (cache dtype)
    v_hist: list[torch.Tensor]
    scale: float


def make_step(
    reqs: list[tuple[int, int]],  # (cached context length, new tokens) per request
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    query_dtype: torch.dtype | None = None,
    seed: int = 0,
    spare_blocks: int = 7,
) -> Step:
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    query_lens = [q for _, q in reqs]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    # Shuffled, non-contiguous block ids (block 0 may be used by a request, too).
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_req) + 2  # wider than needed: padded with 0
    block_tables = torch.zeros(len(reqs), max_blocks, dtype=torch.long)
    tables = []
    for r, n in enumerate(blocks_per_req):
        ids, perm = perm[:n], perm[n:]
        block_tables[r, :n] = torch.tensor(ids, dtype=torch.long)
        tables.append(ids)

    def slot(r: int, pos: int) -> int:
        return tables[r][pos // block_size] * block_size + pos % block_size

    # Never-written cache memory is NaN: no backend may let it leak into the output.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)

    k_hist = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s in seq_lens]
    v_hist = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s in seq_lens]
    # Earlier steps wrote the cached context.
    for r, (ctx, _) in enumerate(reqs):
        if ctx:
            slots = torch.tensor([slot(r, p) for p in range(ctx)], dtype=torch.long)
            write_kv(k_hist[r][:ctx], v_hist[r][:ctx], key_cache, value_cache, slots)

    new_slots = [slot(r, p) for r, (ctx, q) in enumerate(reqs) for p in range(ctx, ctx + q)]
    key = torch.cat([k_hist[r][ctx:] for r, (ctx, _) in enumerate(reqs)])
    value = torch.cat([v_hist[r][ctx:] for r, (ctx, _) in enumerate(reqs)])
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(query_dtype or dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(new_slots, dtype=torch.long),
        block_tables=block_tables,
        query_lens=query_lens,
        seq_lens=seq_lens,
        query_start_loc=torch.tensor(qsl, dtype=torch.long),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long),
        block_size=block_size,
    )
    return Step(query, key, value, key_cache, value_cache, metadata, k_hist, v_hist, head_dim**-0.5)


def to_fp8_step(step: Step) -> Step:
    """The same step over an fp8 (e4m3) cache: the context stored rounded, the new K/V as the
    projection gives them (the backend rounds them as it stores them), and as history what the
    cache holds, so the dense oracle sees the rounded values."""

    def stored(t: torch.Tensor) -> torch.Tensor:
        return to_cache_dtype(t, FP8).to(step.query.dtype)

    return Step(
        step.query, step.key, step.value, step.key_cache.to(FP8), step.value_cache.to(FP8), step.metadata,
        [stored(k) for k in step.k_hist], [stored(v) for v in step.v_hist], step.scale,
    )


def int8_cache(cache: torch.Tensor) -> torch.Tensor:
    """A float cache (never-written rows NaN) as an int8 cache: the written rows as
    ``write_kv`` stores them, the others with a NaN scale, so they too read back as NaN."""
    rows = quantize_int8_rows(torch.nan_to_num(cache.float(), nan=0.0))
    nan_scale = torch.tensor([float("nan")], dtype=torch.float32).view(torch.int8)
    rows[..., -KV_SCALE_BYTES:][torch.isnan(cache).any(dim=-1)] = nan_scale
    return rows


def to_int8_step(step: Step) -> Step:
    """The same step over an int8 cache (per-row codes and a float32 scale): the context stored
    quantized, the new K/V as the projection gives them (the backend quantizes them as it
    stores them), and as history the values the cache holds, read back in the query's dtype
    (as the torch path reads them), so the dense oracle sees the quantized values."""

    def stored(t: torch.Tensor) -> torch.Tensor:
        return as_stored(t, INT8_KV_DTYPE, step.query.dtype)

    return Step(
        step.query, step.key, step.value, int8_cache(step.key_cache), int8_cache(step.value_cache), step.metadata,
        [stored(k) for k in step.k_hist], [stored(v) for v in step.v_hist], step.scale,
    )


def same_cache(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal caches (NaN where NaN; fp8 compared as bytes; int8 rows, scales included, as they are)."""
    if a.dtype == FP8:
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    nan = torch.isnan(a)
    return a.dtype == b.dtype and torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


def dense_expected(
    step: Step, window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal softmax attention over each request's unpaged history, in float64 (each query
    over its last ``window`` positions; scores capped by ``softcap * tanh(s / softcap)``; with
    ``sinks``, each head's sink logit in its softmax, over no value)."""
    md = step.metadata
    num_heads = step.query.shape[1]
    group = num_heads // step.k_hist[0].shape[1]
    outs = []
    start = 0
    for r, (q_len, s_len) in enumerate(zip(md.query_lens, md.seq_lens)):
        q = step.query[start : start + q_len].double()  # [Q, H, D]
        start += q_len
        k = step.k_hist[r].double()  # [S, H_kv, D]
        v = step.v_hist[r].double()
        out = torch.empty(q_len, num_heads, q.shape[-1], dtype=torch.float64)
        for h in range(num_heads):
            kv = h // group
            scores = (q[:, h] @ k[:, kv].T) * step.scale  # [Q, S]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            q_pos = torch.arange(s_len - q_len, s_len)[:, None]
            k_pos = torch.arange(s_len)[None, :]
            scores[k_pos > q_pos] = float("-inf")
            if window is not None:
                scores[k_pos <= q_pos - window] = float("-inf")
            if sinks is not None:  # one more logit per row, over no value
                with_sink = torch.cat([scores, torch.full((q_len, 1), float(sinks[h]), dtype=torch.float64)], dim=1)
                out[:, h] = torch.softmax(with_sink, dim=-1)[:, :-1] @ v[:, kv]
                continue
            out[:, h] = torch.softmax(scores, dim=-1) @ v[:, kv]
        outs.append(out)
    return torch.cat(outs)


def run_backend(backend, step: Step, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None):  # fmt: skip
    kc, vc = step.key_cache.clone(), step.value_cache.clone()
    out = backend.forward(step.query, step.key, step.value, kc, vc, step.metadata, step.scale, window, softcap, sinks)
    return out, kc, vc


def cpu_paged_all_dtypes() -> CPUPagedAttention:
    """The kernel backend (float32, bf16 and fp8 caches through the kernel)."""
    return CPUPagedAttention(KERNELS)


cpu_paged_all_dtypes.name = "cpu_paged"
FAST_BACKENDS = [TorchSDPAAttention, cpu_paged_all_dtypes]


def check_step(
    step: Step, backend_cls: type = TorchSDPAAttention, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    # The arithmetic's dtype sets the tolerance (an fp8 cache is checked against its stored values).
    tol = TOL[attention_dtype(step.query.dtype, step.key_cache.dtype)]
    out_ref, kc_ref, vc_ref = run_backend(ReferenceAttention(), step, window, softcap, sinks)
    out, kc, vc = run_backend(backend_cls(), step, window, softcap, sinks)

    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out_ref, **tol)
    torch.testing.assert_close(out.double(), dense_expected(step, window, softcap, sinks), **tol)

    # The new K/V landed at their slots, as rows of the cache dtype, and nothing else changed.
    num_kv_heads, width = kc.shape[-2:]
    slots = step.metadata.slot_mapping
    assert same_cache(kc.view(-1, num_kv_heads, width)[slots], to_cache_rows(step.key, kc.dtype))
    assert same_cache(vc.view(-1, num_kv_heads, width)[slots], to_cache_rows(step.value, vc.dtype))
    assert same_cache(kc, kc_ref) and same_cache(vc, vc_ref)


def random_reqs(kind: str, n: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)

    def ri(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    if kind == "decode":
        return [(ri(0, 70), 1) for _ in range(n)]
    if kind == "prefill":
        return [(0, ri(2, 40)) for _ in range(n)]
    if kind == "mixed":  # decode rows interleaved with chunked/prefix-hit and fresh prefills
        reqs = []
        for i in range(n):
            kind_i = i % 4
            if kind_i in (0, 2):
                reqs.append((ri(0, 60), 1))
            elif kind_i == 1:
                reqs.append((ri(1, 50), ri(2, 30)))
            else:
                reqs.append((0, ri(2, 30)))
        return reqs
    if kind == "mixed_decode_first":  # the scheduler's usual order
        return [(ri(0, 60), 1) for _ in range(n)] + [(ri(1, 40), ri(2, 20)), (0, ri(2, 20)), (ri(5, 40), ri(2, 20))]
    raise AssertionError(kind)
