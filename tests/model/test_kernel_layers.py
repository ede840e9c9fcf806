"""RMSNorm (+ residual add; Llama's, and Gemma's / Qwen3.5's by 1 + weight) and rotary through the
C++ kernels against their PyTorch definitions."""

from __future__ import annotations

import pytest
import torch

from pagellm import kernels
from pagellm.model.layers import RMSNorm, UnitOffsetRMSNorm, apply_rotary, apply_rotary_

KERNELS = kernels.default()  # this machine's kernel library (None: no compiler)

pytestmark = pytest.mark.skipif(KERNELS is None, reason="CPU kernels not built here")


NORMS = {"llama": RMSNorm, "unit_offset": UnitOffsetRMSNorm}


def _norm(hidden: int, dtype: torch.dtype, use_kernel: bool, kind: str = "llama") -> RMSNorm:
    norm = NORMS[kind](hidden, 1e-5, KERNELS if use_kernel else None)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(1)))
    return norm.to(dtype)


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [576, 100])  # 100: 16-wide vector loops and a scalar tail
def test_add_rms_norm_matches_torch(dtype, rows, hidden, kind):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    ref_norm, fast_norm = _norm(hidden, dtype, False, kind), _norm(hidden, dtype, True, kind)

    expected_out, expected_residual = ref_norm(x, residual.clone())
    res = residual.clone()
    out, new_res = fast_norm(x, res)
    assert new_res is res  # updated in place
    assert torch.equal(new_res, expected_residual)  # the add is rounded exactly like torch's
    # The statistics are summed in another order: at most one rounding step apart.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, expected_out, **tol)
    if dtype == torch.bfloat16:
        assert (out != expected_out).float().mean() < 0.01  # nearly always bit-equal

    torch.testing.assert_close(fast_norm(x), ref_norm(x), **tol)  # without a residual


@pytest.mark.parametrize("rotary_dim", [64, 48, 20], ids=["full", "partial-48", "partial-20"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_in_place_equals_torch(dtype, rotary_dim):
    """All of each head's dims, or its leading ones (partial rotary: 48 = a 16-wide vector step
    and a tail per half, 20 = tail only), the rest untouched; the kernel and the PyTorch path
    alike."""
    g = torch.Generator().manual_seed(0)
    t, heads, kv_heads, d = 33, 9, 3, 64
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)  # strided rows, as in the model
    angles = torch.rand(t, rotary_dim // 2, generator=g) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    expected = qk.clone()
    expected[..., :rotary_dim] = apply_rotary(qk[..., :rotary_dim].clone(), cos, sin)
    assert torch.equal(apply_rotary_(qk.clone(), cos, sin, None), expected)  # the PyTorch path
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    out = apply_rotary_(qk, cos, sin, KERNELS)
    assert out.data_ptr() == qk.data_ptr()  # in place
    assert torch.equal(out, expected)  # each product and the sum rounded as the separate ops
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_head_norm_in_place_equals_the_norm_of_each_head(dtype, tokens, kind):
    """Qwen3's per-head q/k norm on strided heads in place: each head exactly as the row norm
    gives it, close to torch's definition, and the rest of each row untouched."""
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d = 6, 2, 48  # 48: 16-wide vector loops and a 0-long tail; the v heads after k
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 3).to(dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    norm = _norm(d, dtype, True, kind)
    expected = norm(q.reshape(-1, d)).view(tokens, heads, d)  # (the row norm on the kernel)
    reference = _norm(d, dtype, False, kind)(q.reshape(-1, d)).view(tokens, heads, d)
    rest = qkv[:, heads * d :].clone()
    norm.norm_heads_(q)
    assert torch.equal(q, expected)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(q, reference, **tol)
    assert torch.equal(qkv[:, heads * d :], rest)


def test_kernel_wrappers_reject_bad_shapes():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        KERNELS.add_rms_norm(x, None, torch.ones(7, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError):
        KERNELS.add_rms_norm(x, torch.zeros(4, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError):
        KERNELS.rotary_(x.view(4, 2, 4), torch.ones(4, 3, dtype=torch.bfloat16), torch.ones(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="R even"):  # wider than a head
        KERNELS.rotary_(x.view(4, 2, 4), torch.ones(4, 6, dtype=torch.bfloat16), torch.ones(4, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        KERNELS.head_rms_norm_(x.view(4, 2, 4), torch.ones(3, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError):
        KERNELS.head_rms_norm_(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)  # not [T, heads, D]
