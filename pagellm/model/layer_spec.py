"""One decoder layer, described once: what every implementation of the layer reads.

The Python modules (:mod:`pagellm.model.llama`) are built from a layer's :class:`LayerSpec`,
and the one-call C++ stack (:mod:`pagellm.model.fused_stack`) takes its per-layer fields from
the same spec and refuses a layer only for a field it cannot run (:func:`stack_refusal`). A new
family feature is a field here, read by both; where the stack lacks it, the refusal names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.mla_shape import MlaShape
from pagellm.model.scan_shapes import DeltaNetShape, MambaShape


@dataclass(frozen=True)
class LayerSpec:
    """Decoder layer ``index`` of a model (a tensor-parallel rank's share of its heads and width)."""

    index: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's width
    norm_eps: float
    norm_unit_offset: bool  # Gemma: norms scale by (1 + weight), in float32
    sandwich_norms: bool  # Gemma: each block's output normed too, and a norm before the MLP
    qk_norm: bool  # Qwen3, Gemma 3: each q and k head RMS-normed before the rotary embedding
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    activation: str  # the gated MLP's activation (silu, gelu_pytorch_tanh, ...)
    moe: bool  # a routed mixture of experts in place of the dense MLP
    window: int | None  # positions each token attends to, its own included; None: all
    local_rope: bool  # Gemma 3's windowed layers: q and k turned by the local rope base
    scale: float  # attention scores' scale
    softcap: float | None  # Gemma 2: scores capped by c * tanh(s / c)
    rotary_dim: int = 0  # each head's leading dims the rotary turns: head_dim, fewer (partial), 0 (NoPE)
    pre_norms: bool = True  # a norm before each block (OLMo 2: none)
    qk_norm_over_projection: bool = False  # OLMo 2: q and k normed whole, before the heads are split
    residual_multiplier: float = 1.0  # Granite: each block's output scaled before its residual add
    sinks: bool = False  # gpt-oss: a learned logit per head in its softmax (the attention's ``sinks``)
    qk_norm_after_rotary: bool = False  # Hunyuan: the per-head q/k norms follow the rotary
    # LFM2: a short convolution (``model/short_conv.py``) in place of attention, over this many
    # taps (0: an attention layer), with biases or not.
    conv_kernel: int = 0
    conv_bias: bool = False
    conv_channels: int = 0  # the channels it runs (a tensor-parallel rank's share)
    mamba: MambaShape | None = None  # Granite-4.0-H: a Mamba-2 mixer (``model/mamba2.py``) in place of attention
    delta_net: DeltaNetShape | None = None  # Qwen3.5: a gated delta-net (``model/delta_net.py``) in place of attention
    output_gate: bool = False  # Qwen3.5: attention's output times sigmoid(a per-head gate from q_proj)
    mla: MlaShape | None = None  # DeepSeek-V2/V3: multi-head latent attention (``model/mla.py``)

    @property
    def recurrent(self) -> bool:
        """Whether the layer carries a state from token to token (a state slot) instead of K/V."""
        return self.conv_kernel > 0 or self.mamba is not None or self.delta_net is not None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def layer_spec(arch: ModelArchConfig, index: int) -> LayerSpec:
    """Layer ``index`` of ``arch`` (a rank's share under tensor parallelism: ``arch.shard``)."""
    return LayerSpec(
        index=index,
        hidden_size=arch.hidden_size,
        num_heads=arch.num_attention_heads,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        intermediate_size=arch.intermediate_size,
        norm_eps=arch.rms_norm_eps,
        norm_unit_offset=arch.norm_unit_offset,
        sandwich_norms=arch.sandwich_norms,
        qk_norm=arch.qk_norm,
        qkv_bias=arch.attention_bias,
        o_bias=arch.o_proj_bias,
        mlp_bias=arch.mlp_bias,
        activation=arch.hidden_act,
        moe=index in arch.moe_layers,
        window=arch.layer_window(index),
        local_rope=arch.layer_uses_local_rope(index),
        scale=arch.attention_scale or arch.head_dim**-0.5,
        softcap=arch.attn_logit_softcapping,
        rotary_dim=arch.layer_rotary_dim(index),
        pre_norms=arch.pre_norms,
        qk_norm_over_projection=arch.qk_norm_over_projection,
        residual_multiplier=arch.residual_multiplier,
        sinks=arch.attention_sinks,
        qk_norm_after_rotary=arch.qk_norm_after_rotary,
        conv_kernel=arch.conv_kernel if index in arch.recurrent_layers else 0,
        conv_bias=arch.conv_bias,
        conv_channels=arch.convolution_channels,
        mamba=arch.mamba if index in arch.mamba_layers else None,
        delta_net=arch.delta_net if index in arch.delta_net_layers else None,
        output_gate=arch.attn_output_gate,
        mla=arch.mla,
    )


def layer_specs(arch: ModelArchConfig) -> tuple[LayerSpec, ...]:
    """Every layer's spec, in order."""
    return tuple(layer_spec(arch, i) for i in range(arch.num_hidden_layers))


def stack_refusal(spec: LayerSpec) -> str | None:
    """Why the one-call C++ decoder stack cannot run this layer, or None where it can. What it
    runs: RMSNorm (weight-scaled), q/k/v bias, per-head q/k norms, one rotary table over all of
    each head or its leading dims (partial rotary) or none (NoPE), any score scale, soft cap,
    sliding window and residual multiplier (Granite) per layer, a bias-free SiLU-gated dense MLP."""
    if spec.mamba is not None:
        return "a Mamba-2 layer"
    if spec.delta_net is not None:
        return "a gated delta-net layer"
    if spec.output_gate:
        return "a gated attention output"
    if spec.mla is not None:
        return "multi-head latent attention (MLA)"
    if spec.recurrent:
        return "a short-convolution layer"
    if spec.moe:
        return "a mixture of experts"
    if spec.norm_unit_offset or spec.sandwich_norms:
        return "norms around each block (Gemma's, scaled by 1 + weight; OLMo 2's)"
    if spec.local_rope:
        return "a second rotary base for windowed layers"
    if spec.qk_norm_over_projection:
        return "q/k norms over the whole projection"
    if spec.sinks:
        return "attention sinks"
    if spec.qk_norm_after_rotary:
        return "q/k norms after the rotary"
    if spec.activation != "silu":
        return f"the {spec.activation} activation"
    if spec.o_bias or spec.mlp_bias:
        return "a bias on o_proj or the MLP"
    return None
