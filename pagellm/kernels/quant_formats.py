"""Quantized weight formats of the integer GEMM (``csrc/gemm_int8.cpp``): unpacked, packed,
converted from GGUF blocks or from dense weights, and a plain reference product.

Seven formats, 32 weights a block along a row (k):
- ``q4``: codes 0..15 with a scale ``d`` and an offset ``m`` per block (weight = d * code + m):
  GGUF's Q4_1 as stored.
- ``q4s``: codes 0..15 with a scale ``d`` per block, weight = d * (code - 8): GGUF's Q4_0 as
  stored, 4.5 bits a weight (q4 with m = -8 d, without storing m).
- ``q8``: codes -128..127 (int8) with a scale per block: GGUF's Q8_0, and ``--quantization
  int8`` (each block of a dense weight scaled to its largest magnitude, -127..127).
- ``q4k``: GGUF's Q4_K as stored, 4.5 bits a weight: per 256 weights (8 blocks) an fp16 ``d``
  and ``dmin`` (``scale``, ``offset`` [rows, supers]) and Q4_K's 12 bytes of 6-bit scales and
  mins (``sub_scale`` uint8 [rows, supers * 12]); weight = d * sc * code - dmin * m. Its
  activations take one scale per super-block (``quantize_activations(..., super_scale=True)``),
  so the kernel applies sc and m as integers and scales once per super-block (``_reference_q4k``).
- ``q4f``: ``q4`` with float32 scales and offsets: a q4k weight widened (``as_q4f``), where a
  fused linear's shards differ in format, or its blocks are split off a super-block.
- ``q5f``: codes 0..31 with float32 scales and offsets: GGUF's Q5_K (as Q4_K), Q5_1, and Q5_0
  (d * (code - 16): offset -16 d).
- ``q6k``: codes 0..63, weight = d * s * (code - 32) with an fp16 ``d`` per super-block of 256
  (``scale`` [rows, blocks] holds it in each of its blocks) and an int8 ``s`` per 16 weights
  (``sub_scale``): GGUF's Q6_K as stored, 6.5625 bits a weight; activations as q4k's, one scale a
  super-block, and the sub-scales applied as integers.
Scales and offsets are fp16 (``q4f``, ``q5f``: float32). A weight whose k is not a multiple of 32
is padded with zero codes (q4: also zero scale and offset). AMX tiles take q4, q8, q4f
q4s and q4k (``AMX_FORMATS``); AMX-BF16 tiles, each format dequantized to bf16, take all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

BLOCK = 32
TILE_COLS = 16
SUPER_BLOCKS = 8  # q4k, q6k: blocks per super-block (256 weights)
SUPER_FORMATS = frozenset({"q4k", "q6k"})  # whole super-blocks along k, activations scaled per 256
K_SCALE_BYTES = 12  # q4k: Q4_K's packed 6-bit scales and mins per super-block
# Bytes per block of a 16-column tile (q4k, q6k: a super-block's record of 2304 / 3360 bytes, 8 blocks).
RECORD_BYTES = {"q4": 256 + 64, "q8": 512 + 32, "q4f": 256 + 128, "q5f": 256 + 64 + 128, "q6k": (8 * 416 + 32) // 8,
                "q4s": 256 + 32, "q4k": 256 + 32}  # fmt: skip
FORMAT_CODES = {"q4": 0, "q8": 1, "q4f": 2, "q5f": 3, "q6k": 4, "q4s": 5, "q4k": 6}
AMX_FORMATS = frozenset({"q4", "q8", "q4f", "q4s", "q4k"})  # on AMX-INT8 tiles; AMX-BF16 ones take every format
# How the integer GEMM runs a product (``KernelLibrary.gemm_q``): dot products, AMX-INT8 tiles,
# or the weight dequantized to bf16 on AMX-BF16 tiles.
QUANT_TILES = {"none": 0, "int8": 1, "bf16": 2}
_SCALE_DTYPES = {"q4": torch.float16, "q8": torch.float16, "q4f": torch.float32, "q5f": torch.float32,
                 "q6k": torch.float16, "q4s": torch.float16, "q4k": torch.float16}  # fmt: skip
# Formats GGUF rows pack into straight from the file (``KernelLibrary.pack_gguf``): the GGUF
# type's (bytes, weights) a block (Q4_0, Q4_1, Q8_0, Q6_K, Q4_K).
GGUF_ROW_BYTES = {"q4s": (18, 32), "q4": (20, 32), "q8": (34, 32), "q6k": (210, 256), "q4k": (144, 256)}
Q4S_ZERO = 8  # q4s: weight = d * (code - 8)
HALF = BLOCK // 2  # q6k's scale groups


class QuantizedRows(Protocol):
    """A quantized weight while a model loads, however it is held (a :class:`QuantizedWeight`,
    or rows still in a GGUF file): what sharding and fusing do with it before it is packed."""

    k: int

    @property
    def format(self) -> str: ...

    @property
    def rows(self) -> int: ...

    def select_rows(self, rows: torch.Tensor | slice) -> QuantizedRows: ...

    def select_blocks(self, start: int, stop: int) -> QuantizedRows: ...

    def dequantize(self) -> torch.Tensor: ...


@dataclass
class QuantizedWeight:
    """A [rows, k] weight in one format, unpacked: ``codes`` [rows, blocks * 32] (int8 for q8,
    else uint8), ``scale`` and (q4, q4f, q5f) ``offset`` [rows, blocks] (dtypes as in the module
    docstring); q6k: ``sub_scale`` int8 [rows, blocks * 2]; q4k: ``scale``, ``offset`` per
    super-block and ``sub_scale`` its packed bytes. ``k`` is the true width."""

    format: str
    k: int
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None = None
    sub_scale: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        """Output rows (the weight's first dimension)."""
        return self.codes.shape[0]

    @property
    def blocks(self) -> int:
        """Blocks of 32 along k (a tail padded)."""
        return self.codes.shape[1] // BLOCK

    def as_q4f(self) -> QuantizedWeight:
        """A q4k weight as q4f: per block d * sc and -(dmin * m) in float32, as gguf-py forms them."""
        if self.format != "q4k":
            raise ValueError(f"only q4k widens to q4f this way, not {self.format}")
        assert self.offset is not None and self.sub_scale is not None
        sc, mins = k_scales_and_mins(self.sub_scale)
        d = self.scale.float().repeat_interleave(SUPER_BLOCKS, dim=1)
        dmin = self.offset.float().repeat_interleave(SUPER_BLOCKS, dim=1)
        return QuantizedWeight("q4f", self.k, self.codes, d * sc, -(dmin * mins))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [rows, k] these codes stand for (bit for bit as gguf-py's
        dequantization computes the GGUF types they come from)."""
        if self.format == "q4k":
            return self.as_q4f().dequantize()
        blocks = self.scale.shape[1]
        if self.format == "q6k":
            assert self.sub_scale is not None
            codes = self.codes.float().view(self.rows, 2 * blocks, HALF) - 32
            scale = self.scale.float().repeat_interleave(2, dim=1) * self.sub_scale.float()  # exact
            return (codes * scale.unsqueeze(-1)).reshape(self.rows, blocks * BLOCK)[:, : self.k]
        codes = self.codes.float().view(self.rows, blocks, BLOCK)
        if self.format == "q4s":
            codes = codes - Q4S_ZERO
        w = codes * self.scale.float().unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset.float().unsqueeze(-1)
        return w.reshape(self.rows, blocks * BLOCK)[:, : self.k]

    def select_rows(self, rows: torch.Tensor | slice) -> QuantizedWeight:
        """These rows only (a permutation or a slice), same format."""
        offset = None if self.offset is None else self.offset[rows]
        sub = None if self.sub_scale is None else self.sub_scale[rows]
        return QuantizedWeight(self.format, self.k, self.codes[rows], self.scale[rows], offset, sub)

    def select_blocks(self, start: int, stop: int) -> QuantizedWeight:
        """The blocks ``start:stop`` along k (whole blocks: a row-parallel rank's columns); a q4k
        weight split inside a super-block becomes q4f, a q6k one q8."""
        if not 0 <= start < stop <= self.blocks or (stop < self.blocks and stop * BLOCK > self.k):
            raise ValueError(f"blocks {start}:{stop} of a weight with {self.blocks} blocks")
        if self.format == "q6k" and (start % SUPER_BLOCKS or stop % SUPER_BLOCKS):
            # (q6k's d is one a super-block: a share cut inside one is re-quantized to int8 blocks)
            return quantize_q8(self.dequantize()).select_blocks(start, stop)
        if self.format == "q4k":
            if start % SUPER_BLOCKS or stop % SUPER_BLOCKS:
                return self.as_q4f().select_blocks(start, stop)
            first, last = start // SUPER_BLOCKS, stop // SUPER_BLOCKS
            return QuantizedWeight("q4k", (stop - start) * BLOCK, self.codes[:, start * BLOCK : stop * BLOCK],
                                   self.scale[:, first:last], self.offset[:, first:last],  # type: ignore[index]
                                   self.sub_scale[:, first * K_SCALE_BYTES : last * K_SCALE_BYTES])  # type: ignore[index]
        k = min(self.k, stop * BLOCK) - start * BLOCK
        offset = None if self.offset is None else self.offset[:, start:stop]
        sub = None if self.sub_scale is None else self.sub_scale[:, 2 * start : 2 * stop]
        return QuantizedWeight(self.format, k, self.codes[:, start * BLOCK : stop * BLOCK], self.scale[:, start:stop],
                               offset, sub)  # fmt: skip

    def masked_rows(self, keep: torch.Tensor) -> QuantizedWeight:
        """The rows where ``keep`` [rows, 1] is False set to zero weights (codes, scales, offsets
        all +0: no -0.0 scales, so the bytes are those of a zero column packed from the file)."""
        def masked(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.where(keep, t, torch.zeros((), dtype=t.dtype))
        return QuantizedWeight(self.format, self.k, masked(self.codes), masked(self.scale), masked(self.offset),
                               masked(self.sub_scale))  # type: ignore[arg-type]  # fmt: skip


def common_format(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """The shards of one linear in one format: as they are; q4s, q4 and q4f widened (exactly) to
    the widest of q4s < q4 < q4f < q5f among them; else every shard re-quantized to q8 blocks."""
    formats = {p.format for p in parts}
    if len(formats) == 1:
        return parts
    if "q4k" in formats:  # q4k widens to q4f only
        return common_format([p.as_q4f() if p.format == "q4k" else p for p in parts])
    order = ("q4s", "q4", "q4f", "q5f")
    if formats <= set(order):
        target = max(formats, key=order.index)
        return [p if p.format == target else _widen(p, target) for p in parts]
    return [quantize_q8(p.dequantize()) for p in parts]


def _widen(weight: QuantizedWeight, fmt: str) -> QuantizedWeight:
    """q4s / q4 / q4f codes as the same weights in a wider format: q4s's offset -8 d made
    explicit (exact in fp16: a power-of-two multiple; ValueError where it overflows), scales
    and offsets in float32 for q4f and q5f."""
    offset = weight.offset
    if weight.format == "q4s":
        offset = weight.scale.float() * -Q4S_ZERO
        if not torch.isfinite(offset).all() or (offset.abs() > 65504).any():
            raise ValueError("a q4s scale too large for the q4 offset (-8 d) in fp16")
        offset = offset.to(weight.scale.dtype)
    if fmt == "q4":
        return QuantizedWeight(fmt, weight.k, weight.codes, weight.scale, offset)
    return QuantizedWeight(fmt, weight.k, weight.codes, weight.scale.float(), None if offset is None else offset.float())


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format and width (the shards of a fused linear)."""
    first = parts[0]
    if any(p.format != first.format or p.k != first.k for p in parts):
        raise ValueError("only weights of one format and width can be stacked")
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])  # type: ignore[misc]
    sub = None if first.sub_scale is None else torch.cat([p.sub_scale for p in parts])  # type: ignore[misc]
    return QuantizedWeight(first.format, first.k, torch.cat([p.codes for p in parts]),
                           torch.cat([p.scale for p in parts]), offset, sub)  # fmt: skip


def quantize_q8(weight: torch.Tensor) -> QuantizedWeight:
    """Blocks of 32 scaled to their largest magnitude: code = round(w / d), d = amax / 127 in
    fp16 (the int8 format of ``--quantization int8``, and of GGUF types kept dense)."""
    rows, k = weight.shape
    blocks = -(-k // BLOCK)
    w = torch.zeros(rows, blocks * BLOCK, dtype=torch.float32)
    w[:, :k] = weight.float()
    w = w.view(rows, blocks, BLOCK)
    scale = (w.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(scale == 0, torch.zeros((), dtype=torch.float32), 1 / scale.float())
    codes = torch.round(w * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("q8", k, codes.view(rows, blocks * BLOCK), scale)


def random_weight(fmt: str, rows: int, k: int, generator: torch.Generator | None = None) -> QuantizedWeight:
    """Random codes, scales and offsets in ``fmt`` (tests and benchmarks): every code value
    occurs, scales of a size that keeps the products near 1."""
    if fmt == "q8":
        return quantize_q8(torch.randn(rows, k, generator=generator))
    blocks = -(-k // BLOCK)
    levels = {"q4": 16, "q4s": 16, "q4k": 16, "q4f": 16, "q5f": 32, "q6k": 64}[fmt]
    codes = torch.randint(0, levels, (rows, blocks * BLOCK), generator=generator, dtype=torch.uint8)
    codes[:, k:] = 0
    if fmt in SUPER_FORMATS and k % (SUPER_BLOCKS * BLOCK):
        raise ValueError(f"{fmt} weights hold super-blocks of {SUPER_BLOCKS * BLOCK} along k, got k={k}")
    if fmt == "q6k":  # one d a super-block
        sub = torch.randint(-128, 128, (rows, 2 * blocks), generator=generator, dtype=torch.int8)
        d = (torch.rand(rows, blocks // SUPER_BLOCKS, generator=generator) * 1e-3).half()
        return QuantizedWeight(fmt, k, codes, d.repeat_interleave(SUPER_BLOCKS, dim=1), sub_scale=sub)
    if fmt == "q4k":  # any 12 bytes are valid scales and mins
        supers = blocks // SUPER_BLOCKS
        d = (torch.rand(rows, 2, supers, generator=generator) * 2e-3).half()
        packed = torch.randint(0, 256, (rows, supers * K_SCALE_BYTES), generator=generator, dtype=torch.uint8)
        return QuantizedWeight(fmt, k, codes, d[:, 0], d[:, 1], packed)
    scale = (torch.rand(rows, blocks, generator=generator) * 0.1).to(_SCALE_DTYPES[fmt])
    if fmt == "q4s":
        return QuantizedWeight(fmt, k, codes, scale)
    offset = (torch.randn(rows, blocks, generator=generator) * 0.1).to(_SCALE_DTYPES[fmt])
    return QuantizedWeight(fmt, k, codes, scale, offset)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (the last tile's missing columns)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, torch.zeros(rows - t.shape[0], *t.shape[1:], dtype=t.dtype)])


def pack(weight: QuantizedWeight) -> torch.Tensor:
    """The kernel's layout: [tiles, blocks, record bytes] uint8 (see ``gemm_int8.cpp``; q4k:
    [tiles, supers, 8 * record bytes])."""
    fmt, blocks = weight.format, weight.blocks
    if fmt == "q4k":
        return _pack_q4k(weight)
    if fmt == "q6k" and not _one_scale_a_super_block(weight.scale):
        raise ValueError("q6k weights hold whole super-blocks of 256 along k, one d each")
    if weight.scale.dtype != _SCALE_DTYPES[fmt] or (weight.offset is not None and weight.offset.dtype != weight.scale.dtype):
        raise ValueError(f"{fmt} scales and offsets are {_SCALE_DTYPES[fmt]}")
    if (fmt == "q6k") != (weight.sub_scale is not None) or (fmt == "q6k" and weight.sub_scale.dtype != torch.int8):
        raise ValueError("q6k weights carry int8 sub-scales, q4k their packed bytes, the others none")
    tiles = -(-weight.rows // TILE_COLS)
    rows = tiles * TILE_COLS
    codes = _pad_rows(weight.codes.view(torch.uint8) if fmt == "q8" else weight.codes, rows)
    scale = _pad_rows(weight.scale, rows)
    # codes [tile, col, block, k] -> per (tile, block): the groups of 4 k for 16 columns.
    c = codes.view(tiles, TILE_COLS, blocks, BLOCK).permute(0, 2, 1, 3)  # [tiles, blocks, 16, 32]
    if fmt == "q8":
        c = c ^ 0x80  # u8 = q + 128
        code_bytes = c.reshape(tiles, blocks, TILE_COLS, 8, 4).permute(0, 1, 3, 2, 4).reshape(tiles, blocks, 512)
        return torch.cat([code_bytes, _per_column(scale, tiles, blocks)], dim=-1).contiguous()
    c = c.reshape(tiles, blocks, TILE_COLS, 4, 2, 4)  # k = 8 g + 4 h + j
    parts = [_nibble_groups(codes, tiles, blocks)]
    if fmt == "q5f":  # fifth bits: bit 2 g + h of a group byte's plane byte
        shifts = (2 * torch.arange(4).view(4, 1, 1) + torch.arange(2).view(1, 2, 1)).to(torch.uint8)
        parts.append((((c >> 4) & 1) << shifts).sum(dim=(3, 4), dtype=torch.uint8).reshape(tiles, blocks, 64))
    if fmt == "q6k":  # top two bits: plane g // 2, bits 4 (g % 2) + 2 h
        top = ((c >> 4) & 3).view(tiles, blocks, TILE_COLS, 2, 2, 2, 4)  # [.., col, p, e, h, j]
        shifts = (4 * torch.arange(2).view(2, 1, 1) + 2 * torch.arange(2).view(1, 2, 1)).to(torch.uint8)
        planes = (top << shifts).sum(dim=(4, 5), dtype=torch.uint8)  # [tiles, blocks, col, p, j]
        parts.insert(0, planes.permute(0, 1, 3, 2, 4).reshape(tiles, blocks, 128))  # read first: records in order
        sub = _pad_rows(weight.sub_scale, rows)  # type: ignore[arg-type]
        parts.append(sub.view(tiles, TILE_COLS, blocks, 2).permute(0, 2, 3, 1).reshape(tiles, blocks, 32).view(torch.uint8))
        supers = blocks // SUPER_BLOCKS
        per_block = torch.cat([p.contiguous() for p in parts], dim=-1).view(tiles, supers, -1)
        d = _per_column(scale[:, ::SUPER_BLOCKS].contiguous(), tiles, supers)  # one d a super-block
        return torch.cat([per_block, d.view(tiles, supers, -1)], dim=-1).contiguous()
    if fmt == "q4s":
        return torch.cat([parts[0].contiguous(), _per_column(scale, tiles, blocks)], dim=-1).contiguous()
    offset = _pad_rows(weight.offset, rows)  # type: ignore[arg-type]
    parts += [_per_column(scale, tiles, blocks), _per_column(offset, tiles, blocks)]
    return torch.cat([p.contiguous() for p in parts], dim=-1).contiguous()


def _one_scale_a_super_block(scale: torch.Tensor) -> bool:
    """Whether per-block scales [rows, blocks] cover whole super-blocks, one value each."""
    if scale.shape[1] % SUPER_BLOCKS:
        return False
    grouped = scale.view(scale.shape[0], -1, SUPER_BLOCKS)
    return bool((grouped == grouped[..., :1]).all())


def _nibble_groups(codes: torch.Tensor, tiles: int, blocks: int) -> torch.Tensor:
    """Codes [tiles * 16, blocks * 32] as each (tile, block) record's 256 bytes of nibbles."""
    c = codes.view(tiles, TILE_COLS, blocks, BLOCK).permute(0, 2, 1, 3).reshape(tiles, blocks, TILE_COLS, 4, 2, 4)
    low = c & 0x0F  # k = 8 g + 4 h + j
    code_bytes = low[..., 0, :] | (low[..., 1, :] << 4)  # [tiles, blocks, 16, g, j]
    return code_bytes.permute(0, 1, 3, 2, 4).reshape(tiles, blocks, 256)


def _pack_q4k(weight: QuantizedWeight) -> torch.Tensor:
    """q4k per (tile, super-block), 2304 bytes: Q4_K's 12 scale bytes as planes of 16 columns
    (plane p: byte p of each column's 12), d[16] and dmin[16] fp16, then the 8 blocks' nibbles
    (q4's 256 bytes each): in the order the kernel reads them."""
    if weight.scale.dtype != torch.float16 or weight.offset is None or weight.offset.dtype != torch.float16:
        raise ValueError("q4k's d and dmin are fp16")
    if weight.sub_scale is None or weight.sub_scale.dtype != torch.uint8 or weight.blocks % SUPER_BLOCKS:
        raise ValueError("q4k weights carry Q4_K's packed scale bytes and whole super-blocks")
    tiles, supers = -(-weight.rows // TILE_COLS), weight.blocks // SUPER_BLOCKS
    rows = tiles * TILE_COLS
    codes = _nibble_groups(_pad_rows(weight.codes, rows), tiles, weight.blocks).view(tiles, supers, -1)
    packed = _pad_rows(weight.sub_scale, rows).view(tiles, TILE_COLS, supers, K_SCALE_BYTES)
    planes = packed.permute(0, 2, 3, 1).reshape(tiles, supers, K_SCALE_BYTES * TILE_COLS)
    parts = [planes, _per_column(_pad_rows(weight.scale, rows), tiles, supers),
             _per_column(_pad_rows(weight.offset, rows), tiles, supers), codes]  # fmt: skip
    return torch.cat([p.contiguous() for p in parts], dim=-1).contiguous()


def k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes per super-block [rows, supers * 12] -> each block's 6-bit scale and min
    [rows, supers * 8], float32 (llama.cpp's get_scale_min_k4)."""
    b = packed.view(packed.shape[0], -1, K_SCALE_BYTES).to(torch.int32)
    low, high, extra = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([low & 0x3F, (extra & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([high & 0x3F, (extra >> 4) | ((high >> 2) & 0x30)], dim=-1)
    return sc.reshape(packed.shape[0], -1).float(), mins.reshape(packed.shape[0], -1).float()


def _per_column(values: torch.Tensor, tiles: int, blocks: int) -> torch.Tensor:
    """[tiles * 16, blocks] per-column values as each (tile, block) record's bytes."""
    return values.view(tiles, TILE_COLS, blocks).permute(0, 2, 1).contiguous().view(torch.uint8)


def pack_silu_mul(gate_up: QuantizedWeight) -> torch.Tensor:
    """The silu_mul epilogue's layout for a fused [gate; up] weight (2 n rows): each tile of 16
    columns holds 8 gate rows then the same 8 up rows (past n: zero rows, never stored)."""
    half = gate_up.rows // 2
    tiles = -(-half // 8)
    column = torch.arange(tiles * 8).view(tiles, 1, 8)
    source = torch.cat([column, column + half], dim=1).flatten()
    real = torch.cat([column, column], dim=1).flatten() < half
    gathered = gate_up.select_rows(torch.where(real, source, torch.zeros_like(source)))
    if not bool(real.all()):
        gathered = gathered.masked_rows(real.unsqueeze(1))
    return pack(gathered)


def packed_shape(fmt: str, rows: int, k: int, silu_mul: bool = False) -> tuple[int, int, int]:
    """The shape :func:`pack` (or, with ``silu_mul``, :func:`pack_silu_mul` for ``rows`` outputs)
    gives a ``fmt`` weight of ``rows`` x ``k``."""
    tiles = -(-rows // 8) if silu_mul else -(-rows // TILE_COLS)
    blocks = -(-k // BLOCK)
    if fmt in SUPER_FORMATS:
        return (tiles, blocks // SUPER_BLOCKS, SUPER_BLOCKS * RECORD_BYTES[fmt])
    return (tiles, blocks, RECORD_BYTES[fmt])


def quantize_activations(x: torch.Tensor, super_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: per row and block of 32 (with
    ``super_scale``, q4k's and q6k's: per super-block of 256), d = amax / 127, q = round-half-even(x * (1 / d));
    returns (q int8 [M, blocks * 32], d float32 [M, blocks] (a super-block's in each of its
    blocks), sum(q) int32 [M, blocks])."""
    rows, k = x.shape
    blocks = -(-k // BLOCK)
    group = SUPER_BLOCKS if super_scale else 1
    groups = -(-blocks // group)
    a = torch.zeros(rows, groups * group * BLOCK, dtype=torch.float32)
    a[:, :k] = x.float()
    a = a.view(rows, groups, group * BLOCK)
    d = a.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros((), dtype=torch.float32))
    q = torch.round(a * inv.unsqueeze(-1)).clamp_(-127, 127).view(rows, groups * group, BLOCK)[:, :blocks]
    d = d.repeat_interleave(group, dim=1)[:, :blocks]
    return q.to(torch.int8).reshape(rows, blocks * BLOCK), d, q.sum(-1).to(torch.int32)


def _reference_q4k(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """q4k's product as the kernel forms it: per (row, column, super-block) the integer sums
    S = sum_j sc_j * isum_j and M = sum_j m_j * sum_j(q), each rounded to float32 as the kernel
    converts them, then d * da * S - dmin * da * M; in float64 otherwise."""
    assert weight.offset is not None and weight.sub_scale is not None
    q, d, sums = quantize_activations(x, super_scale=True)
    sc, mins = k_scales_and_mins(weight.sub_scale)  # [rows, blocks]
    blocks = weight.blocks
    qa = q.long().view(-1, blocks, BLOCK)
    qw = weight.codes.long().view(weight.rows, blocks, BLOCK)
    isum = torch.einsum("mbk,nbk->mnb", qa, qw)  # exact in int64
    supers = blocks // SUPER_BLOCKS
    scaled = (isum * sc.long().unsqueeze(0)).view(-1, weight.rows, supers, SUPER_BLOCKS).sum(-1)
    min_sums = (sums.long().unsqueeze(1) * mins.long().unsqueeze(0)).view(-1, weight.rows, supers, SUPER_BLOCKS).sum(-1)
    da = d[:, ::SUPER_BLOCKS].double().unsqueeze(1)  # [M, 1, supers]
    out = scaled.float().double() * weight.scale.double() * da - min_sums.float().double() * weight.offset.double() * da
    return out.sum(-1)


def _reference_q6k(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """q6k's product as the kernel forms it: per (row, column, super-block) the integer sum
    S = sum over its halves of 16 of s_h * (isum_h - 32 * sum_h(q)), rounded to float32 as the
    kernel converts it, times d * da; in float64 otherwise."""
    assert weight.sub_scale is not None
    q, d, _ = quantize_activations(x, super_scale=True)
    halves = weight.blocks * 2
    qa = q.long().view(-1, halves, HALF)
    qw = weight.codes.long().view(weight.rows, halves, HALF) - 32
    part = torch.einsum("mhk,nhk->mnh", qa, qw) * weight.sub_scale.long().unsqueeze(0)  # exact in int64
    supers = weight.blocks // SUPER_BLOCKS
    total = part.view(-1, weight.rows, supers, 2 * SUPER_BLOCKS).sum(-1)
    da = d[:, ::SUPER_BLOCKS].double().unsqueeze(1)
    return (total.float().double() * weight.scale[:, ::SUPER_BLOCKS].double() * da).sum(-1)


def reference_gemm(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What the kernel computes, in float64 from the same integers: [M, rows] float64."""
    if weight.format == "q4k":
        return _reference_q4k(x, weight)
    if weight.format == "q6k":
        return _reference_q6k(x, weight)
    q, d, _ = quantize_activations(x)
    scale, offset = weight.scale.double(), None if weight.offset is None else weight.offset.double()
    if weight.format == "q4s":
        offset = -Q4S_ZERO * scale
    groups = scale.shape[1]
    qa = q.double().view(-1, groups, BLOCK)
    qw = weight.codes.double().view(weight.rows, groups, BLOCK)
    isum = torch.einsum("mbk,nbk->mnb", qa, qw)  # exact: integers below 2**53
    out = isum * scale.unsqueeze(0) * d.double().unsqueeze(1)
    if offset is not None:
        out = out + offset.unsqueeze(0) * (d.double() * qa.sum(-1)).unsqueeze(1)
    return out.sum(-1)


def checked_gguf_rows(fmt: str, source: np.ndarray, row_offsets: torch.Tensor, k: int, zero_rows: bool) -> torch.Tensor:
    """The offsets (contiguous) of GGUF rows the C++ reads, each checked to lie inside
    ``source`` (-1, a zero row, where ``zero_rows``)."""
    if fmt not in GGUF_ROW_BYTES:
        raise ValueError(f"GGUF rows are read straight into {sorted(GGUF_ROW_BYTES)}, not {fmt!r}")
    block_bytes, block_weights = GGUF_ROW_BYTES[fmt]
    if source.dtype != np.uint8 or source.ndim != 1 or not source.flags.c_contiguous:
        raise ValueError("GGUF rows are read from a contiguous 1-D uint8 source")
    if row_offsets.dtype != torch.int64 or row_offsets.dim() != 1:
        raise ValueError("GGUF row offsets are a 1-D int64 tensor")
    if k <= 0 or k % block_weights:
        raise ValueError(f"{fmt} rows hold whole blocks of {block_weights}, got k={k}")
    offsets = row_offsets.contiguous()
    real = offsets[offsets >= 0] if zero_rows else offsets
    if (zero_rows and bool((offsets < -1).any())) or (real.numel() and (
            int(real.min()) < 0 or int(real.max()) + k // block_weights * block_bytes > source.nbytes)):  # fmt: skip
        raise ValueError("a GGUF row offset lies outside the source")
    return offsets
