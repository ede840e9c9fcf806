"""int8 K/V rows (``kv_cache_dtype="int8"``): a (token, head) row's codes and float32 scale, as
quantized, stored, read back and gathered by the torch path and the reference oracle."""

from __future__ import annotations

import pytest
import torch

from pagellm.attention.backend import (
    FP8_KV_DTYPES,
    as_stored,
    dequantize_int8_rows,
    from_cache_rows,
    quantize_int8_rows,
    to_cache_dtype,
    to_cache_rows,
    write_kv,
)
from pagellm.attention.reference import gather_context
from pagellm.kv_layout import INT8_KV_DTYPE, KV_SCALE_BYTES, cache_head_dim, kv_row_width


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale each int8 row carries in its last 4 bytes ([..., 1])."""
    return rows[..., -KV_SCALE_BYTES:].clone().view(torch.float32)


def random_rows(seed: int) -> torch.Tensor:
    """[64, 4, 32] float32 rows of very different magnitudes (1e-3 .. 1e3)."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** torch.randint(-3, 4, (64, 4, 1), generator=g).float()
    return torch.randn(64, 4, 32, generator=g) * magnitude


def test_row_width_and_head_dim_of_an_int8_cache():
    assert kv_row_width(64, INT8_KV_DTYPE) == 68
    assert kv_row_width(64, torch.bfloat16) == kv_row_width(64, FP8_KV_DTYPES[0]) == 64
    assert cache_head_dim(torch.zeros(2, 16, 3, 68, dtype=torch.int8)) == 64
    assert cache_head_dim(torch.zeros(2, 16, 3, 64, dtype=torch.bfloat16)) == 64


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_error_is_at_most_half_a_step(seed):
    x = random_rows(seed)
    rows = quantize_int8_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (64, 4, 32 + KV_SCALE_BYTES)
    amax = x.abs().amax(dim=-1, keepdim=True)
    error = (dequantize_int8_rows(rows, torch.float32) - x).abs()
    assert (error <= amax / 254 * (1 + 1e-5)).all()  # half of one code's step, amax / 127
    assert (error > 0).any()  # it really is quantized
    codes = rows[..., :-KV_SCALE_BYTES]
    assert codes.abs().max() == 127 and (codes.abs().amax(dim=-1) == 127).all()  # each row's amax is a full code


def test_scale_bytes_are_the_float32_amax_over_127():
    x = random_rows(3)
    rows = quantize_int8_rows(x)
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert torch.equal(scales(rows), amax / 127)
    assert torch.equal(rows[0, 0, -KV_SCALE_BYTES:], (amax[0, 0] / 127).view(torch.int8))


def test_zero_rows_give_zero_codes_and_scale():
    x = random_rows(4)
    x[5, 2] = 0.0
    x[9] = 0.0
    rows = quantize_int8_rows(x)
    assert not rows[5, 2].any() and not rows[9].any()  # codes and the scale's 4 bytes all zero
    assert rows[5, 1].any()
    back = dequantize_int8_rows(rows, torch.float32)
    assert not back[5, 2].any() and not back[9].any()


def test_exact_codes_and_round_half_to_even_on_hand_made_values():
    # amax 127: the scale is exactly 1.0 and every value its own code; .5 ties go to the even code.
    x = torch.tensor([127.0, -63.5, 0.5, 1.5, 2.5, -2.5, 62.5, -1.0, 0.0, -127.0, 3.5, -0.5])
    rows = quantize_int8_rows(x)
    codes = [127, -64, 0, 2, 2, -2, 62, -1, 0, -127, 4, 0]
    assert rows[:-KV_SCALE_BYTES].tolist() == codes
    assert scales(rows).item() == 1.0
    assert torch.equal(rows[-KV_SCALE_BYTES:], torch.tensor([1.0]).view(torch.int8))
    assert dequantize_int8_rows(rows, torch.float32).tolist() == [float(c) for c in codes]


def test_halved_scale_codes_and_a_bf16_input():
    # amax 63.5: scale 0.5, code = 2x; a bf16 row quantizes as its float32 values do.
    x = torch.tensor([[63.5, -0.25, 0.75, 10.0]])
    rows = quantize_int8_rows(x)
    assert rows[0, :-KV_SCALE_BYTES].tolist() == [127, 0, 2, 20]  # -0.5 -> 0 and 1.5 -> 2: ties to even
    assert scales(rows).item() == 0.5
    assert torch.equal(quantize_int8_rows(x.to(torch.bfloat16)), rows)


def test_dequantized_in_the_compute_dtype():
    rows = quantize_int8_rows(random_rows(5))
    exact = dequantize_int8_rows(rows, torch.float32)
    bf16 = dequantize_int8_rows(rows, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, exact.to(torch.bfloat16))
    assert torch.equal(from_cache_rows(rows, INT8_KV_DTYPE, torch.float32), exact)


def test_cache_rows_of_every_dtype():
    x = random_rows(6)
    assert torch.equal(to_cache_rows(x, INT8_KV_DTYPE), quantize_int8_rows(x))
    assert torch.equal(as_stored(x, INT8_KV_DTYPE, torch.float32), dequantize_int8_rows(quantize_int8_rows(x), torch.float32))
    fp8 = FP8_KV_DTYPES[0]
    assert torch.equal(to_cache_rows(x, fp8).view(torch.uint8), to_cache_dtype(x, fp8).view(torch.uint8))
    assert to_cache_rows(x, torch.float32) is x and from_cache_rows(x, torch.float32, torch.float32) is x
    with pytest.raises(ValueError, match="to_cache_rows"):
        to_cache_dtype(x, INT8_KV_DTYPE)


def test_write_kv_stores_quantized_rows_at_their_slots_and_gather_context_reads_values():
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 8
    shape = (num_blocks, block_size, num_kv_heads, kv_row_width(head_dim, INT8_KV_DTYPE))
    key_cache, value_cache = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    g = torch.Generator().manual_seed(7)
    key, value = torch.randn(6, num_kv_heads, head_dim, generator=g), torch.randn(6, num_kv_heads, head_dim, generator=g)
    block_table = torch.tensor([3, 1, 4])
    positions = torch.arange(6)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    write_kv(key, value, key_cache, value_cache, slots)
    flat = key_cache.view(-1, num_kv_heads, shape[-1])
    assert torch.equal(flat[slots], quantize_int8_rows(key))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not flat[untouched].any()
    k = gather_context(key_cache, block_table, 6)
    v = gather_context(value_cache, block_table, 6)
    assert k.dtype == torch.float32 and k.shape == (6, num_kv_heads, head_dim)
    assert torch.equal(k, as_stored(key, INT8_KV_DTYPE, torch.float32))
    assert torch.equal(v, as_stored(value, INT8_KV_DTYPE, torch.float32))
