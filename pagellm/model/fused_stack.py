"""The decoder layers in one C++ call (``csrc/decoder_stack.cpp``), where the kernel plan says
``decoder="fused"``: quantized linears, the paged attention kernel, kernel norms and rotary.

The call runs the kernels the Python layers run, in the same order on the same buffers, so its
output is bit for bit theirs; what it removes is the Python between them (module calls,
wrapper checks, ctypes: ~3 ms of a ~10 ms batch-1 step on the default model, benchmarks/NOTES.md,
37). The weights' shapes are checked when the stack is built; the step's indices once a step,
as the attention backend checks them. Steps it does not take (more rows than the plan's
``quant_max_rows``, a cache dtype the kernels do not read) run the Python layers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.cpu_paged import CPUPagedAttention, checked_kernel_rows
from pagellm.kernels.library import CACHE_CODES, DTYPE_CODES, DecoderLayerArgs, DecoderStackArgs, KernelLibrary
from pagellm.kernels.quant_formats import FORMAT_CODES
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.layers import RMSNorm
from pagellm.model.quant_linear import QuantizedLinear

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class _LayerWeights:
    """One layer's tensors the call reads (held here so their storage outlives the pointers)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: QuantizedLinear
    o: QuantizedLinear
    gate_up: QuantizedLinear
    down: QuantizedLinear

    def addresses(self) -> tuple[int, ...]:
        """Where the tensors the call reads live now (a reload or a move changes them)."""
        bias = self.qkv.bias
        return (self.input_norm.data_ptr(), self.post_norm.data_ptr(), self.qkv.packed.data_ptr(),
                0 if bias is None else bias.data_ptr(), self.o.packed.data_ptr(), self.gate_up.packed.data_ptr(),
                self.down.packed.data_ptr())  # fmt: skip

    def args(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> DecoderLayerArgs:
        """The C struct for this layer over these caches."""
        bias = self.qkv.bias
        return DecoderLayerArgs(
            self.input_norm.data_ptr(), self.post_norm.data_ptr(), self.qkv.packed.data_ptr(),
            None if bias is None else bias.data_ptr(), self.o.packed.data_ptr(), self.gate_up.packed.data_ptr(),
            self.down.packed.data_ptr(), FORMAT_CODES[self.qkv.format], FORMAT_CODES[self.o.format],
            FORMAT_CODES[self.gate_up.format], FORMAT_CODES[self.down.format], key_cache.data_ptr(),
            value_cache.data_ptr(),
        )  # fmt: skip


def _layer_weights(layer: nn.Module, arch: ModelArchConfig, dtype: torch.dtype) -> _LayerWeights | None:
    """The layer's tensors if the call can run it: quantized linears of the expected shapes, a
    fused silu_mul MLP, no o / down bias, norms in ``dtype``; else None."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    # The call runs the paged kernel, kernel norms and rotary: only where the layer would too.
    if not isinstance(attn.attn_backend, CPUPagedAttention) or attn.rotary_kernels is None:
        return None
    if not all(isinstance(n, RMSNorm) and n.kernels is not None for n in norms):
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(m, QuantizedLinear) and m.format for m in linears):
        return None
    qkv, o, gate_up, down = linears
    shapes = [(qkv.in_features, qkv.out_features), (o.in_features, o.out_features),
              (gate_up.in_features, gate_up.out_features), (down.in_features, down.out_features)]  # fmt: skip
    hidden, inter = arch.hidden_size, arch.intermediate_size
    expected = [(hidden, arch.q_size + 2 * arch.kv_size), (arch.q_size, hidden), (hidden, inter), (inter, hidden)]
    if shapes != expected or not gate_up.silu_mul or o.bias is not None or down.bias is not None:
        return None
    if not all(n.weight.dtype == dtype and n.weight.is_contiguous() for n in norms):
        return None
    if qkv.bias is not None and (qkv.bias.dtype != dtype or not qkv.bias.is_contiguous()):
        return None
    return _LayerWeights(norms[0].weight, norms[1].weight, qkv, o, gate_up, down)


class FusedDecoderStack:
    """Runs a model's decoder layers in one kernel call (see the module docstring)."""

    def __init__(
        self, weights: list[_LayerWeights], arch: ModelArchConfig, lib: KernelLibrary, dtype: torch.dtype,
        max_rows: int | None,
    ) -> None:
        self.weights = weights
        self.arch = arch
        self.kernels = lib
        self.dtype = dtype
        self.max_rows = max_rows
        self.eps = float(arch.rms_norm_eps)
        self.steps = 0  # steps run here (the rest ran the Python layers)
        # The per-layer C structs, keyed by every address in them (caches and weights).
        self._layer_args: tuple[tuple[int, ...], ctypes.Array[DecoderLayerArgs]] | None = None

    @classmethod
    def build(
        cls, layers: nn.ModuleList, arch: ModelArchConfig, lib: KernelLibrary, max_rows: int | None
    ) -> FusedDecoderStack | None:
        """The stack for these layers, or None where any layer does not fit the call."""
        dtype = layers[0].input_layernorm.weight.dtype if len(layers) else None
        if dtype not in DTYPE_CODES:
            return None
        weights = [_layer_weights(layer, arch, dtype) for layer in layers]
        if any(w is None for w in weights):
            return None
        return cls([w for w in weights if w is not None], arch, lib, dtype, max_rows)

    def applies(self, hidden: torch.Tensor, kv_caches: list[KVCache]) -> bool:
        """Whether this step runs here: few enough rows, the model dtype, one cache shape and
        dtype the kernels read, laid out as the model's KV heads."""
        rows = hidden.shape[0]
        key_cache = kv_caches[0][0]
        layout = (self.arch.num_key_value_heads, self.arch.head_dim)
        return (
            0 < rows <= (self.max_rows if self.max_rows is not None else rows)
            and hidden.dtype == self.dtype
            and (self.dtype, key_cache.dtype) in CACHE_CODES
            and key_cache.dim() == 4 and tuple(key_cache.shape[2:]) == layout
            and all(
                t.is_contiguous() and t.shape == key_cache.shape and t.dtype == key_cache.dtype
                for pair in kv_caches for t in pair
            )
        )  # fmt: skip

    def _layers(self, kv_caches: list[KVCache]) -> ctypes.Array[DecoderLayerArgs]:
        """The per-layer arguments, rebuilt whenever a cache or weight has moved (once per
        engine in practice; the check costs ~0.1 ms a step for 30 layers)."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        key += tuple(address for w in self.weights for address in w.addresses())
        if self._layer_args is None or self._layer_args[0] != key:
            layers = [w.args(k, v) for w, (k, v) in zip(self.weights, kv_caches)]
            array = (DecoderLayerArgs * len(layers))(*layers)
            self._layer_args = (key, array)
        return self._layer_args[1]

    def __call__(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(last layer's output, residual stream)`` for embeddings ``hidden`` [T, hidden]
        (overwritten), as the Python layers return them."""
        arch = self.arch
        tokens = hidden.shape[0]
        if len(kv_caches) != len(self.weights):
            raise ValueError(f"expected {len(self.weights)} KV cache pairs, got {len(kv_caches)}")
        key_cache = kv_caches[0][0]
        rows = checked_kernel_rows(metadata, key_cache)
        if rows.num_tokens != tokens or metadata.slot_mapping.numel() != tokens:
            raise ValueError(f"hidden has {tokens} tokens but the metadata has {rows.num_tokens} "
                             f"({metadata.slot_mapping.numel()} slots)")  # fmt: skip
        x = hidden.contiguous()
        cos, sin = cos.to(self.dtype).contiguous(), sin.to(self.dtype).contiguous()
        if cos.shape != (tokens, arch.head_dim) or sin.shape != cos.shape:
            raise ValueError(f"cos/sin must be [{tokens}, {arch.head_dim}]")
        residual = torch.empty_like(x)
        scratch = [torch.empty(tokens, width, dtype=self.dtype) for width in
                   (arch.hidden_size, arch.q_size + 2 * arch.kv_size, arch.q_size, arch.intermediate_size)]  # fmt: skip
        tables = rows.block_tables
        args = DecoderStackArgs(
            self._layers(kv_caches), len(self.weights), tokens, arch.hidden_size, arch.num_attention_heads,
            arch.num_key_value_heads, arch.head_dim, arch.intermediate_size, key_cache.shape[1], self.eps,
            arch.head_dim**-0.5, DTYPE_CODES[self.dtype], CACHE_CODES[(self.dtype, key_cache.dtype)],
            torch.get_num_threads(), 0, x.data_ptr(), residual.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            metadata.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0), rows.row_token.data_ptr(),
            rows.row_req.data_ptr(), rows.row_ctx.data_ptr(), rows.row_token.numel(),
            *(t.data_ptr() for t in scratch),
        )  # fmt: skip
        self.kernels.decoder_stack(args)
        self.steps += 1
        return x, residual
