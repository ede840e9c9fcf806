"""The engine on each lower ISA path this machine can run (``PAGELLM_ISA``), in a fresh process:
greedy output equal to ``transformers`` and the bf16 fast path equal to the plain model, so an
AVX-512 or AMX machine also checks what an AVX2-only (or AVX-512 without AMX) CPU runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagellm.kernels.isa import usable_cpu_flags
from tests.engine.test_engine_vs_hf import BATCHING_FAMILIES, MAPPING_FAMILIES

pytestmark = pytest.mark.slow

HERE = os.path.dirname(__file__)
TESTS = [os.path.join(HERE, "test_engine_vs_hf.py"), os.path.join(HERE, "..", "model", "test_cpu_fast_path.py")]
# Of the family matrix, the families whose layers take a distinct kernel path (plain, q/k norms,
# windows, experts, soft caps, local and global layers, sinks); the others run the same kernels.
# Of the batching configurations, the plain and the chunked runs and the prefix-cache hits (block
# size 1 and preemption run the same kernels again).
KERNEL_FAMILIES = ("tiny_llama_path", "tiny_qwen3_path", "tiny_mistral_window_path", "tiny_qwen3_moe_path",
                   "tiny_gemma2_path", "tiny_gemma3_path", "tiny_gpt_oss_path")  # fmt: skip
OTHER_FAMILIES = [f for f in BATCHING_FAMILIES + MAPPING_FAMILIES if f not in KERNEL_FAMILIES]
SELECTED = f"not ({' or '.join(OTHER_FAMILIES)} or preempt or path-bs1])"


@pytest.mark.parametrize(
    "isa",
    [
        pytest.param("avx2", marks=pytest.mark.skipif(
            "avx512f" not in usable_cpu_flags(), reason="the AVX2 path is this machine's own: the suite runs it")),
        pytest.param("avx512", marks=pytest.mark.skipif(
            "amx_tile" not in usable_cpu_flags() or "avx512_bf16" not in usable_cpu_flags(),
            reason="needs an AMX machine (below it, AVX-512 is the machine's own path)")),
    ],
)
def test_engine_on_a_lower_isa(isa: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PAGELLM_KERNEL_MARCH"}
    env["PAGELLM_ISA"] = isa
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-k", SELECTED, *TESTS],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
