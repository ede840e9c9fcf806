"""GGUF files of each family, written as llama.cpp's converter writes them, give the HF model's
greedy tokens (float32); expert tensors keep their blocks; what the files leave out is decided
as llama.cpp decides it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.benchmarks.requantize import requantize_gguf
from pagellm.model import load_arch_config
from tests.helpers.gguf_writer import write_gguf
from tests.helpers.hf_reference import hf_greedy, load_hf_model
from tests.helpers.tiny_models import TINY_SHAPE, token_ids, write_tiny_model

PROMPTS = [[1, *range(500, 530)], [1, *range(700, 712)]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def gguf_families(tmp_path_factory: pytest.TempPathFactory, default_tokenizer, default_model_path_fixture: str,
                  tiny_qwen3_path: str, tiny_mixtral_path: str, tiny_phi3_path: str,
                  tiny_phi3_longrope_path: str, tiny_phi4_mini_path: str, tiny_granite_path: str,
                  tiny_olmo2_path: str, tiny_glm4_path: str, tiny_lfm2_path: str,
                  tiny_qwen3_5_path: str, tiny_qwen3_5_moe_path: str,
                  tiny_granite_hybrid_path: str) -> dict[str, tuple[str, str]]:  # fmt: skip
    """Family -> (HF folder, its GGUF file). Gemma's score scale is head_dim's, as llama.cpp
    reads a file without query_pre_attn_scalar; Gemma 3 keeps its default pattern of windowed
    layers (a file does not say another); Qwen3-MoE routes in every layer; SmolLM3 has no rope
    in every 4th layer (llama.cpp's fixed step: the converter writes none)."""
    from transformers import Gemma2Config, Gemma3TextConfig, Qwen3MoeConfig, SmolLM3Config

    ids = token_ids(default_tokenizer)
    built = {
        "qwen3moe": Qwen3MoeConfig(**TINY_SHAPE, **ids, head_dim=32, moe_intermediate_size=32, num_experts=8,
                                   num_experts_per_tok=2, norm_topk_prob=True, initializer_range=0.1,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "gemma2": Gemma2Config(**TINY_SHAPE, **ids, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0, initializer_range=0.1),
        "gemma3": Gemma3TextConfig(**{**TINY_SHAPE, "num_hidden_layers": 6}, **ids, head_dim=16, sliding_window=8,
                                   query_pre_attn_scalar=16, initializer_range=0.1, rope_parameters={
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
        "smollm3": SmolLM3Config(**{**TINY_SHAPE, "num_hidden_layers": 4}, **ids, tie_word_embeddings=True,
                                 initializer_range=0.1),
    }  # fmt: skip
    folders = {"qwen3": tiny_qwen3_path, "mixtral": tiny_mixtral_path, "phi3": tiny_phi3_path,
               "phi3-longrope": tiny_phi3_longrope_path, "phi4-mini": tiny_phi4_mini_path, "granite": tiny_granite_path,
               "olmo2": tiny_olmo2_path, "glm4": tiny_glm4_path, "lfm2": tiny_lfm2_path, "qwen35": tiny_qwen3_5_path,
               "qwen35moe": tiny_qwen3_5_moe_path, "granitehybrid": tiny_granite_hybrid_path}
    for name, config in built.items():
        folders[name] = write_tiny_model(tmp_path_factory.mktemp(f"hf_{name}"), config, default_tokenizer)
    out = tmp_path_factory.mktemp("gguf")
    return {name: (folder, write_gguf(folder, out / f"{name}.gguf", default_model_path_fixture))
            for name, folder in folders.items()}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3", "qwen3moe", "mixtral", "gemma2", "gemma3", "phi3", "phi3-longrope",
                                    "phi4-mini", "smollm3", "granite", "olmo2", "glm4", "lfm2", "qwen35",
                                    "qwen35moe", "granitehybrid"])
def test_gguf_greedy_equals_hf(gguf_families: dict[str, tuple[str, str]], family: str) -> None:
    folder, gguf = gguf_families[family]
    expected = [hf_greedy(load_hf_model(folder), p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(gguf, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_gguf_fields_follow_llama_cpp(gguf_families: dict[str, tuple[str, str]]) -> None:
    mixtral = load_arch_config(gguf_families["mixtral"][1])
    assert mixtral.architecture == "MixtralForCausalLM" and mixtral.num_experts == 4 and mixtral.moe_layers == (0, 1)
    qwen3moe = load_arch_config(gguf_families["qwen3moe"][1])
    assert qwen3moe.norm_topk_prob and qwen3moe.moe_intermediate_size == 32
    gemma3 = load_arch_config(gguf_families["gemma3"][1])
    assert [gemma3.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    assert gemma3.local_rope_theta == 10000.0 and gemma3.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    gemma2 = load_arch_config(gguf_families["gemma2"][1])
    assert gemma2.attention_scale == 16**-0.5 and gemma2.attn_logit_softcapping == 5.0
    assert load_arch_config(gguf_families["gemma2"][0]).layer_types == gemma2.layer_types
    lfm2, lfm2_hf = load_arch_config(gguf_families["lfm2"][1]), load_arch_config(gguf_families["lfm2"][0])
    assert lfm2.layer_types == lfm2_hf.layer_types == ("conv", "conv", "full_attention", "conv")
    assert (lfm2.intermediate_size, lfm2.conv_kernel, lfm2.num_key_value_heads) == (256, 3, 2)


def test_quantized_experts_keep_their_blocks(gguf_families: dict[str, tuple[str, str]], tmp_path: Path) -> None:
    """Q8_0 experts (one 3-D tensor per layer) load as each expert's blocks, holding exactly
    the values a dequantizing load gives; the engine runs them on the integer GEMM."""
    from gguf import GGMLQuantizationType

    from pagellm.model.gguf_blocks import GGUFRows
    from pagellm.model.gguf_loader import iter_gguf_weights, open_gguf

    q8 = str(tmp_path / "mixtral-q8_0.gguf")
    assert "blk.0.ffn_up_exps.weight" in requantize_gguf(gguf_families["mixtral"][1], q8, GGMLQuantizationType.Q8_0)
    arch = load_arch_config(q8)
    kept = dict(iter_gguf_weights(open_gguf(q8), arch, keep_quantized=True))
    dense = dict(iter_gguf_weights(open_gguf(q8), arch))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert isinstance(kept[name], GGUFRows) and kept[name].format == "q8"
    assert torch.equal(kept[name].dequantize(), dense[name])
    llm = LLM(q8, dtype="bfloat16")
    if llm.llm_engine.executor.kernel_plan.weights == "gguf":  # (a CPU with the integer GEMM)
        expert = llm.llm_engine.executor.model_runner.model.model.layers[1].mlp.experts[3]
        assert expert.gate_up_proj.format == "q8"


def test_a_qwen3_5_file_keeps_llama_cpps_value_head_order(
    gguf_families: dict[str, tuple[str, str]], tmp_path: Path
) -> None:
    """The converter tiles the delta-nets' value heads (the model reads them so: no column order
    of a quantized out_proj could be undone) and appends no layer here; in a Q8_0 file each
    attention head's query and output gate are split out of ``q_proj``'s blocks, equal to the
    dequantized split."""
    from gguf import GGMLQuantizationType

    from pagellm.model.gguf_loader import iter_gguf_weights, open_gguf
    from pagellm.model.weight_names import checkpoint_parts

    folder, gguf = gguf_families["qwen35"]
    arch, hf_arch = load_arch_config(gguf), load_arch_config(folder)
    assert arch.layer_types == hf_arch.layer_types and arch.delta_net is not None and hf_arch.delta_net is not None
    assert arch.delta_net.tiled_value_heads and not hf_arch.delta_net.tiled_value_heads
    q8 = str(tmp_path / "qwen35-q8_0.gguf")
    assert "blk.2.attn_q.weight" in requantize_gguf(gguf, q8, GGMLQuantizationType.Q8_0)
    name = "model.layers.2.self_attn.q_proj.weight"
    kept = dict(iter_gguf_weights(open_gguf(q8), arch, keep_quantized=True))[name]
    dense = dict(iter_gguf_weights(open_gguf(q8), arch))[name]
    pairs = zip(checkpoint_parts(arch, name, kept), checkpoint_parts(arch, name, dense))
    for (part, rows), (dense_part, dense_rows) in pairs:
        assert part == dense_part and torch.equal(rows.dequantize(), dense_rows)
    llm = LLM(q8, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
