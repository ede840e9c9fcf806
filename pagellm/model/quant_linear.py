"""A linear layer whose weight stays quantized (q4 / q8 blocks, ``kernels.quant_formats``) and
is multiplied by pagellm's integer GEMM, the activations quantized per block on the fly.

Built in place of ``nn.Linear`` where the kernel plan's ``weights`` is ``gguf`` or ``int8``.
Its shards (q, k, v or gate, up) arrive one at a time while the checkpoint loads, each either
quantized (GGUF blocks kept as they are) or dense (quantized to q8 blocks), and are packed as
soon as all have arrived (``finish_loading`` checks that they did). Where the plan sets
``quant_max_rows``, batches of more rows run on its ``quant_large`` path: a dense bf16 copy
through the plan's 16-bit GEMM (AMX tiles beat the integer dot products there), or, where that
copy would not fit the memory, AMX tiles over the quantized weight: dequantized to bf16 a panel
at a time (``dequant-amx``, bf16 models), or the integer GEMM's int8 tiles (``integer-amx``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import skip_init

from pagellm import kernels
from pagellm.kernels import quant_formats
from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.plan import KernelPlan
from pagellm.kernels.quant_formats import (
    AMX_FORMATS, QuantizedRows, QuantizedWeight, common_format, concat_rows, quantize_q8,
)
from pagellm.model.cpu_linear import KernelLinear, KernelSiluAndMulLinear, kernel_gemm_fits
from pagellm.model.gguf_blocks import GGUFRows, pack_gguf_rows


# The plan's AMX paths for big batches -> ``KernelLibrary.gemm_q``'s ``tiles``.
_TILES = {"integer-amx": "int8", "dequant-amx": "bf16"}


@dataclass(frozen=True)
class PackedPart:
    """Consecutive output rows of a quantized linear in one format, packed for the kernel."""

    format: str
    packed: torch.Tensor
    rows: int


class QuantizedLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` for a quantized ``W`` [weight_rows, in_features]; with
    ``silu_mul`` (an MLP's fused [gate; up], bias-free) ``y = silu(x @ gate.T) * (x @ up.T)``,
    computed in the GEMM's epilogue, ``out_features`` = ``weight_rows / 2``."""

    def __init__(
        self, in_features: int, weight_rows: int, bias: bool, lib: KernelLibrary, dense_above_rows: int | None = None,
        dense_gemm: str = "amx", silu_mul: bool = False, amx_above_rows: int | None = None,
        amx_tiles: str = "integer-amx",
    ) -> None:
        super().__init__()
        if silu_mul and (bias or weight_rows % 2):
            raise ValueError("silu_mul needs a bias-free [gate; up] weight with an even number of rows")
        self.in_features = in_features
        self.weight_rows = weight_rows
        self.out_features = weight_rows // 2 if silu_mul else weight_rows
        self.silu_mul = silu_mul
        self.bias = nn.Parameter(torch.empty(weight_rows)) if bias else None
        self.kernels = lib
        # The packed weight: one part, or (a fused q/k/v whose GGUF shards differ in format, as
        # Q4_K_M's Q4_K q and k next to a Q6_K v) one part per run of shards of one format, each
        # kept at its file's bits rather than all re-quantized to one format.
        self.parts: tuple[PackedPart, ...] = ()
        self._shards: list[tuple[int, QuantizedRows]] = []  # (first row, weight) until packed
        self.dense_above_rows = dense_above_rows  # None: the integer GEMM at every batch size
        self.dense_gemm = dense_gemm  # the GEMM path of the dense copy
        self.dense: nn.Module | None = None
        self.amx_above_rows = amx_above_rows  # batches above: AMX tiles (``amx_tiles``)
        if amx_tiles not in _TILES:
            raise ValueError(f"amx_tiles must be one of {sorted(_TILES)}, got {amx_tiles!r}")
        self.amx_tiles = amx_tiles  # the plan's quant_large: integer-amx or dequant-amx
        if dense_above_rows is not None and amx_above_rows is not None:
            raise ValueError("a quantized linear runs big batches on a dense copy or on AMX tiles, not both")

    def load_rows(self, rows: slice | None, weight: torch.Tensor | QuantizedRows) -> None:
        """Take the weight rows ``rows`` (None: all) from a checkpoint tensor: quantized rows as
        they are (GGUF rows still in the file), a dense tensor quantized to q8 blocks."""
        start, stop = (0, self.weight_rows) if rows is None else (rows.start or 0, rows.stop)
        count, width = tuple(weight.shape) if isinstance(weight, torch.Tensor) else (weight.rows, weight.k)
        if count != stop - start or width != self.in_features:
            raise ValueError(f"weight has shape ({count}, {width}), expected ({stop - start}, {self.in_features})")
        if self.parts:
            raise ValueError("this quantized weight is already loaded and packed")
        quantized = quantize_q8(weight) if isinstance(weight, torch.Tensor) else weight
        self._shards = [(s, w) for s, w in self._shards if s != start] + [(start, quantized)]
        if sum(w.rows for _, w in self._shards) == self.weight_rows:
            self._pack()  # now, not at the end of the checkpoint: unpacked codes take 2x the bytes

    def finish_loading(self) -> None:
        """Check that every row has arrived (each weight is packed as soon as it has)."""
        if not self.parts:
            covered = sum(w.rows for _, w in self._shards)
            raise ValueError(f"quantized weight has {covered} of {self.weight_rows} rows")

    def _pack(self) -> None:
        """Pack the shards: straight from the file where they are GGUF rows of one format the
        kernel packs, else through one format for the whole weight (``common_format``); and
        the dense copy where the plan wants one and the dense GEMM takes this shape."""
        parts = [w for _, w in sorted(self._shards, key=lambda item: item[0])]
        from_file = self._packed_from_file(parts)
        if from_file is not None:
            self.parts = from_file
        else:
            weight = concat_rows(common_format([p.weight() if isinstance(p, GGUFRows) else p for p in parts]))  # type: ignore[misc]
            packed_weight = quant_formats.pack_silu_mul(weight) if self.silu_mul else quant_formats.pack(weight)
            self.parts = (PackedPart(weight.format, packed_weight, weight.rows),)
        if self.dense_above_rows is not None:
            # The packed records hold the shards' own weights unless they were widened or
            # re-quantized to one format (``common_format``).
            exact = from_file is not None or all(p.format == self.parts[0].format for p in parts)
            self.dense = self._dense_copy(parts, exact)
        for part in parts:
            if isinstance(part, GGUFRows):
                part.release()
        self._shards = []

    def _packed_from_file(self, parts: list[QuantizedRows]) -> tuple[PackedPart, ...] | None:
        """The shards packed straight from the GGUF file, one part per run of one type (a silu_mul
        gate/up: one part only), or None where the kernel does not take them so."""
        if not all(isinstance(p, GGUFRows) for p in parts):
            return None
        runs = [parts] if self.silu_mul else [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.qtype)]  # type: ignore[attr-defined]
        packed = []
        for run in runs:
            weight = pack_gguf_rows(run, self.silu_mul, self.kernels)  # type: ignore[arg-type]
            if weight is None:
                return None
            packed.append(PackedPart(run[0].format, weight, sum(p.rows for p in run)))
        return tuple(packed)

    def _dense_copy(self, parts: list[QuantizedRows], exact: bool) -> nn.Module | None:
        """The bf16 copy on the plan's dense GEMM, or None where that GEMM does not take this
        shape (then every batch runs the integer GEMM). ``exact``: the packed parts hold the
        shards' weights."""
        cls = KernelSiluAndMulLinear if self.silu_mul else KernelLinear
        fits = self.in_features % kernels.GEMM_AMX_K_MULTIPLE == 0
        if exact and fits and self.dense_gemm == "amx" and self.kernels.gemm_q_amx_available:
            # Every AMX plan (the only ones with a copy): the packed panels straight from the packed
            # records, in C++; the shards unpacked in numpy, dequantized and packed in torch took
            # seconds a billion weights (NOTES 58). The same bf16 values.
            packed = self._packed_copy()
            if packed is not None:
                return cls.from_packed(self.in_features, self.out_features, packed, self.kernels, "amx")
        linear = skip_init(nn.Linear, self.in_features, self.weight_rows, bias=False, dtype=torch.bfloat16)
        if not kernel_gemm_fits(linear, self.dense_gemm):
            return None
        start = 0
        for part in parts:  # one part at a time: a float32 copy of the whole weight never exists
            linear.weight.data[start : start + part.rows].copy_(part.dequantize())
            start += part.rows
        if self.silu_mul:
            return KernelSiluAndMulLinear(linear, self.out_features, self.kernels, self.dense_gemm)
        return KernelLinear(linear, self.kernels, self.dense_gemm)

    def _packed_copy(self) -> torch.Tensor | None:
        """The dense AMX GEMM's packed weight made from the packed parts, or None where a part's
        rows do not start on one of its 32-column panels."""
        k = self.in_features
        if self.silu_mul:  # one part
            part = self.parts[0]
            return self.kernels.dequant_packed(part.packed, part.format, self.out_features, k, silu_mul=True)
        if any(part.rows % kernels.GEMM_AMX_PANEL_COLS for part in self.parts[:-1]):
            return None
        panels = [self.kernels.dequant_packed(part.packed, part.format, part.rows, k) for part in self.parts]
        return panels[0] if len(panels) == 1 else torch.cat(panels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The integer GEMM (on AMX tiles above ``amx_above_rows``), or the dense copy for
        batches above ``dense_above_rows``."""
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)
        if self.dense is not None and x.shape[0] > self.dense_above_rows:  # type: ignore[operator]
            out = self.dense(x)
        elif len(self.parts) == 1:
            epilogue = "silu_mul" if self.silu_mul else "none"
            part = self.parts[0]
            out = self.kernels.gemm_q(x, part.packed, part.format, self.out_features, epilogue, self.tiles(x.shape[0]))
        else:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            start, tiles = 0, self.tiles(x.shape[0])
            for part in self.parts:
                self.kernels.gemm_q(x, part.packed, part.format, part.rows, "none", tiles, out[:, start : start + part.rows])
                start += part.rows
        return out if self.bias is None else out.add_(self.bias)

    @property
    def format(self) -> str:
        """The packed format ("" until loaded; parts of several formats joined by "+")."""
        return "+".join(part.format for part in self.parts)

    @property
    def big_batches_on_amx(self) -> bool:
        """Whether batches above ``amx_above_rows`` run on AMX tiles: the plan's choice, where
        the tiles take this weight (int8 tiles: not q5f and q6k; bf16 tiles: whole blocks of k)."""
        if self.amx_above_rows is None:
            return False
        if self.amx_tiles == "dequant-amx":
            return self.in_features % quant_formats.BLOCK == 0
        return all(part.format in AMX_FORMATS for part in self.parts)

    def tiles(self, rows: int) -> str:
        """How a batch of ``rows`` runs (``KernelLibrary.gemm_q``'s ``tiles``): "none" (dot
        products), "int8" or "bf16" (AMX tiles)."""
        if not self.big_batches_on_amx or rows <= self.amx_above_rows:  # type: ignore[operator]
            return "none"
        return _TILES[self.amx_tiles]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"silu_mul={self.silu_mul}, format={self.format or 'unloaded'}, "
                f"dense_above_rows={self.dense_above_rows}, amx_above_rows={self.amx_above_rows}")  # fmt: skip


def quantized_plan(plan: KernelPlan | None) -> bool:
    """Whether ``plan`` builds :class:`QuantizedLinear` layers."""
    return plan is not None and plan.quantized  # KernelPlan guarantees its library then


def linear_for_plan(
    in_features: int, out_features: int, bias: bool, plan: KernelPlan | None, silu_mul: bool = False
) -> nn.Module:
    """A :class:`QuantizedLinear` where the plan holds quantized weights (``silu_mul``: a fused
    gate/up with its activation), else ``nn.Linear`` (``silu_mul`` is the quantized layer's only)."""
    if not quantized_plan(plan):
        if silu_mul:
            raise ValueError("silu_mul is fused into quantized linears only")
        return nn.Linear(in_features, out_features, bias=bias)
    assert plan is not None and plan.kernels is not None  # quantized_plan
    copy = plan.quant_max_rows if plan.quant_large == "dense" else None
    tiles = plan.quant_max_rows if plan.quant_large in _TILES else None
    amx_tiles = plan.quant_large if plan.quant_large in _TILES else "integer-amx"
    return QuantizedLinear(in_features, out_features, bias, plan.kernels, copy, plan.gemm, silu_mul, tiles, amx_tiles)
