"""Tiny models with a random multi-token-prediction (MTP) layer, as DeepSeek-V3's and GLM-4.5's
checkpoints carry past the model's layers (``add_random_mtp_layer``, with the copies of the
model's embedding and head released checkpoints store; a pytest plugin of tests/conftest.py:
session fixtures)."""

from __future__ import annotations

import shutil

import pytest

from pagellm.benchmarks.random_mtp import add_random_mtp_layer
from tests.helpers.mla_models import add_correction_bias_and_mtp_layer, write_tiny_deepseek_v3, write_tiny_glm4_moe_lite
from tests.helpers.tiny_models import TINY_SHAPE, token_ids, write_tiny_model


@pytest.fixture(scope="session")
def tiny_deepseek_v3_mtp_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny DeepSeek-V3 (MLA, DeepSeek's MoE) with its MTP layer."""
    folder = tmp_path_factory.mktemp("tiny_deepseek_v3_mtp")
    write_tiny_deepseek_v3(folder, default_tokenizer, q_lora_rank=24, mtp=False)
    add_random_mtp_layer(folder, shared_copies=True)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_glm4_moe_lite_mtp_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny GLM-4.7-Flash (MLA, its MoE layers by type) with its MTP layer."""
    folder = tmp_path_factory.mktemp("tiny_glm4_moe_lite_mtp")
    write_tiny_glm4_moe_lite(folder, default_tokenizer, q_lora_rank=24, mtp=False)
    add_random_mtp_layer(folder, shared_copies=True)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_glm4_moe_mtp_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny GLM-4.5 (grouped-query attention with q/k norms and partial rotary, its MoE) with its MTP layer."""
    from transformers import Glm4MoeConfig

    config = Glm4MoeConfig(
        **{**TINY_SHAPE, "num_hidden_layers": 2}, **token_ids(default_tokenizer), moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        tie_word_embeddings=False, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny_glm4_moe_mtp")
    write_tiny_model(folder, config, default_tokenizer)
    add_correction_bias_and_mtp_layer(folder, mtp=False)
    add_random_mtp_layer(folder, shared_copies=True)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_qwen3_5_mtp_path(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_5_path: str) -> str:
    """Tiny Qwen3.5 (gated delta-nets around a gated attention layer) with its MTP layer (``mtp.``)."""
    folder = tmp_path_factory.mktemp("tiny_qwen3_5_mtp")
    shutil.copytree(tiny_qwen3_5_path, folder, dirs_exist_ok=True)
    add_random_mtp_layer(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_mtp_path(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_5_moe_path: str) -> str:
    """Tiny Qwen3.5 MoE with its MTP layer (its experts and gated shared expert)."""
    folder = tmp_path_factory.mktemp("tiny_qwen3_5_moe_mtp")
    shutil.copytree(tiny_qwen3_5_moe_path, folder, dirs_exist_ok=True)
    add_random_mtp_layer(folder)
    return str(folder)
