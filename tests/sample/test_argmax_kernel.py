"""The C++ row argmax behind greedy sampling: torch.max(dim) indices, ties, NaN, strides, dtypes."""

from __future__ import annotations

import shutil

import pytest
import torch

from pagellm import kernels
from pagellm.sample.sampler import greedy_sample

KERNELS = kernels.default()  # this machine's kernel library (None: no compiler)

pytestmark = pytest.mark.skipif(
    KERNELS is None and shutil.which("g++") is None, reason="no C++ compiler: the kernels cannot be built"
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 49152])
def test_argmax_equals_torch_max(dtype, n):
    x = torch.randn(9, n, generator=torch.Generator().manual_seed(n)).to(dtype)
    assert torch.equal(KERNELS.argmax_rows(x), x.max(dim=-1).indices)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_argmax_ties_nan_and_infinities(dtype):
    n = 100
    x = torch.zeros(6, n, dtype=dtype)
    x[0, [5, 40, 90]] = 3.0  # ties: the first index wins, in the vector part and across lanes
    x[1, [50, 99]] = 2.0  # tie between the vector part and the scalar tail (n = 100 is not a multiple of 16)
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 70] = float("nan")
    x[3, 80] = float("nan")
    x[3, 10] = 5.0  # a NaN anywhere wins over any number: the first NaN
    x[4, 97] = float("nan")  # NaN only in the tail
    x[5] = -1.0
    x[5, 17] = float("inf")
    got = KERNELS.argmax_rows(x).tolist()
    assert got == [5, 50, 0, 70, 97, 17]
    assert got == x.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_argmax_on_strided_rows_and_greedy_sample(dtype):
    base = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)).to(dtype)
    view = base[::2, 10:250]  # rows 600 elements apart, each contiguous
    assert torch.equal(KERNELS.argmax_rows(view), view.max(dim=-1).indices)
    assert torch.equal(greedy_sample(view, KERNELS), view.max(dim=-1).indices)
    assert KERNELS.argmax_rows(base[:0]).shape == (0,)


def test_argmax_rejects_bad_arguments():
    with pytest.raises(ValueError):
        KERNELS.argmax_rows(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError):
        KERNELS.argmax_rows(torch.randn(4))
    with pytest.raises(ValueError):
        KERNELS.argmax_rows(torch.randn(4, 6).t())  # columns, not rows, contiguous
    with pytest.raises(ValueError):
        KERNELS.argmax_rows(torch.randn(3, 0))
