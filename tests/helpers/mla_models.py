"""Tiny models of the DeepSeek family (DeepSeek-V2 and V3, GLM-4.7-Flash): multi-head latent
attention (MLA) beside DeepSeek's MoE; session fixtures of each (a pytest plugin of tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import TINY_SHAPE, edit_tensors, token_ids, write_tiny_model

# The latent (32) and the rotary part (8) a token caches; each head's query and key 16 + 8 dims,
# its value 16 (narrower than the query, as in DeepSeek's); rotary pairs interleaved.
_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True)
# Sigmoid routing over 4 groups of 2 experts (the best 2 groups), a shared expert, the first layer dense.
_MOE = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4,
            topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)  # fmt: skip


def write_tiny_deepseek_v3(folder: Path, tokenizer, **overrides) -> str:
    """A tiny DeepSeek-V3 (3 layers, 4 heads, the first dense) with ``overrides`` on its config."""
    from transformers import DeepseekV3Config

    return _write(folder, tokenizer, DeepseekV3Config, first_k_dense_replace=1, **overrides)


def write_tiny_glm4_moe_lite(folder: Path, tokenizer, **overrides) -> str:
    """A tiny GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``: DeepSeek-V3's attention and MoE, its MoE
    layers listed by type) with ``overrides`` on its config."""
    from transformers import Glm4MoeLiteConfig

    return _write(folder, tokenizer, Glm4MoeLiteConfig, mlp_layer_types=["dense", "sparse", "sparse"], **overrides)


def write_tiny_deepseek_v2(folder: Path, tokenizer, **overrides) -> str:
    """A tiny DeepSeek-V2: softmax routing within the best 2 of 4 groups by their best expert,
    scaled by 2, a plain q_proj (V2-Lite's), the first layer dense."""
    from transformers import DeepseekV2Config

    return _write(folder, tokenizer, DeepseekV2Config, mtp=False, first_k_dense_replace=1, q_lora_rank=None,
                  topk_method="group_limited_greedy", **{**_MOE, "routed_scaling_factor": 2.0}, **overrides)  # fmt: skip


def write_tiny_glm4_moe(folder: Path, tokenizer, num_hidden_layers: int = 3, mtp: bool = True) -> str:
    """A tiny GLM-4.5 (Air): sigmoid routing with a correction bias over 4 groups of 2 experts (the
    best 2 groups), a shared expert, the first layer dense, partial rotary (half), q/k norms, q/k/v
    bias; with ``mtp``, a stray layer past the model's (its checkpoint's MTP layer)."""
    from transformers import Glm4MoeConfig

    config = Glm4MoeConfig(
        **{**TINY_SHAPE, "num_hidden_layers": num_hidden_layers}, **token_ids(tokenizer), moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        num_nextn_predict_layers=1, tie_word_embeddings=False, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    write_tiny_model(folder, config, tokenizer)
    add_correction_bias_and_mtp_layer(folder, mtp)
    return str(folder)


def _write(folder: Path, tokenizer, config_class, mtp: bool = True, **overrides) -> str:
    """The model, with a random correction bias (transformers starts it at zeros, which would test
    nothing) and, with ``mtp``, a stray layer past the model's (the checkpoint's multi-token-
    prediction layer)."""
    shape = {**TINY_SHAPE, "num_hidden_layers": 3, "num_key_value_heads": 4}
    options = {**_MLA, **_MOE, **overrides}
    config = config_class(**shape, **token_ids(tokenizer), tie_word_embeddings=False, initializer_range=0.1, **options)
    write_tiny_model(folder, config, tokenizer)
    add_correction_bias_and_mtp_layer(folder, mtp)
    return str(folder)


def add_correction_bias_and_mtp_layer(folder: Path, mtp: bool = True) -> None:
    """A random correction bias (transformers initializes it to zeros, which would test nothing)
    and, with ``mtp``, a stray layer past the model's, as DeepSeek-V3's and GLM-4.5's checkpoints
    carry (the multi-token-prediction layer, which the causal LM does not load)."""
    generator = torch.Generator().manual_seed(7)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
            tensors[name] = torch.rand(tensors[name].shape, generator=generator) * 0.5
        if mtp:
            tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)

    edit_tensors(folder, edit)


@pytest.fixture(scope="session")
def tiny_deepseek_v3_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny DeepSeek-V3: MLA with a low-rank query (q_lora_rank 24), DeepSeek's MoE (GLM-4.5's)."""
    return write_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny_deepseek_v3"), default_tokenizer, q_lora_rank=24)


@pytest.fixture(scope="session")
def tiny_deepseek_v3_yarn_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny DeepSeek-V3 with a plain q_proj (as DeepSeek-V2-Lite's) and YaRN whose mscale_all_dim
    scales the scores, q/k biases on (attention_bias)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 64}
    return write_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny_deepseek_v3_yarn"), default_tokenizer,
                                  q_lora_rank=None, rope_parameters=rope, attention_bias=True)


@pytest.fixture(scope="session")
def tiny_deepseek_v2_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny DeepSeek-V2: MLA, softmax routing within the best groups by their best expert, scaled."""
    return write_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny_deepseek_v2"), default_tokenizer)


@pytest.fixture(scope="session")
def tiny_glm4_moe_lite_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny GLM-4.7-Flash: DeepSeek-V3's MLA and MoE, its MoE layers by ``mlp_layer_types``."""
    return write_tiny_glm4_moe_lite(tmp_path_factory.mktemp("tiny_glm4_moe_lite"), default_tokenizer, q_lora_rank=24)
