"""Rope parameters from a ``config.json``: its base and scaling in either spelling (the old
``rope_theta`` / ``rope_scaling``, or transformers 5's ``rope_parameters``, per layer type where a
model has two), a fixed NTK alpha folded into the base, and the share of each head it turns."""

from __future__ import annotations

import math
from typing import Any

FULL = "full_attention"  # the layer type whose rope parameters a per-type config gives the model's


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature term for a context stretched ``factor`` times: ``0.1 * mscale * ln(factor)
    + 1``, 1 where not stretched (HF's ``get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_from_hf(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either ``rope_theta``/``rope_scaling`` or ``rope_parameters``
    (per layer type in Gemma 3's: the global layers' here)."""
    params = dict(config.get("rope_parameters") or {})
    if FULL in params:
        params = dict(params[FULL] or {})
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


def ntk_alpha(config: dict[str, Any], theta: float, scaling: dict[str, Any] | None) -> tuple[float, dict[str, Any] | None]:
    """Hunyuan's "dynamic" rope with a fixed ``alpha``: a static base, ``theta * alpha ** (d / (d -
    2))`` over the head's d dims (no scaling by length), as transformers computes it."""
    if scaling is None or scaling.get("rope_type") != "dynamic" or not scaling.get("alpha"):
        return theta, scaling
    dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    return theta * float(scaling["alpha"]) ** (dim / (dim - 2)), None


def partial_rotary_factor(config: dict[str, Any]) -> float:
    """The rotary share of each head, from the config or its rope parameters (default 1)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    value = config.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    return 1.0 if value is None else float(value)
