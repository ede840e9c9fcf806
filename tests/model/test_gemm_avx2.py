"""pagellm's AVX2 GEMM (``gemm_avx2.cpp``), float32 or bf16 weights widened to float32, and the
linear layers built on it. The x86-64-v3 build is loaded next to this machine's own (isa
"avx2"), so an AVX-512 or AMX machine tests what an AVX2-only CPU runs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagellm import kernels
from pagellm.config import KernelConfig
from pagellm.kernels.isa import usable_cpu_flags
from pagellm.kernels.packing import avx2_packed_shape
from pagellm.model.cpu_linear import KernelLinear, KernelSiluAndMulLinear, fuse_silu_and_mul, pack_linear_layers

AVX2 = kernels.load(KernelConfig(isa="avx2")) if {"avx2", "fma"} <= usable_cpu_flags() else None
pytestmark = pytest.mark.skipif(AVX2 is None, reason="this CPU cannot run the AVX2 build (or no compiler)")

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["f32", "bf16"]


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding step at |x| (float64)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0**-126))) - 7)


def _assert_product(got: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` is a @ w.T summed in float32 (any order): within 1e-5 of the magnitude of the sum
    for a float32 output, one bf16 step of the rounded result beyond that for bf16."""
    exact = a.double() @ w.double().T
    bound = 1e-5 * (a.double().abs() @ w.double().abs().T) + 1e-30
    if got.dtype == torch.bfloat16:
        bound = bound + _bf16_step(exact)
    excess = ((got.double() - exact).abs() - bound).max()
    assert excess <= 0, f"error exceeds the bound by {float(excess)}"


@pytest.mark.parametrize("a_dtype", DTYPES, ids=[f"a-{i}" for i in IDS])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=[f"w-{i}" for i in IDS])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (2, 64, 7), (3, 98, 33), (7, 576, 100), (33, 1536, 48), (130, 64, 1)])
def test_plain_product_matches_float64(m, k, n, w_dtype, a_dtype):
    a = _rand(m, k, seed=m).to(a_dtype)
    w = _rand(n, k, seed=n, scale=1 / math.sqrt(k)).to(w_dtype)
    packed = kernels.pack_avx2_weight(w)
    assert tuple(packed.shape) == avx2_packed_shape(n, k, w_dtype)
    got = AVX2.gemm_avx2(a, packed, n)
    assert got.dtype == a_dtype and got.shape == (m, n)
    _assert_product(got, a, w)
    # One chain of FMAs in k order per output, whatever the tile: a row is the same alone.
    assert torch.equal(AVX2.gemm_avx2(a[-1:], packed, n), got[-1:])


@pytest.mark.parametrize("a_dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("m", [1, 5, 64])
def test_silu_mul_epilogue_matches_the_unfused_chain(m, a_dtype):
    k, n = 64, 40
    a = _rand(m, k, seed=3).to(a_dtype)
    gate, up = _rand(n, k, seed=4, scale=0.4).to(torch.bfloat16), _rand(n, k, seed=5, scale=0.2).to(torch.bfloat16)
    got = AVX2.gemm_avx2(a, kernels.pack_avx2_silu_mul_weight(gate, up), n, "silu_mul")
    # The epilogue on the kernel's own gate and up products, as the unfused ops in a's dtype.
    g = AVX2.gemm_avx2(a, kernels.pack_avx2_weight(gate), n)
    u = AVX2.gemm_avx2(a, kernels.pack_avx2_weight(up), n)
    expected = F.silu(g) * u if a_dtype == torch.bfloat16 else g / (1 + torch.exp(-g)) * u
    tol = dict(atol=0, rtol=0) if a_dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, expected, **tol)


def test_strided_rows_empty_batch_and_non_finite_values():
    w = _rand(48, 64, seed=1, scale=0.1)
    packed = kernels.pack_avx2_weight(w)
    base = _rand(9, 70, seed=2)
    a = base[:, :64]  # rows 70 apart
    torch.testing.assert_close(AVX2.gemm_avx2(a, packed, 48), AVX2.gemm_avx2(a.contiguous(), packed, 48), atol=0, rtol=0)
    assert AVX2.gemm_avx2(a[:0], packed, 48).shape == (0, 48)
    bad = a.contiguous()
    bad[1, 3], bad[2, 5] = float("nan"), float("inf")
    got = AVX2.gemm_avx2(bad, packed, 48)
    assert torch.isnan(got[1]).all() and not torch.isfinite(got[2]).any() and torch.isfinite(got[0]).all()


@pytest.mark.parametrize(
    "case",
    ["wrong packed shape", "odd k for bf16", "float16 x", "non-contiguous row", "unknown epilogue"],
)
def test_bad_calls_raise(case):
    x, w = _rand(3, 64, seed=0), _rand(48, 64, seed=1)
    calls = {
        "wrong packed shape": lambda: AVX2.gemm_avx2(x, kernels.pack_avx2_weight(w), 32),
        "odd k for bf16": lambda: kernels.pack_avx2_weight(_rand(8, 7, seed=0).to(torch.bfloat16)),
        "float16 x": lambda: AVX2.gemm_avx2(x.half(), kernels.pack_avx2_weight(w), 48),
        "non-contiguous row": lambda: AVX2.gemm_avx2(x.t().contiguous().t(), kernels.pack_avx2_weight(w), 48),
        "unknown epilogue": lambda: AVX2.gemm_avx2(x, kernels.pack_avx2_weight(w), 48, "gelu"),
    }
    with pytest.raises(ValueError):
        calls[case]()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_layers_on_the_avx2_path(dtype, cpu_plan):
    plan = cpu_plan(dtype, isa="avx2")
    assert plan.gemm == "avx2" and plan.kernels is AVX2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=True)).to(dtype)
    plain = [nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=True)]
    for src, dst in zip(model, plain):
        dst.load_state_dict(src.state_dict())
    assert pack_linear_layers(model, plan) == 2
    assert all(type(m) is KernelLinear and m.path == "avx2" for m in model)  # the bias is added after
    x = _rand(2, 5, 64, seed=9).to(dtype)  # a 3-D input is flattened and reshaped back
    with torch.no_grad():
        got = model(x)
        expected = plain[1].to(dtype)(plain[0].to(dtype)(x))
    assert got.shape == (2, 5, 64)
    torch.testing.assert_close(got, expected, **({} if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)))
    gate_up = nn.Linear(64, 80, bias=False).to(dtype)
    fused = fuse_silu_and_mul(gate_up, 40, plan)
    assert type(fused) is KernelSiluAndMulLinear and fused.path == "avx2"


def test_only_the_avx2_path_takes_a_bias():
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    with pytest.raises(ValueError, match="takes no bias"):
        KernelLinear(lin, AVX2, "avx512-bf16")
    assert KernelLinear(lin, AVX2, "avx2").bias is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_mul_apart_is_the_fused_epilogue(dtype: torch.dtype) -> None:
    """SiLU-and-mul after a plain gate/up GEMM gives the bits of the GEMM's own silu_mul
    epilogue, and stays near torch's ``F.silu(gate) * up``."""
    torch.manual_seed(1)
    for m, k, d in ((1, 32, 24), (7, 64, 100)):
        x, gate, up = torch.randn(m, k).to(dtype), torch.randn(d, k).to(dtype), torch.randn(d, k).to(dtype)
        both = AVX2.gemm_avx2(x, kernels.pack_avx2_weight(torch.cat((gate, up))), 2 * d)
        apart = AVX2.silu_mul(both)
        fused = AVX2.gemm_avx2(x, kernels.pack_avx2_silu_mul_weight(gate, up), d, "silu_mul")
        torch.testing.assert_close(apart, fused, rtol=0, atol=0)
        g, u = both.chunk(2, dim=-1)
        torch.testing.assert_close(apart.float(), (F.silu(g) * u).float(), rtol=2e-2, atol=1e-5)
    with pytest.raises(ValueError, match="even width"):
        AVX2.silu_mul(torch.zeros(2, 5, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_bias_gelu_tanh_matches_torch(dtype: torch.dtype) -> None:
    """``gelu_tanh(x + bias)`` in place, on this machine's build and the AVX2 one: float32 within
    float32's rounding of torch's, bf16 within one bf16 step (torch rounds the biased sum to bf16
    first; the kernel keeps it in float32); tails of every width, no bias, bad calls refused."""
    for library in (AVX2, kernels.load(KernelConfig())):
        for rows, width in ((1, 5), (3, 8), (17, 100), (64, 1536)):
            x, bias = _rand(rows, width, seed=width, scale=3.0), _rand(width, seed=width + 1)
            x[0, 0] = 0.0
            expected = F.gelu(x.double() + bias.to(dtype).double(), approximate="tanh")
            got = library.bias_gelu_tanh(x.to(dtype).clone(), bias.to(dtype))
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
            else:  # one bf16 step of the exact value (of its bf16 input)
                exact = F.gelu(x.to(dtype).double() + bias.to(dtype).double(), approximate="tanh")
                step = exact.abs().clamp(min=1e-30) * 2.0**-7
                assert ((got.double() - exact).abs() <= step + 1e-6).all()
            plain = library.bias_gelu_tanh(x.to(dtype).clone())
            torch.testing.assert_close(plain.float(), F.gelu(x.to(dtype).float(), approximate="tanh"), rtol=1e-2, atol=1e-3)
    with pytest.raises(ValueError, match="bias must be"):
        AVX2.bias_gelu_tanh(torch.zeros(2, 4, dtype=dtype), torch.zeros(3, dtype=dtype))
