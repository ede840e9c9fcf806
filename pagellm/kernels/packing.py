"""Weight layouts of the GEMM kernels, and their packing in torch: what float32 weights take at
model load, and the reference the C++ packing of bf16 weights (``KernelLibrary.pack_pairs``,
used at load) is tested against bit for bit.

The AVX-512 BF16 / AMX GEMM (``csrc/gemm_bf16.cpp``) takes bf16 panels of [K / 2][cols][2];
the AVX2 GEMM (``csrc/gemm_avx2.cpp``) 16-column panels of float32 [K][16] or bf16
[K / 2][16][2], one 64-byte line per packed step of k.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Packed weight layouts of the bf16 GEMM (csrc/gemm_bf16.cpp): column panels of [K / 2][cols][2].
GEMM_PANEL_COLS = 48
GEMM_AMX_PANEL_COLS = 32  # the AMX path's plain panels: two 16-column tile groups
GEMM_AMX_K_MULTIPLE = 32  # the AMX path multiplies 32 values of k per tile product
SILU_MUL_HALF_COLS = 32  # a fused MLP panel: 32 gate columns, then the same 32 up columns
_EPILOGUES = {"none": (0, GEMM_PANEL_COLS), "silu_mul": (1, 2 * SILU_MUL_HALF_COLS)}


def gemm_epilogue(epilogue: str, amx: bool) -> tuple[int, int]:
    """The bf16 GEMM's (epilogue code, packed panel width) for ``epilogue`` on its path."""
    if epilogue not in _EPILOGUES:
        raise ValueError(f"epilogue must be one of {sorted(_EPILOGUES)}, got {epilogue!r}")
    code, cols = _EPILOGUES[epilogue]
    return code, GEMM_AMX_PANEL_COLS if amx and code == 0 else cols


def _panels(weight: torch.Tensor, cols: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / cols), cols, K] with zero rows padding the last panel."""
    n, k = weight.shape
    count = -(-n // cols)
    padded = weight.new_zeros(count * cols, k)
    padded[:n] = weight
    return padded.view(count, cols, k)


def _interleave_pairs(panels: torch.Tensor) -> torch.Tensor:
    """[P, cols, K] -> [P, K / 2, cols, 2]: each 64-byte row holds 16 columns' (k, k+1) pairs.
    Each pair moves as one int32 (2.4x faster than torch's copy of a trailing dimension of 2)."""
    count, cols, k = panels.shape
    pairs = panels.contiguous().view(torch.int32).transpose(1, 2).contiguous()
    return pairs.view(panels.dtype).view(count, k // 2, cols, 2)


def _check_gemm_weight(name: str, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(f"{name} must be a 2-D CPU bfloat16 tensor")
    if weight.shape[1] % 2 != 0 or weight.shape[0] == 0:
        raise ValueError(f"{name} must have rows and an even number of columns, got {list(weight.shape)}")


def pack_gemm_weight(weight: torch.Tensor, amx: bool = False) -> torch.Tensor:
    """A linear layer's ``[out, in]`` bf16 weight in the GEMM's plain panel layout (for the
    AMX path with ``amx``: narrower panels)."""
    _check_gemm_weight("weight", weight)
    return _interleave_pairs(_panels(weight, GEMM_AMX_PANEL_COLS if amx else GEMM_PANEL_COLS))


def pack_silu_mul_weight(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gate and up ``[intermediate, in]`` weights side by side per panel, for ``silu(gate) * up``."""
    _check_gemm_weight("gate", gate)
    if up.shape != gate.shape:
        raise ValueError("gate and up weights must have the same shape")
    _check_gemm_weight("up", up)
    both = torch.cat((_panels(gate, SILU_MUL_HALF_COLS), _panels(up, SILU_MUL_HALF_COLS)), dim=1)
    return _interleave_pairs(both)


# The AVX2 GEMM's panels: 16 columns (silu_mul: 8 gate columns, then the same 8 up columns).
AVX2_PANEL_COLS = 16
AVX2_SILU_MUL_HALF_COLS = 8
_AVX2_EPILOGUES = {"none": (0, AVX2_PANEL_COLS), "silu_mul": (1, AVX2_SILU_MUL_HALF_COLS)}
_AVX2_DTYPES = (torch.float32, torch.bfloat16)


def avx2_epilogue(epilogue: str) -> tuple[int, int]:
    """The AVX2 GEMM's (epilogue code, output columns per panel) for ``epilogue``."""
    if epilogue not in _AVX2_EPILOGUES:
        raise ValueError(f"epilogue must be one of {sorted(_AVX2_EPILOGUES)}, got {epilogue!r}")
    return _AVX2_EPILOGUES[epilogue]


def avx2_packed_shape(out_features: int, k: int, dtype: torch.dtype, epilogue: str = "none") -> tuple[int, ...]:
    """The shape of a packed AVX2 GEMM weight for ``out_features`` outputs of width ``k``."""
    panels = -(-out_features // avx2_epilogue(epilogue)[1])
    return (panels, k // 2, AVX2_PANEL_COLS, 2) if dtype == torch.bfloat16 else (panels, k, AVX2_PANEL_COLS)


def _avx2_layout(panels: torch.Tensor) -> torch.Tensor:
    """[P, 16, K] -> float32 [P, K, 16] (one k per 64-byte row) or bf16 [P, K / 2, 16, 2]."""
    if panels.dtype == torch.bfloat16:
        return _interleave_pairs(panels)
    return panels.transpose(1, 2).contiguous()


def _check_avx2_weight(name: str, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype not in _AVX2_DTYPES or weight.device.type != "cpu":
        raise ValueError(f"{name} must be a 2-D CPU float32 or bfloat16 tensor")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"{name} must not be empty, got {list(weight.shape)}")
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 != 0:
        raise ValueError(f"a bfloat16 {name} needs an even number of columns, got {list(weight.shape)}")


def pack_avx2_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's ``[out, in]`` float32 or bf16 weight in the AVX2 GEMM's panel layout."""
    _check_avx2_weight("weight", weight)
    return _avx2_layout(_panels(weight, AVX2_PANEL_COLS))


def pack_avx2_silu_mul_weight(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gate and up ``[intermediate, in]`` weights, 8 + 8 columns per panel, for ``silu(gate) * up``."""
    _check_avx2_weight("gate", gate)
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError("gate and up weights must have the same shape and dtype")
    both = torch.cat((_panels(gate, AVX2_SILU_MUL_HALF_COLS), _panels(up, AVX2_SILU_MUL_HALF_COLS)), dim=1)
    return _avx2_layout(both)


# The LoRA kernel's B (csrc/lora.cpp): each part's output columns in chunks of this many.
LORA_CHUNK_COLS = 64


def _lora_b_rows(rank: int, dtype: torch.dtype) -> int:
    """Rank rows a packed B holds per chunk: bf16 in pairs (the rank rounded up to even)."""
    return rank + rank % 2 if dtype == torch.bfloat16 else rank


def lora_b_elems(part_starts: Sequence[int], rank: int, dtype: torch.dtype) -> int:
    """How many values a packed LoRA ``B`` of ``dtype`` holds for parts whose outputs start at
    ``part_starts`` (then the linear's width), of ``rank`` columns each."""
    chunks = sum(-(-(end - start) // LORA_CHUNK_COLS) for start, end in zip(part_starts, part_starts[1:]))
    return chunks * _lora_b_rows(rank, dtype) * LORA_CHUNK_COLS


def pack_lora_b(b: torch.Tensor, part_starts: Sequence[int], rank: int) -> torch.Tensor:
    """A fused linear's LoRA ``B`` [out, parts * rank] (part p's block: its output rows, columns
    p * rank..) as the LoRA kernel reads it: part after part, chunks of 64 output columns, each
    float32 [rank][64] or bf16 [rank / 2][64][2] (pairs of rank rows; zero past the part's last
    column and the rank); 1-D, in b's dtype. Off-block values are dropped."""
    rows = _lora_b_rows(rank, b.dtype)
    pieces = []
    for part, (start, end) in enumerate(zip(part_starts, part_starts[1:])):
        chunks = -(-(end - start) // LORA_CHUNK_COLS)
        block = b.new_zeros(chunks * LORA_CHUNK_COLS, rows)
        block[: end - start, :rank] = b[start:end, part * rank : (part + 1) * rank]
        if b.dtype == torch.bfloat16:  # [chunks][rows / 2][64][2]
            pieces.append(block.view(chunks, LORA_CHUNK_COLS, rows // 2, 2).permute(0, 2, 1, 3).reshape(-1))
        else:  # [chunks][rank][64]
            pieces.append(block.view(chunks, LORA_CHUNK_COLS, rows).transpose(1, 2).reshape(-1))
    return torch.cat(pieces)
