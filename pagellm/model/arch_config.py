"""The model shape, in one small dataclass the engine can read without loading weights.

The engine sizes the KV cache from this before any weight is touched, so it is built
from ``config.json`` (+ ``generation_config.json``) or from GGUF metadata alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

# HF `model_type` -> architecture class name, for config.json files without "architectures".
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Architectures whose q/k/v projections always carry a bias (no config flag for it).
_ALWAYS_QKV_BIAS = {"Qwen2ForCausalLM"}
# Architectures whose `attention_bias` flag also puts a bias on o_proj.
_O_PROJ_FOLLOWS_ATTENTION_BIAS = {"LlamaForCausalLM"}
# Architectures with an RMSNorm over each head of q and of k before the rotary embedding.
_QK_NORM = {"Qwen3ForCausalLM"}


@dataclass
class ModelArchConfig:
    """Everything about a decoder-only model's shape that the engine and model need."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    o_proj_bias: bool = False  # Llama's `attention_bias` also covers o_proj; Qwen2's bias does not
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None  # effective window (None when the model attends to everything)
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head (weights [head_dim]) before rotary
    partial_rotary_factor: float = 1.0  # share of each head the rotary embedding turns (1: all; checked)

    @property
    def attention_window(self) -> int | None:
        """Positions each query attends to (its own included) where a sliding window limits
        them below the model's context; None where it attends to everything."""
        window = self.sliding_window
        return window if window is not None and window < self.max_position_embeddings else None

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.num_attention_heads * self.head_dim

    def shard(self, size: int) -> ModelArchConfig:
        """What one of ``size`` tensor-parallel ranks holds of each layer: its share of the
        attention heads, KV heads and MLP width (``pagellm.distributed.tensor_parallel``)."""
        if size == 1:
            return self
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(self, name) % size:
                raise ValueError(f"tensor_parallel_size={size} must divide the model's {name} ({getattr(self, name)})")
        if self.o_proj_bias or self.mlp_bias:
            raise ValueError("tensor parallelism does not support a bias on o_proj or the MLP yet")
        return dataclasses.replace(
            self, num_attention_heads=self.num_attention_heads // size,
            num_key_value_heads=self.num_key_value_heads // size, intermediate_size=self.intermediate_size // size,
        )  # fmt: skip

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_key_value_heads * self.head_dim

    def linear_weight_count(self) -> int:
        """Weights of every linear layer (the decoder's and the LM head), biases aside."""
        hidden, inter = self.hidden_size, self.intermediate_size
        per_layer = hidden * (self.q_size + 2 * self.kv_size) + self.q_size * hidden + 3 * hidden * inter
        return self.num_hidden_layers * per_layer + self.vocab_size * hidden

    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K+V bytes one token occupies across all layers (for sizing the paged cache)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.kv_size * element_size

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelArchConfig:
        """Build from a parsed Hugging Face ``config.json`` (old and transformers-5 rope formats)."""
        architecture = _architecture_name(config)
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        rope_theta, rope_scaling = _rope_from_hf(config)
        attention_bias = bool(config.get("attention_bias", False)) or architecture in _ALWAYS_QKV_BIAS
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=bool(config.get("attention_bias", False))
            and architecture in _O_PROJ_FOLLOWS_ATTENTION_BIAS,
            mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_act=str(config.get("hidden_act", "silu")),
            bos_token_id=_optional_int(config.get("bos_token_id")),
            eos_token_ids=_merge_eos(config, generation_config),
            sliding_window=_effective_sliding_window(config),
            qk_norm=architecture in _QK_NORM,
            partial_rotary_factor=_partial_rotary_factor(config),
        )


def _architecture_name(config: dict[str, Any]) -> str:
    """First entry of ``architectures``, else derived from ``model_type``."""
    architectures = config.get("architectures") or []
    if architectures:
        return str(architectures[0])
    model_type = str(config.get("model_type", ""))
    return _MODEL_TYPE_TO_ARCH.get(model_type, model_type or "<missing architectures>")


def _rope_from_hf(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either ``rope_theta``/``rope_scaling`` or ``rope_parameters``."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = float(config.get("rope_theta") or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0)
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:  # pre-4.45 spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    if "original_max_position_embeddings" not in scaling and "original_max_position_embeddings" in config:
        scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]  # Phi-3 keeps it here
    return theta, scaling


def _partial_rotary_factor(config: dict[str, Any]) -> float:
    """The rotary share of each head, from the config or its rope parameters (default 1)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    value = config.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    return 1.0 if value is None else float(value)


def _optional_int(value: Any) -> int | None:
    """``int(value)``, with None (and a one-element list) handled."""
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


def _as_id_list(value: Any) -> list[int]:
    """Normalize an eos entry (int, list of ints or None) to a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _merge_eos(config: dict[str, Any], generation_config: dict[str, Any] | None) -> list[int]:
    """Union of config.json's and generation_config.json's eos ids, order kept, no duplicates."""
    ids = _as_id_list(config.get("eos_token_id"))
    ids += _as_id_list((generation_config or {}).get("eos_token_id"))
    return list(dict.fromkeys(ids))


def _effective_sliding_window(config: dict[str, Any]) -> int | None:
    """The sliding window that actually applies (Qwen2 only uses it with ``use_sliding_window``)."""
    if not config.get("use_sliding_window", True):
        return None
    window = config.get("sliding_window")
    return None if window is None else int(window)
