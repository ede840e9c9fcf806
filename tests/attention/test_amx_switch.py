"""``PAGELLM_AMX=0`` turns the kernels' AMX paths off: the attention scores and the GEMM then run
on AVX-512 BF16 dot products on this same CPU, and both paths agree with each other and with
the dense oracle. (Without AMX both processes take the same path: the comparison still holds.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagellm import kernels

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh process (the switch is read once per process); writes its outputs to argv[1].
SCRIPT = """
import sys
import torch
from safetensors.torch import save_file
from pagellm import kernels
from pagellm.attention import CPUPagedAttention
from tests.attention.test_attention import dense_expected, make_step

out = {"amx": torch.tensor([int(kernels.gemm_amx_available())])}
reqs = [(0, 37), (40, 1), (15, 1), (100, 9), (3, 1)]  # prefill, decodes, a chunk; ragged blocks
for head_dim in (64, 128):
    step = make_step(reqs, 16, 9, 3, head_dim=head_dim, dtype=torch.bfloat16, seed=head_dim)
    out[f"dense{head_dim}"] = dense_expected(step).float()
    kc, vc = step.key_cache.clone(), step.value_cache.clone()
    with torch.inference_mode():
        got = CPUPagedAttention().forward(step.query, step.key, step.value, kc, vc, step.metadata, step.scale)
    out[f"attn{head_dim}"] = got.float()
g = torch.Generator().manual_seed(0)
x = torch.randn(45, 576, generator=g).to(torch.bfloat16)
w = torch.randn(100, 576, generator=g).to(torch.bfloat16)
amx = kernels.gemm_amx_available()
out["gemm"] = kernels.gemm_bf16(x, kernels.pack_gemm_weight(w, amx), 100, amx=amx).float()
save_file(out, sys.argv[1])
"""


def _run(tmp_path: Path, amx_env: str | None) -> dict[str, torch.Tensor]:
    env = {k: v for k, v in os.environ.items() if k != "PAGELLM_AMX"}
    if amx_env is not None:
        env["PAGELLM_AMX"] = amx_env
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    path = tmp_path / f"out-{amx_env}.safetensors"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(path)


@pytest.mark.skipif(not kernels.gemm_available(), reason="needs the AVX-512 BF16 kernel build")
def test_amx_switch_gives_the_dot_product_paths_and_the_same_results(tmp_path):
    on, off = _run(tmp_path, None), _run(tmp_path, "0")
    assert bool(on["amx"]) == kernels.gemm_amx_available()
    assert not bool(off["amx"])
    for head_dim in (64, 128):
        dense = on[f"dense{head_dim}"]
        for result in (on, off):
            torch.testing.assert_close(result[f"attn{head_dim}"], dense, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(on[f"attn{head_dim}"], off[f"attn{head_dim}"], atol=3e-2, rtol=3e-2)
    assert (on["gemm"] == off["gemm"]).float().mean() >= 0.99
