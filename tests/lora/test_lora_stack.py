"""Adapters inside the one-call C++ decoder stack: the same bits as the Python layers adding them
(the stack runs every step here, the adapters' rows grouped by slot), on the GEMM paths the
stack runs (integer weights, pagellm's bf16 GEMM, its AVX2 GEMM in float32); and the LoRA
kernel both run (csrc/lora.cpp) against float64. SiLU-and-mul apart from the gate/up GEMM is
tested in tests/model/test_gemm_avx2.py."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pagellm import LLM, SamplingParams, kernels
from pagellm.config import KernelConfig
from pagellm.kernels.arg_checks import DTYPE_CODES
from pagellm.kernels.packing import lora_b_elems, pack_lora_b
from pagellm.kernels.stack_args import LoRALinearArgs
from tests.helpers.lora_adapters import PROMPTS

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
ORDER = [None, "all", "qv", "mlp0"]


def _generate(llm: LLM, requests, layers: bool) -> list[tuple[list[int], list[float]]]:
    """Every prompt under every adapter of ORDER (and the base) in one batch; ``layers``: the
    Python layers run every step (the one-call stack is taken away)."""
    model = llm.llm_engine.executor.model_runner.model
    if layers:
        model.decoder_kernels = None
    prompts = [{"prompt_token_ids": p} for _ in ORDER for p in PROMPTS]
    loras = [requests[name] if name is not None else None for name in ORDER for _ in PROMPTS]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]  # fmt: skip


@pytest.mark.parametrize("case", ["int8-bf16", "dense-bf16", "dense-f32-avx2", "int8-f32"])
def test_adapters_in_the_stack_equal_the_layers(tiny_llama_path, requests, case: str) -> None:
    options = {
        "int8-bf16": dict(dtype="bfloat16", quantization="int8"),
        "dense-bf16": dict(dtype="bfloat16"),
        "dense-f32-avx2": dict(dtype="float32", cpu_isa="avx2"),
        "int8-f32": dict(dtype="float32", quantization="int8"),
    }[case]
    common = dict(enable_lora=True, max_loras=3, max_lora_rank=8, num_kv_blocks=128, enable_prefix_caching=False)
    stacked_llm = LLM(tiny_llama_path, **common, **options)
    assert stacked_llm.llm_engine.executor.kernel_plan.decoder == "fused"
    stacked = _generate(stacked_llm, requests, layers=False)
    stack = stacked_llm.llm_engine.executor.model_runner.model._fused_stack
    routes = stacked_llm.llm_engine.stats.step_routes
    # Every decode step (each with adapters' rows) ran on the stack; the prompts' step runs the
    # layers where the tiny head dim sends prefill rows to SDPA.
    fused = sum(n for route, n in routes.items() if route.startswith("decoder=fused "))
    assert stack is not None and stack.steps == fused >= PARAMS.max_tokens - 1
    del stacked_llm
    layered = _generate(LLM(tiny_llama_path, **common, **options), requests, layers=True)
    assert stacked == layered
    # (and the adapters changed the output: each adapter's tokens differ from the base's somewhere)
    base = [tokens for tokens, _ in stacked[: len(PROMPTS)]]
    for i in range(1, len(ORDER)):
        assert [tokens for tokens, _ in stacked[i * len(PROMPTS) : (i + 1) * len(PROMPTS)]] != base, ORDER[i]


def test_tensor_parallel_ranks_add_their_shares_in_the_stack(tiny_llama_path, requests) -> None:
    """Two ranks, each adding its share of every adapter inside the stack before the stack's
    all-reduces: rank 0 on the Python layers beside rank 1 on the stack gives the all-stack
    run's tokens and logprobs exactly."""
    runs = []
    for rank0_layers in (False, True):
        llm = LLM(tiny_llama_path, dtype="bfloat16", quantization="int8", enable_lora=True, max_loras=3,
                  max_lora_rank=8, num_kv_blocks=128, enable_prefix_caching=False, tensor_parallel_size=2,
                  num_threads=1)  # fmt: skip
        try:
            model = llm.llm_engine.executor.model_runner.model
            if llm.llm_engine.executor.kernel_plan.decoder != "fused" or model.model.layers[0].self_attn.tp.shm is None:
                pytest.skip("no one-call decoder stack with the shared-memory all-reduce here")
            runs.append(_generate(llm, requests, layers=rank0_layers))
            assert rank0_layers or model._fused_stack.steps >= PARAMS.max_tokens - 1
        finally:
            llm.llm_engine.close()
    assert runs[0] == runs[1]


def _kernel_linear(dtype: torch.dtype, k: int, starts: list[int], rank: int, seed: int):
    """A hand-made LoRA linear of two slots for the kernel, slot 1 active and slot 0 not (its A
    and B random too: nothing from it may show): the struct, slot 1's A, its whole B [n, parts
    * rank] (block-diagonal) and the buffers the struct points to."""
    generator = torch.Generator().manual_seed(seed)
    parts, n = len(starts) - 1, starts[-1]
    pairs = []
    for _ in range(2):
        a = (torch.randn(parts * rank, k, generator=generator) / k**0.5).to(dtype)
        b = torch.zeros(n, parts * rank)
        for p in range(parts):
            b[starts[p] : starts[p + 1], p * rank : (p + 1) * rank] = torch.randn(starts[p + 1] - starts[p], rank,
                                                                               generator=generator)  # fmt: skip
        pairs.append((a, b.to(dtype)))
    a_buffers = [a for a, _ in pairs]
    b_buffers = [pack_lora_b(b, starts, rank) for _, b in pairs]
    assert all(t.numel() == lora_b_elems(starts, rank, dtype) for t in b_buffers)
    active = torch.tensor([0, 1], dtype=torch.uint8)
    a_ptrs, b_ptrs = ((ctypes.c_void_p * 2)(*(t.data_ptr() for t in ts)) for ts in (a_buffers, b_buffers))
    args = LoRALinearArgs(parts * rank, rank, parts, k, (ctypes.c_int64 * 5)(*starts), ctypes.addressof(a_ptrs),
                          ctypes.addressof(b_ptrs), active.data_ptr(), DTYPE_CODES[dtype], 2)  # fmt: skip
    return args, pairs[1][0], pairs[1][1], (a_buffers, b_buffers, active, a_ptrs, b_ptrs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("k,starts,rank", [(37, [0, 70, 75, 150], 3), (50, [0, 64], 16), (576, [0, 576, 768, 960], 16)])
@pytest.mark.parametrize("rows", [9, 40])
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_the_lora_kernel_adds_the_low_rank_product(dtype, k, starts, rank, rows, isa) -> None:
    """``out += B(A x)`` against float64 (A's product rounded to the dtype, then B's, then the
    sum, as the torch ops would), over k tails, parts' column tails and a part of one column
    chunk, a few rows (the threads split A and B) and many (they split the rows); a row gives
    the same bits alone as in a batch, on one thread or two; a slot that is not active adds
    nothing. On this CPU's own build (bf16 on vdpbf16ps where it has AVX-512 BF16) and on the
    AVX2 build."""
    cpu_kernels = kernels.load(KernelConfig.from_env() if isa == "native" else KernelConfig(isa="avx2"))
    if cpu_kernels is None or not cpu_kernels.gemm_avx2_available:
        pytest.skip("the LoRA kernel needs the AVX2 build")
    args, a, b, keep = _kernel_linear(dtype, k, starts, rank, seed=k)
    x, base = torch.randn(rows, k).to(dtype), torch.randn(rows, starts[-1]).to(dtype)
    out = cpu_kernels.lora_add(args, 1, x, base.clone())
    shrunk = (x.double() @ a.double().T).to(dtype).double()
    expected = base.double() + (shrunk @ b.double().T).to(dtype).double()
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6  # (a rounding or two of the dtype)
    torch.testing.assert_close(out.double(), expected, rtol=4 * step, atol=4 * step * float(expected.abs().max()))
    for row in range(rows):
        alone = cpu_kernels.lora_add(args, 1, x[row : row + 1], base[row : row + 1].clone())
        assert torch.equal(alone, out[row : row + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.lora_add(args, 1, x, base.clone()), out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpu_kernels.lora_add(args, 0, x, base.clone()), base)  # slot 0: not active
    with pytest.raises(ValueError, match="slot"):
        cpu_kernels.lora_add(args, 2, x, base.clone())
    with pytest.raises(ValueError, match="columns"):
        cpu_kernels.lora_add(args, 1, torch.randn(rows, k + 1).to(dtype), base.clone())
    for bad in (base[:, :-1].clone(), torch.zeros(1, dtype=dtype).expand(rows, starts[-1]),
                torch.zeros(starts[-1], 2, dtype=dtype)[:, 0].unsqueeze(0)):  # fmt: skip
        with pytest.raises(ValueError, match="out"):
            cpu_kernels.lora_add(args, 1, x[: bad.shape[0]], bad)
    del keep
