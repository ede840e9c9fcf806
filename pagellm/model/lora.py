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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagellm.model.layer_spec import LayerSpec
from pagellm.model.lora_adapter import LoRAAdapter, target_shape

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
    """One fused linear's adapter buffers: ``a`` [slots, parts * rank, in] (each part's ``A``
    in its rows), ``b`` [slots, out, parts * rank] (each part's ``B`` in its block of output
    rows and rank columns, zeros elsewhere): one shrink and one expand for all parts."""

    a: torch.Tensor
    b: torch.Tensor
    rows: list[slice]  # each part's output rows
    # Each slot's ``a`` and ``b`` (views made once: a step selects nothing).
    a_of: list[torch.Tensor] = field(default_factory=list)
    b_of: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.a_of, self.b_of = list(self.a.unbind(0)), list(self.b.unbind(0))


class LoRASlots:
    """``max_loras`` resident adapters (see the module docstring), for ``specs``' layers (a
    tensor-parallel rank's share where sharded). ``dtype``: the buffers' and their products'
    (float32 on CPU: small products run several times faster than in bf16)."""

    def __init__(self, specs: tuple[LayerSpec, ...], max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.linears: dict[tuple[int, str], _Linear] = {}
        for spec in specs:
            for fused, targets in FUSED_TARGETS.items():
                if (fused in ("qkv_proj", "o_proj") and spec.recurrent) or (fused not in ("qkv_proj", "o_proj") and spec.moe):
                    continue
                shapes = [target_shape(spec, t) for t in targets]
                width = len(targets) * max_rank
                out = sum(features_out for _, features_out in shapes)
                a = torch.zeros(max_loras, width, shapes[0][0], dtype=dtype, device=device)
                b = torch.zeros(max_loras, out, width, dtype=dtype, device=device)
                starts = [sum(features_out for _, features_out in shapes[:i]) for i in range(len(shapes) + 1)]
                self.linears[(spec.index, fused)] = _Linear(a, b, [slice(s, e) for s, e in zip(starts, starts[1:])])
        # Per slot, the fused linears its adapter adds to (the others' buffers stay zero).
        self.targets: list[frozenset[tuple[int, str]]] = [frozenset()] * max_loras

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for lin in self.linears.values() for t in (lin.a, lin.b))

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put ``adapter`` in ``slot`` (what was there is cleared)."""
        self.clear(slot)
        # (named first: a copy that fails half way leaves what it wrote to be cleared next time)
        self.targets[slot] = frozenset((layer, _FUSED_OF[target]) for layer, target in adapter.weights)
        rank = self.max_rank
        for (layer, target), (a, b) in adapter.weights.items():
            fused = _FUSED_OF[target]
            linear = self.linears[(layer, fused)]
            part = FUSED_TARGETS[fused].index(target)
            r, first = a.shape[0], part * rank
            linear.a[slot, first : first + r].copy_(a)
            linear.b[slot, linear.rows[part], first : first + r].copy_(b)

    def clear(self, slot: int) -> None:
        for key in self.targets[slot]:
            linear = self.linears[key]
            linear.a[slot].zero_()
            linear.b[slot].zero_()
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
        linear = self.slots.linears.get(key)
        if linear is None:
            return
        targets, dtype = self.slots.targets, self.slots.dtype
        for slot, rows in self.groups:
            if key not in targets[slot]:
                continue
            xr = x[rows]
            delta = F.linear(F.linear(xr if xr.dtype == dtype else xr.to(dtype), linear.a_of[slot]), linear.b_of[slot])
            if isinstance(rows, slice):
                out[rows].add_(delta)  # (a view: added in place, cast to out's dtype on the way)
            else:
                out.index_add_(0, rows, delta.to(out.dtype))
