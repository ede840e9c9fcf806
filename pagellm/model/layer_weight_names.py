"""The weights a decoder layer must load, by its kind (a complete checkpoint's check)."""

from __future__ import annotations

from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.delta_net import delta_net_weight_names
from pagellm.model.mamba2 import mamba_weight_names
from pagellm.model.mla import mla_weight_names
from pagellm.model.weight_names import mlp_weight_names


def layer_weight_names(arch: ModelArchConfig, layer: int) -> set[str]:
    """Every weight decoder layer ``layer`` must load (under ``model.layers.{layer}.``)."""
    prefix = f"model.layers.{layer}."
    names = {prefix + "post_attention_layernorm.weight"} | mlp_weight_names(arch, layer)
    if arch.pre_norms:
        names.add(prefix + "input_layernorm.weight")
    if arch.sandwich_norms:
        names.add(prefix + "post_feedforward_layernorm.weight")
        if arch.pre_norms:
            names.add(prefix + "pre_feedforward_layernorm.weight")
    return names | _mixer_weight_names(arch, layer, prefix)


def _mixer_weight_names(arch: ModelArchConfig, layer: int, prefix: str) -> set[str]:
    """The weights of layer ``layer``'s token mixer: its attention, or its recurrent block."""
    if layer in arch.mamba_layers and arch.mamba is not None:
        return mamba_weight_names(prefix + "mamba.", arch.mamba)
    if layer in arch.delta_net_layers:
        return delta_net_weight_names(prefix + "linear_attn.")
    if layer in arch.recurrent_layers:
        kinds = ("weight", "bias") if arch.conv_bias else ("weight",)
        names = {f"{prefix}conv.{part}.{kind}" for part in ("in_proj", "out_proj") for kind in kinds}
        return names | {prefix + "conv.conv_weight"} | ({prefix + "conv.conv_bias"} if arch.conv_bias else set())
    if arch.mla is not None:
        return mla_weight_names(prefix + "self_attn.", arch.mla, arch.attention_bias)
    names = {f"{prefix}self_attn.{p}_proj.weight" for p in ("qkvog" if arch.attn_output_gate else "qkvo")}
    if arch.attention_bias:
        names |= {f"{prefix}self_attn.{p}_proj.bias" for p in "qkv"}
    if arch.o_proj_bias:
        names.add(prefix + "self_attn.o_proj.bias")
    if arch.qk_norm:
        names |= {prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"}
    if arch.attention_sinks:
        names.add(prefix + "self_attn.sinks")
    return names
