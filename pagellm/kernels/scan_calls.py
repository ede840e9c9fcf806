"""The scan layers' decode calls (``csrc/scan.cpp``): a gated delta-net's or a Mamba-2 layer's
decode tokens, from the input projection's rows to the output projection's, each token's state
slot advanced. Shapes and dtypes are checked here; the rows and slots each token names are
checked against their tensors in the C++ (an error here, never a write out of bounds)."""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels.arg_checks import DTYPE_CODES, check_rows


def _check(tensors: tuple[tuple[str, torch.Tensor, tuple[int, ...], torch.dtype], ...]) -> None:
    for name, t, shape, dtype in tensors:
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor of shape {list(shape)}")


class ScanKernels:
    """One loaded build's scan calls (``KernelLibrary.scan``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    @staticmethod
    def _tokens(
        proj: torch.Tensor, width: int, rows: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None,
        conv: torch.Tensor, ssm: torch.Tensor, out: torch.Tensor, out_width: int,
    ) -> tuple[int, int]:
        """The checks both calls share; (the rows proj and out both have, the state slots)."""
        dtype, n = proj.dtype, rows.numel()
        if dtype not in DTYPE_CODES:
            raise ValueError(f"proj must be float32 or bfloat16, not {dtype}")
        check_rows("proj", proj, (width,), dtype)
        check_rows("out", out, (out_width,), dtype)
        _check((("rows", rows, (n,), torch.int64), ("slots", slots, (n,), torch.int64),
                ("conv", conv, (ssm.shape[0], *conv.shape[1:]), dtype), ("ssm", ssm, tuple(ssm.shape), torch.float32)))  # fmt: skip
        if fresh is not None:
            _check((("fresh", fresh, (n,), torch.bool),))
        return min(len(proj), len(out)), ssm.shape[0]

    def delta_net_decode(
        self, proj: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None,
        conv: torch.Tensor, conv_weight: torch.Tensor, ssm: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
        norm_weight: torch.Tensor, eps: float, key_heads: int, tiled: bool, out: torch.Tensor,
    ) -> None:
        """A gated delta-net layer's decode tokens: ``proj`` [T, conv_dim + value_size + 2 value
        heads] the fused input projection's rows (q, k, v | z | b | a), ``rows`` / ``slots`` [n]
        int64 each token's row and state slot (``fresh`` [n] bool: from zeros; or None); the
        slots' rows of ``conv`` [slots, taps - 1, conv_dim] and ``ssm`` [slots, value heads,
        key_dim, value_dim] (float32) advanced; ``out`` [T, value_size] written at ``rows``.
        ``neg_a`` = -exp(A_log), ``dt_bias`` float32 [value heads]; ``conv_weight`` [conv_dim, 1,
        taps], ``norm_weight`` [value_dim]."""
        (_, heads, key_dim, value_dim), conv_dim = ssm.shape, conv.shape[-1]
        num_rows, num_slots = self._tokens(proj, conv_dim + value_dim * heads + 2 * heads, rows, slots, fresh, conv,
                                           ssm, out, heads * value_dim)  # fmt: skip
        dtype = proj.dtype
        _check((("conv_weight", conv_weight, (conv_dim, 1, conv.shape[1] + 1), dtype),
                ("norm_weight", norm_weight, (value_dim,), dtype), ("neg_a", neg_a, (heads,), torch.float32),
                ("dt_bias", dt_bias, (heads,), torch.float32)))  # fmt: skip
        rc = self._lib.pagellm_delta_net_decode(
            proj.data_ptr(), proj.stride(0), num_rows, rows.data_ptr(), slots.data_ptr(), num_slots,
            None if fresh is None else fresh.data_ptr(), rows.numel(), conv.data_ptr(), conv_weight.data_ptr(), conv_dim,
            conv.shape[1] + 1, ssm.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(), norm_weight.data_ptr(), float(eps),
            key_heads, heads, key_dim, value_dim, int(tiled), out.data_ptr(), out.stride(0), DTYPE_CODES[dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"pagellm_delta_net_decode refused its arguments (code {rc}): rows and slots must index "
                             f"proj / out and the {num_slots} state slots; {heads} value heads a multiple of {key_heads} "
                             f"key heads, conv_dim {conv_dim}")  # fmt: skip

    def mamba2_decode(
        self, proj: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None,
        conv: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, ssm: torch.Tensor,
        neg_a: torch.Tensor, dt_bias: torch.Tensor, d: torch.Tensor, dt_limits: tuple[float, float],
        norm_weight: torch.Tensor, eps: float, groups: int, out: torch.Tensor,
    ) -> None:
        """A Mamba-2 layer's decode tokens: ``proj`` [T, inner + conv_dim + heads] the input
        projection's rows (the gate, x / B / C, a time step a head), rows, slots, ``fresh`` and
        the states as :meth:`delta_net_decode`'s (``ssm`` [slots, heads, head_dim, state_size]);
        ``neg_a`` = -exp(A_log), ``dt_bias`` and ``d`` float32 [heads], the time step clamped to
        ``dt_limits``; ``conv_weight`` [conv_dim, 1, taps], ``conv_bias`` [conv_dim] or None,
        ``norm_weight`` [inner]; ``out`` [T, inner] written at ``rows``."""
        (_, heads, head_dim, state_size), conv_dim, inner = ssm.shape, conv.shape[-1], ssm.shape[1] * ssm.shape[2]
        num_rows, num_slots = self._tokens(proj, inner + conv_dim + heads, rows, slots, fresh, conv, ssm, out, inner)
        dtype = proj.dtype
        _check((("conv_weight", conv_weight, (conv_dim, 1, conv.shape[1] + 1), dtype),
                ("norm_weight", norm_weight, (inner,), dtype), ("neg_a", neg_a, (heads,), torch.float32),
                ("dt_bias", dt_bias, (heads,), torch.float32), ("d", d, (heads,), torch.float32),
                *((("conv_bias", conv_bias, (conv_dim,), dtype),) if conv_bias is not None else ())))  # fmt: skip
        rc = self._lib.pagellm_mamba2_decode(
            proj.data_ptr(), proj.stride(0), num_rows, rows.data_ptr(), slots.data_ptr(), num_slots,
            None if fresh is None else fresh.data_ptr(), rows.numel(), conv.data_ptr(), conv_weight.data_ptr(),
            None if conv_bias is None else conv_bias.data_ptr(), conv_dim, conv.shape[1] + 1, ssm.data_ptr(),
            neg_a.data_ptr(), dt_bias.data_ptr(), d.data_ptr(), float(dt_limits[0]), float(dt_limits[1]),
            norm_weight.data_ptr(), float(eps), heads, head_dim, state_size, groups, out.data_ptr(), out.stride(0),
            DTYPE_CODES[dtype], torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"pagellm_mamba2_decode refused its arguments (code {rc}): rows and slots must index "
                             f"proj / out and the {num_slots} state slots; {heads} heads a multiple of {groups} groups, "
                             f"conv_dim {conv_dim}")  # fmt: skip
