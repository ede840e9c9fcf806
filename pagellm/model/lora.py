"""LoRA adapters applied in the forward: the base projection runs once for every row of the
step, then each adapter's low-rank product is added to its own rows.

``LoRASlots`` holds up to ``max_loras`` adapters at once, each in a slot of preallocated
buffers per layer and fused linear (``A`` of the linear's parts stacked, ``B`` block-diagonal,
scaled at load: one shrink and one expand per linear whatever its parts). ``LoRAStep`` says
which of the step's token rows go with which slot: the worker orders a step's sequences by
adapter, so each adapter's rows are one contiguous run (a view, added to in place); rows given
as indices are gathered, multiplied and added back. The worker's ``LoRAManager`` fills both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.packing import avx2_packed_shape, pack_avx2_weight
from pagellm.model.layer_spec import LayerSpec
from pagellm.model.lora_adapter import ATTENTION_TARGETS, LoRAAdapter, target_shape

# Each fused linear of a layer, and the adapter targets that are its parts (in row order).
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_FUSED_OF = {target: fused for fused, targets in FUSED_TARGETS.items() for target in targets}


@dataclass
class _Linear:
    """One fused linear's adapter buffers, a pair per slot: ``A`` [parts * rank, in] (each part's
    ``A`` in its rows) and ``B`` [out, parts * rank] (each part's ``B`` in its block of output rows
    and rank columns, zeros elsewhere): one shrink and one expand for all parts. Plain tensors,
    or packed for pagellm's AVX2 GEMM where the slots run on it (``LoRASlots.kernels``)."""

    features_in: int
    features_out: int
    width: int  # parts * rank: A's rows, B's columns
    rows: list[slice]  # each part's output rows
    a_of: list[torch.Tensor]
    b_of: list[torch.Tensor]


class LoRASlots:
    """``max_loras`` resident adapters (see the module docstring), for ``specs``' layers (a
    tensor-parallel rank's share where sharded). ``kernels``: pagellm's kernel library, whose
    AVX2 GEMM then runs the products on weights packed in ``dtype`` (the model's: the same
    thread pool as the model's own kernels; small products through torch took 2-4x as long);
    None: torch runs them, in ``dtype`` (float32 on CPU: bf16 products of these shapes are slow)."""

    def __init__(self, specs: tuple[LayerSpec, ...], max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, kernels: KernelLibrary | None = None) -> None:  # fmt: skip
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.kernels = kernels
        self.linears: dict[tuple[int, str], _Linear] = {}
        for spec in specs:
            for fused, targets in FUSED_TARGETS.items():
                # (attention's linears where the layer has attention, the MLP's where it is dense)
                if spec.recurrent if targets[0] in ATTENTION_TARGETS else spec.moe:
                    continue
                shapes = [target_shape(spec, t) for t in targets]
                features_in, width = shapes[0][0], len(targets) * max_rank
                features_out = sum(out for _, out in shapes)
                starts = [sum(out for _, out in shapes[:i]) for i in range(len(shapes) + 1)]
                a = [self._buffer(width, features_in, device) for _ in range(max_loras)]
                b = [self._buffer(features_out, width, device) for _ in range(max_loras)]
                rows = [slice(s, e) for s, e in zip(starts, starts[1:])]
                self.linears[(spec.index, fused)] = _Linear(features_in, features_out, width, rows, a, b)
        # Per slot, the fused linears its adapter adds to (the others' buffers stay zero).
        self.targets: list[frozenset[tuple[int, str]]] = [frozenset()] * max_loras

    def _packed_dtype(self, k: int) -> torch.dtype:
        """A packed weight's dtype: the model's (bf16 packs pairs of k: float32 for an odd k)."""
        return self.dtype if self.dtype == torch.float32 or k % 2 == 0 else torch.float32

    def _buffer(self, rows: int, k: int, device: torch.device) -> torch.Tensor:
        """One slot's zero ``[rows, k]`` weight (packed for the kernel where it runs the products)."""
        if self.kernels is None:
            return torch.zeros(rows, k, dtype=self.dtype, device=device)
        return torch.zeros(avx2_packed_shape(rows, k, self._packed_dtype(k)), dtype=self._packed_dtype(k))

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for lin in self.linears.values() for t in (*lin.a_of, *lin.b_of))

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put ``adapter`` in ``slot`` (what was there is cleared)."""
        self.clear(slot)
        # (named first: a copy that fails half way leaves what it wrote to be cleared next time)
        self.targets[slot] = frozenset((layer, _FUSED_OF[target]) for layer, target in adapter.weights)
        whole: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, target), (a, b) in adapter.weights.items():
            fused = _FUSED_OF[target]
            linear = self.linears[(layer, fused)]
            if (layer, fused) not in whole:
                whole[(layer, fused)] = (torch.zeros(linear.width, linear.features_in),
                                         torch.zeros(linear.features_out, linear.width))  # fmt: skip
            a_whole, b_whole = whole[(layer, fused)]
            part = FUSED_TARGETS[fused].index(target)
            r, first = a.shape[0], part * self.max_rank
            a_whole[first : first + r] = a
            b_whole[linear.rows[part], first : first + r] = b
        for key, (a_whole, b_whole) in whole.items():
            linear = self.linears[key]
            for buffers, weight in ((linear.a_of, a_whole), (linear.b_of, b_whole)):
                if self.kernels is not None:
                    weight = pack_avx2_weight(weight.to(self._packed_dtype(weight.shape[1])))
                buffers[slot].copy_(weight)

    def clear(self, slot: int) -> None:
        for key in self.targets[slot]:
            linear = self.linears[key]
            linear.a_of[slot].zero_()
            linear.b_of[slot].zero_()
        self.targets[slot] = frozenset()


Rows = slice | torch.Tensor  # a contiguous run of the step's token rows, or their indices


@dataclass
class LoRAStep:
    """Which token rows of one step each resident adapter applies to (rows of no adapter are in
    no group); passed to every layer with the step's other inputs."""

    slots: LoRASlots
    groups: list[tuple[int, Rows]]  # (slot, rows)

    def add_(self, out: torch.Tensor, x: torch.Tensor, layer: int, fused: str) -> None:
        """``out`` (the fused linear's output for ``x``) plus each row's adapter's low-rank product."""
        key = (layer, fused)
        slots = self.slots
        linear = slots.linears.get(key)
        if linear is None:
            return
        kernels = slots.kernels
        for slot, rows in self.groups:
            if key not in slots.targets[slot]:
                continue
            xr = x[rows]
            if kernels is not None:
                shrunk = kernels.gemm_avx2(xr, linear.a_of[slot], linear.width)
                delta = kernels.gemm_avx2(shrunk, linear.b_of[slot], linear.features_out)
            else:
                xr = xr if xr.dtype == slots.dtype else xr.to(slots.dtype)
                delta = F.linear(F.linear(xr, linear.a_of[slot]), linear.b_of[slot])
            if isinstance(rows, slice):
                out[rows].add_(delta)  # (a view: added in place, cast to out's dtype on the way)
            else:
                out.index_add_(0, rows, delta.to(out.dtype))
