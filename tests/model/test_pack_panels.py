"""The C++ packing of bf16 weights into the GEMMs' pair panels (``KernelLibrary.pack_pairs``)
against the torch packing it replaced at model load (``pagellm.kernels.packing``), bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagellm import kernels
from pagellm.kernels import packing

KERNELS = kernels.default()  # this machine's kernel library (None: no compiler)

pytestmark = pytest.mark.skipif(KERNELS is None, reason="needs the kernel library (a C++ compiler)")


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(1, 2), (15, 64), (33, 130), (100, 96), (257, 512)])
@pytest.mark.parametrize("cols", [packing.AVX2_PANEL_COLS, packing.GEMM_AMX_PANEL_COLS, packing.GEMM_PANEL_COLS])
def test_plain_panels_equal_the_torch_packing(n, k, cols):
    w = _rand(n, k, seed=n + k)
    expected = packing._interleave_pairs(packing._panels(w, cols))  # zero rows pad the last panel
    assert torch.equal(KERNELS.pack_pairs(w, cols), expected)


@pytest.mark.parametrize("n,k", [(1, 2), (40, 64), (70, 96), (129, 256)])
def test_gate_and_up_panels_equal_the_torch_packing(n, k):
    gate, up = _rand(n, k, seed=1), _rand(n, k, seed=2)
    assert torch.equal(KERNELS.pack_pairs(gate, 2 * packing.SILU_MUL_HALF_COLS, up), kernels.pack_silu_mul_weight(gate, up))
    assert torch.equal(KERNELS.pack_pairs(gate, packing.AVX2_PANEL_COLS, up), kernels.pack_avx2_silu_mul_weight(gate, up))


def test_rows_of_a_view_pack_as_the_copy_does():
    """A fused gate/up weight's halves (views, one at an odd row offset) and a transposed view."""
    w = _rand(81, 64, seed=3)
    assert torch.equal(KERNELS.pack_pairs(w[1:41], 64, w[41:]), kernels.pack_silu_mul_weight(w[1:41].clone(), w[41:].clone()))
    t = _rand(64, 48, seed=4).T
    assert torch.equal(KERNELS.pack_pairs(t, 32), KERNELS.pack_pairs(t.contiguous(), 32))


BAD = {
    "float32": lambda: KERNELS.pack_pairs(torch.zeros(4, 8), 16),
    "odd width": lambda: KERNELS.pack_pairs(_rand(4, 7, seed=0), 16),
    "no rows": lambda: KERNELS.pack_pairs(_rand(0, 8, seed=0), 16),
    "1-D": lambda: KERNELS.pack_pairs(_rand(8, seed=0), 16),
    "halves differ": lambda: KERNELS.pack_pairs(_rand(4, 8, seed=0), 16, _rand(5, 8, seed=0)),
    "odd cols with halves": lambda: KERNELS.pack_pairs(_rand(4, 8, seed=0), 15, _rand(4, 8, seed=0)),
    "no cols": lambda: KERNELS.pack_pairs(_rand(4, 8, seed=0), 0),
}


@pytest.mark.parametrize("call", list(BAD), ids=list(BAD))
def test_bad_arguments_raise(call):
    with pytest.raises(ValueError):
        BAD[call]()
