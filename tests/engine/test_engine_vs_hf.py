"""Greedy outputs equal Hugging Face transformers token for token, whatever the batching."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.model import load_arch_config
from tests.helpers.hf_reference import hf_greedy, load_hf_model

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms",
    "1 2 3",
    "Paged attention splits the KV cache into blocks so that",
]
MAX_TOKENS = 24


# Families whose attention, cache or expert path differs (windows, soft caps, sinks, MoE routing,
# scaled rope): every batching configuration below. The rest differ from these only in how their
# weights map onto the shared layer description: a plain and a chunked run each.
BATCHING_FAMILIES = ["tiny_llama_path", "tiny_qwen2_path", "tiny_qwen3_path", "tiny_qwen2_yarn_path", "tiny_phi3_path",
                     "tiny_phi3_longrope_path", "tiny_mistral_window_path", "tiny_qwen3_moe_path", "tiny_mixtral_path",
                     "tiny_gemma2_path", "tiny_gemma3_path", "tiny_qwen3_window_path", "tiny_gpt_oss_path",
                     "tiny_olmo3_path", "tiny_exaone4_path", "tiny_lfm2_path", "tiny_granite_hybrid_path",
                     "tiny_qwen3_5_path", "tiny_deepseek_v3_path"]  # fmt: skip
MAPPING_FAMILIES = ["tiny_phi4_mini_path", "tiny_smollm3_path", "tiny_olmo2_path", "tiny_granite_path",
                    "tiny_glm4_moe_path", "tiny_qwen2_moe_path", "tiny_glm4_path", "tiny_seed_oss_path",
                    "tiny_ernie4_5_path", "tiny_hunyuan_path", "tiny_granite_hybrid_moe_path",
                    "tiny_qwen3_5_moe_path", "tiny_bamba_path", "tiny_deepseek_v3_yarn_path",
                    "tiny_glm4_moe_lite_path", "tiny_deepseek_v2_path"]  # fmt: skip
CONFIGS = {
    "bs16": dict(block_size=16),
    "bs1": dict(block_size=1),
    # Small step budget: long prompts are prefilled in chunks, mixed with decodes.
    "chunked": dict(block_size=4, max_num_batched_tokens=7),
    # A pool so small that requests are preempted and recomputed.
    "preempt": dict(block_size=4, num_kv_blocks=24, max_model_len=96),
}
CASES = [pytest.param(family, CONFIGS[name], id=f"{family}-{name}")
         for families, names in ((BATCHING_FAMILIES, CONFIGS), (MAPPING_FAMILIES, ["bs16", "chunked"]))
         for family in families for name in names]  # fmt: skip


@pytest.fixture(scope="module", params=BATCHING_FAMILIES + MAPPING_FAMILIES)
def model_and_reference(request, default_tokenizer):
    """A tiny model's path and HF's greedy tokens for every prompt (computed once)."""
    path = request.getfixturevalue(request.param)
    hf_model = load_hf_model(path)
    expected = [hf_greedy(hf_model, default_tokenizer(p).input_ids, MAX_TOKENS) for p in PROMPTS]
    return path, expected


@pytest.mark.parametrize(("model_and_reference", "engine_kwargs"), CASES, indirect=["model_and_reference"])
def test_greedy_matches_hf(model_and_reference, engine_kwargs):
    path, expected = model_and_reference
    if engine_kwargs.get("num_kv_blocks") and load_arch_config(path).window_of_every_layer:
        # Blocks before every layer's window are released: a smaller pool still forces preemption.
        engine_kwargs = {**engine_kwargs, "num_kv_blocks": 13, "max_model_len": 52}
    llm = LLM(path, dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.prompt for o in outputs] == PROMPTS
    engine = llm.llm_engine
    if engine_kwargs.get("num_kv_blocks"):
        assert engine.stats.num_preemptions > 0, "the small pool was meant to force preemption"
    assert engine.kv_cache_manager.num_free_blocks == engine.executor.num_blocks


def test_prefix_cache_hits_give_the_same_tokens(model_and_reference):
    """The prompts again, in reverse order: their leading blocks come from the prefix cache
    (released ones too, behind a window, while nobody has taken them; a hybrid's with the
    states kept at their ends: every block's, or the scan layers' sparse snapshots)."""
    path, expected = model_and_reference
    llm = LLM(path, dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    again = llm.generate(PROMPTS[::-1], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected[::-1]
    assert llm.llm_engine.stats.prefix_cache_hits > 0


def test_a_window_every_layer_keeps_holds_only_its_blocks(tiny_mistral_window_path: str):
    """Window 8, blocks of 4, prompts one at a time (prefill of up to 16 tokens a step): a
    request holds at most the blocks its window and one step's tokens span, while a model
    without the window holds its whole history; the tokens are the same as unbounded ones'
    (greedy equality with transformers is above)."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm = LLM(tiny_mistral_window_path, dtype="float32", block_size=4, max_num_seqs=1, max_num_batched_tokens=16)
    llm.generate(PROMPTS[:2], params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.sliding_window == 8
    longest = max(len(p) for p in engine.tokenizer(PROMPTS[:2]).input_ids)
    # (prefill: every prompt block at once; decode: 8 positions + the new one span <= 4 blocks)
    assert engine.stats.peak_blocks_in_use <= max(-(-longest // 4), 4)
    assert engine.kv_cache_manager.num_free_blocks == engine.executor.num_blocks


def test_a_window_every_layer_keeps_serves_contexts_longer_than_the_pool(tiny_mistral_window_path: str,
                                                                        tiny_llama_path: str, default_tokenizer):
    """Window 8, blocks of 4, 6 blocks (24 tokens), steps of up to 8 tokens: a request never
    holds more than 5 blocks, so max_model_len is the model's 512, and prompts and outputs far
    longer than the pool (run twice: the second time their prefix hits before the window are
    never revived) give transformers' tokens; a model without the window is held to the pool."""
    prompts = [" ".join(PROMPTS) * 2, PROMPTS[2]]
    ids = [default_tokenizer(p).input_ids for p in prompts]
    assert len(ids[0]) > 24
    expected = [hf_greedy(load_hf_model(tiny_mistral_window_path), i, 60) for i in ids]
    llm = LLM(tiny_mistral_window_path, dtype="float32", block_size=4, num_kv_blocks=6, max_num_batched_tokens=8)
    assert llm.llm_engine.max_model_len == 512
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    engine = llm.llm_engine
    assert engine.stats.prefix_cache_hits > 0 and engine.stats.peak_blocks_in_use <= 6
    assert engine.kv_cache_manager.num_free_blocks == 6
    assert LLM(tiny_llama_path, dtype="float32", block_size=4, num_kv_blocks=6).llm_engine.max_model_len == 24


@pytest.mark.parametrize("block_size", [16, 1])
def test_dynamic_rope_past_the_context_matches_hf(tiny_llama_dynamic_path: str, default_tokenizer, block_size: int):
    """Dynamic NTK: each token turns by the base of its sequence's length when computed, as HF's
    per-forward update does for one sequence (a fresh HF model per prompt: its rotary keeps
    the longest length it saw). Whole prompts in one step: a chunked prefill would turn the
    first chunk by its own, shorter length."""
    expected = [hf_greedy(load_hf_model(tiny_llama_dynamic_path), default_tokenizer(p).input_ids, MAX_TOKENS)
                for p in PROMPTS]  # fmt: skip
    llm = LLM(tiny_llama_dynamic_path, dtype="float32", block_size=block_size)
    assert llm.llm_engine.max_model_len == 64  # the context of 16, times the factor
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
