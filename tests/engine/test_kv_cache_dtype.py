"""``kv_cache_dtype="fp8"`` (K/V stored as float8_e4m3fn) and ``"int8"`` (int8 codes and a float32
scale a (token, head) row), through every engine path."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import CacheConfig, resolve_kv_cache_dtype
from pagellm.engine_args import EngineArgs
from pagellm.entrypoints.cli import build_parser
from pagellm.model.arch_config import ModelArchConfig
from pagellm.worker.kv_cache import allocate_kv_cache, bytes_per_block

PROMPT = [(11 * j) % 3000 + 200 for j in range(70)]  # more than four blocks
BUDGET = 8 << 20  # make_llm's kv_cache_memory


def make_llm(path: str, kv_cache_dtype: str, **options) -> LLM:
    return LLM(path, dtype="bfloat16", kv_cache_memory="8MiB", kv_cache_dtype=kv_cache_dtype, **options)


def prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-probabilities of the prompt's own tokens (positions 1..)."""
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([entry[ids[p]].logprob for p, entry in enumerate(out[0].prompt_logprobs) if entry is not None])


def greedy_shortfalls(oracle: LLM, ids: list[int], generated: list[int]) -> torch.Tensor:
    """How far below the oracle's best token each generated token is, in the oracle's
    log-probabilities after the same context (0 where the oracle picks it too)."""
    out = oracle.generate([{"prompt_token_ids": ids + generated}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)  # fmt: skip
    entries = out[0].prompt_logprobs[len(ids) :]
    return torch.tensor([max(e.logprob for e in entry.values()) - entry[t].logprob for t, entry in zip(generated, entries)])


@pytest.fixture(scope="module")
def fp8_llm(tiny_llama_path):
    return make_llm(tiny_llama_path, "fp8")


@pytest.fixture(scope="module")
def int8_llm(tiny_llama_path):
    return make_llm(tiny_llama_path, "int8")


@pytest.fixture(scope="module")
def bf16_llm(tiny_llama_path):
    return make_llm(tiny_llama_path, "auto")


def test_fp8_cache_holds_twice_the_blocks_in_float8(fp8_llm, bf16_llm):
    bf16 = bf16_llm
    engine = fp8_llm.llm_engine
    assert engine.executor.kv_cache_dtype == torch.float8_e4m3fn and bf16.llm_engine.executor.kv_cache_dtype == torch.bfloat16
    assert engine.executor.num_blocks == 2 * bf16.llm_engine.executor.num_blocks
    assert all(t.dtype == torch.float8_e4m3fn for pair in engine.executor.model_runner.kv_cache for t in pair)


def test_fp8_cache_stores_rounded_values_and_the_kernel_reads_them_as_the_oracle_does(fp8_llm, bf16_llm, tiny_llama_path):
    exact = prompt_logprobs(bf16_llm, PROMPT)
    fast = prompt_logprobs(fp8_llm, PROMPT)
    oracle = prompt_logprobs(make_llm(tiny_llama_path, "fp8", attention_backend="reference"), PROMPT)
    torch.testing.assert_close(fast, oracle, atol=0.05, rtol=0)  # same stored values, bf16 vs float32 sums
    diff = (fast - exact).abs()
    assert diff.max() > 0  # the cache really is rounded to fp8 ...
    assert diff.mean() < 0.1  # ... and the model still sees nearly what bf16 gives it


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_prefix_cache_hit_gives_the_same_tokens(kv, request):
    llm = request.getfixturevalue(f"{kv}_llm")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 64  # the stored fp8 / int8 blocks were reused
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_parallel_samples_fork_and_copy_blocks(kv, request):
    # n > 1 forks the prompt's blocks and copies the shared partial block on the first write
    # (an int8 block's scales travel with it: they are in its rows).
    llm = request.getfixturevalue(f"{kv}_llm")
    params = SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True, seed=7)
    out = llm.generate([{"prompt_token_ids": PROMPT[:37]}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 20 for c in out.outputs)
    manager = llm.llm_engine.kv_cache_manager
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_int8_block_takes_a_scale_a_head_and_about_half_of_bf16():
    # A SmolLM2-135M-sized block: 30 layers, 3 KV heads of 64, 16 tokens.
    int8, bf16 = (bytes_per_block(30, 3, 64, 16, dtype) for dtype in (torch.int8, torch.bfloat16))
    assert int8 == 2 * 30 * 16 * 3 * (64 + 4) and bf16 == 2 * 30 * 16 * 3 * 64 * 2
    assert 1.88 < bf16 / int8 < 1.89  # 128 / 68
    arch = ModelArchConfig.from_hf_config(dict(architectures=["LlamaForCausalLM"], hidden_size=576, num_hidden_layers=30,
                                               num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                                               vocab_size=49152))  # fmt: skip
    assert arch.kv_cache_bytes_per_token(torch.int8) * 16 == int8
    assert arch.kv_cache_bytes_per_token(torch.bfloat16) * 16 == bf16
    (key, value), *_ = allocate_kv_cache(2, 5, 16, 3, 64, torch.int8, torch.device("cpu"))
    assert key.shape == value.shape == (5, 16, 3, 68) and key.dtype == torch.int8 and not key.any()


def test_int8_pool_holds_rows_with_scales_and_more_blocks(int8_llm, bf16_llm):
    executor = int8_llm.llm_engine.executor
    arch = executor.arch
    layers, heads, head_dim = arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim
    assert executor.kv_cache_dtype == torch.int8
    assert executor.num_blocks == BUDGET // (2 * layers * 16 * heads * (head_dim + 4))
    assert bf16_llm.llm_engine.executor.num_blocks == BUDGET // (2 * layers * 16 * heads * head_dim * 2)
    ratio = executor.num_blocks / bf16_llm.llm_engine.executor.num_blocks
    assert ratio == pytest.approx(2 * head_dim / (head_dim + 4), rel=1e-3)  # 1.6 at this head dim 16, 1.88 at 64
    caches = [t for pair in executor.model_runner.kv_cache for t in pair]
    assert len(caches) == 2 * layers
    assert all(t.dtype == torch.int8 and t.shape == (executor.num_blocks, 16, heads, head_dim + 4) for t in caches)


def test_int8_cache_stores_quantized_values_and_reads_them_as_the_oracle_does(int8_llm, fp8_llm, bf16_llm, tiny_llama_path):
    exact = prompt_logprobs(bf16_llm, PROMPT)
    fast = prompt_logprobs(int8_llm, PROMPT)
    oracle_llm = make_llm(tiny_llama_path, "int8", attention_backend="reference")
    oracle = prompt_logprobs(oracle_llm, PROMPT)
    torch.testing.assert_close(fast, oracle, atol=0.05, rtol=0)  # same stored values, bf16 vs float32 sums
    torch_path = prompt_logprobs(make_llm(tiny_llama_path, "int8", attention_backend="torch_sdpa"), PROMPT)
    torch.testing.assert_close(torch_path, oracle, atol=0.05, rtol=0)
    diff = (fast - exact).abs()
    assert diff.max() > 0  # the cache really is quantized ...
    assert diff.mean() < 0.05  # ... and the model still sees nearly what bf16 gives it:
    assert diff.mean() < (prompt_logprobs(fp8_llm, PROMPT) - exact).abs().mean()  # closer than fp8's
    # Greedy decoding picks the oracle's best token at every step (up to bf16 ties).
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    generated = list(int8_llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert len(generated) == 16
    assert greedy_shortfalls(oracle_llm, PROMPT, generated).max() < 0.05


def test_int8_generates_text_end_to_end(int8_llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3)
    outs = int8_llm.generate(["The capital of France is", "Once upon a time"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24]
    assert all(o.outputs[0].text for o in outs)
    manager = int8_llm.llm_engine.kv_cache_manager
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_kv_cache_dtype_is_validated_and_on_the_cli():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert EngineArgs.from_cli_args(args).kv_cache_dtype == "fp8"
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert EngineArgs.from_cli_args(args).kv_cache_dtype == "int8"
    assert resolve_kv_cache_dtype("int8", torch.bfloat16) == torch.int8
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
