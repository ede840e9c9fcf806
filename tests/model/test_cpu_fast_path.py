"""bf16 CPU inference fast path: packed linears (bit-exact) and the fused SiLU-and-mul MLP."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagellm import kernels
from pagellm.attention import ReferenceAttention
from pagellm.model.layers import (
    PackedLinear,
    PackedSiluAndMulLinear,
    SiluAndMul,
    pack_linear_layers,
    packed_ops_supported,
)
from pagellm.model.loader import load_model
from tests.model.paged_runner import PagedRunner

needs_packed_bf16 = pytest.mark.skipif(
    not packed_ops_supported(torch.bfloat16),
    reason="oneDNN's packed bf16 linear ops need AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; this CPU has neither",
)


@needs_packed_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_exact(bias):
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin)
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 48).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(packed(x), lin(x))
    x3 = torch.randn(2, 3, 48).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(packed(x3), lin(x3))


@needs_packed_bf16
def test_pack_linear_layers_skips_float32():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert pack_linear_layers(model) == 0 and all(type(m) is nn.Linear for m in model)
    model = model.to(torch.bfloat16)
    assert pack_linear_layers(model) == 2 and all(type(m) is PackedLinear for m in model)


@needs_packed_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_fused_silu_and_mul_close_to_unfused(bias):
    torch.manual_seed(1)
    gate_up = nn.Linear(64, 2 * 96, bias=bias).to(torch.bfloat16)
    fused = PackedSiluAndMulLinear(gate_up, 96)
    x = torch.randn(33, 64).to(torch.bfloat16)
    with torch.no_grad():
        expected = SiluAndMul()(gate_up(x).float())
    got = fused(x).float()
    torch.testing.assert_close(got, expected, atol=2e-2 * float(expected.abs().max()), rtol=2e-2)


@needs_packed_bf16
def test_optimized_model_matches_plain_model(tiny_llama_path):
    """The whole tiny model, bf16, optimized vs not: same greedy tokens, close logits."""
    plain, arch = load_model(tiny_llama_path, torch.bfloat16, ReferenceAttention())
    fast, _ = load_model(tiny_llama_path, torch.bfloat16, ReferenceAttention())
    stats = fast.optimize_for_cpu_inference()
    assert stats["fused_mlps"] == arch.num_hidden_layers
    assert stats["packed_linears"] == 3 * arch.num_hidden_layers + 1  # qkv, o, down per layer + lm_head
    if kernels.available():  # norms (2 per layer + final) and rotary (1 per layer) through the C++ kernels
        assert stats["cpu_kernels"] == 3 * arch.num_hidden_layers + 1
    batch = [(0, [5, 9, 2000, 31, 77, 12]), (1, [400, 3, 3, 3])]
    outs = []
    for model in (plain, fast):
        runner = PagedRunner(model, arch)
        logits = runner.step(batch)
        logits += runner.step([(0, [int(logits[0][-1].argmax())]), (1, [int(logits[1][-1].argmax())])])
        outs.append(logits)
    for got, expected in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_float32_model_is_left_alone(tiny_llama_path):
    model, _ = load_model(tiny_llama_path, torch.float32, ReferenceAttention())
    assert model.optimize_for_cpu_inference() == {"fused_mlps": 0, "packed_linears": 0, "cpu_kernels": 0}
    assert not any(getattr(m, "use_kernel", False) for m in model.modules())
