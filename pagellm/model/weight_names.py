"""Checkpoint tensor names per family, mapped to the names the Llama-family modules load.

Every family's checkpoint is brought to one naming before it reaches a module: Llama's
(``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj``, ``mlp.experts.E.gate_proj``, ...).
So tensor-parallel shares, quantization and q/k/v and gate/up fusing see the same names
whatever the family. What differs per family is in one table (:data:`_RENAMES`) plus the
fused layouts some checkpoints store, which are split here by rows.
"""

from __future__ import annotations

import re

import torch

from pagellm.kernels.quant_formats import QuantizedRows
from pagellm.model.arch_config import ModelArchConfig

Tensor = torch.Tensor | QuantizedRows

# Granite-4.0-H's Mamba-2 mixer: its Conv1d as the mixer's own parameters.
_MAMBA_CONV = ((re.compile(r"\.mamba\.conv1d\.(weight|bias)$"), r".mamba.conv_\1"),)
# Qwen3.5: the text model under `model.language_model` (the multimodal checkpoints); the gated
# delta-net's Conv1d as the mixer's own parameter.
_QWEN3_5 = ((re.compile(r"^model\.language_model\."), "model."),
            (re.compile(r"\.linear_attn\.conv1d\.weight$"), ".linear_attn.conv_weight"))  # fmt: skip
# Architecture -> (pattern, replacement) applied to each checkpoint name in order.
_RENAMES: dict[str, tuple[tuple[re.Pattern[str], str], ...]] = {
    # Mixtral: the MoE block is `block_sparse_moe`, its experts' w1/w3/w2 are gate/up/down.
    "MixtralForCausalLM": (
        (re.compile(r"\.block_sparse_moe\."), ".mlp."),
        (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
        (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
        (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
    ),
    # GLM-4: its sandwich norms by Gemma's names (the pre-MLP norm first: its name is taken next).
    "Glm4ForCausalLM": (
        (re.compile(r"\.post_attention_layernorm\."), ".pre_feedforward_layernorm."),
        (re.compile(r"\.post_self_attn_layernorm\."), ".post_attention_layernorm."),
        (re.compile(r"\.post_mlp_layernorm\."), ".post_feedforward_layernorm."),
    ),
    # Hunyuan: its q/k norms as `query_layernorm` / `key_layernorm`.
    "HunYuanDenseV1ForCausalLM": ((re.compile(r"\.self_attn\.query_layernorm\."), ".self_attn.q_norm."),
                                  (re.compile(r"\.self_attn\.key_layernorm\."), ".self_attn.k_norm.")),
    # Qwen2-MoE: one shared expert, `shared_expert` (GLM-4.5's `shared_experts`).
    "Qwen2MoeForCausalLM": ((re.compile(r"\.mlp\.shared_expert\."), ".mlp.shared_experts."),),
    # LFM2: its norms, MLP, output projection and q/k norms by Llama's names; the convolution's
    # Conv1d as the mixer's own parameters.
    "Lfm2ForCausalLM": (
        (re.compile(r"\.operator_norm\."), ".input_layernorm."),
        (re.compile(r"\.ffn_norm\."), ".post_attention_layernorm."),
        (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
        (re.compile(r"\.self_attn\.(q|k)_layernorm\."), r".self_attn.\1_norm."),
        (re.compile(r"\.feed_forward\.w1\."), ".mlp.gate_proj."),
        (re.compile(r"\.feed_forward\.w3\."), ".mlp.up_proj."),
        (re.compile(r"\.feed_forward\.w2\."), ".mlp.down_proj."),
        (re.compile(r"^model\.embedding_norm\."), "model.norm."),
        (re.compile(r"\.conv\.conv\.(weight|bias)$"), r".conv.conv_\1"),
    ),
    # Granite-4.0-H: its dense MLP as `shared_mlp` (gate and up stored as one, split below).
    "GraniteMoeHybridForCausalLM": (
        (re.compile(r"\.shared_mlp\.input_linear\."), ".mlp.gate_up_proj."),
        (re.compile(r"\.shared_mlp\.output_linear\."), ".mlp.down_proj."),
        *_MAMBA_CONV,
    ),
    # Granite-4.0-H with routed experts (:func:`_renames`): `shared_mlp` beside them as the shared
    # expert; the experts stacked ([E, 2I, H] gate and up, [E, H, I] down) as `input_linear` /
    # `output_linear` (or transformers 5's `experts.gate_up_proj` / `down_proj`); the router's linear.
    "GraniteMoeHybridForCausalLM/experts": (
        (re.compile(r"\.shared_mlp\.input_linear\."), ".mlp.shared_experts.gate_up_proj."),
        (re.compile(r"\.shared_mlp\.output_linear\."), ".mlp.shared_experts.down_proj."),
        (re.compile(r"\.block_sparse_moe\."), ".mlp."),
        (re.compile(r"\.mlp\.input_linear\.weight$"), ".mlp.experts.gate_up_proj"),
        (re.compile(r"\.mlp\.output_linear\.weight$"), ".mlp.experts.down_proj"),
        (re.compile(r"\.mlp\.router\.(layer\.)?weight$"), ".mlp.gate.weight"),
        *_MAMBA_CONV,
    ),
    # Bamba: its MLP as `feed_forward`, the norm before it `pre_ff_layernorm`, the last `final_layernorm`.
    "BambaForCausalLM": (
        (re.compile(r"\.feed_forward\."), ".mlp."),
        (re.compile(r"\.pre_ff_layernorm\."), ".post_attention_layernorm."),
        (re.compile(r"^model\.final_layernorm\."), "model.norm."),
        *_MAMBA_CONV,
    ),
    "Qwen3_5ForCausalLM": _QWEN3_5,
    # Qwen3.5's MoE models: the same, and Qwen2-MoE's one gated shared expert.
    "Qwen3_5MoeForCausalLM": (*_QWEN3_5, (re.compile(r"\.mlp\.shared_expert\."), ".mlp.shared_experts.")),
    # Idefics3 / SmolVLM: the text model under `model.text_model`.
    "LlamaForCausalLM": ((re.compile(r"^model\.text_model\."), "model."),),
    # gpt-oss: the router is `router` (with a bias).
    "GptOssForCausalLM": ((re.compile(r"\.mlp\.router\."), ".mlp.gate."),),
    # Gemma 3 4B and up (Gemma3ForConditionalGeneration): the text model under `language_model`.
    "Gemma3ForCausalLM": (
        (re.compile(r"^(language_model\.model|model\.language_model)\."), "model."),
        (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    ),
}
# Architecture -> the checkpoint's tensors a text model does not load (a multimodal one's vision).
_DROPPED: dict[str, re.Pattern[str]] = {
    "Gemma3ForCausalLM": re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\."),
    "LlamaForCausalLM": re.compile(r"^model\.(vision_model|connector)\."),  # (Idefics3's: its own encoder loads them)
    "Qwen3_5ForCausalLM": re.compile(r"^(model\.visual\.|mtp\.)"),  # (its vision tower; multi-token prediction)
    "Qwen3_5MoeForCausalLM": re.compile(r"^(model\.visual\.|mtp\.)"),
}
# Architectures whose checkpoints carry layers past the model's (GLM-4.5's and DeepSeek-V3's
# multi-token prediction layers, ``num_nextn_predict_layers``): not part of the causal LM, not loaded.
_LAYERS_PAST_THE_MODEL_DROPPED = {"Glm4MoeForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"}
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_Q_PROJ = re.compile(r"^(?P<prefix>.*\.self_attn\.)q_proj\.(?P<kind>weight|bias)$")
_QK_ROWS = re.compile(r"^.*\.self_attn\.(?P<proj>q_proj|k_proj)\.(weight|bias)$")
# MLA's projections holding rotary rows: each head's query (after its nope rows), the shared key's.
_MLA_ROTARY_ROWS = re.compile(r"^.*\.self_attn\.(?P<proj>q_proj|q_b_proj|kv_a_proj_with_mqa)\.(weight|bias)$")
# q/k/v or gate/up stored fused (Phi-3): split into the parts by rows.
_PREFUSED = re.compile(r"^(?P<prefix>.*\.)(?P<fused>qkv_proj|gate_up_proj)\.(?P<kind>weight|bias)$")
# gpt-oss's experts, all in one tensor each: gate_up [E, H, 2I] (x @ W; gate and up columns
# interleaved) and its bias [E, 2I], down [E, I, H] and its bias [E, H].
_GPT_OSS_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts\.)(?P<fused>gate_up_proj|down_proj)(?P<bias>_bias)?$")
# Every expert in one 3-D tensor (transformers 5's own layout: gate_up [E, 2I, H], down [E, H, I]).
_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts\.)(?P<fused>gate_up_proj|down_proj)$")


def llama_name(arch: ModelArchConfig, name: str) -> str:
    """A name of ``arch``'s checkpoint (or of a module path in it: a LoRA adapter's tensors) by
    the Llama-family names (:data:`_RENAMES`)."""
    for pattern, replacement in _renames(arch):
        name = pattern.sub(replacement, name)
    return name


def _renames(arch: ModelArchConfig) -> tuple[tuple[re.Pattern[str], str], ...]:
    """``arch``'s entry of :data:`_RENAMES` (Granite-4.0-H's names its MLP by whether it has experts)."""
    experts = arch.architecture == "GraniteMoeHybridForCausalLM" and arch.num_experts > 0
    return _RENAMES.get(arch.architecture + ("/experts" if experts else ""), ())


def checkpoint_parts(arch: ModelArchConfig, name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
    """The tensor ``name`` of ``arch``'s checkpoint as ``(Llama name, tensor)`` parts: renamed,
    split where the checkpoint stores several weights in one tensor, none where the text model
    does not load it."""
    dropped = _DROPPED.get(arch.architecture)
    if dropped is not None and dropped.match(name):
        return []
    if arch.architecture in _LAYERS_PAST_THE_MODEL_DROPPED:
        layer = _LAYER_INDEX.match(name)
        if layer is not None and int(layer[1]) >= arch.num_hidden_layers:
            return []
    name = llama_name(arch, name)
    if arch.mla is not None:
        if arch.rotary_interleaved and (match := _MLA_ROTARY_ROWS.match(name)) is not None:
            tensor = _select_rows(tensor, _mla_rotate_half_order(arch, match["proj"]))
    elif arch.rotary_interleaved and (match := _QK_ROWS.match(name)) is not None:
        tensor = _rotate_half_order(arch, match["proj"], tensor)
    if arch.attn_output_gate and (match := _Q_PROJ.match(name)) is not None:
        return _split_output_gate(arch, match, tensor)
    if (match := _PREFUSED.match(name)) is not None:
        return _split_prefused(arch, match, tensor)
    if arch.architecture == "GptOssForCausalLM" and (match := _GPT_OSS_EXPERTS.match(name)) is not None:
        return _split_gpt_oss_experts(arch, match, tensor)
    if (match := _STACKED_EXPERTS.match(name)) is not None:
        return _split_stacked_experts(arch, match, tensor)
    return [(name, tensor)]


def mlp_weight_names(arch: ModelArchConfig, layer: int) -> set[str]:
    """The MLP weights layer ``layer`` must load: gate/up/down (with biases where the config
    says), or the router and each expert's gate/up/down in a mixture-of-experts layer."""
    prefix = f"model.layers.{layer}.mlp."
    parts = ("gate_proj", "up_proj", "down_proj")
    if layer in arch.moe_layers:
        kinds = ("weight", "bias") if arch.mlp_bias else ("weight",)  # (gpt-oss's experts have biases)
        experts = {f"{prefix}experts.{e}.{p}.{k}" for e in range(arch.num_experts) for p in parts for k in kinds}
        if arch.moe_router_bias:
            experts.add(prefix + "gate.bias")
        shared = {f"{prefix}shared_experts.{p}.weight" for p in parts} if arch.shared_expert_size else set()
        if arch.shared_expert_gate:
            shared.add(prefix + "shared_expert_gate.weight")
        bias = {prefix + "gate.e_score_correction_bias"} if arch.moe_scoring == "sigmoid" else set()
        return experts | shared | bias | {prefix + "gate.weight"}
    kinds = ("weight", "bias") if arch.mlp_bias else ("weight",)
    return {f"{prefix}{p}.{kind}" for p in parts for kind in kinds}


def _split_prefused(arch: ModelArchConfig, match: re.Match[str], tensor: Tensor) -> list[tuple[str, Tensor]]:
    """A fused ``qkv_proj`` / ``gate_up_proj`` (a layer's MLP's or its shared expert's) as its q,
    k, v / gate, up parts by rows."""
    if match["fused"] == "qkv_proj":
        parts = [("self_attn.q_proj", arch.q_size), ("self_attn.k_proj", arch.kv_size), ("self_attn.v_proj", arch.kv_size)]
    elif match["prefix"].endswith(".shared_experts."):
        parts = [(f"mlp.shared_experts.{p}", arch.shared_expert_size) for p in ("gate_proj", "up_proj")]
    else:
        parts = [("mlp.gate_proj", arch.intermediate_size), ("mlp.up_proj", arch.intermediate_size)]
    name = match.string
    rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) else tensor.rows
    if rows != sum(size for _, size in parts):
        raise ValueError(f"weight {name!r} has {rows} rows, expected {sum(size for _, size in parts)}")
    layer = _LAYER_INDEX.match(name)
    prefix = layer[0] if layer is not None else match["prefix"].rsplit(".", 2)[0] + "."  # "model.layers.N."
    out, start = [], 0
    for part, size in parts:
        rows_slice = slice(start, start + size)
        piece = tensor[rows_slice] if isinstance(tensor, torch.Tensor) else tensor.select_rows(rows_slice)
        out.append((f"{prefix}{part}.{match['kind']}", piece))
        start += size
    return out


def _split_output_gate(arch: ModelArchConfig, match: re.Match[str], tensor: Tensor) -> list[tuple[str, Tensor]]:
    """Qwen3.5's ``q_proj``, each head's query rows then its output gate's, as ``q_proj`` and ``g_proj``."""
    rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) else tensor.rows
    if rows != 2 * arch.q_size:
        raise ValueError(f"weight {match.string!r} has {rows} rows, expected {2 * arch.q_size} "
                         "(each head's query and gate)")  # fmt: skip
    heads = torch.arange(arch.num_attention_heads)[:, None] * 2 * arch.head_dim
    query = (heads + torch.arange(arch.head_dim)[None, :]).flatten()
    parts = []
    for part, order in (("q_proj", query), ("g_proj", query + arch.head_dim)):
        piece = tensor[order] if isinstance(tensor, torch.Tensor) else tensor.select_rows(order)
        parts.append((f"{match['prefix']}{part}.{match['kind']}", piece))
    return parts


def _rotate_half_order(arch: ModelArchConfig, proj: str, tensor: Tensor) -> Tensor:
    """q or k rows of an interleaved rotary (GLM-4: dims 2i and 2i + 1 turn together) in
    rotate-half's order (dims i and i + rotary_dim / 2): each head's even rotary rows, then its odd
    ones, then the rows the rotary leaves. The same order for q and k keeps every score."""
    heads = arch.num_attention_heads if proj == "q_proj" else arch.num_key_value_heads
    rotary, head_dim = arch.rotary_dim, arch.head_dim
    within = torch.cat([torch.arange(0, rotary, 2), torch.arange(1, rotary, 2), torch.arange(rotary, head_dim)])
    order = (torch.arange(heads)[:, None] * head_dim + within[None, :]).flatten()
    if not isinstance(tensor, torch.Tensor):
        return tensor.select_rows(order)
    return tensor[order]


def _mla_rotate_half_order(arch: ModelArchConfig, proj: str) -> torch.Tensor:
    """The row order of an MLA projection whose rotary rows turn interleaved pairs (DeepSeek's
    ``rope_interleave``) that makes them rotate-half's: each rotary part's even rows, then its
    odd ones; the query's other rows (each head's first ``qk_nope_head_dim``) and the latent's
    stay. The same order for the query and the shared key keeps every score."""
    shape = arch.mla
    assert shape is not None
    rope = shape.qk_rope_head_dim
    rotary = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if proj == "kv_a_proj_with_mqa":
        return torch.cat([torch.arange(shape.kv_lora_rank), shape.kv_lora_rank + rotary])
    head = torch.cat([torch.arange(shape.qk_nope_head_dim), shape.qk_nope_head_dim + rotary])
    return (torch.arange(arch.num_attention_heads)[:, None] * shape.qk_head_dim + head[None, :]).flatten()


def _select_rows(tensor: Tensor, order: torch.Tensor) -> Tensor:
    """``tensor``'s rows in ``order``, dense or quantized."""
    return tensor[order] if isinstance(tensor, torch.Tensor) else tensor.select_rows(order)


def _split_gpt_oss_experts(arch: ModelArchConfig, match: re.Match[str], tensor: Tensor) -> list[tuple[str, Tensor]]:
    """gpt-oss's stacked experts as each expert's gate, up and down weights and biases (the
    weights transposed to the rows-out layout every linear here loads, gate and up de-interleaved)."""
    name, inter, hidden, experts = match.string, arch.moe_intermediate_size, arch.hidden_size, arch.num_experts
    gate_up, bias = match["fused"] == "gate_up_proj", match["bias"] is not None
    if bias:
        expected: tuple[int, ...] = (experts, 2 * inter) if gate_up else (experts, hidden)
    else:
        expected = (experts, hidden, 2 * inter) if gate_up else (experts, inter, hidden)
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else "quantized"
        raise ValueError(f"weight {name!r} is {shape}, expected a dense tensor of shape {expected}")
    kind, prefix = "bias" if bias else "weight", match["prefix"]
    if not gate_up:
        return [(f"{prefix}{e}.down_proj.{kind}", tensor[e] if bias else tensor[e].t()) for e in range(experts)]
    parts = []
    for e in range(experts):
        for part, columns in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
            piece = tensor[e, columns] if bias else tensor[e][:, columns].t()
            parts.append((f"{prefix}{e}.{part}.{kind}", piece))
    return parts


def _split_stacked_experts(arch: ModelArchConfig, match: re.Match[str], tensor: Tensor) -> list[tuple[str, Tensor]]:
    """``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I] as each expert's
    gate and up / down weight."""
    name, inter, hidden = match.string, arch.moe_intermediate_size, arch.hidden_size
    expected = (arch.num_experts, 2 * inter, hidden) if match["fused"] == "gate_up_proj" else (arch.num_experts, hidden, inter)
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else "quantized"
        raise ValueError(f"weight {name!r} is {shape}, expected a dense tensor of shape {expected}")
    prefix = match["prefix"]
    if match["fused"] == "down_proj":
        return [(f"{prefix}{e}.down_proj.weight", tensor[e]) for e in range(arch.num_experts)]
    return [
        (f"{prefix}{e}.{part}.weight", tensor[e, rows])
        for e in range(arch.num_experts)
        for part, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter)))
    ]
