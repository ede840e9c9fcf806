"""GGUF rows packed straight from the file (``csrc/gguf_rows.cpp``, ``gguf_blocks.GGUFRows``):
byte for byte what ``quant_formats.pack`` makes of the same rows unpacked, for every format the
kernel takes, with rows permuted (q/k's order), cut along k (a tensor-parallel share), from
several tensors of one file, padded to whole tiles and interleaved for silu_mul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from pagellm import kernels
from pagellm.kernels import quant_formats as qf
from pagellm.kernels.library import KernelLibrary
from pagellm.model.gguf_blocks import GGUFRows, pack_gguf_rows
from tests.helpers.gguf_writer import random_k_quant

PACKED = {T.Q4_0: "q4s", T.Q4_1: "q4", T.Q8_0: "q8", T.Q6_K: "q6k", T.Q4_K: "q4k"}


@pytest.fixture(scope="module")
def lib() -> KernelLibrary:
    library = kernels.default()
    if library is None:
        pytest.skip("no C++ compiler: the kernels cannot be built")
    return library


def _blocks(qtype: T, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return random_k_quant(qtype, rows, k, rng)
    return quantize(rng.standard_normal((rows, k)).astype(np.float32), qtype)


def _file(qtype: T, row_counts: list[int], k: int, seed: int = 0) -> list[GGUFRows]:
    """Tensors of ``row_counts`` rows laid one after another in one byte buffer (a file), after
    a header of odd length."""
    rng = np.random.default_rng(seed)
    tensors = [_blocks(qtype, rows, k, rng) for rows in row_counts]
    source = np.concatenate([rng.integers(0, 256, 37, dtype=np.uint8), *(t.reshape(-1) for t in tensors)])
    parts, start = [], 37
    for t in tensors:
        parts.append(GGUFRows.of(source, source[start : start + t.nbytes].reshape(t.shape), qtype, k))
        start += t.nbytes
    return parts


def _expected(parts: list[GGUFRows], silu_mul: bool) -> torch.Tensor:
    weight = qf.concat_rows([p.weight() for p in parts])
    return qf.pack_silu_mul(weight) if silu_mul else qf.pack(weight)


@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("qtype", list(PACKED), ids=[t.name for t in PACKED])
def test_packed_from_the_file_as_from_unpacked_codes(lib: KernelLibrary, qtype: T, silu_mul: bool) -> None:
    first, second = _file(qtype, [24, 14], 512)
    permuted = first.select_rows(torch.randperm(24, generator=torch.Generator().manual_seed(1)))
    parts = [permuted, second]  # 38 rows: a part tile (silu_mul: 19 a half, a part tile of 8)
    assert permuted.format == PACKED[qtype]
    got = pack_gguf_rows(parts, silu_mul, lib)
    assert got is not None and torch.equal(got, _expected(parts, silu_mul))


@pytest.mark.parametrize("qtype", list(PACKED), ids=[t.name for t in PACKED])
def test_a_share_of_whole_blocks_along_k(lib: KernelLibrary, qtype: T) -> None:
    """A row-parallel rank's columns: whole blocks (K-quants: whole super-blocks) stay rows of
    the file; a K-quant cut inside a super-block is unpacked as QuantizedWeight cuts it (Q4_K to
    q4f, Q6_K to q8)."""
    (rows,) = _file(qtype, [20], 1024, seed=2)
    share = rows.select_blocks(16, 32)
    assert isinstance(share, GGUFRows) and share.k == 512
    assert torch.equal(lib.pack_gguf(share.format, share.source, _padded(share.offsets), 512), qf.pack(share.weight()))
    assert torch.equal(share.dequantize(), rows.dequantize()[:, 512:1024])
    if qtype in (T.Q4_K, T.Q6_K):
        inside = rows.select_blocks(4, 32)
        assert not isinstance(inside, GGUFRows)
        expected = rows.dequantize()[:, 128:1024]
        if qtype == T.Q4_K:  # exact: q4f's float32 scales
            assert inside.format == "q4f" and torch.equal(inside.dequantize(), expected)
        else:  # q6k's d is one a super-block: re-quantized to int8 blocks
            assert inside.format == "q8"
            torch.testing.assert_close(inside.dequantize(), expected, rtol=0, atol=float(expected.abs().max()) / 100)


def _padded(offsets: torch.Tensor) -> torch.Tensor:
    out = torch.full((-(-offsets.numel() // 16) * 16,), -1, dtype=torch.int64)
    out[: offsets.numel()] = offsets
    return out


def test_parts_the_kernel_does_not_take_together_are_left_to_the_caller(lib: KernelLibrary) -> None:
    """Parts of two types, or of two files, or of a type packed through unpacked codes (Q5_K):
    no packed result, so the linear unpacks them (and finds a common format)."""
    (q4k,) = _file(T.Q4_K, [16], 512)
    (q6k,) = _file(T.Q6_K, [16], 512)
    (other_file,) = _file(T.Q4_K, [16], 512, seed=3)
    (q5k,) = _file(T.Q5_K, [16], 512)
    assert pack_gguf_rows([q4k, q6k], False, lib) is None
    assert pack_gguf_rows([q4k, other_file], False, lib) is None
    assert pack_gguf_rows([q5k], False, lib) is None


def test_offsets_outside_the_source_are_refused(lib: KernelLibrary) -> None:
    (rows,) = _file(T.Q4_0, [16], 64)
    offsets = rows.offsets.clone()
    offsets[3] = rows.source.nbytes - 10  # the row's 36 bytes would run past the end
    with pytest.raises(ValueError, match="outside the source"):
        lib.pack_gguf("q4s", rows.source, offsets, 64)
    with pytest.raises(ValueError, match="outside the source"):
        lib.pack_gguf("q4s", rows.source, torch.full((16,), -2, dtype=torch.int64), 64)
    with pytest.raises(ValueError, match="whole blocks"):
        lib.pack_gguf("q4k", rows.source, rows.offsets, 64)
    with pytest.raises(ValueError, match="read straight into"):
        lib.pack_gguf("q5f", rows.source, rows.offsets, 64)


@pytest.mark.parametrize("qtype", list(PACKED), ids=[t.name for t in PACKED])
def test_rows_dequantized_as_gguf_py_does(lib: KernelLibrary, qtype: T) -> None:
    """An embedding's looked-up rows, dequantized straight from the file: gguf-py's values bit
    for bit (its float32 operations in its order), rows in any order and repeated."""
    (rows,) = _file(qtype, [12], 512, seed=5)
    ids = torch.tensor([3, 0, 11, 3, 7])
    got = lib.dequant_gguf_rows(rows.format, rows.source, rows.offsets[ids], 512)
    assert torch.equal(got, torch.from_numpy(dequantize(rows.raw(), qtype))[ids])
    with pytest.raises(ValueError, match="outside the source"):
        lib.dequant_gguf_rows(rows.format, rows.source, torch.tensor([-1]), 512)


def test_a_linear_of_two_formats_keeps_both(lib: KernelLibrary) -> None:
    """q and k in Q4_K next to a v in Q6_K (llama.cpp's Q4_K_M): two packed parts at the file's
    bits, whose outputs are each part's own product, side by side (no re-quantization)."""
    from pagellm.model.quant_linear import QuantizedLinear

    q, k, v = _file(T.Q4_K, [32, 16], 512, seed=6) + _file(T.Q6_K, [16], 512, seed=7)
    linear = QuantizedLinear(512, 64, False, lib)
    for start, part in ((0, q), (32, k), (48, v)):
        linear.load_rows(slice(start, start + part.rows), part)
    assert linear.format == "q4k+q6k" and [p.rows for p in linear.parts] == [48, 16]
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(8))
    expected = torch.cat([lib.gemm_q(x, qf.pack(qf.concat_rows([q.weight(), k.weight()])), "q4k", 48),
                          lib.gemm_q(x, qf.pack(v.weight()), "q6k", 16)], dim=1)  # fmt: skip
    assert torch.equal(linear(x), expected)


def test_released_rows_read_again_from_the_file(tmp_path, lib: KernelLibrary) -> None:
    """Packed rows leave this process's memory (the file mapping's pages dropped) and read the
    same again later; a source that is not a read-only file mapping is never touched."""
    (rows,) = _file(T.Q4_0, [64], 2048, seed=9)
    before = rows.weight().dequantize()
    rows.release()  # plain memory: left as it is
    assert torch.equal(rows.weight().dequantize(), before)
    path = tmp_path / "rows.bin"
    rows.source.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    in_file = GGUFRows(mapped, rows.qtype, rows.k, rows.offsets)
    packed = pack_gguf_rows([in_file], False, lib)
    in_file.release()
    assert torch.equal(in_file.weight().dequantize(), before)
    assert packed is not None and torch.equal(packed, pack_gguf_rows([in_file], False, lib))


def test_gemm_q_writes_only_into_an_output_of_its_shape(lib: KernelLibrary) -> None:
    """``out=``: a column slice of a wider tensor is written in place; a wrong dtype, shape or
    column stride is refused before the kernel runs."""
    weight = qf.random_weight("q8", 16, 64, torch.Generator().manual_seed(10))
    packed, x = qf.pack(weight), torch.randn(2, 64, generator=torch.Generator().manual_seed(11))
    wide = torch.zeros(2, 40)
    lib.gemm_q(x, packed, "q8", 16, out=wide[:, 8:24])
    assert torch.equal(wide[:, 8:24], lib.gemm_q(x, packed, "q8", 16)) and not wide[:, :8].any() and not wide[:, 24:].any()
    for bad in (torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(2, 17), torch.zeros(16, 2).T, torch.zeros(3, 16)):
        with pytest.raises(ValueError, match="out must be"):
            lib.gemm_q(x, packed, "q8", 16, out=bad)
