"""The bandwidth floor of batch-1 decode: a decode token reads every weight once (and the K/V of
its context), so no engine decodes faster than the bytes a token reads over the read bandwidth.

Three figures, measured in the benchmark itself (``pagellm bench latency`` prints them):

- the read bandwidth with the loads the kernels use: ``KernelLibrary.read_sum`` over a buffer
  larger than any cache (1 GiB), the run's thread count, the build's vector width, the best of a
  few passes (PyTorch's ``sum`` where the kernels are not built);
- the bytes a pagellm decode token reads: every linear as the model holds it (packed blocks,
  not a dense copy kept for large batches), norms, one embedding row (the whole matrix where it
  is also the output);
- the bytes the GGUF file's tensors hold for one token (the token embedding one row unless the
  file has no output matrix), the same for every engine that reads the file as stored.

The floor that counts is the file's bytes (plus the K/V read at the run's mean context) over the
bandwidth, and never below the best decode rate any engine reached in the same run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

BUFFER_BYTES = 1 << 30
_PASSES = 5
# The attributes where pagellm's linears keep the weight a decode token reads (not registered
# as parameters: packed blocks and GEMM layouts).
_PACKED_ATTRIBUTES = ("packed_weight", "gate_weight", "up_weight")


@dataclass
class DecodeFloor:
    """What one decode token reads and the best rate that allows (tokens/s), for pagellm's
    own bytes and for the file's."""

    read_gb_per_s: float  # measured read bandwidth (1e9 bytes/s)
    bandwidth_source: str  # "kernels (-march=...)" or "torch.sum"
    kv_bytes: int  # K/V read per token at the run's mean context
    pagellm_bytes: int  # pagellm's weights read per decode token
    file_bytes: int | None  # the GGUF file's tensors per token (None: not a GGUF)

    @property
    def pagellm_floor(self) -> float:
        return self.read_gb_per_s * 1e9 / (self.pagellm_bytes + self.kv_bytes)

    @property
    def file_floor(self) -> float | None:
        return None if self.file_bytes is None else self.read_gb_per_s * 1e9 / (self.file_bytes + self.kv_bytes)

    def as_dict(self) -> dict[str, Any]:
        return dict(asdict(self), pagellm_floor_tokens_per_s=self.pagellm_floor, file_floor_tokens_per_s=self.file_floor)


def read_bandwidth(threads: int, lib: Any = None, nbytes: int | None = None) -> tuple[float, str]:
    """Read bandwidth in 1e9 bytes/s with ``threads`` threads: the kernel library's vector loads
    (``lib``: a ``KernelLibrary``) or, without one, ``torch.sum``; the best of a few passes over
    ``nbytes`` (:data:`BUFFER_BYTES`)."""
    nbytes = nbytes or BUFFER_BYTES
    buffer = torch.ones(nbytes // 8, dtype=torch.int64)  # written: every page is mapped before timing
    best = float("inf")
    for _ in range(_PASSES):
        start = time.perf_counter()
        if lib is not None:
            lib.read_sum(buffer, threads)
        else:
            buffer.sum()
        best = min(best, time.perf_counter() - start)
    source = f"kernels ({' '.join(lib.march)})" if lib is not None else "torch.sum"
    return nbytes / best / 1e9, source


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one batch-1 decode token reads from ``model`` (each storage once)."""
    from pagellm.model.quant_embedding import QuantizedEmbedding
    from pagellm.model.quant_linear import QuantizedLinear

    read: dict[int, int] = {}
    embedding_rows: dict[int, int] = {}

    def visit(module: nn.Module) -> None:
        if isinstance(module, nn.Embedding):
            embedding_rows[module.weight.data_ptr()] = module.weight.shape[1] * module.weight.element_size()
            return
        if isinstance(module, QuantizedEmbedding):  # one row, as the file stores it (or the dense table's)
            embedding_rows[id(module)] = module.rows.row_bytes if module.rows is not None else module.table[0].nbytes
            return
        tensors = list(module.parameters(recurse=False))
        tensors += [t for name in _PACKED_ATTRIBUTES if isinstance(t := getattr(module, name, None), torch.Tensor)]
        tensors += [part.packed for part in module.parts] if isinstance(module, QuantizedLinear) else []
        for tensor in tensors:
            if tensor.numel():
                read[tensor.data_ptr()] = tensor.nbytes
        for name, child in module.named_children():
            if not (isinstance(module, QuantizedLinear) and name == "dense"):  # large batches' copy
                visit(child)

    visit(model)
    return sum(read.values()) + sum(row for ptr, row in embedding_rows.items() if ptr not in read)


def gguf_bytes_per_token(path: str) -> int:
    """Bytes of a GGUF file's tensors one decode token reads as stored: all, except the token
    embedding's other rows where the file has an output matrix of its own."""
    from pagellm.model.gguf_loader import open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}
    sizes = {name: int(t.data.nbytes) for name, t in tensors.items()}
    if "output.weight" in sizes and "token_embd.weight" in sizes:
        sizes["token_embd.weight"] //= int(tensors["token_embd.weight"].shape[-1])  # GGUF lists the row length first
    return sum(sizes.values())


def measure_floor(model: nn.Module, arch: Any, kv_dtype: torch.dtype, mean_context: float, threads: int,
                  lib: Any = None, gguf_path: str | None = None) -> DecodeFloor:  # fmt: skip
    """The floor of a batch-1 decode run whose tokens see ``mean_context`` tokens on average."""
    gb_per_s, source = read_bandwidth(threads, lib)
    return DecodeFloor(
        read_gb_per_s=gb_per_s, bandwidth_source=source,
        kv_bytes=int(arch.kv_cache_bytes_per_token(kv_dtype) * mean_context),
        pagellm_bytes=decode_weight_bytes(model),
        file_bytes=gguf_bytes_per_token(gguf_path) if gguf_path else None,
    )  # fmt: skip
