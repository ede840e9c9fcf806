"""Tiny models with a random multi-token-prediction (MTP) layer, as DeepSeek-V3's and GLM-4.5's
checkpoints carry past the model's layers (``add_random_mtp_layer``, with the copies of the
model's embedding and head released checkpoints store; a pytest plugin of tests/conftest.py:
session fixtures)."""

from __future__ import annotations

import shutil

import pytest

from pagellm.benchmarks.random_mtp import add_random_mtp_layer
from tests.helpers.mla_models import write_tiny_deepseek_v3, write_tiny_glm4_moe, write_tiny_glm4_moe_lite


def _with_mtp(tmp_path_factory: pytest.TempPathFactory, name: str, write) -> str:
    """A tiny model written by ``write(folder)`` given a random MTP layer (DeepSeek's style with the
    copies of the model's embedding and head, as released checkpoints store them)."""
    folder = tmp_path_factory.mktemp(name)
    write(folder)
    add_random_mtp_layer(folder, shared_copies=True)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_deepseek_v3_mtp_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny DeepSeek-V3 (MLA, DeepSeek's MoE) with its MTP layer."""
    return _with_mtp(tmp_path_factory, "tiny_deepseek_v3_mtp",
                     lambda folder: write_tiny_deepseek_v3(folder, default_tokenizer, q_lora_rank=24, mtp=False))


@pytest.fixture(scope="session")
def tiny_glm4_moe_lite_mtp_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny GLM-4.7-Flash (MLA, its MoE layers by type) with its MTP layer."""
    return _with_mtp(tmp_path_factory, "tiny_glm4_moe_lite_mtp",
                     lambda folder: write_tiny_glm4_moe_lite(folder, default_tokenizer, q_lora_rank=24, mtp=False))


@pytest.fixture(scope="session")
def tiny_glm4_moe_mtp_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny GLM-4.5 (grouped-query attention with q/k norms and partial rotary, its MoE; 2 layers) with its MTP layer."""
    return _with_mtp(tmp_path_factory, "tiny_glm4_moe_mtp",
                     lambda folder: write_tiny_glm4_moe(folder, default_tokenizer, num_hidden_layers=2, mtp=False))


def _copy_with_mtp(tmp_path_factory: pytest.TempPathFactory, name: str, source: str) -> str:
    """A copy of the tiny model in ``source`` given a random MTP layer (Qwen3.5's style)."""
    folder = tmp_path_factory.mktemp(name)
    shutil.copytree(source, folder, dirs_exist_ok=True)
    add_random_mtp_layer(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_qwen3_5_mtp_path(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_5_path: str) -> str:
    """Tiny Qwen3.5 (gated delta-nets around a gated attention layer) with its MTP layer (``mtp.``)."""
    return _copy_with_mtp(tmp_path_factory, "tiny_qwen3_5_mtp", tiny_qwen3_5_path)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_mtp_path(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_5_moe_path: str) -> str:
    """Tiny Qwen3.5 MoE with its MTP layer (its experts and gated shared expert)."""
    return _copy_with_mtp(tmp_path_factory, "tiny_qwen3_5_moe_mtp", tiny_qwen3_5_moe_path)
