"""Random-weight files of the shapes people run (Llama 3.2 1B and 3B, Llama 3 8B, Qwen2.5 7B):
GGUF in llama.cpp's type mixes, and sharded safetensors, with the default model's tokenizer.

Decode speed depends on shapes and bytes, not on weight values: a random file of a real shape
and type mix costs what the real file costs, in every engine (issue P3's measurements). The
tensors are written one at a time, so an 8B file needs the memory of its largest tensor, not of
the model. The same seed gives the same weights in both formats (the GGUF's q/k rows permuted as
llama.cpp's converter does), so ``pagellm`` on the GGUF and another engine on the safetensors run
the same model up to quantization.

Type mixes follow ``llama-quantize`` (``llama_tensor_get_type``): Q4_0 and Q8_0 files hold every
linear in that type, the output matrix (or a tied embedding) in Q6_K (Q8_0: Q8_0); Q4_K_M holds
Q4_K with Q6_K for the output and for ``attn_v`` and ``ffn_down`` of the layers its
``use_more_bits`` picks. The K-quant scales are round-to-nearest (``gguf_encode``), not
llama-quantize's search: the same bytes, a little more error. The tokenizer is the default
model's (49,152 tokens), padded with ``<pad_N>`` tokens to the shape's vocabulary, so every id
decodes and the embedding and output matrices have their real sizes.

    python -m pagellm.benchmarks.random_model /tmp/llama-1b-q4km.gguf --shape llama-1b --gguf Q4_K_M
    python -m pagellm.benchmarks.random_model /tmp/llama-1b --shape llama-1b   # safetensors, bf16
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, GGUFWriter, LlamaFileType

from pagellm.benchmarks.gguf_encode import SUPER_BLOCK, encode
from pagellm.model.gguf_families import gguf_tensor_name, permute_qk_rows

# --gguf NAME -> (the linears' type, the output matrix's type, general.file_type)
FILE_TYPES: dict[str, tuple[T, T, LlamaFileType]] = {
    "Q4_0": (T.Q4_0, T.Q6_K, LlamaFileType.MOSTLY_Q4_0),
    "Q4_K_M": (T.Q4_K, T.Q6_K, LlamaFileType.MOSTLY_Q4_K_M),
    "Q8_0": (T.Q8_0, T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "BF16": (T.BF16, T.BF16, LlamaFileType.MOSTLY_BF16),
}
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2"}  # the families these writers cover
# Types stored as plain numpy arrays (the block types: rows of bytes).
_NUMPY_TYPES = {T.F32: np.dtype(np.float32), T.F16: np.dtype(np.float16)}
_WEIGHT_STD = 0.02  # transformers' initializer_range
_SHARD_BYTES = 2 << 30  # safetensors shard size, as transformers' save_pretrained


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its HF name, torch shape ([out, in] for a linear) and layer."""

    name: str
    shape: tuple[int, ...]
    layer: int | None = None

    @property
    def is_linear(self) -> bool:
        return len(self.shape) == 2 and self.name.endswith(".weight")


def checkpoint_tensors(shape: dict[str, Any]) -> list[TensorSpec]:
    """The tensors of a Llama-family (llama, qwen2) shape, in the order a checkpoint stores them."""
    if shape["architecture"] not in _GGUF_ARCHS:
        raise ValueError(f"random real-shape files cover {sorted(_GGUF_ARCHS)}, not {shape['architecture']!r}")
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    bias = shape["architecture"] == "qwen2"  # Qwen2: q/k/v biases
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
            specs.append(TensorSpec(f"{p}self_attn.{proj}.weight", (rows, hidden), i))
            if bias:
                specs.append(TensorSpec(f"{p}self_attn.{proj}.bias", (rows,), i))
        specs += [TensorSpec(f"{p}self_attn.o_proj.weight", (hidden, heads * head_dim), i),
                  TensorSpec(f"{p}mlp.gate_proj.weight", (inter, hidden), i),
                  TensorSpec(f"{p}mlp.up_proj.weight", (inter, hidden), i),
                  TensorSpec(f"{p}mlp.down_proj.weight", (hidden, inter), i),
                  TensorSpec(f"{p}input_layernorm.weight", (hidden,), i),
                  TensorSpec(f"{p}post_attention_layernorm.weight", (hidden,), i)]  # fmt: skip
    specs.append(TensorSpec("model.norm.weight", (hidden,)))
    if not shape.get("tie_word_embeddings", False):
        specs.append(TensorSpec("lm_head.weight", (vocab, hidden)))
    return specs


def random_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The float32 values of ``spec``, the same for a seed whatever the format: weights and
    biases N(0, 0.02), norm weights around 1."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    values = torch.randn(spec.shape, generator=generator)
    if spec.name.endswith("norm.weight"):
        return values.mul_(0.1).add_(1.0)
    return values.mul_(_WEIGHT_STD)


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v and ffn_down get more bits (Q4_K_M)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def gguf_type(spec: TensorSpec, file_type: str, layers: int, tied: bool) -> T:
    """The type llama-quantize gives ``spec`` in a ``file_type`` file (norms and biases: F32)."""
    linear, output, _ = FILE_TYPES[file_type]
    if not spec.is_linear:
        return T.F32
    if spec.name == "lm_head.weight" or (tied and spec.name == "model.embed_tokens.weight"):
        kind = output
    elif file_type == "Q4_K_M" and spec.layer is not None and _use_more_bits(spec.layer, layers) and (
            spec.name.endswith(("v_proj.weight", "down_proj.weight"))):  # fmt: skip
        kind = T.Q6_K
    else:
        kind = linear
    block = SUPER_BLOCK if kind in (T.Q4_K, T.Q6_K) else 32
    return kind if spec.shape[1] % block == 0 else T.F16  # (llama-quantize falls back too)


def _gguf_values(spec: TensorSpec, values: torch.Tensor, shape: dict[str, Any]) -> torch.Tensor:
    """A checkpoint tensor as llama.cpp's converter stores it (Llama's q/k rows permuted)."""
    heads = {"q_proj": shape["num_attention_heads"], "k_proj": shape["num_key_value_heads"]}
    projection = spec.name.split(".")[-2]
    if shape["architecture"] == "llama" and projection in heads:
        return permute_qk_rows(values, heads[projection])
    return values


def write_random_gguf(path: str | Path, shape: dict[str, Any], file_type: str, seed: int = 0,
                      name: str = "") -> dict[str, int]:  # fmt: skip
    """Write a random-weight GGUF of ``shape`` in ``file_type`` (a key of :data:`FILE_TYPES`) to
    ``path`` (``general.name``: "random NAME"); returns the count of tensors per GGUF type."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown GGUF file type {file_type!r}; choose from {sorted(FILE_TYPES)}")
    arch = _GGUF_ARCHS.get(shape["architecture"])
    if arch is None:
        raise ValueError(f"random GGUF files cover {sorted(_GGUF_ARCHS)}, not {shape['architecture']!r}")
    specs = checkpoint_tensors(shape)
    layers, tied = shape["num_hidden_layers"], bool(shape.get("tie_word_embeddings", False))
    types = {spec.name: gguf_type(spec, file_type, layers, tied) for spec in specs}
    writer = GGUFWriter(str(path), arch)
    _add_metadata(writer, name or arch, shape, FILE_TYPES[file_type][2])
    for spec in specs:
        stored, dtype = _encoded_shape(spec.shape, types[spec.name]), _NUMPY_TYPES.get(types[spec.name], np.dtype(np.uint8))
        nbytes = int(np.prod(stored)) * dtype.itemsize
        writer.add_tensor_info(gguf_tensor_name(spec.name), stored, dtype, nbytes, raw_dtype=types[spec.name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for spec in specs:
        values = _gguf_values(spec, random_tensor(spec, seed), shape).numpy()
        writer.write_tensor_data(encode(values.reshape(-1, values.shape[-1]), types[spec.name]).reshape(
            _encoded_shape(spec.shape, types[spec.name])))  # fmt: skip
    writer.close()
    counts: dict[str, int] = {}
    for kind in types.values():
        counts[kind.name] = counts.get(kind.name, 0) + 1
    return counts


def _encoded_shape(shape: tuple[int, ...], kind: T) -> tuple[int, ...]:
    """The numpy shape of a tensor's encoded data: rows of bytes for block types."""
    if kind in _NUMPY_TYPES:
        return shape
    block, size = GGML_QUANT_SIZES[kind]
    return (*shape[:-1], shape[-1] // block * size)


def _add_metadata(writer: GGUFWriter, name: str, shape: dict[str, Any], file_type: LlamaFileType) -> None:
    """The hyperparameters llama.cpp and pagellm read, and the default model's tokenizer padded
    to the shape's vocabulary."""
    heads = shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or shape["hidden_size"] // heads
    writer.add_name(f"random {name}")
    writer.add_context_length(shape["max_position_embeddings"])
    writer.add_embedding_length(shape["hidden_size"])
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(shape["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(shape["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(shape["rms_norm_eps"]))
    writer.add_vocab_size(shape["vocab_size"])
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(2)
    _add_default_tokenizer(writer, shape["vocab_size"])


def _add_default_tokenizer(writer: GGUFWriter, vocab_size: int) -> None:
    """The default model's tokenizer, its token list padded with ``<pad_N>`` (normal tokens no
    merge reaches) to ``vocab_size``."""
    from pagellm.model.default_model import default_model_path
    from pagellm.model.gguf_loader import open_gguf, read_metadata

    reader = open_gguf(default_model_path())

    def meta(key: str) -> Any:
        return read_metadata(reader, f"tokenizer.{key}")

    def array(key: str) -> list[Any]:
        return list(reader.fields[f"tokenizer.{key}"].values())

    tokens = array("ggml.tokens")
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size {vocab_size} is below the default tokenizer's {len(tokens)} tokens")
    pads = vocab_size - len(tokens)
    writer.add_tokenizer_model(meta("ggml.model"))
    writer.add_tokenizer_pre(meta("ggml.pre"))
    writer.add_token_list(tokens + [f"<pad_{i}>" for i in range(len(tokens), vocab_size)])
    writer.add_token_types(array("ggml.token_type") + [1] * pads)
    writer.add_token_merges(array("ggml.merges"))
    writer.add_bos_token_id(int(meta("ggml.bos_token_id")))
    writer.add_eos_token_id(int(meta("ggml.eos_token_id")))
    writer.add_unk_token_id(int(meta("ggml.unknown_token_id")))
    writer.add_pad_token_id(int(meta("ggml.padding_token_id")))
    writer.add_add_bos_token(bool(meta("ggml.add_bos_token")))
    writer.add_add_space_prefix(bool(meta("ggml.add_space_prefix")))
    writer.add_chat_template(meta("chat_template"))


def write_random_safetensors(folder: str | Path, shape: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> str:
    """Write the same random weights as :func:`write_random_gguf` into ``folder`` as sharded
    safetensors with their index, and the padded default tokenizer (the caller writes
    ``config.json``)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards = _shards(checkpoint_tensors(shape), torch.tensor([], dtype=dtype).element_size())
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({spec.name: random_tensor(spec, seed).to(dtype) for spec in shard}, str(folder / name),
                  metadata={"format": "pt"})  # fmt: skip
        weight_map.update({spec.name: name for spec in shard})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    padded_default_tokenizer(shape["vocab_size"]).save_pretrained(folder)
    return str(folder)


def _shards(specs: list[TensorSpec], itemsize: int) -> list[list[TensorSpec]]:
    """The tensors in order, cut into shards of at most :data:`_SHARD_BYTES` (or one tensor)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec.shape)) * itemsize
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def padded_default_tokenizer(vocab_size: int):
    """The default model's tokenizer with ``<pad_N>`` tokens up to ``vocab_size``: entries of its
    BPE vocabulary (no merges reach them), as the GGUF writer pads its token list. Added tokens
    instead would make each load deep-copy tens of thousands of them (seconds a start), which a
    real checkpoint's tokenizer does not cost."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from pagellm.model.default_model import default_model_path
    from pagellm.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is below the default tokenizer's {len(vocab)} tokens")
    vocab.update({f"<pad_{i}>": i for i in range(len(vocab), vocab_size)})
    special = {name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   chat_template=tokenizer.chat_template,
                                   **{name: token for name, token in special.items() if token is not None})
