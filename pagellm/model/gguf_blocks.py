"""GGUF's quantized blocks in the integer GEMM's formats (``kernels.quant_formats``), exactly.

A GGUF tensor of a type in :data:`GGUF_FORMATS` keeps its codes, scales and offsets: the
weights the kernel multiplies are bit for bit those gguf-py's dequantization gives (tested).
Types not listed (Q2_K, Q3_K, the IQ types, ...) are dequantized at load and re-quantized to
int8 blocks where they feed a quantized linear (``model.gguf_loader``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import mmap
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.quant_formats import (
    BLOCK, GGUF_ROW_BYTES, TILE_COLS, QuantizedWeight, k_scales_and_mins, packed_shape,
)
from pagellm.model.packed_weights_cache import PackedWeightsCache, pack_key

GGUF_FORMATS = {
    T.Q4_0: "q4s", T.Q4_1: "q4", T.Q8_0: "q8", T.Q4_K: "q4k", T.Q5_0: "q5f", T.Q5_1: "q5f", T.Q5_K: "q5f",
    T.Q6_K: "q6k",
}
_SUPER = 256  # K-quants: super-blocks of 256 weights
_SUPER_BYTES = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}


@dataclass(frozen=True)
class GGUFRows:
    """Rows of a 2-D GGUF tensor of a type in :data:`GGUF_FORMATS`, still in the memory-mapped
    file: rows picked (q/k's order, a tensor-parallel share) and whole blocks cut along k by
    offset arithmetic alone, the bytes read once, when packed (:func:`pack_gguf_rows`) or
    converted (:meth:`weight`). Plays the :class:`QuantizedWeight` role while a model loads."""

    source: np.ndarray  # the file's bytes (1-D uint8)
    qtype: T
    k: int
    offsets: torch.Tensor  # int64 [rows]: each row's first wanted byte in ``source``
    # Where this file's packed weights are kept between starts (None: packed at every load).
    packs: PackedWeightsCache | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(
        cls, source: np.ndarray, data: np.ndarray, qtype: T, k: int, packs: PackedWeightsCache | None = None
    ) -> GGUFRows:
        """The rows of ``data`` ([rows, bytes a row], a view into ``source``)."""
        weights, block_bytes = GGML_QUANT_SIZES[qtype]
        if qtype not in GGUF_FORMATS or k % weights:
            raise ValueError(f"GGUF type {qtype.name} with k={k} is not kept packed")
        start = data.ctypes.data - source.ctypes.data
        if not 0 <= start <= source.nbytes - data.nbytes or data.shape[1] != k // weights * block_bytes:
            raise ValueError("GGUF tensor data is not a [rows, row bytes] view of its file")
        return cls(source, qtype, k, start + torch.arange(data.shape[0], dtype=torch.int64) * data.shape[1], packs)

    @property
    def format(self) -> str:
        """The integer GEMM's format of these blocks."""
        return GGUF_FORMATS[self.qtype]

    @property
    def rows(self) -> int:
        return self.offsets.numel()

    @property
    def row_bytes(self) -> int:
        """Bytes of one row in the file."""
        weights, block_bytes = GGML_QUANT_SIZES[self.qtype]
        return self.k // weights * block_bytes

    def select_rows(self, rows: torch.Tensor | slice) -> GGUFRows:
        """These rows only (a permutation or a slice)."""
        return dataclasses.replace(self, offsets=self.offsets[rows])

    def select_blocks(self, start: int, stop: int) -> GGUFRows | QuantizedWeight:
        """Blocks of 32 ``start:stop`` along k; cut inside a K-quant's super-block, as
        :meth:`QuantizedWeight.select_blocks` gives them (q4k widened to q4f)."""
        weights, block_bytes = GGML_QUANT_SIZES[self.qtype]  # a K-quant's block: its super-block
        unit = weights // BLOCK
        if not 0 <= start < stop <= self.k // BLOCK:
            raise ValueError(f"blocks {start}:{stop} of a weight with {self.k // BLOCK} blocks")
        if start % unit or stop % unit:
            return self.weight().select_blocks(start, stop)
        skip = start // unit * block_bytes
        return dataclasses.replace(self, k=(stop - start) * BLOCK, offsets=self.offsets + skip)

    def raw(self) -> np.ndarray:
        """The rows' bytes [rows, bytes a row]: a view of the file where they lie in order, one
        after another (a whole tensor), else a copy."""
        row_bytes = self.row_bytes
        first = int(self.offsets[0]) if self.rows else 0
        if torch.equal(self.offsets, first + torch.arange(self.rows, dtype=torch.int64) * row_bytes):
            return self.source[first : first + self.rows * row_bytes].reshape(self.rows, row_bytes)
        return self.source[self.offsets.numpy()[:, None] + np.arange(row_bytes)]

    def weight(self) -> QuantizedWeight:
        """The rows as a :class:`QuantizedWeight` (codes unpacked)."""
        return from_gguf_blocks(self.raw(), self.qtype, self.k)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [rows, k]."""
        return self.weight().dequantize()

    def release(self) -> None:
        """Drop the file pages holding these rows from this process's memory (once they are
        packed): the mapping is read-only, so a later read faults them in again from the page
        cache, and a loaded model's resident memory is its packed weights, not those plus the
        file."""
        if self.rows:
            end = int(self.offsets.max()) + self.row_bytes
            _drop_pages(self.source, int(self.offsets.min()), end)


_MADV_DONTNEED = 4  # Linux
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _drop_pages(source: np.ndarray, start: int, stop: int) -> None:
    """``madvise(MADV_DONTNEED)`` on the whole pages inside ``source[start:stop]`` where it is a
    read-only file mapping (anywhere else the call would zero memory: nothing is done; nor
    where the call is unavailable or fails)."""
    if not isinstance(source, np.memmap) or source.mode != "r":
        return
    base = source.ctypes.data
    first = -(-(base + start) // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (base + stop) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first and hasattr(_libc, "madvise"):
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def pack_gguf_rows(parts: list[GGUFRows], silu_mul: bool, lib: KernelLibrary) -> torch.Tensor | None:
    """The parts stacked by rows, packed straight from the file (``quant_formats.pack``, or with
    ``silu_mul`` ``pack_silu_mul``, of the same weights); None where the kernel does not take
    them (q5f, or parts of several formats, widths or files). Taken from the file's packed
    weights cache where it holds them (``first.packs``), and kept there where not."""
    first = parts[0]
    if first.format not in GGUF_ROW_BYTES or any(
        p.qtype != first.qtype or p.k != first.k or p.source is not first.source for p in parts
    ):
        return None
    offsets = torch.cat([p.offsets for p in parts])
    if silu_mul:  # each tile: 8 gate rows, then the same 8 up rows (past the end: zero columns)
        half = offsets.numel() // 2
        column = torch.arange(-(-half // 8) * 8).view(-1, 1, 8)
        source = torch.cat([column, column + half], dim=1).flatten()
        real = torch.cat([column, column], dim=1).flatten() < half
        offsets = torch.where(real, offsets[source.clamp(max=offsets.numel() - 1)], -1)
    padded = torch.full((-(-offsets.numel() // TILE_COLS) * TILE_COLS,), -1, dtype=torch.int64)
    padded[: offsets.numel()] = offsets
    if first.packs is None:
        return lib.pack_gguf(first.format, first.source, padded, first.k)
    key = pack_key(first.format, first.k, padded)
    shape = packed_shape(first.format, padded.numel(), first.k)
    packed = first.packs.lookup(key, shape)
    if packed is None:
        place = first.packs.reserve(key, shape)
        packed = lib.pack_gguf(first.format, first.source, padded, first.k, out=place)
        packed = packed if place is None else first.packs.served(packed)
    return packed


def from_gguf_blocks(raw: np.ndarray, qtype: T, k: int) -> QuantizedWeight:
    """GGUF's bytes of a [rows, k] tensor (``raw``: [rows, bytes per row]) in their own format
    (:data:`GGUF_FORMATS`), without changing the codes' meaning."""
    rows = raw.shape[0]
    if qtype not in GGUF_FORMATS or k % (_SUPER if qtype in _SUPER_BYTES else BLOCK) != 0:
        raise ValueError(f"GGUF type {qtype.name} with k={k} is not kept packed")
    data = np.ascontiguousarray(raw)
    if qtype in _SUPER_BYTES:
        supers = data.reshape(rows, k // _SUPER, _SUPER_BYTES[qtype])
        return {T.Q4_K: _from_q4_k, T.Q5_K: _from_q5_k, T.Q6_K: _from_q6_k}[qtype](supers, k)
    blocks = data.reshape(rows, k // BLOCK, -1)
    scale = _halves(blocks[..., 0:2])
    if qtype == T.Q8_0:
        return QuantizedWeight("q8", k, torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows, k)), scale)
    if qtype in (T.Q5_0, T.Q5_1):
        return _from_q5(blocks, qtype, scale, k)
    if qtype == T.Q4_0:  # d * (code - 8): q4s, the file's 18 bytes a block
        return QuantizedWeight("q4s", k, _codes(_split_nibbles(blocks[..., 2:]), rows, k), scale)
    offset = _halves(blocks[..., 2:4])
    return QuantizedWeight("q4", k, _codes(_split_nibbles(blocks[..., 4:]), rows, k), scale, offset)


def _halves(data: np.ndarray) -> torch.Tensor:
    """[..., 2] bytes as fp16 values [...] (a copy)."""
    return torch.from_numpy(data.copy().view(np.float16)[..., 0])


def _codes(codes: np.ndarray, rows: int, k: int) -> torch.Tensor:
    return torch.from_numpy(codes.astype(np.uint8).reshape(rows, k))


def _split_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """A legacy block's 16 bytes: element j in byte j's low nibble, element j + 16 in its high."""
    return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)


def _from_q5(blocks: np.ndarray, qtype: T, scale: torch.Tensor, k: int) -> QuantizedWeight:
    """Q5_0 (d, 4 bytes of fifth bits, 16 of nibbles: d * (code - 16)) and Q5_1 (d, m, ...:
    d * code + m) as q5f, scales and offsets widened to float32 (d * code - 16 d is exact)."""
    rows, count = blocks.shape[:2]
    start = 2 if qtype == T.Q5_0 else 4
    fifth = blocks[..., start : start + 4].copy().view(np.uint32)  # [rows, blocks, 1]
    high = (fifth >> np.arange(BLOCK, dtype=np.uint32)) & 1
    codes = _split_nibbles(blocks[..., start + 4 :]) | (high.astype(np.uint8) << 4)
    d = scale.float()
    offset = -16 * d if qtype == T.Q5_0 else _halves(blocks[..., 2:4]).float()
    return QuantizedWeight("q5f", k, _codes(codes, rows, k), d, offset)


def _k_scale_offset(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_K: per 32 weights scale d * sc and offset -(dmin * m) in float32, as gguf-py's
    dequantization computes them (the 6-bit sc and m: ``k_scales_and_mins``)."""
    rows, supers = data.shape[:2]
    d = torch.from_numpy(data[..., 0:2].copy().view(np.float16).astype(np.float32)).view(rows, supers, 1)
    dmin = torch.from_numpy(data[..., 2:4].copy().view(np.float16).astype(np.float32)).view(rows, supers, 1)
    sc, mins = k_scales_and_mins(torch.from_numpy(data[..., 4:16].copy().reshape(rows, -1)))
    return (d * sc.view(rows, supers, 8)).reshape(rows, -1), (-(dmin * mins.view(rows, supers, 8))).reshape(rows, -1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes [rows, supers, 128]: each 32-byte group p holds sub-block 2p in its
    low nibbles and 2p + 1 in its high ones -> [rows, supers, 8, 32]."""
    rows, supers = qs.shape[:2]
    groups = qs.reshape(rows, supers, 4, 1, 32)
    return np.concatenate([groups & 0x0F, groups >> 4], axis=3).reshape(rows, supers, 8, 32)


def _from_q4_k(data: np.ndarray, k: int) -> QuantizedWeight:
    """Q4_K super-blocks ([rows, supers, 144]: d, dmin fp16, 12 bytes of 6-bit scales and mins,
    128 bytes of nibbles) as q4k: the same bytes, the nibbles in block order."""
    rows = data.shape[0]
    packed = torch.from_numpy(data[..., 4:16].copy().reshape(rows, -1))
    return QuantizedWeight("q4k", k, _codes(_k_nibbles(data[..., 16:]), rows, k), _halves(data[..., 0:2]),
                           _halves(data[..., 2:4]), packed)  # fmt: skip


def _from_q5_k(data: np.ndarray, k: int) -> QuantizedWeight:
    """Q5_K super-blocks ([rows, supers, 176]: Q4_K's scales, then 32 bytes of fifth bits, bit i
    of byte j for element j of sub-block i, then Q4_K's nibbles) as q5f."""
    rows, supers = data.shape[:2]
    scale, offset = _k_scale_offset(data)
    high = (data[..., 16:48].reshape(rows, supers, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    codes = _k_nibbles(data[..., 48:]) | (high << 4)
    return QuantizedWeight("q5f", k, _codes(codes, rows, k), scale, offset)


def _from_q6_k(data: np.ndarray, k: int) -> QuantizedWeight:
    """Q6_K super-blocks ([rows, supers, 210]: 128 bytes of low nibbles, 64 of top bit pairs, 16
    int8 scales (one per 16 weights), d fp16) as q6k. Element 128 h + 32 s + j: low nibble
    ``ql[64 h + 32 (s % 2) + j] >> 4 (s // 2)``, top bits ``qh[32 h + j] >> 2 s``."""
    rows, supers = data.shape[:2]
    ql = data[..., :128].reshape(rows, supers, 2, 1, 2, 32)  # [h, -, s % 2, j]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(rows, supers, 2, 4, 32)  # s = 2 (s // 2) + s % 2
    top = (data[..., 128:192].reshape(rows, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    sub_scale = torch.from_numpy(data[..., 192:208].copy().view(np.int8).reshape(rows, supers * 16))
    d = _halves(data[..., 208:210]).repeat_interleave(_SUPER // BLOCK, dim=1)  # [rows, blocks]
    return QuantizedWeight("q6k", k, _codes(low | (top << 4), rows, k), d, sub_scale=sub_scale)
