"""Read a GGUF file (llama.cpp format) as an HF-named, dequantized checkpoint.

We serve GGUF models with plain dense weights: every tensor is dequantized at load time
with ``gguf.quants.dequantize`` and renamed to the Hugging Face layout, so the same
``LlamaForCausalLM.load_weights`` handles both formats. llama.cpp's converter permutes
the rows of q_proj/k_proj (for its interleaved rotary layout); we undo that permutation,
as HF transformers' GGUF loader does, so our weights equal the HF model's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from pagellm.model.arch_config import ModelArchConfig

# GGUF general.architecture -> (HF architecture, q/k/v bias, q/k rows permuted by the converter).
_GGUF_ARCHS: dict[str, tuple[str, bool, bool]] = {
    "llama": ("LlamaForCausalLM", False, True),
    "qwen2": ("Qwen2ForCausalLM", True, False),
}
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
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<name>\w+)\.(?P<kind>weight|bias)$")
_MISSING = object()


@lru_cache(maxsize=2)
def open_gguf(path: str) -> GGUFReader:
    """Memory-map a GGUF file, read-only; cached because parsing the metadata (the whole
    token list) takes seconds and the engine asks for config, weights and tokenizer in turn."""
    return GGUFReader(path, "r")


def _field_value(field: Any) -> Any:
    """A scalar or string metadata value as a Python object."""
    value_type = field.types[0] if field.types else None
    if value_type == GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {field.name!r} is an array, expected a scalar")
    part = field.parts[field.data[0]]
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def read_metadata(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """One metadata value; ValueError naming the key when it is required and absent."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata is missing {key!r}")
        return default
    return _field_value(field)


def _gguf_arch(reader: GGUFReader) -> tuple[str, str, bool, bool]:
    """(gguf arch prefix, HF architecture, qkv bias, q/k permuted), rejecting unknown archs."""
    gguf_arch = read_metadata(reader, "general.architecture")
    if gguf_arch not in _GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(sorted(_GGUF_ARCHS))}"
        )
    return (gguf_arch, *_GGUF_ARCHS[gguf_arch])


def _check_rope(reader: GGUFReader, prefix: str, head_dim: int) -> None:
    """Refuse rope variants whose GGUF encoding we do not translate."""
    scaling = read_metadata(reader, f"{prefix}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise NotImplementedError(f"GGUF rope scaling type {scaling!r} is not supported")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise NotImplementedError("GGUF rope frequency factors (rope_freqs, Llama-3.1 style) are not supported")
    rope_dims = read_metadata(reader, f"{prefix}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise NotImplementedError(f"partial rotary (rope dims {rope_dims} < head_dim {head_dim}) is not supported")


def _eos_ids(reader: GGUFReader) -> list[int]:
    """eos plus end-of-turn / end-of-message ids, when the file names them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [read_metadata(reader, key, None) for key in keys]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _vocab_size(reader: GGUFReader, prefix: str) -> int:
    """Vocabulary size from the token list (authoritative), else ``{arch}.vocab_size``."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    return int(read_metadata(reader, f"{prefix}.vocab_size"))


def arch_config_from_gguf(reader: GGUFReader) -> ModelArchConfig:
    """Build the model shape from GGUF metadata alone (no tensor data read)."""
    prefix, architecture, qkv_bias, _ = _gguf_arch(reader)
    hidden_size = int(read_metadata(reader, f"{prefix}.embedding_length"))
    num_heads = int(read_metadata(reader, f"{prefix}.attention.head_count"))
    head_dim = int(read_metadata(reader, f"{prefix}.attention.key_length", hidden_size // num_heads))
    _check_rope(reader, prefix, head_dim)
    bos = read_metadata(reader, "tokenizer.ggml.bos_token_id", None)
    return ModelArchConfig(
        architecture=architecture,
        vocab_size=_vocab_size(reader, prefix),
        hidden_size=hidden_size,
        intermediate_size=int(read_metadata(reader, f"{prefix}.feed_forward_length")),
        num_hidden_layers=int(read_metadata(reader, f"{prefix}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(read_metadata(reader, f"{prefix}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(read_metadata(reader, f"{prefix}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(read_metadata(reader, f"{prefix}.rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(read_metadata(reader, f"{prefix}.context_length")),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        attention_bias=qkv_bias,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(reader),
    )


def read_gguf_arch_config(path: str) -> ModelArchConfig:
    """``arch_config_from_gguf`` for a file path."""
    return arch_config_from_gguf(open_gguf(path))


def gguf_chat_template(path: str) -> str | None:
    """The chat template embedded in the file's ``tokenizer.chat_template`` metadata, if any."""
    return read_metadata(open_gguf(path), "tokenizer.chat_template", None)


def hf_tensor_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF parameter name; ValueError for names we do not know."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.match(gguf_name)
    if match is None or match["name"] not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{match['layer']}.{_BLOCK_NAMES[match['name']]}.{match['kind']}"


def unpermute_qk_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of q_proj/k_proj (weight or bias).

    The converter maps each head's rows ``[half0 | half1]`` to interleaved pairs; reshaping
    to ``(heads, half, 2, ...)`` and swapping the middle axes restores HF's rotate-half order.
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _dequantized(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as a float32 torch tensor in HF shape (GGUF lists dims reversed)."""
    data = np.require(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, requirements=["C", "W"])
    return torch.from_numpy(data).reshape(tuple(reversed([int(d) for d in tensor.shape])))


def iter_gguf_weights(
    reader: GGUFReader, arch: ModelArchConfig, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor, dequantized into ``dtype``, one at a time."""
    _, _, _, permuted = _gguf_arch(reader)
    heads_for = {"q_proj": arch.num_attention_heads, "k_proj": arch.num_key_value_heads}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        weight = _dequantized(tensor)
        projection = name.split(".")[-2]
        if permuted and projection in heads_for:
            weight = unpermute_qk_rows(weight, heads_for[projection])
        yield name, weight.to(dtype)
