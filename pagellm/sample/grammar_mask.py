"""Apply structured outputs' packed token masks to a step's logits, in one vectorized op."""

from __future__ import annotations

import torch

from pagellm.kernels import KernelLibrary, supports_dtype


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, vocab_size] bool, True where the token is allowed."""
    rows = bitmask.shape[0]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.view(rows, -1)[:, :vocab_size].bool()


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int | None], kernels: KernelLibrary | None = None
) -> None:
    """Set to -inf, in place, the logits of tokens a row's grammar forbids.

    ``rows[i]`` is the bitmask row of logits row ``i``, or None for an unconstrained row (left
    exactly as it was). Tokens past the mask's width (a vocabulary padded beyond the
    grammar's) are forbidden too. With ``kernels`` (CPU logits) one C++ pass does it; the torch
    ops below are its reference (equal, tested).
    """
    if len(rows) != logits.shape[0]:
        raise ValueError(f"apply_token_bitmask: {len(rows)} row entries for {logits.shape[0]} logits rows")
    if all(r is None for r in rows):
        return
    if kernels is not None and logits.device.type == "cpu" and supports_dtype(logits.dtype):
        mask_rows = torch.tensor([-1 if r is None else r for r in rows], dtype=torch.int64)
        kernels.apply_token_bitmask_(logits, bitmask.contiguous(), mask_rows)
        return
    targets = [i for i, r in enumerate(rows) if r is not None]
    sources = [r for r in rows if r is not None]
    vocab_size = logits.shape[1]
    allowed = unpack_bitmask(bitmask[sources].to(logits.device), min(vocab_size, bitmask.shape[1] * 32))
    if allowed.shape[1] < vocab_size:
        pad = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=allowed.device)
        allowed = torch.cat([allowed, pad], dim=1)
    index = torch.tensor(targets, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
