"""An embedding table left in the GGUF file: each step dequantizes only the rows it looks up.

An 8B model's table (128k tokens x 4096) is 1 GiB in bf16, more than a tenth of the weights; a
copy of it in memory would also be the one weight a decode step barely reads. Here the rows stay
in the memory-mapped file and the kernel dequantizes the looked-up ones exactly as gguf-py
does (``csrc/gguf_rows.cpp``), so the values equal those of a dense table loaded from the same
file. A checkpoint whose table is not in such blocks (dense, or a type read through unpacked
codes) is held dense, as ``nn.Embedding`` holds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.plan import KernelPlan
from pagellm.kernels.quant_formats import GGUF_ROW_BYTES, QuantizedRows
from pagellm.model.gguf_blocks import GGUFRows


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over a table that stays in the GGUF file where it can."""

    def __init__(self, num_embeddings: int, embedding_dim: int, lib: KernelLibrary) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = torch.get_default_dtype()  # the model's (set while it is built)
        self.kernels = lib
        self.rows: GGUFRows | None = None  # the table in the file
        self.register_buffer("table", None, persistent=False)  # else: the table, dense

    def load_rows(self, rows: slice | None, weight: torch.Tensor | QuantizedRows) -> None:
        """Take the whole table (``rows`` None): GGUF rows the kernel reads stay in the file,
        anything else becomes a dense table in the model's dtype."""
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else (weight.rows, weight.k)
        if rows is not None or shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"embedding has shape {shape}, expected ({self.num_embeddings}, {self.embedding_dim})")
        if isinstance(weight, GGUFRows) and weight.format in GGUF_ROW_BYTES:
            self.rows, self.table = weight, None
            return
        dense = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
        self.rows, self.table = None, dense.to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            if self.table is None:
                raise RuntimeError("the embedding table was never loaded")
            return F.embedding(input_ids, self.table)
        offsets = self.rows.offsets[input_ids.reshape(-1)]
        values = self.kernels.dequant_gguf_rows(self.rows.format, self.rows.source, offsets, self.embedding_dim)
        return values.to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        held = f"in the file ({self.rows.format})" if self.rows is not None else "dense"
        return f"{self.num_embeddings}, {self.embedding_dim}, {held}"


def embedding_for_plan(num_embeddings: int, embedding_dim: int, plan: KernelPlan | None) -> nn.Module:
    """A :class:`QuantizedEmbedding` where the plan keeps a GGUF file's blocks, else ``nn.Embedding``."""
    if plan is not None and plan.weights == "gguf" and plan.kernels is not None:
        return QuantizedEmbedding(num_embeddings, embedding_dim, plan.kernels)
    return nn.Embedding(num_embeddings, embedding_dim)
