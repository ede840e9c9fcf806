"""pagellm's integer GEMM (``gemm_int8.cpp``): quantized weights (q4: GGUF Q4_0 / Q4_1, q8:
Q8_0 and --quantization int8, q4k: Q4_K, q4f: Q4_K split off its super-blocks, q5f: Q5_0 / Q5_1 /
Q5_K, q6k: Q6_K) times activations quantized per block of 32 (q4k, q6k: a scale per 256).

Each ISA path this CPU can run is built and checked against the plain reference
(``quant_formats``): the activation quantization exactly, the product within float32 rounding of
the float64 reference from the same integers (an off-by-one in any integer product would be
off by ~1e-3 of the output scale, far above the tolerance). Paths this CPU cannot run are built.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagellm.kernels import quant_formats as qf
from pagellm.kernels.build import load_library
from pagellm.kernels.isa import usable_cpu_flags
from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.packing import pack_gemm_weight, pack_silu_mul_weight
from pagellm.model.gguf_blocks import from_gguf_blocks
from tests.helpers.gguf_writer import random_k_quant

# (compiler flags, CPU flags the path needs to run, the path the build reports)
PATHS = [
    (("-march=x86-64-v3",), {"avx2", "fma", "f16c"}, "avx2"),
    (("-march=x86-64-v3", "-mavxvnni"), {"avx2", "fma", "f16c", "avx_vnni"}, "avx-vnni"),
    (("-march=x86-64-v4", "-mavx512vnni"), {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx512-vnni"),
]
SHAPES = [(1, 64, 16), (1, 256, 88), (1, 96, 256), (2, 96, 40), (3, 576, 192), (5, 100, 33), (17, 1536, 48), (0, 64, 16)]
FORMATS = sorted(qf.FORMAT_CODES)


def _library(march: tuple[str, ...]) -> KernelLibrary:
    lib = load_library(march, "test-" + " ".join(march))
    if lib is None:
        pytest.skip("no C++ compiler: the kernels cannot be built")
    return KernelLibrary(lib, march)


@pytest.fixture(scope="module", params=PATHS, ids=[p[2] for p in PATHS])
def path_lib(request) -> KernelLibrary:
    march, needs, name = request.param
    lib = _library(march)
    assert lib.gemm_q_built == name  # built (on any x86 CPU)
    # cpuid (an emulator's CPU, not the host's /proc/cpuinfo) says whether it runs here.
    if lib.gemm_q_path == "none":
        pytest.skip(f"this CPU cannot run the {name} path (built only)")
    if not needs <= usable_cpu_flags("amx"):
        pytest.skip(f"this process may not use the {name} path (ISA cap)")
    return lib


_random_weight = qf.random_weight


def _width(fmt: str, k: int) -> int:
    """``k``, or for q4k and q6k (whole super-blocks of 256 along k) the next multiple of 256."""
    return -(-k // 256) * 256 if fmt in qf.SUPER_FORMATS else k


@pytest.mark.parametrize("super_scale", [False, True], ids=["per-32", "per-256"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_is_exact(path_lib: KernelLibrary, dtype: torch.dtype, super_scale: bool) -> None:
    """Per block of 32, or (q4k's) one scale per super-block of 256 over all its blocks, a tail
    group short."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 600, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1)).to(dtype)
    x[3] = 0  # all-zero blocks: scale 0, codes 0
    x[4, :4] = torch.tensor([127.0, 2.5, 3.5, -2.5])  # scale 1: ties round to even
    x[4, 4:256] = x[4, 4:256].clamp(-100, 100)  # (the super-block's largest magnitude stays 127)
    got = path_lib.quantize_rows(x, super_scale)
    assert got[0][4, 1:4].tolist() == [2, 4, -2]
    expected = qf.quantize_activations(x, super_scale)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert int(got[0].abs().max()) == 127
    scales = got[1][:, :16].reshape(7, 2, 8)  # two super-blocks' blocks
    assert bool((scales == scales[..., :1]).all()) == super_scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("super_scale", [False, True], ids=["per-32", "per-256"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vectorized_activation_quantization_equals_the_scalar_loop(dtype: torch.dtype, super_scale: bool) -> None:
    """The AVX2 quantization (every path's) against the scalar loop of a build without AVX2,
    bit for bit, on the awkward values: NaN, infinities, denormals, ties, zeros, a tail block."""
    scalar, vector = _library(("-march=x86-64-v2",)), _library(PATHS[0][0])
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 300, generator=g) * torch.logspace(-40, 30, 8).unsqueeze(1)  # denormal rows first
    x[2, 5], x[3, 40], x[4, 270] = float("nan"), float("inf"), float("-inf")
    x[5, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: ties
    x[6] = 0.0
    x = x.to(dtype)
    for a, b in zip(scalar.quantize_rows(x, super_scale), vector.quantize_rows(x, super_scale)):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))  # codes, scales (NaN bits too), sums
    scales = scalar.quantize_rows(x, super_scale)[1]
    assert bool(scales[2].isnan().any()) and bool(scales[3:5].isinf().any(dim=1).all())  # NaN and infinity rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gemm_equals_reference(path_lib: KernelLibrary, fmt: str, m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    k = _width(fmt, k)
    weight = _random_weight(fmt, n, k, g)
    packed = qf.pack(weight)
    x = torch.randn(m, k, generator=g)
    got = path_lib.gemm_q(x, packed, fmt, n)
    assert got.shape == (m, n) and got.dtype == torch.float32
    expected = qf.reference_gemm(x, weight)
    if m == 0:
        assert path_lib.gemm_q(x.bfloat16(), packed, fmt, n).shape == (0, n)
        return
    scale = float(expected.abs().max())
    assert float((got.double() - expected).abs().max()) <= 2e-6 * scale
    bf16 = path_lib.gemm_q(x.bfloat16(), packed, fmt, n)
    assert bf16.dtype == torch.bfloat16
    expected_bf16 = qf.reference_gemm(x.bfloat16(), weight).float()
    torch.testing.assert_close(bf16.float(), expected_bf16, rtol=1e-2, atol=1e-2 * scale)
    if m > 1:  # a row's result does not depend on the batch it came in
        assert torch.equal(path_lib.gemm_q(x[-1:], packed, fmt, n), got[-1:])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [8, 20, 48])
def test_silu_mul_epilogue(path_lib: KernelLibrary, fmt: str, n: int) -> None:
    """silu(gate) * up from one product over a [gate; up] weight, ragged n included."""
    g = torch.Generator().manual_seed(n)
    k = _width(fmt, 96)
    gate_up = _random_weight(fmt, 2 * n, k, g)
    x = torch.randn(5, k, generator=g)
    got = path_lib.gemm_q(x, qf.pack_silu_mul(gate_up), fmt, n, "silu_mul")
    both = qf.reference_gemm(x, gate_up)
    expected = torch.nn.functional.silu(both[:, :n]) * both[:, n:]
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    assert torch.equal(path_lib.gemm_q(x[:1], qf.pack_silu_mul(gate_up), fmt, n, "silu_mul"), got[:1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_big_batches_over_two_chunks(path_lib: KernelLibrary, fmt: str) -> None:
    """Batches over two chunks of rows (128, the fewest a chunk holds, then 5-7: row tails of 1, 2
    and 3 after the 4-row tiles), a ragged number of columns (a pair of tiles and a lone one),
    plain and silu_mul, bf16 out: every row equals its reference and its own result alone. q5f and
    q6k unpack each work item's codes once there (AVX-512: gemm_int8_unpacked.h), and the one-row
    path rebuilds them in registers."""
    g = torch.Generator().manual_seed(11)
    k = _width(fmt, 2048)
    weight = _random_weight(fmt, 40, k, g)
    x = torch.randn(135, k, generator=g)
    both = qf.reference_gemm(x, weight)
    for packed, n, epilogue in ((qf.pack(weight), 40, "none"), (qf.pack_silu_mul(weight), 20, "silu_mul")):
        expected = both if epilogue == "none" else torch.nn.functional.silu(both[:, :n]) * both[:, n:]
        for m in (133, 134, 135):
            got = path_lib.gemm_q(x[:m], packed, fmt, n, epilogue)
            torch.testing.assert_close(got.double(), expected[:m], rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
            for row in (0, 7, 127, *range(128, m)):
                assert torch.equal(path_lib.gemm_q(x[row : row + 1], packed, fmt, n, epilogue), got[row : row + 1])
        in_bf16 = path_lib.gemm_q(x.bfloat16(), packed, fmt, n, epilogue)
        for row in (0, 130, 134):
            assert torch.equal(path_lib.gemm_q(x[row : row + 1].bfloat16(), packed, fmt, n, epilogue), in_bf16[row : row + 1])


def test_extreme_codes_do_not_saturate(path_lib: KernelLibrary) -> None:
    """The AVX2 path's int16 sums at their bounds: q4 codes all 15, q5f 31, q6k 63 (under int8
    sub-scales -128 and 127), q8 codes -128 / 127, against activations all +-127 (every block's
    amax repeated), mixed signs and all of one sign (a q4 block's 32 products then sum to
    16 * 15 * 127 in each int16 lane; a q6k group's 8 to 8 * 63 * 127)."""
    k, n = 256, 32  # (q6k: one super-block)
    x = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0).repeat(5, 1) * torch.tensor([[1.0], [-1.0], [2.0], [0], [0]])
    x[3], x[4] = 1.0, -3.0
    x = torch.cat([x, x])  # 10 rows: q5f and q6k unpack their codes first (test_big_batches_over_two_chunks)
    blocks = k // qf.BLOCK
    scale = torch.full((n, blocks), 0.01).half()
    q4 = qf.QuantizedWeight("q4", k, torch.full((n, k), 15, dtype=torch.uint8), scale, torch.zeros(n, blocks).half())
    q8_codes = torch.where(torch.arange(n * k).view(n, k) % 2 == 0, -128, 127).to(torch.int8)
    q8 = qf.QuantizedWeight("q8", k, q8_codes, scale)
    q5f = qf.QuantizedWeight("q5f", k, torch.full((n, k), 31, dtype=torch.uint8), scale.float(), scale.float() * 0)
    sub = torch.where(torch.arange(2 * blocks) % 2 == 0, -128, 127).to(torch.int8).repeat(n, 1)
    q6k = qf.QuantizedWeight("q6k", k, torch.full((n, k), 63, dtype=torch.uint8), scale, sub_scale=sub)
    q6k_low = qf.QuantizedWeight("q6k", k, torch.zeros(n, k, dtype=torch.uint8), scale, sub_scale=sub)
    q4s_high = qf.QuantizedWeight("q4s", k, torch.full((n, k), 15, dtype=torch.uint8), scale)
    q4s_low = qf.QuantizedWeight("q4s", k, torch.zeros(n, k, dtype=torch.uint8), scale)
    for fmt, weight in (("q4", q4), ("q8", q8), ("q5f", q5f), ("q6k", q6k), ("q6k", q6k_low), ("q4s", q4s_high),
                        ("q4s", q4s_low)):  # fmt: skip
        expected = qf.reference_gemm(x, weight)
        got = path_lib.gemm_q(x, qf.pack(weight), fmt, n)
        torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


def test_nan_activations_give_nan_rows(path_lib: KernelLibrary) -> None:
    weight = _random_weight("q4", 16, 64, torch.Generator().manual_seed(6))
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")
    out = path_lib.gemm_q(x, qf.pack(weight), "q4", 16)
    assert bool(out[0].isfinite().all()) and bool(out[1].isnan().all())


def test_paths_agree_bit_for_bit() -> None:
    """Every runnable path sums the same integers and applies one epilogue: equal outputs."""
    libraries = [_library(march) for march, needs, _ in PATHS if needs <= usable_cpu_flags("amx")]
    runnable = [lib for lib in libraries if lib.gemm_q_path != "none"]
    g = torch.Generator().manual_seed(3)
    for fmt in FORMATS:
        k = _width(fmt, 320)
        weight = _random_weight(fmt, 80, k, g)
        packed = qf.pack(weight)
        x = torch.randn(9, k, generator=g)
        outputs = [lib.gemm_q(x, packed, fmt, 80) for lib in runnable]
        assert all(torch.equal(outputs[0], out) for out in outputs[1:])


@pytest.fixture(scope="module")
def amx_lib() -> KernelLibrary:
    """This machine's own build, where it has the integer GEMM on AMX tiles."""
    lib = _library(("-march=native",))
    if not lib.gemm_q_amx_available:
        pytest.skip("no AMX-INT8 tiles this process may use (built where the compiler targets them)")
    return lib


@pytest.mark.parametrize("fmt", sorted(qf.AMX_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 16), (15, 96, 40), (16, 576, 48), (17, 100, 33), (45, 1536, 160)])
def test_amx_tiles_equal_the_dot_products(amx_lib: KernelLibrary, fmt: str, dtype: torch.dtype, m: int, k: int,
                                          n: int) -> None:
    """The same integers and the same fp32 epilogue on AMX tiles: the dot-product path's bits, for
    row counts around the 16-row tile, ragged k and n, plain and silu_mul."""
    g = torch.Generator().manual_seed(m * 7 + k + n)
    k = _width(fmt, k)
    x = torch.randn(m, k, generator=g).to(dtype)
    plain = qf.pack(_random_weight(fmt, n, k, g))
    assert torch.equal(amx_lib.gemm_q(x, plain, fmt, n, tiles="int8"), amx_lib.gemm_q(x, plain, fmt, n))
    fused = qf.pack_silu_mul(_random_weight(fmt, 2 * n, k, g))
    expected = amx_lib.gemm_q(x, fused, fmt, n, "silu_mul")
    assert torch.equal(amx_lib.gemm_q(x, fused, fmt, n, "silu_mul", tiles="int8"), expected)


def test_amx_tiles_are_refused_where_the_build_has_none() -> None:
    lib = _library(PATHS[0][0])  # x86-64-v3: no AMX in the build, and it runs on any AVX2 CPU
    if lib.gemm_q_path == "none":
        pytest.skip("this CPU cannot run the AVX2 path")
    assert not lib.gemm_q_amx_available
    weight = _random_weight("q4", 16, 64, torch.Generator().manual_seed(8))
    with pytest.raises(RuntimeError, match="AMX"):
        lib.gemm_q(torch.randn(2, 64), qf.pack(weight), "q4", 16, tiles="int8")
    with pytest.raises(RuntimeError, match="AMX"):
        lib.gemm_q(torch.randn(2, 64).bfloat16(), qf.pack(weight), "q4", 16, tiles="bf16")


@pytest.mark.parametrize("fmt", sorted(set(qf.FORMAT_CODES) - qf.AMX_FORMATS))
def test_amx_tiles_are_refused_for_formats_they_do_not_take(fmt: str) -> None:
    lib = _library(PATHS[0][0])
    k = _width(fmt, 64)
    weight = _random_weight(fmt, 16, k, torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match="AMX-INT8 tiles take"):
        lib.gemm_q(torch.randn(2, k), qf.pack(weight), fmt, 16, tiles="int8")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", [(1, 64, 16), (15, 96, 40), (16, 576, 48), (33, 256, 33), (45, 1536, 160),
                                   (70, 512, 8), (140, 4352, 300)])  # fmt: skip
def test_bf16_tiles_equal_the_dense_copy(amx_lib: KernelLibrary, fmt: str, m: int, k: int, n: int) -> None:
    """Every format dequantized to bf16 on AMX-BF16 tiles: bit for bit the dense GEMM on AMX
    tiles over ``QuantizedWeight.dequantize()`` rounded to bf16 (the dense copy's weight), for
    row counts around the 16- and 32-row blocks, odd column tiles, plain and silu_mul. At k =
    4352 the dense GEMM splits k into blocks, C tiles stored between them (two chunks of rows,
    the second ragged; a ragged group of panels): the same float32 sums as unsplit tiles."""
    g = torch.Generator().manual_seed(m * 5 + k + n)
    k = _width(fmt, k)
    x = torch.randn(m, k, generator=g).bfloat16()
    weight = _random_weight(fmt, n, k, g)
    dense = weight.dequantize().bfloat16()
    expected = amx_lib.gemm_bf16(x, pack_gemm_weight(dense, amx=True), n, amx=True)
    assert torch.equal(amx_lib.gemm_q(x, qf.pack(weight), fmt, n, tiles="bf16"), expected)
    gate_up = _random_weight(fmt, 2 * n, k, g)
    dense = gate_up.dequantize().bfloat16()
    expected = amx_lib.gemm_bf16(x, pack_silu_mul_weight(dense[:n], dense[n:]), n, "silu_mul", amx=True)
    assert torch.equal(amx_lib.gemm_q(x, qf.pack_silu_mul(gate_up), fmt, n, "silu_mul", tiles="bf16"), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_packed_weight_is_the_dense_copy(amx_lib: KernelLibrary, fmt: str) -> None:
    """``dequant_packed`` (the dense copy's weight, from the packed records): ``dequantize()``
    rounded to bf16, bit for bit, in the dense AMX GEMM's packed panels, ragged last tiles and panels
    included."""
    g = torch.Generator().manual_seed(11)
    k = _width(fmt, 96)
    weight = _random_weight(fmt, 40, k, g)
    dense = weight.dequantize().bfloat16()
    panels = amx_lib.dequant_packed(qf.pack(weight), fmt, 40, k)  # [panels, k / 2, 32, 2]
    assert torch.equal(panels.transpose(1, 2).reshape(-1, k)[:40], dense)
    assert torch.equal(panels, pack_gemm_weight(dense, amx=True))  # the dense GEMM's panels, zero padding too
    fused = amx_lib.dequant_packed(qf.pack_silu_mul(weight), fmt, 20, k, silu_mul=True)  # from tiles of 8 + 8
    assert torch.equal(fused, pack_silu_mul_weight(dense[:20], dense[20:]))
    with pytest.raises(ValueError, match="packed must be a contiguous uint8"):
        amx_lib.dequant_packed(qf.pack(weight), fmt, 40, k, silu_mul=True)  # a plain weight's records


def test_bf16_tiles_take_bf16_rows_of_whole_blocks(amx_lib: KernelLibrary) -> None:
    packed = qf.pack(_random_weight("q4", 16, 64, torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match="AMX-BF16 tiles take bf16"):
        amx_lib.gemm_q(torch.randn(2, 64), packed, "q4", 16, tiles="bf16")
    packed = qf.pack(_random_weight("q4", 16, 48, torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match="multiple of 32"):
        amx_lib.gemm_q(torch.randn(2, 48).bfloat16(), packed, "q4", 16, tiles="bf16")
    with pytest.raises(ValueError, match="tiles must be one of"):
        amx_lib.gemm_q(torch.randn(2, 48), packed, "q4", 16, tiles="amx")


LEGACY = {GGMLQuantizationType.Q4_0: "q4s", GGMLQuantizationType.Q4_1: "q4", GGMLQuantizationType.Q8_0: "q8",
          GGMLQuantizationType.Q5_0: "q5f", GGMLQuantizationType.Q5_1: "q5f"}  # fmt: skip


@pytest.mark.parametrize("qtype", list(LEGACY), ids=[t.name for t in LEGACY])
def test_gguf_blocks_mean_what_gguf_says(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((24, 96)).astype(np.float32)
    raw = quantize(dense, qtype)
    weight = from_gguf_blocks(raw, qtype, 96)
    assert weight.format == LEGACY[qtype]
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(raw, qtype)))
    permutation = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    assert torch.equal(weight.select_rows(permutation).dequantize(), weight.dequantize()[permutation])


K_QUANTS = {GGMLQuantizationType.Q4_K: "q4k", GGMLQuantizationType.Q5_K: "q5f", GGMLQuantizationType.Q6_K: "q6k"}


@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=[t.name for t in K_QUANTS])
def test_k_quant_blocks_mean_what_gguf_says(qtype: GGMLQuantizationType) -> None:
    """Q4_K, Q5_K and Q6_K kept in their own formats: exactly gguf-py's dequantization, and the
    kernel's product equals the reference on them."""
    raw = random_k_quant(qtype, 24, 512, np.random.default_rng(1))
    weight = from_gguf_blocks(raw, qtype, 512)
    assert weight.format == K_QUANTS[qtype]
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(raw, qtype)))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    expected = qf.reference_gemm(x, weight)
    torch.testing.assert_close(x.double() @ weight.dequantize().double().T, expected, rtol=0.05, atol=0.05 * float(expected.abs().max()))


def test_mixed_shards_widen_exactly() -> None:
    """q4 next to q4f widens to q4f, next to q5f to q5f, q4s next to q4 to q4 and so on (the same
    weights); q6k next to another format is re-quantized to q8."""
    rng = np.random.default_rng(1)
    q4 = from_gguf_blocks(quantize(rng.standard_normal((8, 512)).astype(np.float32), GGMLQuantizationType.Q4_1),
                          GGMLQuantizationType.Q4_1, 512)  # fmt: skip
    q4s = from_gguf_blocks(quantize(rng.standard_normal((8, 512)).astype(np.float32), GGMLQuantizationType.Q4_0),
                           GGMLQuantizationType.Q4_0, 512)  # fmt: skip
    assert q4s.format == "q4s" and q4s.offset is None
    both = qf.concat_rows(qf.common_format([q4s, q4]))
    assert both.format == "q4" and torch.equal(both.dequantize(), torch.cat([q4s.dequantize(), q4.dequantize()]))
    shards = {fmt: from_gguf_blocks(random_k_quant(qtype, 24, 512, rng), qtype, 512) for qtype, fmt in K_QUANTS.items()}
    # q4k widens to q4f only (then as q4f does): next to q4 -> q4f, next to q5f -> q5f
    widened = {"q4k": "q4f", "q5f": "q5f"}
    for first in (q4, q4s):
        for other, target in widened.items():
            both = qf.concat_rows(qf.common_format([shards[other], first]))
            assert both.format == target
            assert torch.equal(both.dequantize(), torch.cat([shards[other].dequantize(), first.dequantize()]))
    assert qf.concat_rows(qf.common_format([shards["q4k"], shards["q5f"], q4])).format == "q5f"
    assert {p.format for p in qf.common_format([shards["q6k"], q4])} == {"q8"}


def test_q4k_keeps_the_files_bits_and_a_row_its_result(path_lib: KernelLibrary) -> None:
    """Q4_K kept as stored (4.5 bits a weight); every batch size runs the one integer-scale
    kernel, so each row's output is the same alone as in a batch of any size, plain and silu_mul;
    a weight split off its super-blocks (a row-parallel share) widens to q4f exactly."""
    rng = np.random.default_rng(4)
    weight = from_gguf_blocks(random_k_quant(GGMLQuantizationType.Q4_K, 48, 768, rng), GGMLQuantizationType.Q4_K, 768)
    x = torch.from_numpy(rng.standard_normal((9, 768)).astype(np.float32))
    for packed, n, epilogue in ((qf.pack(weight), 48, "none"), (qf.pack_silu_mul(weight), 24, "silu_mul")):
        batch = path_lib.gemm_q(x, packed, "q4k", n, epilogue)
        for rows in (slice(0, 1), slice(3, 5), slice(2, 5), slice(5, 9)):
            assert torch.equal(path_lib.gemm_q(x[rows], packed, "q4k", n, epilogue), batch[rows])
    assert qf.pack(weight).numel() * 8 == 48 * 768 * 4.5  # the file's 4.5 bits a weight (whole tiles here)
    aligned, split = weight.select_blocks(8, 24), weight.select_blocks(4, 24)
    assert aligned.format == "q4k" and split.format == "q4f"
    with pytest.raises(ValueError, match="super-blocks of 256"):  # a width off the super-blocks
        path_lib.gemm_q(torch.zeros(1, 736), qf.pack(weight), "q4k", 48)
    with pytest.raises(ValueError, match="super-blocks of 256"):
        qf.random_weight("q4k", 16, 96)
    assert torch.equal(aligned.dequantize(), weight.dequantize()[:, 256:768])
    assert torch.equal(split.dequantize(), weight.dequantize()[:, 128:768])


def test_q4k_integer_sums_at_their_bounds(path_lib: KernelLibrary) -> None:
    """Codes all 15 with 6-bit scales and mins all 63, against activations all +-127: the largest
    per-block sums (16 * 15 * 127 in each of the AVX2 path's int16 lanes) and super-block sums."""
    k, n = 512, 32
    supers = k // 256
    x = torch.where(torch.arange(k) % 5 == 0, -1.0, 1.0).repeat(3, 1) * torch.tensor([[1.0], [-1.0], [3.0]])
    x[2] = 3.0  # all of one sign
    for code in (15, 0):
        weight = qf.QuantizedWeight("q4k", k, torch.full((n, k), code, dtype=torch.uint8), torch.full((n, supers), 0.01).half(),
                                    torch.full((n, supers), 0.02).half(), torch.full((n, supers * 12), 0xFF, dtype=torch.uint8))  # fmt: skip
        assert bool((qf.k_scales_and_mins(weight.sub_scale)[0] == 63).all())
        expected = qf.reference_gemm(x, weight)
        got = path_lib.gemm_q(x, qf.pack(weight), "q4k", n)
        torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


def test_int8_quantization_error_is_bounded() -> None:
    w = torch.randn(64, 200, generator=torch.Generator().manual_seed(4))
    q = qf.quantize_q8(w)
    blocks = torch.nn.functional.pad(w, (0, q.scale.shape[1] * qf.BLOCK - 200)).view(64, -1, qf.BLOCK)
    bound = blocks.abs().amax(-1, keepdim=True) / 127 * 0.5 * 1.01  # half a step (fp16 scale rounding)
    err = (q.dequantize() - w).abs()
    padded = torch.nn.functional.pad(err, (0, q.scale.shape[1] * qf.BLOCK - 200)).view(64, -1, qf.BLOCK)
    assert bool((padded <= bound).all())


def test_wrapper_refuses_bad_calls() -> None:
    lib = _library(PATHS[0][0])
    weight = _random_weight("q4", 32, 64, torch.Generator().manual_seed(5))
    packed = qf.pack(weight)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="format"):
        lib.gemm_q(x, packed, "q5", 32)
    with pytest.raises(ValueError, match="epilogue"):
        lib.gemm_q(x, packed, "q4", 32, "gelu")
    with pytest.raises(ValueError, match="shape"):
        lib.gemm_q(x, packed, "q4", 32, "silu_mul")  # a plain layout has half the tiles
    with pytest.raises(ValueError, match="shape"):
        lib.gemm_q(x, packed, "q8", 32)  # a q4 record is not a q8 one
    with pytest.raises(ValueError, match="shape"):
        lib.gemm_q(torch.randn(2, 96), packed, "q4", 32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        lib.gemm_q(x.half(), packed, "q4", 32)
    with pytest.raises(ValueError, match="contiguous"):
        lib.gemm_q(torch.randn(64, 2).t(), packed, "q4", 32)
