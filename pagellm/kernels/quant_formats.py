"""Quantized weight formats of the integer GEMM (``csrc/gemm_int8.cpp``): unpacked, packed,
converted from GGUF blocks or from dense weights, and a plain reference product.

Two formats, 32 weights a block along a row (k):
- ``q4``: codes 0..15 with a scale ``d`` and an offset ``m`` per block (weight = d * code + m):
  GGUF's Q4_1 as stored, and Q4_0 (d * (code - 8)) with m = -8 d (``model.gguf_loader``).
- ``q8``: codes -128..127 (int8) with a scale per block: GGUF's Q8_0, and ``--quantization
  int8`` (each block of a dense weight scaled to its largest magnitude, -127..127).
- ``q4f``: ``q4`` with float32 scales and offsets: GGUF's Q4_K, whose per-32 scales are an
  fp16 times a 6-bit integer (exact in float32, not in fp16).
Scales and offsets are fp16 (``q4f``: float32). A weight whose k is not a multiple of 32 is padded
with zero codes (q4: also zero scale and offset).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
TILE_COLS = 16
RECORD_BYTES = {"q4": 256 + 64, "q8": 512 + 32, "q4f": 256 + 128}
FORMAT_CODES = {"q4": 0, "q8": 1, "q4f": 2}
_SCALE_DTYPES = {"q4": torch.float16, "q8": torch.float16, "q4f": torch.float32}


@dataclass
class QuantizedWeight:
    """A [rows, k] weight in one format, unpacked: ``codes`` [rows, blocks * 32] (uint8 for q4,
    int8 for q8), ``scale`` and (q4) ``offset`` [rows, blocks] fp16. ``k`` is the true width."""

    format: str
    k: int
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        """Output rows (the weight's first dimension)."""
        return self.codes.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [rows, k] these codes stand for."""
        blocks = self.scale.shape[1]
        codes = self.codes.float().view(self.rows, blocks, BLOCK)
        w = codes * self.scale.float().unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset.float().unsqueeze(-1)
        return w.reshape(self.rows, blocks * BLOCK)[:, : self.k]

    def select_rows(self, rows: torch.Tensor | slice) -> QuantizedWeight:
        """These rows only (a permutation or a slice), same format."""
        offset = None if self.offset is None else self.offset[rows]
        return QuantizedWeight(self.format, self.k, self.codes[rows], self.scale[rows], offset)


def common_format(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """The shards of one linear in one format: as they are, q4 widened to q4f (exact) next to
    q4f, else every shard re-quantized to q8 blocks."""
    formats = {p.format for p in parts}
    if len(formats) == 1:
        return parts
    if formats == {"q4", "q4f"}:
        return [p if p.format == "q4f" else _widen_scales(p) for p in parts]
    return [quantize_q8(p.dequantize()) for p in parts]


def _widen_scales(weight: QuantizedWeight) -> QuantizedWeight:
    offset = None if weight.offset is None else weight.offset.float()
    return QuantizedWeight("q4f", weight.k, weight.codes, weight.scale.float(), offset)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format and width (the shards of a fused linear)."""
    first = parts[0]
    if any(p.format != first.format or p.k != first.k for p in parts):
        raise ValueError("only weights of one format and width can be stacked")
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])  # type: ignore[misc]
    return QuantizedWeight(first.format, first.k, torch.cat([p.codes for p in parts]),
                           torch.cat([p.scale for p in parts]), offset)  # fmt: skip


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


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (the last tile's missing columns)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, torch.zeros(rows - t.shape[0], *t.shape[1:], dtype=t.dtype)])


def pack(weight: QuantizedWeight) -> torch.Tensor:
    """The kernel's layout: [tiles, blocks, record bytes] uint8 (see ``gemm_int8.cpp``)."""
    fmt, blocks = weight.format, weight.scale.shape[1]
    if weight.scale.dtype != _SCALE_DTYPES[fmt] or (weight.offset is not None and weight.offset.dtype != weight.scale.dtype):
        raise ValueError(f"{fmt} scales and offsets are {_SCALE_DTYPES[fmt]}")
    tiles = -(-weight.rows // TILE_COLS)
    rows = tiles * TILE_COLS
    codes = _pad_rows(weight.codes.view(torch.uint8) if fmt == "q8" else weight.codes, rows)
    scale = _pad_rows(weight.scale, rows)
    # codes [tile, col, block, k] -> per (tile, block): the groups of 4 k for 16 columns.
    c = codes.view(tiles, TILE_COLS, blocks, BLOCK).permute(0, 2, 1, 3)  # [tiles, blocks, 16, 32]
    if fmt in ("q4", "q4f"):
        c = c.reshape(tiles, blocks, TILE_COLS, 4, 2, 4)  # k = 8 g + 4 h + j
        code_bytes = c[..., 0, :] | (c[..., 1, :] << 4)  # [tiles, blocks, 16, g, j]
        code_bytes = code_bytes.permute(0, 1, 3, 2, 4).reshape(tiles, blocks, 256)
        offset = _pad_rows(weight.offset, rows)  # type: ignore[arg-type]
        halves = [scale, offset]
    else:
        c = c ^ 0x80  # u8 = q + 128
        code_bytes = c.reshape(tiles, blocks, TILE_COLS, 8, 4).permute(0, 1, 3, 2, 4).reshape(tiles, blocks, 512)
        halves = [scale]
    per_block = [h.view(tiles, TILE_COLS, blocks).permute(0, 2, 1).contiguous().view(torch.uint8) for h in halves]
    return torch.cat([code_bytes.contiguous(), *per_block], dim=-1).contiguous()


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
        keep = real.unsqueeze(1)
        offset = None if gathered.offset is None else gathered.offset * keep
        gathered = QuantizedWeight(gathered.format, gathered.k, gathered.codes * keep.to(gathered.codes.dtype),
                                   gathered.scale * keep, offset)  # fmt: skip
    return pack(gathered)


def packed_shape(fmt: str, rows: int, k: int, silu_mul: bool = False) -> tuple[int, int, int]:
    """The shape :func:`pack` (or, with ``silu_mul``, :func:`pack_silu_mul` for ``rows`` outputs)
    gives a ``fmt`` weight of ``rows`` x ``k``."""
    tiles = -(-rows // 8) if silu_mul else -(-rows // TILE_COLS)
    return (tiles, -(-k // BLOCK), RECORD_BYTES[fmt])


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: per row and block of 32, d = amax / 127,
    q = round-half-even(x * (1 / d)); returns (q int8 [M, blocks * 32], d float32 [M, blocks],
    sum(q) int32 [M, blocks])."""
    rows, k = x.shape
    blocks = -(-k // BLOCK)
    a = torch.zeros(rows, blocks * BLOCK, dtype=torch.float32)
    a[:, :k] = x.float()
    a = a.view(rows, blocks, BLOCK)
    d = a.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros((), dtype=torch.float32))
    q = torch.round(a * inv.unsqueeze(-1)).clamp_(-127, 127)
    return q.to(torch.int8).view(rows, blocks * BLOCK), d, q.sum(-1).to(torch.int32)


def reference_gemm(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What the kernel computes, in float64 from the same integers: [M, rows] float64."""
    q, d, _ = quantize_activations(x)
    rows, blocks = weight.rows, weight.scale.shape[1]
    qa = q.double().view(-1, blocks, BLOCK)
    qw = weight.codes.double().view(rows, blocks, BLOCK)
    isum = torch.einsum("mbk,nbk->mnb", qa, qw)  # exact: integers below 2**53
    out = isum * weight.scale.double().unsqueeze(0) * d.double().unsqueeze(1)
    if weight.offset is not None:
        out = out + weight.offset.double().unsqueeze(0) * (d.double() * qa.sum(-1)).unsqueeze(1)
    return out.sum(-1)
