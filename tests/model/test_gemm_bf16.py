"""pagellm's bf16 GEMM (kernels.gemm_bf16) and the linear layers built on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagellm import kernels
from pagellm.config import KernelConfig
from pagellm.kernels.isa import usable_cpu_flags
from pagellm.model.cpu_linear import (
    KernelLinear,
    KernelSiluAndMulLinear,
    PackedLinear,
    PackedSiluAndMulLinear,
    fuse_silu_and_mul,
    pack_linear_layers,
)
from pagellm.worker.kernel_plan import bf16_gemm_path

KERNELS = kernels.default()  # this machine's kernel library (None: no compiler)
GEMM_BF16 = KERNELS is not None and KERNELS.gemm_bf16_available
GEMM_AMX = KERNELS is not None and KERNELS.gemm_amx_available

pytestmark = pytest.mark.skipif(not GEMM_BF16, reason="needs the AVX-512 BF16 kernel build")

BF16_ULP = 2.0**-7  # spacing of bfloat16 values relative to their binade

# Both paths of the kernel: AVX-512 BF16 dot products, and AMX tiles where this CPU has them.
ISAS = [
    pytest.param(False, id="avx512"),
    pytest.param(True, id="amx", marks=pytest.mark.skipif(not GEMM_AMX, reason="no AMX here")),
]


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _assert_rounded_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` is x @ w.T computed in float32 and rounded once: within half a bf16 step of the
    exact product plus float32 summation error (a lost or doubled term is far outside)."""
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    bound = exact.abs() * BF16_ULP / 2 + magnitude * x.shape[1] * 2.0**-24 + 1e-30
    excess = ((got.double() - exact).abs() - bound).max()
    assert excess <= 0, f"error exceeds the rounding bound by {float(excess)}"


@pytest.mark.parametrize("amx", ISAS)
@pytest.mark.parametrize("m", [1, 5, 8, 9, 16, 17, 64, 131])
@pytest.mark.parametrize("k,n", [(2, 1), (64, 47), (64, 48), (96, 49), (576, 960), (1536, 100)])
def test_gemm_matches_the_exact_product(m, k, n, amx):
    x, w = _rand(m, k, seed=m * 7 + k), _rand(n, k, seed=n)
    if amx and k % kernels.GEMM_AMX_K_MULTIPLE:
        with pytest.raises(ValueError, match="multiple of 32"):
            KERNELS.gemm_bf16(x, kernels.pack_gemm_weight(w, amx=True), n, amx=True)
        return
    got = KERNELS.gemm_bf16(x, kernels.pack_gemm_weight(w, amx), n, amx=amx)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    _assert_rounded_product(got, x, w)
    # oneDNN sums in the same precision: the two agree except where float32 sums in another
    # order round to the other side of a bf16 step.
    assert (got == F.linear(x, w)).float().mean() >= 0.99


@pytest.mark.parametrize("amx", ISAS)
def test_gemm_reads_strided_rows_and_leaves_no_stale_columns(amx):
    big = _rand(20, 200, seed=3)
    x = big[:, 10:138]  # row stride 200, 128 columns; 20 rows = one AMX tile of 16 and 4 more
    w = _rand(50, 128, seed=4)  # 50 = one full 48-column panel + 2 columns of a padded one
    got = KERNELS.gemm_bf16(x, kernels.pack_gemm_weight(w, amx), 50, amx=amx)
    _assert_rounded_product(got, x, w)
    assert torch.equal(KERNELS.gemm_bf16(x.contiguous(), kernels.pack_gemm_weight(w, amx), 50, amx=amx), got)


@pytest.mark.parametrize("amx", ISAS)
def test_gemm_with_no_rows(amx):
    w = kernels.pack_gemm_weight(_rand(8, 64, seed=0), amx)
    out = KERNELS.gemm_bf16(torch.empty(0, 64, dtype=torch.bfloat16), w, 8, amx=amx)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("m,k,n", [(700, 576, 100), (300, 1536, 49), (150, 4160, 290)])
def test_amx_takes_rows_in_chunks_and_agrees_with_dot_products(m, k, n):
    """Enough rows for several of the AMX path's L2-sized chunks of A, the last one ragged (at
    k = 4160: k in two blocks, panels in groups, the last group ragged)."""
    if not GEMM_AMX:
        pytest.skip("no AMX here")
    x, w = _rand(m, k, seed=m), _rand(n, k, seed=k)
    got = KERNELS.gemm_bf16(x, kernels.pack_gemm_weight(w, amx=True), n, amx=True)
    _assert_rounded_product(got, x, w)
    assert (got == KERNELS.gemm_bf16(x, kernels.pack_gemm_weight(w), n)).float().mean() >= 0.99


@pytest.mark.parametrize("amx", ISAS)
@pytest.mark.parametrize("m,n,epilogue", [(9, 100, "none"), (700, 160, "none"), (40, 70, "silu_mul")])
def test_any_thread_count_gives_the_same_bits(m, n, epilogue, amx):
    """Threads take their own items, then steal others': with 1 to 5 threads (more than items,
    for some) every output is computed exactly once, and the same way."""
    k = 576
    x = _rand(m, k, seed=3)
    if epilogue == "none":
        packed = kernels.pack_gemm_weight(_rand(n, k, seed=4), amx)
    else:
        packed = kernels.pack_silu_mul_weight(_rand(n, k, seed=4), _rand(n, k, seed=5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = KERNELS.gemm_bf16(x, packed, n, epilogue, amx)
        for count in (2, 3, 5):
            torch.set_num_threads(count)
            assert torch.equal(KERNELS.gemm_bf16(x, packed, n, epilogue, amx), expected), count
    finally:
        torch.set_num_threads(threads)


def _unfused_silu_mul(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, amx: bool = False) -> torch.Tensor:
    """HF's bf16 chain on the same matmul outputs: silu(x @ gate.T) * (x @ up.T)."""
    g = KERNELS.gemm_bf16(x, kernels.pack_gemm_weight(gate, amx), gate.shape[0], amx=amx)
    u = KERNELS.gemm_bf16(x, kernels.pack_gemm_weight(up, amx), up.shape[0], amx=amx)
    return F.silu(g) * u


@pytest.mark.parametrize("amx", ISAS)
@pytest.mark.parametrize("m,k,inter", [(1, 64, 32), (7, 64, 40), (64, 576, 1536), (13, 128, 33), (37, 576, 70)])
def test_silu_mul_epilogue_rounds_like_the_unfused_ops(m, k, inter, amx):
    x = _rand(m, k, seed=m)
    gate, up = _rand(inter, k, seed=1, scale=0.5), _rand(inter, k, seed=2, scale=0.5)
    got = KERNELS.gemm_bf16(x, kernels.pack_silu_mul_weight(gate, up), inter, epilogue="silu_mul", amx=amx)
    expected = _unfused_silu_mul(x, gate, up, amx)
    assert got.shape == (m, inter)
    # Our exp and torch's differ in the last float32 bits, which moves a rare bf16 rounding.
    assert (got == expected).float().mean() >= 0.999
    assert ((got.float() - expected.float()).abs() <= expected.float().abs() * BF16_ULP + 1e-30).all()


@pytest.mark.parametrize("amx", ISAS)
def test_silu_mul_saturates_for_large_gates(amx):
    k = 64
    x = torch.ones(2, k, dtype=torch.bfloat16)
    x[1] = -1
    gate = torch.full((32, k), 4.0, dtype=torch.bfloat16)  # gate = +-256: exp(-+256) over/underflows
    up = torch.full((32, k), 0.5, dtype=torch.bfloat16)
    got = KERNELS.gemm_bf16(x, kernels.pack_silu_mul_weight(gate, up), 32, epilogue="silu_mul", amx=amx).float()
    assert torch.equal(got[0], torch.full((32,), 256.0 * 32.0))  # silu(256) = 256, times up = 32
    assert got[1].abs().max() == 0  # silu(-256) = -0.0 to bf16, times up = -32


BAD_CALLS = {
    "float32 x": lambda x, p: KERNELS.gemm_bf16(x.float(), p, 48),
    "odd columns": lambda x, p: KERNELS.gemm_bf16(x[:, :63], p, 48),
    "wrong width": lambda x, p: KERNELS.gemm_bf16(x, p, 100),
    "unknown epilogue": lambda x, p: KERNELS.gemm_bf16(x, p, 48, epilogue="gelu"),
    "silu weight for plain": lambda x, p: KERNELS.gemm_bf16(x, kernels.pack_silu_mul_weight(_rand(32, 64, seed=0), _rand(32, 64, seed=1)), 48),
    "3-D x": lambda x, p: KERNELS.gemm_bf16(x[None], p, 48),
    "column-strided x": lambda x, p: KERNELS.gemm_bf16(_rand(64, 3, seed=0).T, p, 48),
    "dot-product panels on the amx path": lambda x, p: KERNELS.gemm_bf16(x, p, 48, amx=True),
    "amx with k not a multiple of 32": lambda x, p: KERNELS.gemm_bf16(
        x[:, :48], kernels.pack_gemm_weight(_rand(48, 48, seed=1), amx=True), 48, amx=True
    ),
}


@pytest.mark.parametrize("call", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_bad_calls_raise(call):
    x, packed = _rand(3, 64, seed=0), kernels.pack_gemm_weight(_rand(48, 64, seed=1))
    with pytest.raises(ValueError):
        BAD_CALLS[call](x, packed)


def test_pack_rejects_odd_inputs_and_mismatched_halves():
    with pytest.raises(ValueError):
        kernels.pack_gemm_weight(_rand(8, 7, seed=0))
    with pytest.raises(ValueError):
        kernels.pack_silu_mul_weight(_rand(8, 8, seed=0), _rand(9, 8, seed=0))


def test_layers_choose_the_kernel_for_bias_free_bf16_linears(cpu_plan):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=True)).to(torch.bfloat16)
    plain = [nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=True)]
    for src, dst in zip(model, plain):
        dst.load_state_dict(src.state_dict())
    assert pack_linear_layers(model, cpu_plan(torch.bfloat16, gemm="pagellm")) == 2
    assert type(model[0]) is KernelLinear and type(model[1]) is PackedLinear  # oneDNN keeps the bias case
    assert model[0].path == ("amx" if GEMM_AMX else "avx512-bf16")
    x = _rand(2, 5, 64, seed=9)  # a 3-D input is flattened and reshaped back
    with torch.no_grad():
        got = model[0](x)
        assert got.shape == (2, 5, 96)
        _assert_rounded_product(got.reshape(10, 96), x.reshape(10, 64), plain[0].weight.to(torch.bfloat16))


def test_fused_mlp_uses_the_kernel_and_matches_the_unfused_chain(cpu_plan):
    gate_up = nn.Linear(64, 2 * 40, bias=False).to(torch.bfloat16)
    fused = fuse_silu_and_mul(gate_up, 40, cpu_plan(torch.bfloat16, gemm="pagellm"))
    assert type(fused) is KernelSiluAndMulLinear and fused.path == ("amx" if GEMM_AMX else "avx512-bf16")
    x = _rand(6, 64, seed=5)
    with torch.no_grad():
        got = fused(x)
    w = gate_up.weight.detach()
    expected = _unfused_silu_mul(x, w[:40], w[40:])
    assert (got == expected).float().mean() >= 0.999
    assert ((got.float() - expected.float()).abs() <= expected.float().abs() * BF16_ULP + 1e-30).all()


def test_gemm_choice_follows_the_cpu_and_the_override(cpu_plan):
    amx = GEMM_AMX
    flags = usable_cpu_flags()
    assert bf16_gemm_path("onednn", KERNELS, flags) == "onednn"
    assert bf16_gemm_path("torch", KERNELS, flags) == "torch"
    assert bf16_gemm_path("pagellm", KERNELS, flags) == ("amx" if amx else "avx512-bf16")
    # A CPU with AMX that the kernels cannot use is left to oneDNN, which can.
    assert bf16_gemm_path("auto", KERNELS, flags) == ("amx" if amx else "onednn" if "amx_bf16" in flags else "avx512-bf16")
    with pytest.raises(ValueError, match="gemm must be one of"):
        KernelConfig(gemm="mkl")
    gate_up = nn.Linear(64, 80, bias=False).to(torch.bfloat16)
    onednn = cpu_plan(torch.bfloat16, gemm="onednn")
    assert type(fuse_silu_and_mul(gate_up, 40, onednn)) is PackedSiluAndMulLinear
    model = nn.Sequential(nn.Linear(64, 96, bias=False)).to(torch.bfloat16)
    assert pack_linear_layers(model, onednn) == 1 and type(model[0]) is PackedLinear
