"""An AMX machine runs the AVX-512 BF16 build next to its AMX one, in one process (isa
"avx512"): the attention scores and the GEMM then run on dot products, and both builds agree
with each other and with the dense oracle."""

from __future__ import annotations

import pytest
import torch

from pagellm import kernels
from pagellm.attention import CPUPagedAttention
from pagellm.config import KernelConfig
from tests.helpers.attention import dense_expected, make_step

AMX = kernels.load(KernelConfig(isa="amx"))
AVX512 = kernels.load(KernelConfig(isa="avx512"))


def _results(lib: kernels.KernelLibrary) -> dict[str, torch.Tensor]:
    out = {}
    reqs = [(0, 37), (40, 1), (15, 1), (100, 9), (3, 1)]  # prefill, decodes, a chunk; ragged blocks
    for head_dim in (64, 128):
        for window, softcap in ((None, None), (21, 3.0)):  # also a sliding window and capped scores
            step = make_step(reqs, 16, 9, 3, head_dim=head_dim, dtype=torch.bfloat16, seed=head_dim)
            out[f"dense{head_dim}-{window}"] = dense_expected(step, window, softcap).float()
            kc, vc = step.key_cache.clone(), step.value_cache.clone()
            with torch.inference_mode():
                got = CPUPagedAttention(lib).forward(step.query, step.key, step.value, kc, vc, step.metadata,
                                                     step.scale, window, softcap)  # fmt: skip
            out[f"attn{head_dim}-{window}"] = got.float()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(45, 576, generator=g).to(torch.bfloat16)
    w = torch.randn(100, 576, generator=g).to(torch.bfloat16)
    amx = lib.gemm_amx_available
    out["gemm"] = lib.gemm_bf16(x, kernels.pack_gemm_weight(w, amx), 100, amx=amx).float()
    return out


@pytest.mark.skipif(AMX is None or not AMX.gemm_amx_available, reason="needs a CPU whose AMX this process may use")
def test_the_avx512_build_beside_the_amx_one_gives_the_same_results():
    assert AVX512 is not None and AVX512 is not AMX and AVX512.gemm_bf16_available and not AVX512.gemm_amx_available
    assert "-mno-amx-tile" in AVX512.march
    on, off = _results(AMX), _results(AVX512)
    for case in ("64-None", "128-None", "64-21", "128-21"):
        dense = on[f"dense{case}"]
        for result in (on, off):
            torch.testing.assert_close(result[f"attn{case}"], dense, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(on[f"attn{case}"], off[f"attn{case}"], atol=3e-2, rtol=3e-2)
    assert (on["gemm"] == off["gemm"]).float().mean() >= 0.99
