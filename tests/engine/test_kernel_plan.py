"""The kernel plan: chosen once from the CPU and the options, passed into the model, logged,
and independent between engines in one process."""

from __future__ import annotations

import logging

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import KernelConfig
from pagellm.kernels import kernel_target
from pagellm.kernels.isa import usable_cpu_flags
from pagellm.kernels.plan import KernelPlan
from pagellm.model.cpu_linear import KernelLinear
from pagellm.model.layers import RMSNorm
from pagellm.worker.kernel_plan import plan_kernels

FLAGS = usable_cpu_flags()
CPU = torch.device("cpu")


def _plan(dtype: torch.dtype, **options: object) -> KernelPlan:
    return plan_kernels(KernelConfig(**options), CPU, "auto", lambda fast: dtype)


@pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="this CPU cannot run the AVX2 build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_an_avx2_plan_runs_pagellm_kernels_everywhere(dtype):
    plan = _plan(dtype, isa="avx2")
    assert plan.cpu.startswith("avx2+fma") and "avx512" not in plan.cpu
    assert (plan.gemm, plan.attention, plan.norm, plan.rotary, plan.argmax, plan.scan) == (
        "avx2", "cpu_paged", "kernel", "kernel", "kernel", "kernel")
    # x86-64-v3 below the host's level; -march=native where AVX2 is all the host has.
    target = kernel_target(KernelConfig(isa="avx2"))
    assert target in {("-march=x86-64-v3",), ("-march=native",)}
    assert (target == ("-march=native",)) == (FLAGS == usable_cpu_flags("avx2"))
    assert plan.kernels is not None and plan.kernels.march == target
    assert plan.describe() == (
        f"cpu={plan.cpu} kernel_target={' '.join(target)} dtype={str(dtype).removeprefix('torch.')} gemm=avx2 "
        "attention=cpu_paged norm=kernel rotary=kernel argmax=kernel scan=kernel weights=dense qgemm=none "
        "quant_max_rows=none "
        "quant_large=none decoder=fused"
    )


def test_without_kernels_the_plan_is_pytorch_and_bf16_is_not_fast():
    seen = []
    plan = plan_kernels(KernelConfig(cpu_kernels=False), CPU, "auto", lambda fast: seen.append(fast) or torch.float32)
    assert (plan.kernels, plan.attention, plan.norm, plan.argmax) == (None, "torch_sdpa", "torch", "torch")
    assert plan.gemm == "torch" and plan.as_dict()["kernel_target"] == "none"
    assert seen == [bool({"avx512_bf16", "amx_bf16"} & FLAGS)]  # oneDNN's bf16 still counts where native
    with pytest.raises(ValueError, match="needs a kernel library"):
        KernelPlan("cpu", "-", torch.float32, "torch_sdpa", "torch", norm="kernel")


def test_the_model_is_built_on_the_plan_and_the_plan_is_logged(tiny_llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="pagellm.worker.worker"):
        engine = LLM(tiny_llama_path, num_kv_blocks=32, dtype="float32").llm_engine
    plan = engine.executor.kernel_plan
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernel plan:")] == [
        f"kernel plan: {plan.describe()}"]
    assert engine.kernel_plan_info == plan.as_dict() and plan.dtype is engine.executor.dtype is torch.float32
    norms = [m for m in engine.executor.model_runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernels is plan.library("norm") for m in norms)  # given at construction
    assert all(layer.self_attn.rotary_kernels is plan.library("rotary") for layer in engine.executor.model_runner.model.model.layers)
    assert engine.executor.model_runner.argmax_kernels is plan.library("argmax")


@pytest.mark.skipif("avx512f" not in FLAGS or not {"avx2", "fma"} <= FLAGS,
                    reason="needs a CPU above AVX2 to hold two plans' builds at once")
def test_two_engines_with_different_plans_in_one_process(tiny_llama_path):
    prompts = [{"prompt_token_ids": [5, 9, 2000, 31, 77, 12]}, {"prompt_token_ids": [400, 3, 3, 3] * 5}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    native = LLM(tiny_llama_path, num_kv_blocks=32, dtype="float32")
    avx2 = LLM(tiny_llama_path, num_kv_blocks=32, dtype="float32", cpu_isa="avx2")
    assert native.llm_engine.executor.kernel_plan.kernels is not avx2.llm_engine.executor.kernel_plan.kernels
    assert avx2.llm_engine.executor.kernel_plan.gemm == "avx2"
    assert any(isinstance(m, KernelLinear) and m.path == "avx2" for m in avx2.llm_engine.executor.model_runner.model.modules())
    assert not any(isinstance(m, KernelLinear) for m in native.llm_engine.executor.model_runner.model.modules())  # float32: torch's GEMM
    first = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in avx2.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    assert first == second == again


def test_cpu_paged_attention_is_refused_off_the_cpu():
    with pytest.raises(ValueError, match="runs on CPU only"):
        plan_kernels(KernelConfig(), torch.device("meta"), "cpu_paged", lambda fast: torch.float32)
