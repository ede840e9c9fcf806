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

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.kernels.arg_checks import DTYPE_CODES
from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.packing import lora_b_elems, pack_lora_b
from pagellm.kernels.stack_args import STACK_LINEARS, LoRALinearArgs
from pagellm.model.layer_spec import LayerSpec
from pagellm.model.lora_adapter import (
    ATTENTION_TARGETS, FUSED_OF, FUSED_TARGETS, AdapterInfo, LoRAAdapter, fused_parts, target_shape,
)


@dataclass
class _Linear:
    """One fused linear's adapter buffers, a pair per slot: ``A`` [parts * rank, in] (each part's
    ``A`` in its rows) and ``B`` (each part's ``B`` on its output rows and rank columns): one
    shrink and one expand for all parts. On torch, ``B`` is [out, parts * rank] with zeros off
    each part's block; on the kernel (``LoRASlots.kernels``) only the parts' blocks, in
    ``csrc/lora.cpp``'s layout, and ``args`` is the struct the kernel reads."""

    features_in: int
    features_out: int
    width: int  # parts * rank: A's rows, B's columns
    rows: list[slice]  # each part's output rows
    parts: tuple[str, ...]  # the targets those rows are (``fused_parts``)
    a_of: list[torch.Tensor]
    b_of: list[torch.Tensor]
    active: torch.Tensor  # uint8 [max_loras]: 1 where the slot's adapter adds to this linear
    args: LoRALinearArgs | None = None
    _pointers: tuple[ctypes.Array[ctypes.c_void_p], ...] = ()  # (what ``args`` points to)


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter as slots hold it (``LoRASlots.prepare``): per fused linear ``(layer, name)``
    its ``A`` and ``B`` in the slots' dtype and layout."""

    info: AdapterInfo
    buffers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoRASlots:
    """``max_loras`` resident adapters (see the module docstring), for ``specs``' layers (a
    tensor-parallel rank's share where sharded). ``kernels``: pagellm's kernel library, whose
    LoRA kernel then runs the products in ``dtype`` (the model's, float32 or bf16: the same
    thread pool as the model's own kernels; these small products through torch took 2-4x as
    long); None: torch runs them, in ``dtype`` (float32 on CPU: bf16 products of these shapes
    are slow)."""

    def __init__(self, specs: tuple[LayerSpec, ...], max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, kernels: KernelLibrary | None = None) -> None:  # fmt: skip
        if kernels is not None and dtype not in DTYPE_CODES:
            raise ValueError(f"the LoRA kernel runs float32 or bfloat16 products, not {dtype}")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.kernels = kernels
        self.linears: dict[tuple[int, str], _Linear] = {}
        for spec in specs:
            for fused in FUSED_TARGETS:
                targets = fused_parts(spec, fused)
                # (attention's linears where the layer has attention, the MLP's where it is dense)
                if spec.recurrent if targets[0] in ATTENTION_TARGETS else spec.moe:
                    continue
                shapes = [target_shape(spec, t) for t in targets]
                starts = [sum(out for _, out in shapes[:i]) for i in range(len(shapes) + 1)]
                self.linears[(spec.index, fused)] = self._linear(shapes[0][0], starts, targets, device)
        # Per slot, the fused linears its adapter adds to (the others' buffers stay zero).
        self.targets: list[frozenset[tuple[int, str]]] = [frozenset()] * max_loras
        self._stack_args: tuple[tuple[int, ...], ctypes.Array[LoRALinearArgs]] | None = None

    def _linear(self, features_in: int, starts: list[int], parts: tuple[str, ...], device: torch.device) -> _Linear:
        """Zero buffers of every slot for a linear whose parts' outputs start at ``starts``."""
        n, width, slots = starts[-1], (len(starts) - 1) * self.max_rank, range(self.max_loras)
        rows = [slice(s, e) for s, e in zip(starts, starts[1:])]
        active = torch.zeros(self.max_loras, dtype=torch.uint8)
        if self.kernels is None:
            a = [torch.zeros(width, features_in, dtype=self.dtype, device=device) for _ in slots]
            b = [torch.zeros(n, width, dtype=self.dtype, device=device) for _ in slots]
            return _Linear(features_in, n, width, rows, parts, a, b, active)
        a = [torch.zeros(width, features_in, dtype=self.dtype) for _ in slots]
        b = [torch.zeros(lora_b_elems(starts, self.max_rank, self.dtype), dtype=self.dtype) for _ in slots]
        a_ptrs, b_ptrs = ((ctypes.c_void_p * self.max_loras)(*(t.data_ptr() for t in ts)) for ts in (a, b))
        args = LoRALinearArgs(
            width, self.max_rank, len(rows), features_in, (ctypes.c_int64 * 5)(*starts), ctypes.addressof(a_ptrs),
            ctypes.addressof(b_ptrs), active.data_ptr(), DTYPE_CODES[self.dtype], self.max_loras,
        )  # fmt: skip
        return _Linear(features_in, n, width, rows, parts, a, b, active, args, (a_ptrs, b_ptrs))

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for lin in self.linears.values() for t in (*lin.a_of, *lin.b_of))

    def prepare(self, adapter: LoRAAdapter) -> PreparedAdapter:
        """``adapter``'s buffers as a slot holds them (one A and one B per fused linear it adds
        to, in the slots' dtype and layout): made once per adapter in host memory, so that a
        slot takes one by copies alone."""
        whole: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, target), (a, b) in adapter.weights.items():
            fused = FUSED_OF[target]
            linear = self.linears[(layer, fused)]
            if (layer, fused) not in whole:
                whole[(layer, fused)] = (torch.zeros(linear.width, linear.features_in),
                                         torch.zeros(linear.features_out, linear.width))  # fmt: skip
            a_whole, b_whole = whole[(layer, fused)]
            part = linear.parts.index(target)
            r, first = a.shape[0], part * self.max_rank
            a_whole[first : first + r] = a
            b_whole[linear.rows[part], first : first + r] = b
        buffers = {}
        for key, (a_whole, b_whole) in whole.items():
            linear = self.linears[key]
            a_whole, b_whole = a_whole.to(self.dtype), b_whole.to(self.dtype)
            if self.kernels is not None:
                b_whole = pack_lora_b(b_whole, [rows.start for rows in linear.rows] + [linear.features_out], self.max_rank)
            buffers[key] = (a_whole, b_whole)
        return PreparedAdapter(adapter.info, buffers)

    def load(self, slot: int, adapter: PreparedAdapter) -> None:
        """Put ``adapter`` in ``slot`` (what was there is cleared)."""
        self.clear(slot)
        # (named first: a copy that fails half way leaves what it wrote to be cleared next time)
        self.targets[slot] = frozenset(adapter.buffers)
        for key, (a, b) in adapter.buffers.items():
            linear = self.linears[key]
            linear.a_of[slot].copy_(a)
            linear.b_of[slot].copy_(b)
            linear.active[slot] = 1

    def clear(self, slot: int) -> None:
        for key in self.targets[slot]:
            linear = self.linears[key]
            linear.active[slot] = 0
            linear.a_of[slot].zero_()
            linear.b_of[slot].zero_()
        self.targets[slot] = frozenset()

    def stack_args(self, layers: list[int]) -> ctypes.Array[LoRALinearArgs]:
        """The one-call decoder stack's ``lora`` array for these layers (their indices, in the
        stack's order): per layer its ``STACK_LINEARS``' slots, width 0 where it has none. Built
        once (the buffers never move; ``active`` is updated in place as slots load)."""
        if self.kernels is None:
            raise RuntimeError("the one-call stack runs adapters on pagellm's LoRA kernel: these slots are torch's")
        if self._stack_args is None or self._stack_args[0] != tuple(layers):
            entries = []
            for index in layers:
                for fused in STACK_LINEARS:
                    linear = self.linears.get((index, fused))
                    entries.append(linear.args if linear is not None and linear.args is not None else LoRALinearArgs())
            self._stack_args = (tuple(layers), (LoRALinearArgs * len(entries))(*entries))
        return self._stack_args[1]


Rows = slice | torch.Tensor  # a contiguous run of the step's token rows, or their indices


@dataclass
class LoRAStep:
    """Which token rows of one step each resident adapter applies to (rows of no adapter are in
    no group); passed to every layer with the step's other inputs."""

    slots: LoRASlots
    groups: list[tuple[int, Rows]]  # (slot, rows)

    @property
    def in_stack(self) -> bool:
        """Whether the one-call decoder stack can add these adapters (each group a run of rows,
        the products on pagellm's LoRA kernel)."""
        return self.slots.kernels is not None and all(isinstance(rows, slice) for _, rows in self.groups)

    def group_array(self) -> torch.Tensor:
        """The groups as the stack reads them: int64 ``[groups, 3]`` (slot, first row, rows);
        only where :attr:`in_stack`."""
        runs = [(slot, rows.start, rows.stop - rows.start) for slot, rows in self.groups if isinstance(rows, slice)]
        return torch.tensor(runs, dtype=torch.int64).reshape(-1, 3)

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
            if kernels is not None and linear.args is not None:  # (the bits the one-call stack computes)
                if isinstance(rows, slice):
                    kernels.lora_add(linear.args, slot, xr, out[rows])
                    continue
                delta = kernels.lora_add(linear.args, slot, xr, out.new_zeros(xr.shape[0], out.shape[1]))
            else:
                xr = xr if xr.dtype == slots.dtype else xr.to(slots.dtype)
                delta = F.linear(F.linear(xr, linear.a_of[slot]), linear.b_of[slot])
            if isinstance(rows, slice):
                out[rows].add_(delta)  # (a view: added in place, cast to out's dtype on the way)
            else:
                out.index_add_(0, rows, delta.to(out.dtype))
