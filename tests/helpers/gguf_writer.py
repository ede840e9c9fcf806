"""A tiny HF folder written as a float32 GGUF file the way llama.cpp's converter
(``convert_hf_to_gguf.py``) writes its family: the same metadata keys, tensor names and
changes (Llama's q/k rows permuted, Gemma's norms stored as 1 + w, experts stacked in 3-D
tensors, Phi-3's LongRoPE factors as tensors). Checked against that converter's own output
for Qwen3, Qwen3-MoE, Mixtral and Gemma 3 (NOTES 48; Phi-3 and Gemma 2 from its code, as it
needs a sentencepiece tokenizer for them); the tests cannot run the converter (it is not in
this repository).

The tokenizer comes from the default model's GGUF (the tiny models share its vocabulary).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from safetensors.torch import load_file

# HF block tensor (after "model.layers.N.") -> GGUF block tensor name.
_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
    "block_sparse_moe.gate": "ffn_gate_inp", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip
_EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # fmt: skip
_OLMO2_NAMES = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_GLM4_NAMES = {"post_self_attn_layernorm": "post_attention_norm", "post_attention_layernorm": "ffn_norm",
               "post_mlp_layernorm": "post_ffw_norm"}  # fmt: skip
_ARCHS = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
          "Qwen3MoeForCausalLM": "qwen3moe", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
          "Phi3ForCausalLM": "phi3", "SmolLM3ForCausalLM": "smollm3", "GraniteForCausalLM": "granite",
          "Olmo2ForCausalLM": "olmo2", "Glm4ForCausalLM": "glm4", "Lfm2ForCausalLM": "lfm2",
          "Qwen3_5ForCausalLM": "qwen35", "Qwen3_5MoeForCausalLM": "qwen35moe",
          "GraniteMoeHybridForCausalLM": "granitehybrid"}  # fmt: skip
_QWEN35 = ("qwen35", "qwen35moe")
_LFM2_NAMES = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.out_proj": "attn_output",
               "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
               "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
               "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj",
               "conv.out_proj": "shortconv.out_proj"}  # fmt: skip
# Qwen3.5 (the converter's ``Qwen3_5TextModel`` and ``Qwen3_5MoeTextModel``, checked against its
# output for the tiny models: NOTES 72): its gated delta-nets' tensors, A_log stored as
# -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the value heads reordered from grouped by key
# head to tiled; the MoE models' shared expert as `*_shexp`.
_QWEN35_NAMES = {"post_attention_layernorm": "post_attention_norm", "linear_attn.in_proj_qkv": "attn_qkv",
                 "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
                 "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.conv1d": "ssm_conv1d",
                 "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
                 "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                 "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}  # fmt: skip
# The converter's LlamaModel subclasses: q/k rows permuted, vocab size and rope dims written.
_LLAMA_LIKE = ("llama", "smollm3", "granite")


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for its rotary layout (the converter's ``permute``)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _metadata(writer: GGUFWriter, arch: str, config: dict) -> None:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    writer.add_block_count(config["num_hidden_layers"])
    no_rope = arch == "granitehybrid" and config.get("position_embedding_type") != "rope"
    writer.add_context_length(2**20 if no_rope else config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    if arch == "lfm2":
        _lfm2_metadata(writer, config)
        return
    if arch == "granitehybrid":
        _granite_hybrid_metadata(writer, config)
        return
    if arch in _QWEN35:
        _qwen35_metadata(writer, arch, config)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch in (*_LLAMA_LIKE, "phi3"):  # (the converter writes these instead of the key/value lengths)
        if arch in _LLAMA_LIKE:
            writer.add_vocab_size(config["vocab_size"])
        rope_params = config.get("rope_parameters") or {}
        factor = config.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(factor * hidden) // heads)  # (Phi-4-mini: 3/4 of each head)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        if arch == "glm4":  # (the rotary's share of each head)
            writer.add_rope_dimension_count(int(head_dim * (config.get("rope_parameters") or {})["partial_rotary_factor"]))
    rope = config.get("rope_parameters") or {}
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention")
    writer.add_rope_freq_base(full.get("rope_theta", 10000.0))
    if full.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", full["factor"])
    if local is not None:
        writer.add_float32(f"{arch}.rope.freq_base_swa", local["rope_theta"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "phi3":
        _phi3_metadata(writer, config, full)
    if arch == "granite":
        writer.add_float32("granite.embedding_scale", config["embedding_multiplier"])
        writer.add_float32("granite.residual_scale", config["residual_multiplier"])
        writer.add_float32("granite.attention.scale", config["attention_multiplier"])
        writer.add_float32("granite.logit_scale", config["logits_scaling"])
    if arch.startswith("gemma"):
        writer.add_sliding_window(config["sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key):
                writer.add_float32(f"{arch}.{key}", config[key])


def _qwen35_metadata(writer: GGUFWriter, arch: str, config: dict) -> None:
    """Qwen3.5's: the gated delta-nets' shape as ``ssm`` keys, which layers they are, the rotary's
    dims and its (multimodal) sections; the MoE models' shared expert's width."""
    writer.add_uint32(f"{arch}.ssm.conv_kernel", config["linear_conv_kernel_dim"])
    writer.add_uint32(f"{arch}.ssm.state_size", config["linear_key_head_dim"])
    writer.add_uint32(f"{arch}.ssm.group_count", config["linear_num_key_heads"])
    writer.add_uint32(f"{arch}.ssm.time_step_rank", config["linear_num_value_heads"])
    writer.add_uint32(f"{arch}.ssm.inner_size", config["linear_value_head_dim"] * config["linear_num_value_heads"])
    writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in config["layer_types"]])
    writer.add_uint32(f"{arch}.full_attention_interval", config.get("full_attention_interval", 4))
    rope = config["rope_parameters"]
    writer.add_rope_dimension_count(int(config["head_dim"] * rope.get("partial_rotary_factor", 1.0)))
    writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    if "shared_expert_intermediate_size" in config:
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", config["shared_expert_intermediate_size"])


def _tiled_value_heads(tensor: torch.Tensor, dim: int, config: dict, head_dim: int) -> torch.Tensor:
    """Value heads grouped by key head ([g0v0, g0v1, g1v0, ...]) reordered tiled ([g0v0, g1v0, g0v1, ...])."""
    keys = config["linear_num_key_heads"]
    per_key = config["linear_num_value_heads"] // keys
    shape = list(tensor.shape)
    split = tensor.reshape(*shape[:dim], keys, per_key, head_dim, *shape[dim + 1 :])
    return split.transpose(dim, dim + 1).reshape(shape)


def _qwen35_tensor(module: str, kind: str, tensor: torch.Tensor, config: dict) -> tuple[str, torch.Tensor]:
    """A Qwen3.5 gated delta-net tensor (``linear_attn.*``) as the converter writes it."""
    value_dim = config["linear_value_head_dim"]
    key_size = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
    if kind == "A_log":
        return "ssm_a", _tiled_value_heads(-torch.exp(tensor), 0, config, 1)
    if kind == "dt_bias":
        return "ssm_dt.bias", _tiled_value_heads(tensor, 0, config, 1)
    if module in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
        tensor = tensor.squeeze(1) if module.endswith("conv1d") else tensor
        tensor = torch.cat([tensor[:key_size], _tiled_value_heads(tensor[key_size:], 0, config, value_dim)])
    elif module == "linear_attn.in_proj_z":
        tensor = _tiled_value_heads(tensor, 0, config, value_dim)
    elif module in ("linear_attn.in_proj_a", "linear_attn.in_proj_b"):
        tensor = _tiled_value_heads(tensor, 0, config, 1)
    elif module == "linear_attn.out_proj":
        tensor = _tiled_value_heads(tensor, 1, config, value_dim)
    return f"{_QWEN35_NAMES[module]}.{kind}", tensor


def _granite_hybrid_metadata(writer: GGUFWriter, config: dict) -> None:
    """Granite-4.0-H's (the converter's ``GraniteHybridModel``, checked against its output for the
    tiny dense model: NOTES 72): KV heads per layer (0 for a Mamba-2 layer), Granite's multipliers,
    the Mamba-2 shape as ``ssm`` keys, rope marked unused (``rope.scaling.finetuned``) and the
    context then written as 2**20."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    inner = config["mamba_expand"] * hidden
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    attention = ("attention", "full_attention")  # (the Hub's spelling and transformers 5's)
    writer.add_head_count_kv([config["num_key_value_heads"] if t in attention else 0 for t in config["layer_types"]])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_float32("granitehybrid.attention.scale", config["attention_multiplier"])
    writer.add_float32("granitehybrid.embedding_scale", config["embedding_multiplier"])
    writer.add_float32("granitehybrid.residual_scale", config["residual_multiplier"])
    writer.add_float32("granitehybrid.logit_scale", config["logits_scaling"])
    writer.add_uint32("granitehybrid.expert_shared_feed_forward_length", config["shared_intermediate_size"])
    writer.add_uint32("granitehybrid.ssm.conv_kernel", config["mamba_d_conv"])
    writer.add_uint32("granitehybrid.ssm.state_size", config["mamba_d_state"])
    writer.add_uint32("granitehybrid.ssm.group_count", config["mamba_n_groups"])
    writer.add_uint32("granitehybrid.ssm.inner_size", inner)
    writer.add_uint32("granitehybrid.ssm.time_step_rank", config["mamba_n_heads"])
    writer.add_bool("granitehybrid.rope.scaling.finetuned", config.get("position_embedding_type") == "rope")


def _granite_hybrid_tensors(name: str, tensor: torch.Tensor, config: dict) -> list[tuple[str, torch.Tensor]]:
    """A Granite-4.0-H block tensor as the converter writes it (the dense model's): the MLP's
    fused gate/up split, the Mamba-2 mixer's tensors as ``ssm_*`` (A as -exp(A_log), A and D as
    [heads, 1], the norm as [groups, channels / groups], the Conv1d squeezed)."""
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    prefix = f"blk.{layer}."
    if rest == "shared_mlp.input_linear.weight":
        gate, up = tensor.split(config["shared_intermediate_size"], dim=0)
        return [(prefix + "ffn_gate.weight", gate), (prefix + "ffn_up.weight", up)]
    if rest == "shared_mlp.output_linear.weight":
        return [(prefix + "ffn_down.weight", tensor)]
    mamba = {"mamba.in_proj.weight": ("ssm_in.weight", lambda t: t),
             "mamba.out_proj.weight": ("ssm_out.weight", lambda t: t),
             "mamba.conv1d.weight": ("ssm_conv1d.weight", lambda t: t.squeeze(1)),
             "mamba.conv1d.bias": ("ssm_conv1d.bias", lambda t: t), "mamba.dt_bias": ("ssm_dt.bias", lambda t: t),
             "mamba.A_log": ("ssm_a", lambda t: -torch.exp(t).unsqueeze(1)), "mamba.D": ("ssm_d", lambda t: t.unsqueeze(1)),
             "mamba.norm.weight": ("ssm_norm.weight", lambda t: t.reshape(config["mamba_n_groups"], -1))}  # fmt: skip
    if rest in mamba:
        gguf_name, change = mamba[rest]
        return [(prefix + gguf_name, change(tensor))]
    return [_block_tensors(name, tensor, "granite", config)]


def _lfm2_metadata(writer: GGUFWriter, config: dict) -> None:
    """LFM2's (the converter's ``LFM2Model``): KV heads per layer (0 for a convolution layer), the
    MLP's width as its config derives it, the convolutions' taps, ``norm_eps``."""
    writer.add_head_count(config["num_attention_heads"])
    kv = [config["num_key_value_heads"] if t == "full_attention" else 0 for t in config["layer_types"]]
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(config["norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_uint32("lfm2.shortconv.l_cache", config["conv_L_cache"])
    width = int(2 * config["intermediate_size"] / 3)
    multiple = config["block_multiple_of"]
    width = multiple * ((int(config["block_ffn_dim_multiplier"] * width) + multiple - 1) // multiple)
    writer.add_feed_forward_length(width)
    writer.add_rope_freq_base((config.get("rope_parameters") or {}).get("rope_theta", 1000000.0))


def _phi3_metadata(writer: GGUFWriter, config: dict, rope: dict) -> None:
    """Phi-3's: the original context, its window (0: none), LongRoPE's attention factor."""
    original = rope.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def _copy_tokenizer(writer: GGUFWriter, tokenizer_gguf: str) -> None:
    for field in GGUFReader(tokenizer_gguf).fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)


def _block_tensors(name: str, tensor: torch.Tensor, arch: str, config: dict) -> tuple[str, torch.Tensor]:
    """The GGUF name and data of one HF block tensor (experts are gathered by the caller)."""
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    module, kind = rest.rsplit(".", 1)
    if arch in _QWEN35 and module.startswith("linear_attn") and module != "linear_attn.norm":
        gguf_name, tensor = _qwen35_tensor(module, kind, tensor, config)
        return f"blk.{layer}.{gguf_name}", tensor
    names = {**_NAMES, **{"olmo2": _OLMO2_NAMES, "glm4": _GLM4_NAMES, "lfm2": _LFM2_NAMES, "qwen35": _QWEN35_NAMES,
                          "qwen35moe": _QWEN35_NAMES}.get(
        arch, _GEMMA_NAMES if arch.startswith("gemma") else {})}  # fmt: skip
    if arch in _LLAMA_LIKE and module in ("self_attn.q_proj", "self_attn.k_proj"):
        heads = config["num_attention_heads"] if module.endswith("q_proj") else config["num_key_value_heads"]
        tensor = _permute(tensor, heads)
    if (arch.startswith("gemma") or arch in _QWEN35) and module.endswith("norm") and module != "linear_attn.norm":
        tensor = tensor + 1
    if arch == "lfm2" and module == "conv.conv":
        tensor = tensor.squeeze(1)  # (the converter's: its conv op takes [channels, taps])
    return f"blk.{layer}.{names[module]}.{kind}", tensor


def write_gguf(hf_folder: str, out: Path, tokenizer_gguf: str) -> str:
    """Write ``hf_folder``'s model (float32) to ``out`` as llama.cpp's converter would."""
    config = json.loads((Path(hf_folder) / "config.json").read_text())
    arch = _ARCHS[config["architectures"][0]]
    tensors = load_file(str(Path(hf_folder) / "model.safetensors"))
    writer = GGUFWriter(str(out), arch)
    _metadata(writer, arch, config)
    _copy_tokenizer(writer, tokenizer_gguf)
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight", "model.embedding_norm.weight": "token_embd_norm.weight"}  # fmt: skip
    for name, tensor in tensors.items():
        tensor = tensor.float()
        if name in top:
            plus_one = arch.startswith("gemma") or arch in _QWEN35
            data = tensor + 1 if plus_one and name == "model.norm.weight" else tensor
            if name != "lm_head.weight" or not config.get("tie_word_embeddings"):
                writer.add_tensor(top[name], data.numpy())
            continue
        if arch == "granitehybrid" and name.startswith("model.layers."):
            for gguf_name, data in _granite_hybrid_tensors(name, tensor, config):
                writer.add_tensor(gguf_name, data.numpy())
            continue
        if ".experts." in name:  # model.layers.N.<mlp|block_sparse_moe>.experts.E.<part>.weight
            layer = name.split(".")[2]
            expert, part = name.split(".experts.")[1].split(".")[:2]
            experts.setdefault((layer, _EXPERT_PARTS[part]), {})[int(expert)] = tensor
            continue
        gguf_name, data = _block_tensors(name, tensor, arch, config)
        writer.add_tensor(gguf_name, data.numpy())
    for (layer, part), by_expert in sorted(experts.items()):
        writer.add_tensor(f"blk.{layer}.{part}.weight", torch.stack([by_expert[e] for e in sorted(by_expert)]).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out)


def gguf_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file by name (for comparing two files)."""
    return {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}


def _half_bytes(value: float) -> np.ndarray:
    return np.frombuffer(np.array([value], dtype=np.float16).tobytes(), dtype=np.uint8)


def random_k_quant(qtype: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant super-blocks (gguf-py has no quantizer for them) with sane fp16 scales."""
    size = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q5_K: 176, GGMLQuantizationType.Q6_K: 210}[qtype]
    raw = rng.integers(0, 256, (rows, k // 256 * size), dtype=np.uint8)
    supers = raw.reshape(rows, k // 256, size)
    if qtype == GGMLQuantizationType.Q6_K:
        supers[..., 208:210] = _half_bytes(0.0021)
    else:
        supers[..., 0:2], supers[..., 2:4] = _half_bytes(0.0123), _half_bytes(0.0047)
    return raw
