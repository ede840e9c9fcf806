"""Architecture name -> model class, plus the config checks that decide "can we serve this"."""

from __future__ import annotations

from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.layers import check_rope_scaling
from pagellm.model.llama import LlamaForCausalLM

# Mistral is Llama (with or without a sliding window); Qwen2 is Llama with q/k/v bias; Qwen3 is
# Llama with per-head q/k norms (each set in the arch config); Phi-3 is Llama whose checkpoints
# store q/k/v and gate/up fused (split on load); Qwen3-MoE and Mixtral are Qwen3 and Mistral with
# mixture-of-experts MLPs (pagellm.model.moe; checkpoint names mapped in weight_names); Gemma 2/3
# are Llama with (1 + w) norms around each block, GeGLU, scaled embeddings, windowed and global
# layers, soft caps (Gemma 2), q/k norms and a local rope base (Gemma 3); SmolLM3 is Llama with
# NoPE layers; OLMo 2 is Llama with norms after each block only and q/k norms over the whole
# projection; Granite is Llama with multipliers; Phi-4-mini is Phi-3 with partial rotary: all
# arch-config fields.
_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": LlamaForCausalLM,
    "Olmo3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "GraniteMoeHybridForCausalLM": LlamaForCausalLM,
    "BambaForCausalLM": LlamaForCausalLM,
    "Qwen3_5ForCausalLM": LlamaForCausalLM,
    "Qwen3_5MoeForCausalLM": LlamaForCausalLM,
    "Glm4MoeForCausalLM": LlamaForCausalLM,
    "Glm4ForCausalLM": LlamaForCausalLM,
    "Exaone4ForCausalLM": LlamaForCausalLM,
    "HunYuanDenseV1ForCausalLM": LlamaForCausalLM,
    "SeedOssForCausalLM": LlamaForCausalLM,
    "Ernie4_5ForCausalLM": LlamaForCausalLM,
    "GptOssForCausalLM": LlamaForCausalLM,
    "Lfm2ForCausalLM": LlamaForCausalLM,
    "DeepseekV3ForCausalLM": LlamaForCausalLM,  # (multi-head latent attention: model/mla.py)
    "Glm4MoeLiteForCausalLM": LlamaForCausalLM,  # (GLM-4.7-Flash: DeepSeek-V3's attention and MoE)
    "DeepseekV2ForCausalLM": LlamaForCausalLM,  # (MLA; softmax routing by groups)
}


def supported_architectures() -> list[str]:
    """Architecture names (HF ``architectures[0]``) this engine can run."""
    return sorted(_MODEL_CLASSES)


def get_model_class(arch_name: str) -> type[LlamaForCausalLM]:
    """The class implementing ``arch_name``; ValueError naming it and the supported ones otherwise."""
    try:
        return _MODEL_CLASSES[arch_name]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {arch_name!r}; supported: {', '.join(supported_architectures())}"
        ) from None


def validate_arch_config(arch: ModelArchConfig) -> type[LlamaForCausalLM]:
    """Reject configs we would run incorrectly (unknown rope, a partial rotary of an odd count of
    dims or none, uneven GQA, a top-k beyond the experts); return the class."""
    model_class = get_model_class(arch.architecture)
    check_rope_scaling(arch.rope_scaling)
    if arch.rotary_dim % 2 or not 0 < arch.rotary_dim <= arch.head_dim:
        raise ValueError(f"{arch.architecture} with partial_rotary_factor={arch.partial_rotary_factor} turns "
                         f"{arch.rotary_dim} of {arch.head_dim} dims a head: it must be an even count, at least 2")  # fmt: skip
    if arch.num_attention_heads % arch.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={arch.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={arch.num_key_value_heads}"
        )
    if arch.moe_layers and not 0 < arch.num_experts_per_tok <= arch.num_experts:
        raise ValueError(f"num_experts_per_tok={arch.num_experts_per_tok} must be between 1 and the number of "
                         f"experts ({arch.num_experts})")  # fmt: skip
    groups, chosen = arch.moe_groups
    if arch.moe_layers and (groups < 1 or arch.num_experts % groups or not 1 <= chosen <= groups
                            or arch.num_experts_per_tok > chosen * (arch.num_experts // groups)):  # fmt: skip
        raise ValueError(f"n_group={groups}, topk_group={chosen} do not split {arch.num_experts} experts into groups "
                         f"that hold num_experts_per_tok={arch.num_experts_per_tok}")  # fmt: skip
    return model_class
