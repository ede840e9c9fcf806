"""MXFP4 weights as gpt-oss's checkpoints store its experts: each ``X`` as ``X_blocks`` (uint8
[..., rows, G, 16]: 32 FP4 e2m1 values a group, two a byte, the low nibble first) and
``X_scales`` (uint8 [..., rows, G]: a power of two per group, biased by 127).

They are dequantized at load (exactly: an e2m1 value times a power of two is a bfloat16), to
the layout ``transformers`` holds them in (``[..., in, out]``: the stored rows become columns);
pagellm keeps no 4-bit MXFP4 format of its own yet, so a gpt-oss's experts take the memory of
the dtype they load into (or of int8 blocks with ``--quantization int8``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# The 16 FP4 (e2m1) values, by nibble.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS, _SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., rows, G * 32]`` float32 values of ``blocks`` [..., rows, G, 16] and ``scales``
    [..., rows, G]; ValueError for tensors that are not such a pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} "
                         f"({scales.dtype}) do not pair: uint8 [..., G, 16] and uint8 [..., G]")  # fmt: skip
    if blocks.dim() > 3:  # one expert (leading index) at a time: the index tensors stay small
        return torch.stack([dequantize_mxfp4(b, s) for b, s in zip(blocks, scales)])
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def join_mxfp4_pairs(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each ``X_blocks`` / ``X_scales`` pair as one dense ``X`` (in
    ``transformers``' layout, ``[..., in, out]``) once both have come by; the rest as they come.
    A pair left incomplete at the end is a ValueError naming it."""
    waiting: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = _BLOCKS if name.endswith(_BLOCKS) else _SCALES if name.endswith(_SCALES) else None
        if suffix is None or tensor.dtype != torch.uint8:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        partner = waiting.pop(base, None)
        if partner is None:
            waiting[base] = (suffix, tensor)
            continue
        blocks, scales = (tensor, partner[1]) if suffix == _BLOCKS else (partner[1], tensor)
        yield base, dequantize_mxfp4(blocks, scales).transpose(-1, -2)
    if waiting:
        raise ValueError(f"MXFP4 weights without their pair: {sorted(waiting)[:3]}")
