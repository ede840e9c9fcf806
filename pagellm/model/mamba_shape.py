"""The shape of a Mamba-2 layer (Granite-4.0-H's ``mamba`` layers), read from ``config.json``
without loading weights: the engine sizes each sequence's recurrent state from it.

Kept apart from :mod:`pagellm.model.arch_config` (which holds it as ``ModelArchConfig.mamba``) so
the family's config reading lives in one place: :func:`granite_hybrid_config` brings a
GraniteMoeHybrid ``config.json`` to the common spelling the arch config reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# The layer type of a Mamba-2 layer in ``ModelArchConfig.layer_types`` (transformers 5 writes
# "linear_attention" for it; the Hub's Granite-4.0-H files say "mamba").
MAMBA = "mamba"
_MAMBA_NAMES = {"mamba", "linear_attention"}
_ATTENTION_NAMES = {"attention", "full_attention"}


@dataclass(frozen=True)
class MambaShape:
    """One Mamba-2 mixer: ``num_heads`` heads of ``head_dim`` channels, each carrying a
    ``[head_dim, state_size]`` state; B and C shared by the heads of each of ``num_groups``
    groups; a depthwise causal convolution of ``conv_kernel`` taps over x, B and C first."""

    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    chunk_size: int  # tokens a prefill's scan takes at once (the reference's chunk)
    conv_bias: bool
    proj_bias: bool  # a bias on in_proj and out_proj
    dt_min: float = 0.0  # the time step clamped to [dt_min, dt_max] after its softplus
    dt_max: float = math.inf

    @property
    def inner_size(self) -> int:
        """Channels of x (and of the gate, and of the scan's output)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: x, B and C."""
        return self.inner_size + 2 * self.num_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        """``in_proj``'s outputs: the gate, x / B / C, and one time step a head."""
        return self.inner_size + self.conv_dim + self.num_heads

    def slot_floats(self) -> tuple[int, int]:
        """(convolution inputs, float32 SSM state) elements one sequence's state holds."""
        return (self.conv_kernel - 1) * self.conv_dim, self.num_heads * self.head_dim * self.state_size


def granite_hybrid_config(config: dict[str, Any]) -> tuple[dict[str, Any], MambaShape]:
    """A GraniteMoeHybrid ``config.json`` in the common spelling (``layer_types`` as
    :data:`MAMBA` / "full_attention", its dense MLP's width as ``intermediate_size``), and its
    Mamba-2 layers' shape. With routed experts (H Tiny, H Small: ``num_local_experts``) every
    layer's MLP is a mixture of experts ``intermediate_size`` wide (``moe_intermediate_size``)
    beside its shared MLP."""
    config = dict(config)
    config["moe_intermediate_size"] = config.get("intermediate_size")
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or config.get("layers_block_type") or [MAMBA] * layers
    unknown = sorted({str(t) for t in types} - _MAMBA_NAMES - _ATTENTION_NAMES)
    if unknown:
        raise NotImplementedError(f"GraniteMoeHybrid layer types {unknown} are not supported (only mamba and attention)")
    config["layer_types"] = [MAMBA if t in _MAMBA_NAMES else "full_attention" for t in types]
    config["intermediate_size"] = int(config.get("shared_intermediate_size") or 1024)
    hidden = int(config["hidden_size"])
    heads = int(config.get("mamba_n_heads") or 128)
    head_dim = config.get("mamba_d_head") or "auto"
    inner = int(config.get("mamba_expand") or 2) * hidden
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if heads * head_dim != inner:
        raise ValueError(f"mamba_n_heads ({heads}) x mamba_d_head ({head_dim}) must be mamba_expand x hidden_size ({inner})")
    dt_min, dt_max = (_float(v) for v in config.get("time_step_limit") or (0.0, math.inf))
    shape = MambaShape(
        num_heads=heads, head_dim=head_dim, state_size=int(config.get("mamba_d_state") or 256),
        num_groups=int(config.get("mamba_n_groups") or 1), conv_kernel=int(config.get("mamba_d_conv") or 4),
        chunk_size=int(config.get("mamba_chunk_size") or 256), conv_bias=bool(config.get("mamba_conv_bias", True)),
        proj_bias=bool(config.get("mamba_proj_bias", False)), dt_min=dt_min, dt_max=dt_max,
    )  # fmt: skip
    if heads % shape.num_groups:
        raise ValueError(f"mamba_n_groups ({shape.num_groups}) must divide mamba_n_heads ({heads})")
    if shape.conv_kernel < 2:
        raise ValueError(f"mamba_d_conv must be at least 2, got {shape.conv_kernel}")
    return config, shape


def _float(value: Any) -> float:
    """A number of ``config.json``: plain, a string ("Infinity"), or as transformers writes a
    float JSON cannot hold (``{"__float__": "Infinity"}``)."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)
