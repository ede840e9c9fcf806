"""Config parsing, rope math and checkpoint layouts (sharded safetensors, GGUF folders)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm.attention.reference import ReferenceAttention
from pagellm.model import ModelArchConfig, default_model_path, load_arch_config, load_model, resolve_model_path
from pagellm.model.gguf_families import unpermute_qk_rows
from pagellm.model.layers import RotaryEmbedding, compute_inv_freq, default_inv_freq

LLAMA31_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "tie_word_embeddings": False,
    "attention_bias": False,
}


def test_from_hf_config_old_style_rope_and_eos_lists() -> None:
    arch = ModelArchConfig.from_hf_config(LLAMA31_CONFIG, {"eos_token_id": [128009, 128010]})
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "llama3"
    assert arch.eos_token_ids == [128001, 128008, 128009, 128010]
    assert (arch.head_dim, arch.num_key_value_heads, arch.bos_token_id) == (128, 8, 128000)
    assert arch.kv_cache_bytes_per_token(torch.bfloat16) == 2 * 32 * 8 * 128 * 2


def test_from_hf_config_legacy_type_key_and_biases() -> None:
    legacy = dict(LLAMA31_CONFIG, rope_scaling={"type": "llama3", "factor": 8.0}, attention_bias=True)
    arch = ModelArchConfig.from_hf_config(legacy)
    assert arch.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    assert arch.attention_bias and arch.o_proj_bias  # Llama's flag covers o_proj too
    qwen = dict(LLAMA31_CONFIG, architectures=["Qwen2ForCausalLM"], rope_scaling=None)
    qwen.pop("attention_bias")
    arch = ModelArchConfig.from_hf_config(qwen)
    assert arch.attention_bias and not arch.o_proj_bias and arch.rope_scaling is None


def test_tiny_configs_read_transformers5_rope_parameters(tiny_llama_path: str, tiny_qwen2_path: str) -> None:
    llama = load_arch_config(tiny_llama_path)
    assert llama.rope_theta == 10000.0 and llama.rope_scaling["rope_type"] == "llama3"
    assert "rope_theta" not in llama.rope_scaling
    assert (llama.vocab_size, llama.bos_token_id, llama.eos_token_ids) == (49152, 1, [2])
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (4, 2, 16)
    qwen = load_arch_config(tiny_qwen2_path)
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.attention_bias and qwen.tie_word_embeddings
    assert qwen.rope_theta == 1000000.0 and qwen.rope_scaling is None and qwen.sliding_window is None


def test_llama3_inv_freq_matches_hf(tiny_llama_path: str) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(tiny_llama_path, local_files_only=True)
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    arch = load_arch_config(tiny_llama_path)
    ours = compute_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    torch.testing.assert_close(ours, reference, atol=0, rtol=0)
    assert not torch.equal(ours, default_inv_freq(arch.head_dim, arch.rope_theta))  # scaling is in effect


ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
                 "short_factor": [1.0 + 0.1 * i for i in range(32)], "long_factor": [1.5 + 0.5 * i for i in range(32)]},
    "yarn-no-factor": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": None,
                       "original_max_position_embeddings": 128, "truncate": False},
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variants_match_hf(variant: str) -> None:
    """linear and YaRN inverse frequencies and attention factor: HF's, bit for bit."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagellm.model.layers import rope_attention_factor

    rope = ROPE_VARIANTS[variant]
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=512, rope_parameters=dict(rope))
    reference, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device("cpu"))
    arch = ModelArchConfig.from_hf_config(config.to_dict())
    ours = compute_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings)
    torch.testing.assert_close(ours, reference, atol=0, rtol=0)
    assert rope_attention_factor(arch.rope_scaling, arch.max_position_embeddings) == factor
    assert not torch.equal(ours, default_inv_freq(arch.head_dim, arch.rope_theta))
    if rope["rope_type"] == "longrope":  # from the original context on: the long factors, per position
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=129)
        rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings)
        cos, _ = rotary.cos_sin(torch.tensor([127, 128, 300]), torch.float32)
        for row, position, inv in ((0, 127, reference), (1, 128, long), (2, 300, long)):
            expected = torch.cat([position * inv, position * inv]).cos() * factor
            assert torch.equal(cos[row], expected)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    """llama.cpp's converter permute (copied from convert_hf_to_gguf.py), then ours, is the identity."""
    heads, head_dim, cols = 3, 8, 5
    weight = torch.randn(heads * head_dim, cols)
    permuted = weight.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(weight.shape)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_qk_rows(permuted, heads), weight)


def test_sharded_safetensors_with_index(tmp_path: Path, tiny_llama_path: str) -> None:
    """Weights split across two shards (with an index) load to the same parameters."""
    source = Path(tiny_llama_path)
    weights = load_file(str(source / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text((source / "config.json").read_text())

    sharded, _ = load_model(str(tmp_path), torch.float32, ReferenceAttention())
    single, _ = load_model(tiny_llama_path, torch.float32, ReferenceAttention())
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert torch.equal(a, b), name


def test_model_path_forms(tmp_path: Path, tiny_llama_path: str) -> None:
    """None -> default GGUF; a folder with one .gguf -> that file; an HF folder -> the folder."""
    gguf = default_model_path()
    assert resolve_model_path(None) == gguf and gguf.endswith(".gguf")
    (tmp_path / "model.gguf").symlink_to(gguf)
    assert resolve_model_path(str(tmp_path)) == str(tmp_path / "model.gguf")
    assert resolve_model_path(tiny_llama_path) == tiny_llama_path
    (tmp_path / "other.gguf").symlink_to(gguf)
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_model_path(str(tmp_path))


def test_partial_rotary_turns_the_leading_dims() -> None:
    """A rotary embedding over part of each head (Phi-4-mini: 3/4 of 128 dims); an odd count of
    dims cannot be turned in pairs: refused."""
    from pagellm.model.registry import validate_arch_config

    config = dict(LLAMA31_CONFIG, architectures=["Phi3ForCausalLM"], rope_scaling=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})  # fmt: skip
    arch = ModelArchConfig.from_hf_config(config)
    assert arch.partial_rotary_factor == 0.75 and arch.rotary_dim == 96 == arch.layer_rotary_dim(0)
    validate_arch_config(arch)
    odd = ModelArchConfig.from_hf_config({**config, "partial_rotary_factor": 0.7})  # 89.6 -> 89 dims
    with pytest.raises(ValueError, match="turns 89 of 128 dims a head: it must be an even count"):
        validate_arch_config(odd)


def test_smollm3_nope_layers() -> None:
    config = dict(LLAMA31_CONFIG, architectures=["SmolLM3ForCausalLM"], num_hidden_layers=8)
    assert ModelArchConfig.from_hf_config(config).nope_layers == (3, 7)  # every 4th by default
    listed = ModelArchConfig.from_hf_config({**config, "no_rope_layers": [1, 0, 1, 1, 1, 1, 1, 0]})
    assert listed.nope_layers == (1, 7) and listed.layer_rotary_dim(1) == 0 and listed.layer_rotary_dim(2) == 128
    with pytest.raises(ValueError, match="no_rope_layers lists 2 layers, the model has 8"):
        ModelArchConfig.from_hf_config({**config, "no_rope_layers": [1, 0]})


def test_olmo3_windowed_layers_turn_unscaled() -> None:
    """OLMo 3: YaRN on the global layers only; the windowed ones turn by the plain base, in the
    per-type format and in the older one (one rope_theta and rope_scaling)."""
    layers = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    base = dict(LLAMA31_CONFIG, architectures=["Olmo3ForCausalLM"], num_hidden_layers=4, layer_types=layers,
                sliding_window=8)  # fmt: skip
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
    older = ModelArchConfig.from_hf_config({**base, "rope_theta": 500000.0, "rope_scaling": yarn, "rope_parameters": None})
    newer = ModelArchConfig.from_hf_config({**base, "rope_scaling": None, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
        "full_attention": {**yarn, "rope_theta": 500000.0}}})  # fmt: skip
    for arch in (older, newer):
        assert arch.local_rope_theta == 500000.0 and arch.rope_scaling["rope_type"] == "yarn"
        assert [arch.layer_uses_local_rope(i) for i in range(4)] == [True, True, True, False]
