"""``kv_cache_dtype="fp8"``: K/V stored as float8_e4m3fn, through every engine path."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import CacheConfig
from pagellm.engine_args import EngineArgs
from pagellm.entrypoints.cli import build_parser

PROMPT = [(11 * j) % 3000 + 200 for j in range(70)]  # more than four blocks


def make_llm(path: str, kv_cache_dtype: str, **options) -> LLM:
    return LLM(path, dtype="bfloat16", kv_cache_memory="8MiB", kv_cache_dtype=kv_cache_dtype, **options)


def prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-probabilities of the prompt's own tokens (positions 1..)."""
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([entry[ids[p]].logprob for p, entry in enumerate(out[0].prompt_logprobs) if entry is not None])


@pytest.fixture(scope="module")
def fp8_llm(tiny_llama_path):
    return make_llm(tiny_llama_path, "fp8")


def test_fp8_cache_holds_twice_the_blocks_in_float8(fp8_llm, tiny_llama_path):
    bf16 = make_llm(tiny_llama_path, "auto")
    engine = fp8_llm.llm_engine
    assert engine.executor.kv_cache_dtype == torch.float8_e4m3fn and bf16.llm_engine.executor.kv_cache_dtype == torch.bfloat16
    assert engine.executor.num_blocks == 2 * bf16.llm_engine.executor.num_blocks
    assert all(t.dtype == torch.float8_e4m3fn for pair in engine.executor.model_runner.kv_cache for t in pair)


def test_fp8_cache_stores_rounded_values_and_the_kernel_reads_them_as_the_oracle_does(fp8_llm, tiny_llama_path):
    exact = prompt_logprobs(make_llm(tiny_llama_path, "auto"), PROMPT)
    fast = prompt_logprobs(fp8_llm, PROMPT)
    oracle = prompt_logprobs(make_llm(tiny_llama_path, "fp8", attention_backend="reference"), PROMPT)
    torch.testing.assert_close(fast, oracle, atol=0.05, rtol=0)  # same stored values, bf16 vs float32 sums
    diff = (fast - exact).abs()
    assert diff.max() > 0  # the cache really is rounded to fp8 ...
    assert diff.mean() < 0.1  # ... and the model still sees nearly what bf16 gives it


def test_fp8_prefix_cache_hit_gives_the_same_tokens(fp8_llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = fp8_llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    second = fp8_llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 64  # the stored fp8 blocks were reused
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_fp8_parallel_samples_fork_and_copy_blocks(fp8_llm):
    # n > 1 forks the prompt's blocks and copies the shared partial block on the first write.
    params = SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True, seed=7)
    out = fp8_llm.generate([{"prompt_token_ids": PROMPT[:37]}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 20 for c in out.outputs)
    manager = fp8_llm.llm_engine.kv_cache_manager
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_kv_cache_dtype_is_validated_and_on_the_cli():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert EngineArgs.from_cli_args(args).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
