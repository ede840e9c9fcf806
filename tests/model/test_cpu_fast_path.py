"""bf16 CPU inference fast path: packed linears (bit-exact) and the fused SiLU-and-mul MLP."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagellm.attention import ReferenceAttention
from pagellm.model.cpu_linear import (
    PackedLinear,
    PackedSiluAndMulLinear,
    pack_linear_layers,
    packed_ops_supported,
)
from pagellm.model.layers import RMSNorm, SiluAndMul
from pagellm.model.loader import load_model
from tests.helpers.paged_runner import PagedRunner

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
def test_pack_linear_layers_skips_float32(cpu_plan):
    plan = cpu_plan(torch.bfloat16, gemm="onednn")
    assert plan.gemm == "onednn"
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert pack_linear_layers(model, plan) == 0 and all(type(m) is nn.Linear for m in model)
    model = model.to(torch.bfloat16)
    assert pack_linear_layers(model, cpu_plan(torch.bfloat16, gemm="torch")) == 0  # the plan keeps F.linear
    assert pack_linear_layers(model, plan) == 2 and all(type(m) is PackedLinear for m in model)


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


def test_optimized_model_matches_plain_model(tiny_llama_path, cpu_plan):
    """The whole tiny model, bf16, on this machine's kernel plan vs plain PyTorch: same greedy
    tokens, close logits."""
    plan = cpu_plan(torch.bfloat16)
    if plan.gemm == "torch":
        pytest.skip("no fast bf16 GEMM here (no pagellm GEMM, no oneDNN bf16)")
    plain, arch = load_model(tiny_llama_path, torch.bfloat16, ReferenceAttention())
    fast, _ = load_model(tiny_llama_path, torch.bfloat16, ReferenceAttention(), plan=plan)
    stats = fast.optimize_for_cpu_inference(plan)
    assert stats["fused_mlps"] == arch.num_hidden_layers
    assert stats["packed_linears"] == 3 * arch.num_hidden_layers + 1  # qkv, o, down per layer + lm_head
    # norms (2 per layer + final) and rotary (1 per layer) through the C++ kernels where the plan says so
    on_kernels = sum(m.kernels is not None for m in fast.modules() if isinstance(m, RMSNorm))
    on_kernels += sum(layer.self_attn.rotary_kernels is not None for layer in fast.model.layers)
    assert on_kernels == (3 * arch.num_hidden_layers + 1 if plan.norm == "kernel" else 0)
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


def test_float32_weights_stay_on_torch_unless_the_plan_says_avx2(tiny_llama_path, cpu_plan):
    plan = cpu_plan(torch.float32)
    model, arch = load_model(tiny_llama_path, torch.float32, ReferenceAttention(), plan=plan)
    stats = model.optimize_for_cpu_inference(plan)
    if plan.gemm == "avx2":  # a CPU without AVX-512: pagellm's AVX2 GEMM takes float32 too
        assert stats == {"fused_mlps": arch.num_hidden_layers, "packed_linears": 3 * arch.num_hidden_layers + 1}
    else:
        assert plan.gemm == "torch"
        assert stats == {"fused_mlps": 0, "packed_linears": 0}
        assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
