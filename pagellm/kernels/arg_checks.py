"""The checks the kernel wrappers run before a call (``library.py``): shapes, dtypes, strides
and every index the C++ will follow, so a wrong call raises a Python exception instead of
reading stray memory; and the dtype codes the kernels take."""

from __future__ import annotations

import torch

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# (K/V and query dtype, cache dtype) -> the attention and K/V-write kernels' dtype code.
CACHE_CODES = {(torch.float32, torch.float32): 0, (torch.bfloat16, torch.bfloat16): 1,
               (torch.bfloat16, torch.float8_e4m3fn): 2, (torch.bfloat16, torch.int8): 3, (torch.float32, torch.int8): 4}


def check_logits_rows(name: str, x: torch.Tensor) -> tuple[int, int]:
    """``x`` is 2-D float32/bfloat16 on CPU with non-empty rows, each contiguous; its shape."""
    if x.dtype not in DTYPE_CODES or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"{name} takes a 2-D CPU float32 or bfloat16 tensor")
    rows, n = x.shape
    if n == 0 or (rows > 1 and x.stride(0) < n) or (n > 1 and x.stride(1) != 1):
        raise ValueError(f"{name} needs non-empty rows, each contiguous")
    return rows, n


def check_rows(name: str, t: torch.Tensor, inner: tuple[int, ...], dtype: torch.dtype) -> None:
    """``t`` is [N, *inner] on CPU with contiguous inner dims (any row stride)."""
    if t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.device} {t.dtype}")
    if tuple(t.shape[1:]) != inner:
        raise ValueError(f"{name} must have shape [N, {', '.join(map(str, inner))}], got {list(t.shape)}")
    expected = 1
    for dim in range(t.dim() - 1, 0, -1):
        if t.shape[dim] > 1 and t.stride(dim) != expected:
            raise ValueError(f"{name} must be contiguous within a row")
        expected *= t.shape[dim]


def check_int(name: str, t: torch.Tensor, dtype: torch.dtype, n: int | None = None) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} must have {n} elements, got {t.numel()}")


def check_paged_attention_rows(
    num_tokens: int, key_cache: torch.Tensor, block_tables: torch.Tensor,
    row_token: torch.Tensor, row_req: torch.Tensor, row_ctx: torch.Tensor, row_start: torch.Tensor | None = None,
) -> None:
    """Every index the kernel will follow is in range (one pass of min/max per tensor), and each
    row's first position (``row_start``, where given) lies before its limit."""
    n = row_token.numel()
    for name, t in (("row_token", row_token), ("row_req", row_req), ("row_ctx", row_ctx)):
        check_int(name, t, torch.int32, n)
    if row_start is not None:
        check_int("row_start", row_start, torch.int32, n)
        starts = row_start.numpy()
        if n and (bool((starts < 0).any()) or bool((starts >= row_ctx.numpy()).any())):
            raise ValueError("row_start values must lie in [0, row_ctx)")
    check_block_tables(block_tables, key_cache, 0)
    if n == 0:
        return
    limits = (
        ("row_token", row_token, 0, num_tokens - 1),
        ("row_req", row_req, 0, block_tables.shape[0] - 1),
        ("row_ctx", row_ctx, 1, block_tables.shape[1] * key_cache.shape[1]),
    )
    for name, t, lo, hi in limits:
        if not _within(t, lo, hi):
            raise ValueError(f"{name} values must lie in [{lo}, {hi}]")


def check_block_tables(block_tables: torch.Tensor, key_cache: torch.Tensor, max_context: int) -> None:
    """Block tables are CPU int64 rows naming blocks of this cache, wide enough for
    ``max_context`` tokens."""
    num_blocks, block_size = key_cache.shape[:2]
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a 2-D tensor with contiguous rows")
    if block_tables.dtype != torch.int64 or block_tables.device.type != "cpu":
        raise ValueError("block_tables must be a CPU int64 tensor")
    if max_context > block_tables.shape[1] * block_size:
        raise ValueError(f"block_tables hold {block_tables.shape[1]} blocks a row, fewer than {max_context} tokens need")
    if block_tables.numel() and not _within(block_tables, 0, num_blocks - 1):
        raise ValueError(f"block_tables entries must lie in [0, {num_blocks - 1}]")


def _within(t: torch.Tensor, lo: int, hi: int) -> bool:
    """Every value of a non-empty integer CPU tensor lies in [lo, hi] (through numpy: a small
    torch reduction costs ~10 us, a step's worth at batch 1 over the ~5 checked per step)."""
    values = t.numpy()
    return lo <= int(values.min()) and int(values.max()) <= hi


def check_slots(slot_mapping: torch.Tensor, key_cache: torch.Tensor) -> None:
    """Slots lie in the cache (or are -1: a padding token that stores nothing)."""
    check_int("slot_mapping", slot_mapping, torch.int64)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if slot_mapping.numel() and not _within(slot_mapping, -1, num_slots - 1):
        raise ValueError(f"slot_mapping values must lie in [-1, {num_slots - 1}]")


def check_gemm_input(x: torch.Tensor) -> tuple[int, int]:
    """(rows, k) of a 2-D CPU float32/bf16 ``x`` whose rows are each contiguous."""
    if x.dim() != 2 or x.dtype not in DTYPE_CODES or x.device.type != "cpu":
        raise ValueError("x must be a 2-D CPU float32 or bfloat16 tensor")
    rows, k = x.shape
    if k == 0 or (rows > 1 and x.stride(0) < k) or (k > 1 and x.stride(1) != 1):
        raise ValueError("x needs columns, each row contiguous")
    return rows, k


def cache_code(dtype: torch.dtype, key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """The kernels' code for ``dtype`` queries or K/V over these caches (checked: CPU, contiguous,
    same shape and dtype, a supported pair: float32 / bf16 caches of the same dtype, an fp8 e4m3
    cache under bf16, or an int8 cache under either)."""
    if key_cache.device.type != "cpu" or not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("key_cache and value_cache must be contiguous CPU tensors")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    code = CACHE_CODES.get((dtype, key_cache.dtype))
    if code is None:
        pairs = ", ".join(f"{str(c).removeprefix('torch.')} cache with {str(q).removeprefix('torch.')}"
                          for q, c in CACHE_CODES)
        raise ValueError(f"the CPU kernels support a {pairs}; got a {key_cache.dtype} cache with {dtype}")
    return code
