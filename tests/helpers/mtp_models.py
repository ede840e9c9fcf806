"""Tiny models with a real multi-token-prediction (MTP) layer, as DeepSeek-V3's and GLM-4.5's
checkpoints carry past the model's layers, and the reference that layer is checked against
(a pytest plugin of tests/conftest.py: session fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagellm.benchmarks.random_model import randomize_norms_and_biases
from tests.helpers.mla_models import add_correction_bias_and_mtp_layer, write_tiny_deepseek_v3, write_tiny_glm4_moe_lite
from tests.helpers.tiny_models import TINY_SHAPE, edit_tensors, token_ids, write_tiny_model


def one_layer_config(folder: str | Path):
    """The config of ``folder``'s model cut to one layer of experts (the MTP layer's kind)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = 1
    config.first_k_dense_replace = 0
    if getattr(config, "mlp_layer_types", None) is not None:
        config.mlp_layer_types = ["sparse"]
    return config


def add_mtp_layer(folder: Path) -> None:
    """A random MTP layer past the model's (``model.layers.{N}``): its decoder layer from a
    one-layer model of the same kind (random norms and correction bias), random ``enorm``,
    ``hnorm``, ``eh_proj`` and ``shared_head.norm``, and the model's embedding and head copied
    under it (as released checkpoints store them); ``num_nextn_predict_layers`` 1."""
    from transformers import AutoModelForCausalLM

    config = json.loads((folder / "config.json").read_text())
    index, hidden = config["num_hidden_layers"], config["hidden_size"]
    torch.manual_seed(11)
    block = AutoModelForCausalLM.from_config(one_layer_config(folder), dtype=torch.float32)
    randomize_norms_and_biases(block)
    generator = torch.Generator().manual_seed(12)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.startswith(f"model.layers.{index}.")]:
            del tensors[name]  # (a stray placeholder)
        prefix = f"model.layers.{index}."
        for name, tensor in block.state_dict().items():
            if name.startswith("model.layers.0."):
                value = tensor.clone()
                if name.endswith("e_score_correction_bias"):
                    value = torch.rand(value.shape, generator=generator) * 0.5
                tensors[prefix + name.removeprefix("model.layers.0.")] = value
        for part in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{prefix}{part}.weight"] = 1.0 + 0.3 * torch.randn(hidden, generator=generator)
        tensors[prefix + "eh_proj.weight"] = 0.15 * torch.randn(hidden, 2 * hidden, generator=generator)
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()

    edit_tensors(folder, edit)
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="session")
def tiny_deepseek_v3_mtp_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny DeepSeek-V3 (MLA, DeepSeek's MoE) with its MTP layer."""
    folder = tmp_path_factory.mktemp("tiny_deepseek_v3_mtp")
    write_tiny_deepseek_v3(folder, default_tokenizer, q_lora_rank=24)
    add_mtp_layer(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_glm4_moe_lite_mtp_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny GLM-4.7-Flash (MLA, its MoE layers by type) with its MTP layer."""
    folder = tmp_path_factory.mktemp("tiny_glm4_moe_lite_mtp")
    write_tiny_glm4_moe_lite(folder, default_tokenizer, q_lora_rank=24)
    add_mtp_layer(folder)
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
    add_mtp_layer(folder)
    return str(folder)
