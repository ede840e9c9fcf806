"""Tensor parallelism (Megatron-style) over ``torch.distributed``: what one rank holds of a
layer, and the all-reduce that joins the ranks' partial sums.

Each rank holds its share of every layer: the attention heads and KV heads ``rank``-th of
``size`` (so its KV cache blocks hold only those heads, with the same block ids on every rank),
and the ``rank``-th part of the MLP's intermediate width. The q/k/v and gate/up projections
are split by output rows (column-parallel: no communication); the output and down projections
by input columns (row-parallel), each followed by one all-reduce of the ``[tokens, hidden]``
partial sums. Embeddings, norms and the LM head are whole on every rank.

On CPU the ranks are processes on one host joined by gloo over 127.0.0.1; the all-reduces of
the forward pass go through shared memory where the kernel library is built
(``distributed.shm_all_reduce``: microseconds against gloo's ~1.3 ms), else through gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagellm.distributed.shm_all_reduce import SharedMemoryAllReduce
from pagellm.kernels.quant_formats import BLOCK, QuantizedRows

# HF weight names by how a rank takes its share: the rows of the output (column-parallel) or
# the columns of the input (row-parallel).
# (MLA's q_b_proj and kv_b_proj: rows by head; its down projections and their norms whole)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks of one model."""

    rank: int
    size: int
    group: Any = None  # the torch.distributed process group (None: the default one)
    shm: SharedMemoryAllReduce | None = None  # the one-host all-reduce (None: gloo's)

    def all_reduce_(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results in place (in float32 for 16-bit tensors: one rounding)."""
        if partial.dtype == torch.float32 and partial.is_contiguous():
            total = partial
        elif partial.dtype == torch.float64 and self.shm is None:
            total = partial
        else:
            total = partial.float().contiguous()
        if self.shm is not None:
            self.shm.all_reduce_(total)
        else:
            dist.all_reduce(total, group=self.group)
        return partial if total is partial else partial.copy_(total)

    def share(self, name: str, tensor: torch.Tensor | QuantizedRows) -> torch.Tensor | QuantizedRows:
        """This rank's part of a whole HF weight (or bias) ``name``, dense or quantized (whole
        blocks of 32 along k for a row-parallel one); the tensor itself if every rank holds it
        whole."""
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name.endswith("self_attn.sinks"):  # (gpt-oss) one per query head: this rank's heads'
            return tensor.chunk(self.size, dim=0)[self.rank]  # type: ignore[union-attr]
        if ".conv." in name:  # (LFM2's convolutions) this rank's channels
            return self._convolution_share(name, tensor)
        if module in ROW_PARALLEL and name.endswith(".bias"):
            # Every rank's partial output joins in one sum: the bias is added once, by rank 0.
            return tensor if self.rank == 0 else torch.zeros_like(tensor)  # type: ignore[arg-type]
        if module in COLUMN_PARALLEL:
            if not isinstance(tensor, torch.Tensor):
                rows = tensor.rows // self.size  # divisibility checked with the model's shapes
                return tensor.select_rows(slice(self.rank * rows, (self.rank + 1) * rows))
            return tensor.chunk(self.size, dim=0)[self.rank]
        if module in ROW_PARALLEL and name.endswith(".weight"):
            return self._input_columns(name, tensor)
        return tensor

    def _input_columns(self, name: str, tensor: torch.Tensor | QuantizedRows) -> torch.Tensor | QuantizedRows:
        """This rank's share of a row-parallel weight's input columns (whole blocks where quantized)."""
        if not isinstance(tensor, torch.Tensor):
            if tensor.k % (BLOCK * self.size):
                raise ValueError(f"quantized {name} has {tensor.k} input columns: tensor parallelism over "
                                 f"{self.size} ranks needs a multiple of {BLOCK * self.size} (whole blocks "
                                 "of 32 per rank); serve it with --quantization none")  # fmt: skip
            blocks = tensor.k // BLOCK // self.size
            return tensor.select_blocks(self.rank * blocks, (self.rank + 1) * blocks)
        return tensor.chunk(self.size, dim=1)[self.rank]

    def _convolution_share(self, name: str, tensor: torch.Tensor | QuantizedRows) -> torch.Tensor | QuantizedRows:
        """A convolution layer's weights by channel: ``in_proj``'s rows of this rank's channels in
        each of its three parts (B, C, x), the filters and their biases of those channels, and
        ``out_proj`` as a row-parallel output projection."""
        if ".conv.out_proj." in name:  # (its bias added once, by rank 0: the ranks' outputs are summed)
            if name.endswith(".bias"):
                return tensor if self.rank == 0 else torch.zeros_like(tensor)  # type: ignore[arg-type]
            return self._input_columns(name, tensor)
        if ".conv.in_proj." not in name:  # conv_weight [channels, 1, taps], conv_bias [channels]
            return tensor.chunk(self.size, dim=0)[self.rank]  # type: ignore[union-attr]
        rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) else tensor.rows
        part, share = rows // 3, rows // 3 // self.size
        index = torch.cat([torch.arange(p * part + self.rank * share, p * part + (self.rank + 1) * share) for p in range(3)])
        return tensor[index] if isinstance(tensor, torch.Tensor) else tensor.select_rows(index)
