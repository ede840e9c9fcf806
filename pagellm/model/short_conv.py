"""LFM2's short-convolution mixer: a gated, depthwise causal convolution over the last few inputs,
in place of attention in a hybrid model's convolution layers.

``in_proj`` makes three parts of each token, B, C and x; the convolution runs over ``B * x``
along the sequence (each channel its own ``kernel``-tap filter over its last inputs), and its
output gated by C goes through ``out_proj``. What a sequence carries from step to step is its
last ``kernel - 1`` inputs to the convolution: a row of the layer's state (``ConvState.slots``,
one row a sequence's state slot, ``core/state_slots.py``). A request whose context starts at
position 0 starts from zeros, as the reference pads.

For the prefix cache, each KV block also keeps the state at its last position
(``ConvState.blocks``, written when a step computes that position): a request whose first blocks
come from the cache starts from the last cached block's state (the scheduler's ``state_loads``)
instead of computing its prompt again.

The step's tokens are convolved at once: each token's window of inputs is gathered from one
table, the requests' previous inputs (zeros for a fresh start) followed by the step's new ones;
the gather indices depend only on the step's spans, so they are built once a step
(:func:`conv_plan`) and every convolution layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagellm.attention.backend import AttentionMetadata
from pagellm.distributed.tensor_parallel import TensorParallel
from pagellm.kernels.plan import KernelPlan
from pagellm.model.layer_spec import LayerSpec
from pagellm.model.quant_linear import linear_for_plan


@dataclass
class ConvState:
    """What one convolution layer keeps between steps: each running sequence's latest inputs
    (``slots``: [state slots, kernel - 1, hidden]) and each KV block's inputs up to its last
    position (``blocks``: [KV blocks, kernel - 1, hidden]; the prefix cache's snapshots)."""

    slots: torch.Tensor
    blocks: torch.Tensor

    def slot_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor with a row a state slot (what a sample born from its parent copies)."""
        return (self.slots,)


@dataclass(frozen=True)
class ConvPlan:
    """One step's gather indices into the table ``[zero row, previous inputs of each request
    (kernel - 1 rows each), the step's new inputs]``."""

    slots: torch.Tensor  # [R] each request's state slot
    windows: torch.Tensor  # [T, kernel] the table rows each new token's output convolves
    last: torch.Tensor  # [R, kernel - 1] the table rows that become each request's state
    snapshot_rows: torch.Tensor  # [S, kernel - 1] the state at each block end the step computes
    snapshot_blocks: torch.Tensor  # [S] the KV block each of those ends


def conv_plan(metadata: AttentionMetadata, kernel: int, device: torch.device) -> ConvPlan:
    """The step's :class:`ConvPlan` (cached in ``metadata.derived``: the same for every layer)."""
    key = ("short_conv", kernel)
    plan = metadata.derived.get(key)
    if plan is None:
        plan = metadata.derived[key] = _build_plan(metadata, kernel, device)
    return plan  # type: ignore[return-value]


def _build_plan(metadata: AttentionMetadata, kernel: int, device: torch.device) -> ConvPlan:
    if metadata.state_slots is None:
        raise ValueError("a convolution layer needs each request's state slot (AttentionMetadata.state_slots)")
    keep = kernel - 1
    query_lens = np.asarray(metadata.query_lens, dtype=np.int64)
    fresh = (np.asarray(metadata.seq_lens, dtype=np.int64) - query_lens) == 0
    num_reqs = len(query_lens)
    starts = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=starts[1:])
    new_base = 1 + num_reqs * keep  # the first new input's row in the table

    def rows(req: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Table rows of request ``req``'s input ``k`` (k < 0: its previous inputs, -1 the latest)."""
        previous = np.where(fresh[req], 0, 1 + req * keep + keep + k)
        return np.where(k >= 0, new_base + starts[req] + k, previous)

    req = np.repeat(np.arange(num_reqs), query_lens)
    index = np.arange(int(starts[-1])) - starts[req]  # each token's place in its request's span
    windows = rows(req[:, None], index[:, None] - keep + np.arange(kernel)[None, :])
    last_req = np.arange(num_reqs)[:, None]
    last = rows(last_req, query_lens[:, None] - keep + np.arange(keep)[None, :])
    # Block ends: the positions p with p % block_size == block_size - 1 this step computes.
    block_size = metadata.block_size
    positions = (np.asarray(metadata.seq_lens, dtype=np.int64) - query_lens)[req] + index
    ends = np.flatnonzero(positions % block_size == block_size - 1)
    snapshot_rows = rows(req[ends][:, None], index[ends][:, None] - keep + 1 + np.arange(keep)[None, :])
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
    end_req, end_block = as_tensor(req[ends]), as_tensor(positions[ends] // block_size)
    snapshot_blocks = metadata.block_tables[end_req, end_block] if len(ends) else end_req
    return ConvPlan(as_tensor(metadata.state_slots), as_tensor(windows), as_tensor(last), as_tensor(snapshot_rows),
                    snapshot_blocks)  # fmt: skip


def convolve(
    inputs: torch.Tensor, slots: torch.Tensor, plan: ConvPlan, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's depthwise causal convolution of ``inputs`` [T, channels] (``weight``: the
    checkpoint's Conv1d layout, [channels, 1, taps]) over each request's previous inputs, read
    from its row of ``slots`` [state slots, taps - 1, channels], which is left holding its latest
    ones. Returns the output [T, channels] and the gathered table (the block ends' snapshots
    are rows of it)."""
    zero = inputs.new_zeros(1, inputs.shape[1])
    table = torch.cat((zero, slots[plan.slots].to(inputs.dtype).flatten(0, 1), inputs))
    taps = weight[:, 0, :].t().to(inputs.dtype)  # [taps, channels]
    out = (table[plan.windows] * taps).sum(dim=1)
    if bias is not None:
        out = out + bias.to(out.dtype)
    slots[plan.slots] = table[plan.last].to(slots.dtype)
    return out, table


class ShortConv(nn.Module):
    """The mixer of one convolution layer (see the module docstring). Under tensor parallelism a
    rank runs its share of the channels (each channel is its own filter): ``in_proj`` gives its
    channels of B, C and x, ``out_proj`` takes them as its share of the input, and the ranks'
    partial outputs are summed."""

    def __init__(self, spec: LayerSpec, plan: KernelPlan | None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        channels = spec.conv_channels or spec.hidden_size
        self.channels = channels
        self.kernel = spec.conv_kernel
        self.tp = tp
        self.in_proj = linear_for_plan(spec.hidden_size, 3 * channels, spec.conv_bias, plan)
        self.out_proj = linear_for_plan(channels, spec.hidden_size, spec.conv_bias, plan)
        # (the checkpoint's Conv1d layout: [channels, 1, taps])
        self.conv_weight = nn.Parameter(torch.empty(channels, 1, self.kernel))
        self.conv_bias = nn.Parameter(torch.empty(channels)) if spec.conv_bias else None

    def forward(self, hidden: torch.Tensor, state: ConvState, metadata: AttentionMetadata) -> torch.Tensor:
        """``hidden`` [T, hidden] -> [T, hidden]; each request's state slot is read for its previous
        inputs and left holding its latest ones, and each block end computed is kept in its block."""
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        plan = conv_plan(metadata, self.kernel, hidden.device)
        out, table = convolve(b * x, state.slots, plan, self.conv_weight, self.conv_bias)
        if len(plan.snapshot_blocks):
            state.blocks[plan.snapshot_blocks] = table[plan.snapshot_rows].to(state.blocks.dtype)
        out = self.out_proj(c * out)
        return out if self.tp is None else self.tp.all_reduce_(out)
