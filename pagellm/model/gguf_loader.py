"""Read a GGUF file (llama.cpp format) as an HF-named checkpoint.

Every tensor is renamed to the Hugging Face layout (``gguf_families``: per family, with what
the converter changed undone, e.g. the q/k row permutation for Llama's rotary layout, as HF
transformers' GGUF loader does), so the same ``load_weights`` handles both formats and the
weights equal the HF model's. Block-quantized 2-D tensors can stay in their blocks; others
are dequantized at load time.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from pagellm.kernels.quant_formats import QuantizedRows
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.gguf_blocks import GGUF_FORMATS, GGUFRows
from pagellm.model.gguf_families import (
    ROPE_FACTOR_TENSORS, architecture, family, hf_config, hf_tensor_name, hf_tensors,
)
from pagellm.model.packed_weights_cache import PackedWeightsCache

_MISSING = object()


# ---- a lean GGUF reader --------------------------------------------------------------------
#
# gguf-py's GGUFReader turns every array element of the metadata into numpy views: for a
# 49k-token vocabulary (tokens, merges, types) that is ~500k small objects and 2-4 s per parse.
# The loader needs a dozen scalars, the vocabulary's length and the tensors, so this reader
# walks the metadata once with ``struct``, keeps arrays as (type, count, offset) until asked,
# and memory-maps tensor data exactly as GGUFReader shapes it. Files it cannot read (GGUF v1,
# big-endian) fall back to GGUFReader.


@dataclass
class GGUFArray:
    """An array-valued metadata entry, decoded on demand."""

    item_type: int
    count: int
    offset: int  # of the first item
    _file: "GGUFFile"

    def __len__(self) -> int:
        return self.count

    def values(self) -> list[Any]:
        return self._file._read_array(self)


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: list[int]  # GGUF order (reversed w.r.t. torch)
    data: np.ndarray  # memory-mapped, shaped like GGUFReader's ReaderTensor.data


_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64,
}
_GGUF_MAGIC = 0x46554747  # b"GGUF" little-endian
_PLAIN_TENSOR_TYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}
_BLOCK_INDEX = re.compile(r"^blk\.(\d+)\.")


def has_quantized_linears(reader: GGUFFile | _ReaderAdapter) -> bool:
    """Whether any decoder-layer weight (``blk.*``) is in a quantized block format; a file whose
    only quantized tensors are the embedding or output does not count."""
    return any(t.name.startswith("blk.") and is_block_quantized(t.tensor_type) for t in reader.tensors)


def is_block_quantized(qtype: GGMLQuantizationType) -> bool:
    """Whether a GGUF tensor type is a quantized block format (Q4_0, Q8_0, the K-quants, ...),
    not plain floats or integers."""
    return qtype not in _PLAIN_TENSOR_TYPES and qtype != GGMLQuantizationType.BF16


class GGUFFile:
    """Metadata (``fields``: key -> value or :class:`GGUFArray`) and tensors of a GGUF v2/v3 file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: np.ndarray = np.memmap(path, dtype=np.uint8, mode="r")  # the file's bytes
        buf = memoryview(self.data)
        self._buf = buf
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != _GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file (magic {magic:#x}, version {version})")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        off = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key, off = self._string(off)
            (value_type,) = struct.unpack_from("<I", buf, off)
            value, off = self._value(value_type, off + 4)
            self.fields[key] = value
        infos = []
        for _ in range(n_tensors):
            name, off = self._string(off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = list(struct.unpack_from(f"<{n_dims}Q", buf, off + 4))
            off += 4 + 8 * n_dims
            raw_type, rel = struct.unpack_from("<IQ", buf, off)
            off += 12
            infos.append((name, dims, GGMLQuantizationType(raw_type), rel))
        alignment = int(self.fields.get("general.alignment", 32))
        start = off + (alignment - off % alignment) % alignment
        self.tensors = [self._tensor(name, dims, qtype, start + rel) for name, dims, qtype, rel in infos]

    def _string(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, off)
        return bytes(self._buf[off + 8 : off + 8 + n]).decode("utf-8"), off + 8 + n

    def _value(self, value_type: int, off: int) -> tuple[Any, int]:
        if value_type == GGUFValueType.STRING:
            return self._string(off)
        if value_type == GGUFValueType.ARRAY:
            item_type, count = struct.unpack_from("<IQ", self._buf, off)
            off += 12
            array = GGUFArray(item_type, count, off, self)
            if item_type == GGUFValueType.STRING:
                for _ in range(count):  # skip: lengths only, no decoding
                    (n,) = struct.unpack_from("<Q", self._buf, off)
                    off += 8 + n
            elif item_type == GGUFValueType.ARRAY:
                for _ in range(count):
                    _, off = self._value(GGUFValueType.ARRAY, off)
            else:
                off += count * struct.calcsize(_SCALARS[GGUFValueType(item_type)])
            return array, off
        fmt = _SCALARS[GGUFValueType(value_type)]
        return struct.unpack_from(fmt, self._buf, off)[0], off + struct.calcsize(fmt)

    def _read_array(self, array: GGUFArray) -> list[Any]:
        if array.item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[GGUFValueType(array.item_type)]).newbyteorder("<")
            return np.frombuffer(self._buf, dtype=dtype, count=array.count, offset=array.offset).tolist()
        values, off = [], array.offset
        for _ in range(array.count):
            value, off = self._value(array.item_type, off)
            values.append(value.values() if isinstance(value, GGUFArray) else value)
        return values

    def _tensor(self, name: str, dims: list[int], qtype: GGMLQuantizationType, offset: int) -> GGUFTensor:
        np_dims = tuple(reversed(dims))
        n_elems = int(np.prod(dims)) if dims else 1
        if qtype in _PLAIN_TENSOR_TYPES:
            dtype = np.dtype(_PLAIN_TENSOR_TYPES[qtype])
            data = np.frombuffer(self._buf, dtype=dtype, count=n_elems, offset=offset)
        else:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            data = np.frombuffer(self._buf, dtype=np.uint8, count=n_elems * type_size // block_size, offset=offset)
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        return GGUFTensor(name, qtype, dims, data.reshape(np_dims))


class _ReaderAdapter:
    """GGUFReader behind GGUFFile's interface, for files the lean reader refuses."""

    def __init__(self, path: str) -> None:
        reader = GGUFReader(path, "r")
        self.path = path
        self.data: np.ndarray = reader.data
        self.tensors = reader.tensors
        self.fields = {}
        for key, field in reader.fields.items():
            if field.types and field.types[0] == GGUFValueType.ARRAY:
                self.fields[key] = _AdaptedArray(field)
            else:
                self.fields[key] = _field_value(field)


class _AdaptedArray:
    def __init__(self, field: Any) -> None:
        self._field = field

    def __len__(self) -> int:
        return len(self._field.data)

    def values(self) -> list[Any]:
        return self._field.contents()


def _field_value(field: Any) -> Any:
    """A GGUFReader scalar or string field as a Python object."""
    part = field.parts[field.data[0]]
    if field.types and field.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


@lru_cache(maxsize=2)
def open_gguf(path: str) -> GGUFFile | _ReaderAdapter:
    """Memory-map a GGUF file, read-only, and index its metadata and tensors (cached)."""
    try:
        return GGUFFile(path)
    except (ValueError, struct.error, KeyError):
        return _ReaderAdapter(path)


def read_metadata(reader: GGUFFile | _ReaderAdapter, key: str, default: Any = _MISSING) -> Any:
    """One scalar or string metadata value; ValueError naming the key when it is required and absent."""
    if key not in reader.fields:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata is missing {key!r}")
        return default
    value = reader.fields[key]
    if isinstance(value, (GGUFArray, _AdaptedArray)):
        raise ValueError(f"GGUF metadata {key!r} is an array, expected a scalar")
    return value


# Per-layer metadata arrays (LFM2's head_count_kv, Gemma's window pattern) hold one item a layer.
MAX_LAYER_ARRAY = 4096


def read_layer_metadata(reader: GGUFFile | _ReaderAdapter, key: str, default: Any = _MISSING) -> Any:
    """``read_metadata``, or a short array (one item a layer) as a list."""
    value = reader.fields.get(key)
    if not isinstance(value, (GGUFArray, _AdaptedArray)):
        return read_metadata(reader, key, default)
    if len(value) > MAX_LAYER_ARRAY:
        raise ValueError(f"GGUF metadata {key!r} holds {len(value)} items, more than a model has layers")
    return list(value.values())


def _gguf_arch(reader: GGUFFile | _ReaderAdapter) -> str:
    """``general.architecture``, refused where no family here reads it."""
    gguf_arch = str(read_metadata(reader, "general.architecture"))
    family(gguf_arch)
    return gguf_arch


def _check_rope(reader: GGUFFile | _ReaderAdapter, prefix: str, head_dim: int) -> None:
    """Refuse rope variants whose GGUF encoding we do not translate."""
    scaling = read_metadata(reader, f"{prefix}.rope.scaling.type", "none")
    if scaling not in ("none", "", "linear"):
        raise NotImplementedError(f"GGUF rope scaling type {scaling!r} is not supported")
    factors = [t.name for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS]
    if factors and prefix != "phi3":
        raise NotImplementedError(f"GGUF rope factors ({factors[0]}) are read for Phi-3 only")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise NotImplementedError("GGUF rope frequency factors (rope_freqs, Llama-3.1 style) are not supported")
    rope_dims = read_metadata(reader, f"{prefix}.rope.dimension_count", head_dim)
    if not 0 < rope_dims <= head_dim:
        raise ValueError(f"GGUF rope dimension count {rope_dims} is not within the head's {head_dim} dims")


def _eos_ids(reader: GGUFFile | _ReaderAdapter) -> list[int]:
    """eos plus end-of-turn / end-of-message ids, when the file names them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [read_metadata(reader, key, None) for key in keys]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _vocab_size(reader: GGUFFile | _ReaderAdapter, prefix: str) -> int:
    """Vocabulary size from the token list (authoritative), else ``{arch}.vocab_size``."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    return int(read_metadata(reader, f"{prefix}.vocab_size"))


def _kv_heads(value: Any) -> int:
    """``head_count_kv``: one number, or one a layer (LFM2: 0 for its convolution layers)."""
    return max(int(v) for v in value) if isinstance(value, list) else int(value)


def arch_config_from_gguf(reader: GGUFFile | _ReaderAdapter) -> ModelArchConfig:
    """Build the model shape from GGUF metadata alone (no tensor data read), as the
    ``config.json`` the file was converted from would give it."""
    prefix = _gguf_arch(reader)
    hidden_size = int(read_metadata(reader, f"{prefix}.embedding_length"))
    num_heads = int(read_metadata(reader, f"{prefix}.attention.head_count"))
    head_dim = int(read_metadata(reader, f"{prefix}.attention.key_length", hidden_size // num_heads))
    _check_rope(reader, prefix, head_dim)
    scaling = read_metadata(reader, f"{prefix}.rope.scaling.type", "none")

    def meta(key: str, default: Any) -> Any:
        return read_layer_metadata(reader, key, default)

    config: dict[str, Any] = dict(
        architectures=[architecture(prefix, meta)],
        vocab_size=_vocab_size(reader, prefix),
        hidden_size=hidden_size,
        intermediate_size=int(read_metadata(reader, f"{prefix}.feed_forward_length")),
        num_hidden_layers=int(read_metadata(reader, f"{prefix}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=_kv_heads(read_layer_metadata(reader, f"{prefix}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(read_metadata(reader, f"{prefix}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(read_metadata(reader, f"{prefix}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(read_metadata(reader, f"{prefix}.context_length")),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=read_metadata(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_eos_ids(reader),
        # Partial rotary (Phi-4-mini): the converter writes the rotary dims.
        partial_rotary_factor=int(read_metadata(reader, f"{prefix}.rope.dimension_count", head_dim)) / head_dim,
    )
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(read_metadata(reader, f"{prefix}.rope.scaling.factor"))}
    config.update(hf_config(prefix, meta))
    if prefix == "glm4":  # its q/k/v bias is in the tensors (the config's attention_bias)
        config["attention_bias"] = any(t.name == "blk.0.attn_q.bias" for t in reader.tensors)
    factors = {ROPE_FACTOR_TENSORS[t.name]: dequantized_tensor(reader, t).tolist() for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS}
    if factors:  # Phi-3 LongRoPE (its attention factor follows from the two context lengths, as HF's)
        config["rope_scaling"] = {"rope_type": "longrope", **factors,
                                  "original_max_position_embeddings": config["original_max_position_embeddings"]}
    return ModelArchConfig.from_hf_config(config)


def read_gguf_arch_config(path: str) -> ModelArchConfig:
    """``arch_config_from_gguf`` for a file path."""
    return arch_config_from_gguf(open_gguf(path))


def gguf_chat_template(path: str) -> str | None:
    """The chat template embedded in the file's ``tokenizer.chat_template`` metadata, if any."""
    return read_metadata(open_gguf(path), "tokenizer.chat_template", None)


def dequantized_tensor(reader: GGUFFile | _ReaderAdapter, tensor: Any) -> torch.Tensor:
    """One GGUF tensor as a float32 torch tensor in HF shape (GGUF lists dims reversed): the
    types the integer GEMM keeps through their blocks (torch ops, bit-identical to gguf-py's
    numpy path: the same float32 products and sums, and several times faster), others through
    gguf-py."""
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    blocks = _kept_blocks(reader, tensor)
    if isinstance(blocks, list):
        return torch.stack([expert.dequantize() for expert in blocks]).reshape(shape)
    if blocks is not None:
        return blocks.dequantize().reshape(shape)
    data = np.require(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, requirements=["C", "W"])
    return torch.from_numpy(data).reshape(shape)


def _kept_blocks(
    reader: GGUFFile | _ReaderAdapter, tensor: Any, packs: PackedWeightsCache | None = None
) -> QuantizedRows | list[QuantizedRows] | None:
    """A 2-D tensor of a type in ``GGUF_FORMATS`` as its rows in the file (a 3-D one, every
    expert's in one, as a list of each expert's); None for other tensors, and for rows that are
    not whole blocks (they are then dequantized like other types). ``packs``: where the rows'
    packed weights are kept between starts."""
    if tensor.tensor_type not in GGUF_FORMATS or len(tensor.shape) not in (2, 3):
        return None
    data, k = np.asarray(tensor.data), int(tensor.shape[0])
    try:
        if len(tensor.shape) == 3:
            return [GGUFRows.of(reader.data, data[expert], tensor.tensor_type, k, packs) for expert in range(data.shape[0])]
        return GGUFRows.of(reader.data, data, tensor.tensor_type, k, packs)
    except ValueError:
        return None


def iter_gguf_weights(
    reader: GGUFFile | _ReaderAdapter,
    arch: ModelArchConfig,
    dtype: torch.dtype = torch.float32,
    keep_float32: bool = False,
    keep_quantized: bool = False,
    keep: Callable[[str], bool] = lambda name: True,
    packs: PackedWeightsCache | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """Yield ``(hf_name, tensor)`` for every tensor, dequantized into ``dtype`` (float32 with
    ``keep_float32``: for a caller that casts while copying), one at a time; with
    ``keep_quantized``, 2-D tensors of the types in ``GGUF_FORMATS`` come as their blocks (a
    :class:`GGUFRows`, read when packed, through ``packs`` where given), not dequantized; only
    the tensors ``keep`` names."""
    gguf_arch = _gguf_arch(reader)
    heads = {"q_proj": arch.num_attention_heads, "k_proj": arch.num_key_value_heads}
    for tensor in reader.tensors:
        if tensor.name in ROPE_FACTOR_TENSORS:  # (in the rope config)
            continue
        block = _BLOCK_INDEX.match(tensor.name)
        if block is not None and int(block[1]) >= arch.num_hidden_layers:
            continue  # (blocks past the model's: Qwen3.5's multi-token prediction)
        name = hf_tensor_name(tensor.name, gguf_arch)
        if not keep(name):  # another pipeline stage's: never read
            continue
        blocks = _kept_blocks(reader, tensor, packs) if keep_quantized else None
        if blocks is not None:
            yield from hf_tensors(name, blocks, gguf_arch, heads)
            continue
        weight = dequantized_tensor(reader, tensor)
        # Float32 as dequantized: the copy into the model's parameter casts to its dtype in the
        # same pass (``dtype`` only matters to callers that keep the tensors themselves).
        weight = weight if dtype == torch.float32 or keep_float32 else weight.to(dtype)
        yield from hf_tensors(name, weight, gguf_arch, heads)
