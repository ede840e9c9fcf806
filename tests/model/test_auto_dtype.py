"""``dtype="auto"``: the checkpoint's precision where the kernel plan computes bf16 fast, float32 otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from pagellm import LLM
from pagellm.config import KernelConfig
from pagellm.worker.worker import engine_dtype
from pagellm.kernels.isa import usable_cpu_flags
from pagellm.kernels.plan import OWN_GEMM_PATHS
from pagellm.model.loader import auto_dtype, checkpoint_is_16bit
from pagellm.worker.kernel_plan import plan_kernels


def _with_dtype(src: str, dst: Path, dtype_name: str | None) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if dtype_name is not None:
        config["torch_dtype"] = dtype_name
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_checkpoint_precision_from_config(tiny_llama_path, tmp_path):
    assert checkpoint_is_16bit(_with_dtype(tiny_llama_path, tmp_path / "bf16", "bfloat16"))
    assert checkpoint_is_16bit(_with_dtype(tiny_llama_path, tmp_path / "fp16", "float16"))
    assert not checkpoint_is_16bit(_with_dtype(tiny_llama_path, tmp_path / "fp32", "float32"))
    assert not checkpoint_is_16bit(_with_dtype(tiny_llama_path, tmp_path / "none", None))  # HF default: float32


def test_gguf_counts_as_16bit(default_model_path_fixture):
    assert checkpoint_is_16bit(default_model_path_fixture)


def test_auto_dtype_needs_fast_bf16(tiny_llama_path, tmp_path):
    half = _with_dtype(tiny_llama_path, tmp_path / "bf16", "bfloat16")
    full = _with_dtype(tiny_llama_path, tmp_path / "fp32", "float32")
    assert auto_dtype(half, bf16_is_fast=True) is torch.bfloat16
    assert auto_dtype(half, bf16_is_fast=False) is torch.float32
    assert auto_dtype(full, bf16_is_fast=True) is torch.float32
    # An explicit dtype always wins.
    assert engine_dtype("float32", half, torch.device("cpu")) is torch.float32
    assert engine_dtype(torch.bfloat16, full, torch.device("cpu")) is torch.bfloat16


def test_the_plan_says_where_bf16_is_fast():
    # bf16 is fast with AVX-512 BF16 or AMX (pagellm's GEMM or oneDNN's) and, through pagellm's
    # AVX2 GEMM, on AVX2 + FMA; below that torch would emulate it. Asked for each level here.
    for isa in ("baseline", "avx2", "avx512", "amx"):
        seen = []
        plan_kernels(KernelConfig(isa=isa), torch.device("cpu"), "auto", lambda fast: seen.append(fast) or torch.float32)
        flags = usable_cpu_flags(isa)
        assert seen == [bool({"avx512_bf16", "amx_bf16"} & flags) or {"avx2", "fma"} <= flags], isa


def test_engine_resolves_auto(tiny_llama_path, tmp_path):
    assert LLM(tiny_llama_path, num_kv_blocks=8).llm_engine.executor.dtype is torch.float32  # float32 checkpoint
    half = _with_dtype(tiny_llama_path, tmp_path / "bf16", "bfloat16")
    engine = LLM(half, num_kv_blocks=8).llm_engine
    fast = engine.executor.kernel_plan.gemm in OWN_GEMM_PATHS or "avx512_bf16" in usable_cpu_flags()
    assert engine.executor.dtype is (torch.bfloat16 if fast else torch.float32)
    assert LLM(half, num_kv_blocks=8, cpu_isa="baseline").llm_engine.executor.dtype is torch.float32
