"""The shapes of the scan layers, read from ``config.json`` without loading weights (the engine
sizes each sequence's recurrent state from them): a Mamba-2 layer (Granite-4.0-H's ``mamba``
layers, ``model/mamba2.py``) and a gated delta-net layer (Qwen3.5's ``linear_attention`` layers,
``model/delta_net.py``).

Kept apart from :mod:`pagellm.model.arch_config` (which holds them as ``ModelArchConfig.mamba``
and ``delta_net``) so each family's config reading lives in one place: :func:`granite_hybrid_config`
brings a GraniteMoeHybrid ``config.json`` to the common spelling the arch config reads, and
:func:`qwen3_5_fields` gives Qwen3.5's fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# The layer type of a Mamba-2 layer in ``ModelArchConfig.layer_types`` (transformers 5 writes
# "linear_attention" for it; the Hub's Granite-4.0-H files say "mamba").
MAMBA = "mamba"
# The layer type of a gated delta-net layer (Qwen3.5, Qwen3-Next: transformers' own name).
DELTA_NET = "linear_attention"
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

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's state: its convolution inputs and its float32 SSM state."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_heads, self.head_dim, self.state_size)


@dataclass(frozen=True)
class DeltaNetShape:
    """One gated delta-net mixer: ``num_value_heads`` heads each carrying a ``[key_head_dim,
    value_head_dim]`` state, written with keys and read with queries of ``num_key_heads`` heads
    (each serving ``num_value_heads / num_key_heads`` value heads); a depthwise causal
    convolution of ``conv_kernel`` taps over q, k and v first."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    chunk_size: int = 64  # tokens a prefill's scan takes at once
    # llama.cpp's files order the value heads tiled by key head ([k0, k1, ..., k0, k1, ...]: value
    # head h reads key head h % num_key_heads); HF's group them (h reads h // per_key).
    tiled_value_heads: bool = False

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: q, k and v."""
        return 2 * self.key_size + self.value_size

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's state: its convolution inputs and its float32 delta-rule state."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_value_heads, self.key_head_dim, self.value_head_dim)


def qwen3_5_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's ``ModelArchConfig`` fields beyond a Qwen3 decoder's: its norms scale by (1 +
    weight), its attention's output is gated (q_proj gives each head's query and gate), and its
    ``linear_attention`` layers are gated delta-nets of this shape."""
    shape = DeltaNetShape(
        num_key_heads=_positive(config, "linear_num_key_heads", 16),
        num_value_heads=_positive(config, "linear_num_value_heads", 32),
        key_head_dim=_positive(config, "linear_key_head_dim", 128),
        value_head_dim=_positive(config, "linear_value_head_dim", 128),
        conv_kernel=_positive(config, "linear_conv_kernel_dim", 4),
        tiled_value_heads=bool(config.get("linear_value_heads_tiled", False)),
    )  # fmt: skip
    if shape.num_value_heads % shape.num_key_heads:
        raise ValueError(f"linear_num_key_heads ({shape.num_key_heads}) must divide linear_num_value_heads "
                         f"({shape.num_value_heads})")  # fmt: skip
    if shape.conv_kernel < 2:
        raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {shape.conv_kernel}")
    return dict(norm_unit_offset=True, attn_output_gate=True, delta_net=shape)


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
    return config, _mamba_shape(config)


def bamba_config(config: dict[str, Any]) -> tuple[dict[str, Any], MambaShape]:
    """A Bamba ``config.json`` (IBM's Mamba-2 hybrid, Granite-4.0-H's predecessor: its Mamba-2
    layers, a dense MLP, no multipliers) with ``layer_types`` from ``attn_layer_indices``, and
    its Mamba-2 layers' shape."""
    config = dict(config)
    layers = int(config["num_hidden_layers"])
    attention = config.get("attn_layer_indices") or []
    if not isinstance(attention, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                              for i in attention):  # fmt: skip
        raise ValueError(f"attn_layer_indices must list layers below num_hidden_layers ({layers}), got {attention!r}")
    config["layer_types"] = ["full_attention" if i in attention else MAMBA for i in range(layers)]
    return config, _mamba_shape(config)


def _mamba_shape(config: dict[str, Any]) -> MambaShape:
    """The Mamba-2 layers' shape from IBM's ``mamba_*`` keys (Bamba, Granite-4.0-H)."""
    heads = _positive(config, "mamba_n_heads", 128)
    inner = _positive(config, "mamba_expand", 2) * _positive(config, "hidden_size", 1)
    head_dim = inner // heads if config.get("mamba_d_head", "auto") == "auto" else _positive(config, "mamba_d_head", 1)
    if heads * head_dim != inner:
        raise ValueError(f"mamba_n_heads ({heads}) x mamba_d_head ({head_dim}) must be mamba_expand x hidden_size "
                         f"({inner})")  # fmt: skip
    dt_min, dt_max = _time_step_limit(config.get("time_step_limit"))
    shape = MambaShape(
        num_heads=heads, head_dim=head_dim, state_size=_positive(config, "mamba_d_state", 256),
        num_groups=_positive(config, "mamba_n_groups", 1), conv_kernel=_positive(config, "mamba_d_conv", 4),
        chunk_size=_positive(config, "mamba_chunk_size", 256), conv_bias=bool(config.get("mamba_conv_bias", True)),
        proj_bias=bool(config.get("mamba_proj_bias", False)), dt_min=dt_min, dt_max=dt_max,
    )  # fmt: skip
    if heads % shape.num_groups:
        raise ValueError(f"mamba_n_groups ({shape.num_groups}) must divide mamba_n_heads ({heads})")
    if shape.conv_kernel < 2:
        raise ValueError(f"mamba_d_conv must be at least 2, got {shape.conv_kernel}")
    return shape


def _positive(config: dict[str, Any], key: str, default: int) -> int:
    """``config[key]`` (``default`` where absent) as a positive integer; ValueError naming it otherwise."""
    value = config.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return int(value)


def _time_step_limit(value: Any) -> tuple[float, float]:
    """``time_step_limit``: two numbers, low <= high (default 0 and infinity); each plain, a string
    ("Infinity"), or as transformers writes a float JSON cannot hold (``{"__float__": "Infinity"}``)."""
    if value is None:
        return 0.0, math.inf
    try:
        low, high = (float(v["__float__"] if isinstance(v, dict) else v) for v in value)
    except (TypeError, ValueError, KeyError):
        raise ValueError(f"time_step_limit must be two numbers, got {value!r}") from None
    if not low <= high:
        raise ValueError(f"time_step_limit must be two numbers, low <= high, got {value!r}")
    return low, high
