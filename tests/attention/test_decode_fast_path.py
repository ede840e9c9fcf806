"""The batched-matmul decode path and decode-row grouping of TorchSDPAAttention, against the oracle."""

from __future__ import annotations

import pytest
import torch

from pagellm.attention import TorchSDPAAttention
from pagellm.attention.torch_sdpa import _build_plan, decode_attention_bmm, group_decode_rows
from tests.helpers.attention import check_step, make_step


def test_group_decode_rows():
    assert group_decode_rows([], []) == []
    # Equal lengths: one group, batch order kept.
    assert group_decode_rows([0, 1, 2], [50, 50, 50]) == [[0, 1, 2]]
    # One long outlier among short rows gets its own group.
    lens = [40] * 9 + [1000]
    assert group_decode_rows(list(range(10)), lens) == [[9], list(range(9))]
    # Small differences are not worth a group.
    assert group_decode_rows([0, 1, 2, 3], [100, 98, 97, 99]) == [[0, 1, 2, 3]]
    # Never more than 8 groups, every row exactly once.
    lens = [2**i * 10 for i in range(12)] * 3
    groups = group_decode_rows(list(range(len(lens))), lens)
    assert len(groups) <= 8 and sorted(r for g in groups for r in g) == list(range(len(lens)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_decode_rows_match_reference(dtype):
    # Two length clusters and an outlier -> several groups, interleaved with prefills.
    reqs = [(30, 1), (700, 1), (31, 1), (2, 5), (33, 1), (300, 1), (29, 1), (0, 9), (310, 1), (28, 1)]
    step = make_step(reqs, block_size=16, num_heads=6, num_kv_heads=2, dtype=dtype, seed=5)
    plan = _build_plan(step.metadata, torch.device("cpu"))
    assert len(plan.decodes) >= 3 and sum(d.num_rows for d in plan.decodes) == 8
    check_step(step)


@pytest.mark.parametrize("impl", ["bmm", "sdpa"])
@pytest.mark.parametrize("rows", [1, 3, 4, 17])
def test_decode_impls_and_small_batches(impl, rows, monkeypatch):
    monkeypatch.setattr(TorchSDPAAttention, "decode_impl", impl)
    step = make_step([(5 + 7 * i, 1) for i in range(rows)], block_size=4, num_heads=9, num_kv_heads=3,
                     head_dim=64, dtype=torch.bfloat16, seed=rows)
    check_step(step)


def test_decode_attention_bmm_against_dense():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 3, 16, generator=g)
    k = torch.randn(5, 2, 11, 16, generator=g)
    v = torch.randn(5, 2, 11, 16, generator=g)
    lens = torch.tensor([11, 4, 1, 7, 11])
    valid = torch.arange(11)[None, :] < lens[:, None]
    mask = torch.zeros(5, 1, 1, 11).masked_fill_(~valid[:, None, None, :], float("-inf"))
    out = decode_attention_bmm(q, k, v, mask, 0.25)
    scores = torch.einsum("rhgd,rhsd->rhgs", q.double(), k.double()) * 0.25
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    expected = torch.einsum("rhgs,rhsd->rhgd", scores.softmax(-1), v.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_attention_bmm(q, k, v, None, 0.25).double(),
                               torch.einsum("rhgs,rhsd->rhgd", (torch.einsum("rhgd,rhsd->rhgs", q.double(), k.double()) * 0.25).softmax(-1), v.double()),
                               atol=1e-5, rtol=1e-5)
