"""Multi-head latent attention (DeepSeek-V3's MLA): the cache holds one latent row a token and
layer, and every path that moves K/V (copy-on-write forks, the disk tier, speculation) moves it.
Greedy equality with transformers through every batching configuration: test_engine_vs_hf.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm import LLM, BeamSearchParams, SamplingParams
from pagellm.model import load_arch_config
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.lora_adapter import LoRAAdapterError, inspect_adapter
from pagellm.model.mla_prefill import expanded_values, expands
from pagellm.model.mla_shape import MlaShape, mla_config
from pagellm.lora_request import LoRARequest
from tests.helpers.hf_reference import hf_beam_search, hf_greedy, load_hf_model
from tests.helpers.lora_adapters import write_lora_adapter

PROMPTS = ["The best part of", "Once upon a time, in a land far", "1, 2, 3,"]


def test_the_cache_holds_one_latent_row_a_token(tiny_deepseek_v3_path: str) -> None:
    """Each layer's pair is one tensor of one head as wide as the latent and the rotary part
    (32 + 8), and the pool is sized for that: a budget of 64 blocks' bytes gives 64 blocks."""
    arch = load_arch_config(tiny_deepseek_v3_path)
    assert (arch.num_key_value_heads, arch.head_dim, arch.rotary_dim) == (1, 40, 8)
    per_token = arch.kv_cache_bytes_per_token(torch.float32)
    assert per_token == 3 * 40 * 4  # (3 layers, float32, no separate values)
    llm = LLM(tiny_deepseek_v3_path, dtype="float32", block_size=4, kv_cache_memory=64 * 4 * per_token)
    executor = llm.llm_engine.executor
    assert executor.num_blocks == 64
    for key_cache, value_cache in executor.model_runner.kv_cache:
        assert key_cache is value_cache and tuple(key_cache.shape) == (64, 4, 1, 40)
    llm.llm_engine.close()


def test_long_prompts_attend_through_the_expanded_keys_and_values(tiny_deepseek_v3_path: str, monkeypatch) -> None:
    """Prompts of more new tokens than the expansion costs (32 at this shape) attend through the
    expanded keys and values, beside short ones in the latent's space in the same step, fresh, in
    chunks over their earlier chunks, and over prefix-cache hits: transformers' tokens throughout."""
    import pagellm.model.mla as mla

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3].mask is None)  # (a fresh prompt: causal; over context: masked)
        return expanded_values(*args, **kwargs)

    monkeypatch.setattr(mla, "expanded_values", counted)
    prompts = [[300 + (7 * i) % 900 for i in range(90)], [5, 9, 200, 31, 8], [1200 + (11 * i) % 700 for i in range(60)]]
    hf_model = load_hf_model(tiny_deepseek_v3_path)
    expected = [hf_greedy(hf_model, p, 12) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for options in (dict(block_size=16), dict(block_size=4, max_num_batched_tokens=40)):
        calls.clear()
        llm = LLM(tiny_deepseek_v3_path, dtype="float32", **options)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert True in calls and (options.get("max_num_batched_tokens") is None or False in calls)
    # The first prompt again with 40 more tokens: 88 positions from the prefix cache, 42 new ones.
    longer = prompts[0] + [700 + i for i in range(40)]
    calls.clear()
    out = llm.generate([{"prompt_token_ids": longer}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 88 and calls == [False] * 3  # (3 layers)
    assert out.outputs[0].token_ids == hf_greedy(hf_model, longer, 12)


def test_a_short_prompt_over_blocks_a_long_one_computes_in_its_step(tiny_deepseek_v3_path: str) -> None:
    """A long prompt (expanded) and the same prompt with 3 more tokens in one batch: the second
    hits the blocks the first computes in that very step, and attends over them in the latent's
    space (their rows written before it reads them): transformers' tokens for both."""
    shared = [500 + i for i in range(40)]
    prompts = [shared, shared + [7, 8, 9]]
    hf_model = load_hf_model(tiny_deepseek_v3_path)
    llm = LLM(tiny_deepseek_v3_path, dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert outputs[1].num_cached_tokens == 40
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 4) for p in prompts]


def test_beam_search_forks_the_latent_rows(tiny_deepseek_v3_path: str, default_tokenizer) -> None:
    """Beams share blocks and fork them by copy-on-write (the one latent tensor copied once):
    the best beam equals Hugging Face's, in a pool small enough to preempt too."""
    hf_model = load_hf_model(tiny_deepseek_v3_path)
    llm = LLM(tiny_deepseek_v3_path, dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=64)
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=10), use_tqdm=False)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.stats.forks > 0
    for prompt, output in zip(PROMPTS, outputs):
        ids = default_tokenizer(prompt).input_ids
        expected = hf_beam_search(hf_model, ids, 3, 10, 1.0, default_tokenizer.eos_token_id)
        assert output.sequences[0].tokens == ids + expected, prompt
    assert engine.kv_cache_manager.num_free_blocks == engine.executor.num_blocks


def test_an_evicted_prefix_comes_back_from_disk(tiny_deepseek_v3_path: str, tmp_path) -> None:
    """The disk tier writes and reads each block's latent rows once (an entry holds the one
    tensor a layer), and a prefix evicted from the pool comes back with the same output."""
    prompt = {"prompt_token_ids": [(17 * i) % 2000 + 300 for i in range(40)]}
    others = [{"prompt_token_ids": [(31 * i + 7 * r) % 2000 + 300 for i in range(40)]} for r in range(1, 4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = LLM(tiny_deepseek_v3_path, block_size=4, num_kv_blocks=16, enable_prefix_caching=False)
    expected = cold.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(tiny_deepseek_v3_path, block_size=4, num_kv_blocks=16, kv_offload_dir=str(tmp_path),
              kv_offload_size="1MiB")  # fmt: skip
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    for other in others:  # (each evicts the last one's blocks)
        llm.generate([other], params, use_tqdm=False)
    engine = llm.llm_engine
    before = engine.stats.disk_tier_loaded_blocks
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected and out.num_cached_tokens == 36
    assert engine.stats.disk_tier_loaded_blocks - before == 9
    caches = engine.executor.model_runner.disk_tier.caches
    assert len(caches) == 3  # (a tensor a layer, not a key and a value)
    engine.close()


def test_speculation_gives_plain_decoding_output(tiny_deepseek_v3_path: str) -> None:
    """N-gram drafts verified over the latent rows (rejected ones cut back): plain greedy output."""
    prompt = {"prompt_token_ids": [300 + i % 7 for i in range(48)]}  # (repetitive: drafts found)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny_deepseek_v3_path, dtype="float32", block_size=4)
    spec = LLM(tiny_deepseek_v3_path, dtype="float32", block_size=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None,
                                   "adaptive": False})  # fmt: skip
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert spec.llm_engine.stats.spec_num_draft_tokens > 0


def test_adapters_on_the_mlp_run_and_on_latent_attention_are_refused(tiny_deepseek_v3_path: str, tmp_path,
                                                                      default_tokenizer) -> None:
    """An adapter on the dense first layer's MLP gives the tokens of the model with the adapter
    merged into its weights; one on MLA's projections is refused by name when read."""
    mlp = write_lora_adapter(str(tmp_path / "mlp"), tiny_deepseek_v3_path, seed=3, targets=_MLP, layers=[0])
    ids = default_tokenizer(PROMPTS[1]).input_ids
    expected = hf_greedy(_merged(tiny_deepseek_v3_path, mlp), ids, 8)
    assert expected != hf_greedy(load_hf_model(tiny_deepseek_v3_path), ids, 8)
    llm = LLM(tiny_deepseek_v3_path, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       lora_request=LoRARequest("mlp", 1, _first_layer_only(mlp)), use_tqdm=False)  # fmt: skip
    assert out[0].outputs[0].token_ids == expected
    attention = write_lora_adapter(str(tmp_path / "o"), tiny_deepseek_v3_path, seed=4, targets=["o_proj"])
    with pytest.raises(LoRAAdapterError, match="multi-head latent attention"):
        inspect_adapter(attention, load_arch_config(tiny_deepseek_v3_path), 8)


_MLP = ("gate_proj", "up_proj", "down_proj")


def _merged(base: str, adapter: str) -> torch.nn.Module:
    """The base model with the adapter's first-layer MLP deltas (scale * B @ A) added to its
    weights: the reference (PEFT itself also puts adapters of its own on a transformers-5 MoE
    model's experts, which this adapter's config does not ask for)."""
    model = load_hf_model(base)
    tensors = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    with torch.no_grad():
        for name in _MLP:
            prefix = f"base_model.model.model.layers.0.mlp.{name}"
            delta = tensors[f"{prefix}.lora_B.weight"] @ tensors[f"{prefix}.lora_A.weight"]
            getattr(model.model.layers[0].mlp, name).weight += config["lora_alpha"] / config["r"] * delta
    return model


def _first_layer_only(folder: str) -> str:
    """The adapter's first-layer tensors only, and its config saying so (PEFT's experts' adapters
    dropped: pagellm refuses adapters on experts)."""
    weights = Path(folder) / "adapter_model.safetensors"
    tensors = {k: v for k, v in load_file(str(weights)).items() if ".layers.0." in k}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config_file = Path(folder) / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(alpha_pattern={}, rank_pattern={}, target_parameters=None)
    config_file.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("field, value", [("kv_lora_rank", 0), ("qk_rope_head_dim", 7), ("v_head_dim", -1),
                                          ("q_lora_rank", -4), ("qk_nope_head_dim", 0)])  # fmt: skip
def test_a_bad_shape_is_refused_by_name(field: str, value: int) -> None:
    config = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=24)
    with pytest.raises(ValueError, match=field):
        mla_config("DeepseekV3ForCausalLM", {**config, field: value})


def test_which_requests_expand() -> None:
    """Past 170 new tokens at DeepSeek-V3's shape (the expansion's cost a position over the pairs'
    savings), while the expanded context fits 256 MiB (1,365 positions of 128 heads, twice that
    for a rank of two)."""
    v3 = MlaShape(1536, 512, 128, 64, 128)
    assert not expands(v3, 170, 1000, 128) and expands(v3, 171, 1000, 128)
    assert expands(v3, 500, 1365, 128) and not expands(v3, 500, 1366, 128) and expands(v3, 500, 2730, 64)


def test_a_routing_deepseek_v2_lacks_is_refused_by_name(tiny_deepseek_v2_path: str) -> None:
    config = json.loads((Path(tiny_deepseek_v2_path) / "config.json").read_text())
    assert ModelArchConfig.from_hf_config(config).moe_groups == (4, 2)  # (group_limited_greedy)
    assert ModelArchConfig.from_hf_config({**config, "topk_method": "greedy"}).moe_groups == (1, 1)
    with pytest.raises(NotImplementedError, match="topk_method 'noaux_tc' is not supported"):
        ModelArchConfig.from_hf_config({**config, "topk_method": "noaux_tc"})


@pytest.mark.parametrize("value", ["512", 512.5, None, True, [512], 10**40 * 1.0])
def test_a_shape_field_of_the_wrong_type_is_refused_by_name(value: object) -> None:
    config = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    with pytest.raises(ValueError, match="kv_lora_rank must be a whole number"):
        mla_config("DeepseekV3ForCausalLM", {**config, "kv_lora_rank": value})


def test_a_config_without_the_shape_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="lacks qk_rope_head_dim, v_head_dim"):
        mla_config("DeepseekV3ForCausalLM", dict(kv_lora_rank=32, qk_nope_head_dim=16))


def test_the_scores_scale_takes_yarns_mscale_twice() -> None:
    """qk_head_dim ** -0.5, times (0.1 * mscale_all_dim * ln(factor) + 1) ** 2 under YaRN (DeepSeek-V3's
    factor 40: 0.0722 -> 0.1373); the plain rope's unchanged."""
    config = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536)
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    _, shape, plain = mla_config("DeepseekV3ForCausalLM", config)
    _, _, scaled = mla_config("DeepseekV3ForCausalLM", {**config, "rope_scaling": yarn})
    assert shape == MlaShape(1536, 512, 128, 64, 128) and shape.cache_width == 576
    assert plain["attention_scale"] == pytest.approx(192**-0.5)
    assert scaled["attention_scale"] == pytest.approx(192**-0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
