"""The shape of multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, Moonlight), read
from ``config.json`` without loading weights: the engine sizes the KV cache from it.

An MLA layer caches one row a token, shared by all its heads: the compressed latent
(``kv_lora_rank`` values, normed) and the key's rotary part (``qk_rope_head_dim``, one for all
heads). Attention runs over that row as multi-query attention with one KV head whose keys are
the whole row and whose values are its latent part (``model/mla.py``), so the arch config
describes the cache as one KV head of ``kv_lora_rank + qk_rope_head_dim`` dims and no separate
values (:attr:`MlaShape.cache_width`). Kept apart from :mod:`pagellm.model.arch_config`, which
holds it as ``ModelArchConfig.mla``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.model.rope_config import rope_from_hf, yarn_mscale

# Architectures whose attention is MLA.
MLA_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"})


@dataclass(frozen=True)
class MlaShape:
    """One MLA layer: queries from ``q_lora_rank`` (0: a plain ``q_proj``), each head's query of
    ``qk_nope_head_dim`` + ``qk_rope_head_dim`` dims, the latent of ``kv_lora_rank`` values that
    ``kv_b_proj`` expands into each head's key (``qk_nope_head_dim``) and value (``v_head_dim``)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        """Each head's query and key width as the checkpoint computes them (nope + rope)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """A cached row: the latent, then the key's rotary part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def weight_count(self, hidden_size: int, num_heads: int) -> int:
        """Weights of one layer's projections (q, the latent's down and up projections, o)."""
        q_out = num_heads * self.qk_head_dim
        query = (hidden_size + q_out) * self.q_lora_rank if self.q_lora_rank else hidden_size * q_out
        latent = hidden_size * self.cache_width + self.kv_lora_rank * num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return query + latent + num_heads * self.v_head_dim * hidden_size

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MLA's {name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA needs q_lora_rank >= 0 and an even qk_rope_head_dim, got {self.q_lora_rank}, "
                             f"{self.qk_rope_head_dim}")  # fmt: skip


def mla_config(architecture: str, config: dict[str, Any]) -> tuple[dict[str, Any], MlaShape | None, dict[str, Any]]:
    """``config`` in the common spelling the arch config reads (one KV head as wide as a cached
    row), the MLA shape, and the fields it sets (``attention_scale``, the rotary's
    interleaving); the config unchanged, None and no fields for another architecture."""
    if architecture not in MLA_ARCHITECTURES:
        return config, None, {}
    missing = [key for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if key not in config]
    if missing:
        raise ValueError(f"{architecture}'s config.json lacks {', '.join(missing)} (its attention's shape)")
    shape = MlaShape(
        q_lora_rank=_whole(config, "q_lora_rank", 0), kv_lora_rank=_whole(config, "kv_lora_rank"),
        qk_nope_head_dim=_whole(config, "qk_nope_head_dim"), qk_rope_head_dim=_whole(config, "qk_rope_head_dim"),
        v_head_dim=_whole(config, "v_head_dim"),
    )  # fmt: skip
    config = {**config, "num_key_value_heads": 1, "head_dim": shape.cache_width, "partial_rotary_factor": 1.0}
    fields = {"attention_scale": mla_scale(shape, config), "rotary_interleaved": bool(config.get("rope_interleave", True))}
    return config, shape, fields


def _whole(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """``config[key]`` as a whole number (``default`` where null), or a ValueError naming it."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"MLA's {key} must be a whole number, got {value!r}")
    return value


def mla_scale(shape: MlaShape, config: dict[str, Any]) -> float:
    """The scores' scale: ``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim`` term squared
    where the rope is scaled (DeepSeek's reference; transformers' ``yarn_apply_mscale``)."""
    _, scaling = rope_from_hf(config)
    mscale_all_dim = float((scaling or {}).get("mscale_all_dim") or 0)
    if scaling is None or not mscale_all_dim:
        return shape.qk_head_dim**-0.5
    return shape.qk_head_dim**-0.5 * yarn_mscale(float(scaling["factor"]), mscale_all_dim) ** 2
