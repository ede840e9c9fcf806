"""What llama.cpp's converter writes per model family, read back as a Hugging Face config and
HF tensor names.

GGUF metadata (``{arch}.embedding_length``, ...) becomes a ``config.json``-shaped dict, so the
same ``ModelArchConfig.from_hf_config`` derives every family's fields (expert layers, Gemma's
windowed layers) for both formats. Where the converter changed a tensor (q/k rows permuted
for Llama's rotary layout, Gemma's norm weights stored as ``1 + w``, experts stacked in one
3-D tensor), :func:`hf_tensors` undoes it, so the model loads weights equal to the HF ones.
Where llama.cpp decides something the file does not say (Gemma's score scale, Qwen3-MoE's
renormalised routing), this module decides it the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagellm.kernels.quant_formats import QuantizedRows

Tensor = torch.Tensor | QuantizedRows
Metadata = Callable[[str, Any], Any]  # (key, default) -> value


@dataclass(frozen=True)
class GGUFFamily:
    """One ``general.architecture`` value as llama.cpp's converter writes it."""

    hf_architecture: str
    qk_permuted: bool = False  # q/k rows interleaved for llama.cpp's rotary layout
    norm_plus_one: bool = False  # Gemma: norm weights stored as 1 + w
    block_names: tuple[tuple[str, str], ...] = ()  # family-specific GGUF -> HF block names
    top_names: tuple[tuple[str, str], ...] = ()  # family-specific GGUF -> HF names outside the blocks
    bare_names: tuple[tuple[str, str], ...] = ()  # block tensors named whole, without .weight / .bias


_GEMMA_NAMES = (("ffn_norm", "pre_feedforward_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                ("post_ffw_norm", "post_feedforward_layernorm"))  # fmt: skip
FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("LlamaForCausalLM", qk_permuted=True),  # Mixtral too (with experts)
    "qwen2": GGUFFamily("Qwen2ForCausalLM"),
    "qwen3": GGUFFamily("Qwen3ForCausalLM"),
    "qwen3moe": GGUFFamily("Qwen3MoeForCausalLM"),
    "gemma2": GGUFFamily("Gemma2ForCausalLM", norm_plus_one=True, block_names=_GEMMA_NAMES),
    "gemma3": GGUFFamily("Gemma3ForCausalLM", norm_plus_one=True, block_names=_GEMMA_NAMES),
    "smollm3": GGUFFamily("SmolLM3ForCausalLM", qk_permuted=True),  # (llama.cpp: NoPE every 4th layer, as HF's default)
    "granite": GGUFFamily("GraniteForCausalLM", qk_permuted=True),
    # GLM-4: its four norms, gate and up fused in `ffn_up`; q/k rows as HF's (interleaved rotary).
    "glm4": GGUFFamily("Glm4ForCausalLM", block_names=(
        ("post_attention_norm", "post_self_attn_layernorm"), ("post_ffw_norm", "post_mlp_layernorm"),
        ("ffn_up", "mlp.gate_up_proj"))),  # fmt: skip
    "olmo2": GGUFFamily("Olmo2ForCausalLM", block_names=(("post_attention_norm", "post_attention_layernorm"),
                                                         ("post_ffw_norm", "post_feedforward_layernorm"))),
    # LFM2: its convolutions' tensors, the final norm as `token_embd_norm`; q/k rows as HF's.
    "lfm2": GGUFFamily("Lfm2ForCausalLM", block_names=(
        ("shortconv.conv", "conv.conv"), ("shortconv.in_proj", "conv.in_proj"),
        ("shortconv.out_proj", "conv.out_proj")), top_names=(("token_embd_norm.weight", "model.norm.weight"),)),
    # Qwen3.5: its gated delta-nets' tensors (`ssm_a` holds -exp(A_log); their value heads in
    # llama.cpp's tiled order, kept so: ``_qwen35_config``), the norm after attention by its name.
    "qwen35": GGUFFamily("Qwen3_5ForCausalLM", norm_plus_one=True, block_names=(
        ("post_attention_norm", "post_attention_layernorm"), ("attn_qkv", "linear_attn.in_proj_qkv"),
        ("attn_gate", "linear_attn.in_proj_z"), ("ssm_beta", "linear_attn.in_proj_b"),
        ("ssm_alpha", "linear_attn.in_proj_a"), ("ssm_conv1d", "linear_attn.conv1d"), ("ssm_norm", "linear_attn.norm"),
        ("ssm_out", "linear_attn.out_proj")),
        bare_names=(("ssm_a", "linear_attn.A_log"), ("ssm_dt.bias", "linear_attn.dt_bias"))),  # fmt: skip
    # Phi-3: q/k/v in one tensor, gate and up in `ffn_up` (split by rows on load).
    "phi3": GGUFFamily("Phi3ForCausalLM", block_names=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))),
}
# Granite-4.0-H: Granite's (q/k rows permuted), its Mamba-2 mixers' tensors (`ssm_a` holds
# -exp(A_log); `ssm_a`, `ssm_d` and the norm reshaped: ``hf_tensors`` flattens them).
FAMILIES["granitehybrid"] = GGUFFamily("GraniteMoeHybridForCausalLM", qk_permuted=True, block_names=(
    ("ssm_in", "mamba.in_proj"), ("ssm_out", "mamba.out_proj"), ("ssm_conv1d", "mamba.conv1d"),
    ("ssm_norm", "mamba.norm")),
    bare_names=(("ssm_a", "mamba.A_log"), ("ssm_d", "mamba.D"), ("ssm_dt.bias", "mamba.dt_bias")))  # fmt: skip
# Qwen3.5's MoE models: its tensors and every MLP's experts (`ffn_*_exps`) beside a gated shared expert.
FAMILIES["qwen35moe"] = replace(FAMILIES["qwen35"], hf_architecture="Qwen3_5MoeForCausalLM", block_names=(
    *FAMILIES["qwen35"].block_names, ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"),
    ("ffn_up_shexp", "mlp.shared_expert.up_proj"), ("ffn_down_shexp", "mlp.shared_expert.down_proj"),
    ("ffn_gate_inp_shexp", "mlp.shared_expert_gate")))  # fmt: skip
# Not weights: LongRoPE's factors (read into the rope config by the loader).
ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Every expert of a layer in one 3-D tensor [experts, rows, cols] (HF shape order).
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<name>[\w.]+)\.(?P<kind>weight|bias)$")
# llama.cpp's Gemma 27B (by layer count) scales scores by 1/sqrt(hidden / heads), others by
# 1/sqrt(head_dim): the files do not say (HF's query_pre_attn_scalar).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def family(gguf_arch: str) -> GGUFFamily:
    """The family of ``general.architecture``; ValueError naming the supported ones otherwise."""
    if gguf_arch not in FAMILIES:
        raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[gguf_arch]


def hf_config(gguf_arch: str, meta: Metadata) -> dict[str, Any]:
    """The family-specific part of a ``config.json`` for this file (the common shape is the
    caller's): experts, Gemma's windows, caps and score scale."""
    prefix, config = gguf_arch, {}
    experts = int(meta(f"{prefix}.expert_count", 0) or 0)
    if experts:
        config.update(num_experts=experts, num_experts_per_tok=int(meta(f"{prefix}.expert_used_count", 0)),
                      moe_intermediate_size=meta(f"{prefix}.expert_feed_forward_length", None),
                      norm_topk_prob=True)  # llama.cpp renormalises Qwen3-MoE's top-k (Mixtral always does)
    if gguf_arch in _GEMMA_27B_LAYERS:
        config.update(_gemma_config(gguf_arch, meta))
    if gguf_arch in ("granite", "granitehybrid"):  # its multipliers, as the converter names them
        config.update(embedding_multiplier=meta(f"{prefix}.embedding_scale", 1.0),
                      residual_multiplier=meta(f"{prefix}.residual_scale", 1.0),
                      attention_multiplier=meta(f"{prefix}.attention.scale", 1.0),
                      logits_scaling=meta(f"{prefix}.logit_scale", 1.0))  # fmt: skip
    if gguf_arch == "lfm2":  # (its MLP's width as written: already the one the config derives)
        config.update(_lfm2_config(meta))
    if gguf_arch == "granitehybrid":
        config.update(_granite_hybrid_config(meta))
    if gguf_arch in ("qwen35", "qwen35moe"):
        config.update(_qwen35_config(gguf_arch, meta))
    if gguf_arch == "phi3":  # (a window of 0: none, as the converter writes Phi-4's)
        config.update(sliding_window=meta(f"{prefix}.attention.sliding_window", 0) or None,
                      original_max_position_embeddings=meta(f"{prefix}.rope.scaling.original_context_length", None))
    return config


def architecture(gguf_arch: str, meta: Metadata) -> str:
    """The HF architecture: a Llama file with experts is a Mixtral."""
    if gguf_arch == "llama" and int(meta("llama.expert_count", 0) or 0):
        return "MixtralForCausalLM"
    return family(gguf_arch).hf_architecture


def _lfm2_config(meta: Metadata) -> dict[str, Any]:
    """LFM2's layer types: the converter writes ``head_count_kv`` per layer, 0 for a convolution."""
    kv_heads = meta("lfm2.attention.head_count_kv", None)
    if not isinstance(kv_heads, list):
        raise ValueError("an LFM2 file lists lfm2.attention.head_count_kv per layer (0: a convolution layer)")
    return dict(layer_types=["full_attention" if n else "conv" for n in kv_heads], num_key_value_heads=max(kv_heads),
                conv_L_cache=int(meta("lfm2.shortconv.l_cache", 3)), block_auto_adjust_ff_dim=False)  # fmt: skip


def _granite_hybrid_config(meta: Metadata) -> dict[str, Any]:
    """Granite-4.0-H's: its Mamba-2 layers are those without KV heads (``head_count_kv`` per
    layer), their shape from the ``ssm`` keys; rope only where the converter marks it used
    (``rope.scaling.finetuned``: its files without rope say False); the dense MLP's width is the
    shared expert's (``expert_shared_feed_forward_length``)."""
    if int(meta("granitehybrid.expert_count", 0) or 0):
        raise NotImplementedError("Granite-4.0-H GGUF files with routed experts (H Tiny, H Small) are not supported "
                                  "yet; their safetensors folders are")  # fmt: skip
    kv_heads = meta("granitehybrid.attention.head_count_kv", None)
    if not isinstance(kv_heads, list):
        raise ValueError("a Granite-4.0-H file lists granitehybrid.attention.head_count_kv per layer (0: a Mamba-2 layer)")
    heads, inner = int(meta("granitehybrid.ssm.time_step_rank", 0)), int(meta("granitehybrid.ssm.inner_size", 0))
    if heads < 1:
        raise ValueError("a Granite-4.0-H file gives its Mamba-2 heads as granitehybrid.ssm.time_step_rank")
    hidden = int(meta("granitehybrid.embedding_length", 1))
    ssm = lambda key, default: int(meta(f"granitehybrid.ssm.{key}", default))  # noqa: E731
    rope = bool(meta("granitehybrid.rope.scaling.finetuned", False))
    return dict(layer_types=["attention" if n else "mamba" for n in kv_heads], mamba_n_heads=heads,
                mamba_d_head=inner // heads, mamba_expand=inner // hidden, mamba_d_conv=ssm("conv_kernel", 4),
                mamba_d_state=ssm("state_size", 0), mamba_n_groups=ssm("group_count", 1), num_local_experts=0,
                shared_intermediate_size=meta("granitehybrid.expert_shared_feed_forward_length", None),
                position_embedding_type="rope" if rope else None)  # fmt: skip


def _qwen35_config(prefix: str, meta: Metadata) -> dict[str, Any]:
    """Qwen3.5's: its layers without the multi-token-prediction ones the converter appends, which
    are gated delta-nets (``attention.recurrent_layers``, else all but every
    ``full_attention_interval``-th), and their shape from the ``ssm`` keys. The converter orders
    the value heads tiled ([k0, k1, ..., k0, k1, ...]) where HF groups them by key head: the model
    reads them so (``linear_value_heads_tiled``), as no column order of a quantized out_proj
    could be undone."""
    layers = int(meta(f"{prefix}.block_count", 0)) - int(meta(f"{prefix}.nextn_predict_layers", 0) or 0)
    recurrent = meta(f"{prefix}.attention.recurrent_layers", None)
    if not isinstance(recurrent, list):
        interval = int(meta(f"{prefix}.full_attention_interval", 4) or 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    value_heads = int(meta(f"{prefix}.ssm.time_step_rank", 0))
    if value_heads < 1:
        raise ValueError(f"a Qwen3.5 file gives its gated delta-nets' value heads as {prefix}.ssm.time_step_rank")
    shared = meta(f"{prefix}.expert_shared_feed_forward_length", None)  # (the MoE models' shared expert)
    layer_types = ["linear_attention" if r else "full_attention" for r in recurrent[:layers]]
    return dict(num_hidden_layers=layers, layer_types=layer_types,
                linear_conv_kernel_dim=int(meta(f"{prefix}.ssm.conv_kernel", 4)),
                linear_key_head_dim=int(meta(f"{prefix}.ssm.state_size", 0)),
                linear_num_key_heads=int(meta(f"{prefix}.ssm.group_count", 0)), linear_num_value_heads=value_heads,
                linear_value_head_dim=int(meta(f"{prefix}.ssm.inner_size", 0)) // value_heads,
                linear_value_heads_tiled=True,
                **({} if shared is None else {"shared_expert_intermediate_size": shared}))  # fmt: skip


def _gemma_config(gguf_arch: str, meta: Metadata) -> dict[str, Any]:
    prefix = gguf_arch
    layers = int(meta(f"{prefix}.block_count", 0))
    hidden, heads = int(meta(f"{prefix}.embedding_length", 0)), int(meta(f"{prefix}.attention.head_count", 1))
    head_dim = int(meta(f"{prefix}.attention.key_length", hidden // heads))
    # Every N-th layer global (llama.cpp's default N is the config's, derived there), or per layer.
    pattern = meta(f"{prefix}.attention.sliding_window_pattern", None)
    per_layer = isinstance(pattern, list)
    layer_types = ["sliding_attention" if swa else "full_attention" for swa in pattern] if per_layer else None
    window = meta(f"{prefix}.attention.sliding_window", None)
    base = float(meta(f"{prefix}.rope.freq_base", 10000.0))
    return dict(
        sliding_window=None if not window else int(window), layer_types=layer_types,
        sliding_window_pattern=None if per_layer else pattern,
        rope_local_base_freq=float(meta(f"{prefix}.rope.freq_base_swa", base)),
        query_pre_attn_scalar=hidden // heads if layers == _GEMMA_27B_LAYERS[gguf_arch] else head_dim,
        attn_logit_softcapping=meta(f"{prefix}.attn_logit_softcapping", None) or None,
        final_logit_softcapping=meta(f"{prefix}.final_logit_softcapping", None) or None,
        hidden_activation="gelu_pytorch_tanh",
    )  # fmt: skip


def hf_tensor_name(gguf_name: str, gguf_arch: str = "llama") -> str:
    """GGUF tensor name -> HF parameter name; ValueError for names we do not know."""
    top = {**_TOP_LEVEL_NAMES, **dict(family(gguf_arch).top_names)}
    if gguf_name in top:
        return top[gguf_name]
    layer, _, rest = gguf_name.removeprefix("blk.").partition(".")
    bare = dict(family(gguf_arch).bare_names)
    if gguf_name.startswith("blk.") and rest in bare:
        return f"model.layers.{layer}.{bare[rest]}"
    match = _BLOCK_TENSOR.match(gguf_name)
    names = {**_BLOCK_NAMES, **dict(family(gguf_arch).block_names), **_EXPERT_NAMES}
    if match is None or match["name"] not in names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    if match["name"] in _EXPERT_NAMES:
        return f"model.layers.{match['layer']}.mlp.experts.{_EXPERT_NAMES[match['name']]}"  # split by hf_tensors
    return f"model.layers.{match['layer']}.{names[match['name']]}.{match['kind']}"


def gguf_tensor_name(hf_name: str, gguf_arch: str = "llama") -> str:
    """HF parameter name -> GGUF tensor name, for the shared names of :data:`_BLOCK_NAMES` and
    ``gguf_arch``'s own (the inverse of :func:`hf_tensor_name` there; files written by
    ``benchmarks.random_gguf``, LoRA files written as llama.cpp's converter writes them)."""
    inverse_top = {hf: gguf for gguf, hf in _TOP_LEVEL_NAMES.items()}
    if hf_name in inverse_top:
        return inverse_top[hf_name]
    match = re.match(r"^model\.layers\.(?P<layer>\d+)\.(?P<name>.+)\.(?P<kind>weight|bias)$", hf_name)
    inverse = {hf: gguf for gguf, hf in (*_BLOCK_NAMES.items(), *family(gguf_arch).block_names)}
    if match is None or match["name"] not in inverse:
        raise ValueError(f"no GGUF name for {hf_name!r}")
    return f"blk.{match['layer']}.{inverse[match['name']]}.{match['kind']}"


def hf_tensors(
    name: str, tensor: Tensor | list[QuantizedRows], gguf_arch: str, heads: dict[str, int]
) -> Iterator[tuple[str, Tensor]]:
    """One GGUF tensor (already named by :func:`hf_tensor_name`) as the HF tensors it holds:
    q/k rows back in HF's order, Gemma norms back to ``w``, stacked experts one by one (a
    dense 3-D tensor, or each expert's blocks)."""
    fam = family(gguf_arch)
    projection = name.split(".")[-2]
    if name.rsplit(".", 1)[-1] in _EXPERT_NAMES.values():
        if not isinstance(tensor, list) and (not isinstance(tensor, torch.Tensor) or tensor.dim() != 3):
            raise ValueError(f"GGUF experts {name!r}: expected a 3-D tensor")
        prefix, part = name.rsplit(".", 1)
        for expert in range(len(tensor)):
            yield f"{prefix}.{expert}.{part}.weight", tensor[expert]
        return
    if isinstance(tensor, list):
        raise ValueError(f"GGUF tensor {name!r} is 3-D; only experts are")
    if fam.qk_permuted and projection in heads:
        rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) else tensor.rows
        order = unpermute_qk_rows(torch.arange(rows), heads[projection])
        tensor = tensor[order] if isinstance(tensor, torch.Tensor) else tensor.select_rows(order)
    plain_norm = name.endswith(".linear_attn.norm.weight")  # (Qwen3.5's delta-nets' norm: stored as it is)
    if fam.norm_plus_one and name.endswith("norm.weight") and not plain_norm and isinstance(tensor, torch.Tensor):
        tensor = tensor - 1
    conv = name.endswith((".conv.conv.weight", ".linear_attn.conv1d.weight", ".mamba.conv1d.weight"))
    if conv and isinstance(tensor, torch.Tensor):
        tensor = tensor.unsqueeze(1)  # (the converter squeezes Conv1d's [channels, 1, taps]: LFM2, Qwen3.5)
    if name.endswith((".linear_attn.A_log", ".mamba.A_log")) and isinstance(tensor, torch.Tensor):
        tensor = torch.log(-tensor)  # (Qwen3.5, Granite-4.0-H: the converter stores A = -exp(A_log))
    if name.endswith((".mamba.A_log", ".mamba.D", ".mamba.norm.weight")) and isinstance(tensor, torch.Tensor):
        tensor = tensor.reshape(-1)  # (Granite-4.0-H: [heads, 1], the norm [groups, channels / groups])
    yield name, tensor


def permute_qk_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter's per-head row permutation of q_proj/k_proj (the inverse of
    :func:`unpermute_qk_rows`): each head's rotate-half rows ``[half0 | half1]`` interleaved."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute_qk_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of q_proj/k_proj (weight or bias).

    The converter maps each head's rows ``[half0 | half1]`` to interleaved pairs; reshaping
    to ``(heads, half, 2, ...)`` and swapping the middle axes restores HF's rotate-half order.
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
