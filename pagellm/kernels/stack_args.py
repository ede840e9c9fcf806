"""The one-call decoder stack's arguments (``csrc/decoder_stack.cpp``'s ``PagellmLinear``,
``PagellmLayer`` and ``PagellmStack``) as ctypes structures, field for field: what
``KernelLibrary.decoder_stack`` passes and ``model/fused_stack.py`` fills."""

from __future__ import annotations

import ctypes

_P = ctypes.c_void_p


class LinearArgs(ctypes.Structure):
    """``PagellmLinear`` of ``csrc/decoder_stack.cpp``: a packed weight and its GEMM (``kind``:
    ``LINEAR_KINDS``; ``format``: the integer GEMM's format or the AVX2 GEMM's weight dtype code;
    ``epilogue``: that GEMM's own code); ``next``, where set, the address of the part computing
    the output columns after this part's first ``cols`` (kept alive by the caller)."""

    _fields_ = [
        ("weight", _P), ("kind", ctypes.c_int32), ("format", ctypes.c_int32), ("epilogue", ctypes.c_int32),
        ("reserved", ctypes.c_int32), ("cols", ctypes.c_int64), ("next", _P),
    ]  # fmt: skip


# LinearArgs.kind for each GEMM path: the integer GEMM, then the kernel plan's dense paths, then
# the integer GEMM's AMX paths.
LINEAR_KINDS = {"integer": 0, "avx512-bf16": 1, "amx": 2, "avx2": 3, "integer-amx": 4, "dequant-amx": 5}


class LoRALinearArgs(ctypes.Structure):
    """``PagellmLoRALinear`` of ``csrc/exports.h``: one linear's LoRA slots (``width``: A's rows,
    parts x ``rank``, 0 where no adapter can add to it; ``features_in``: A's columns;
    ``part_cols``: each part's first output column, then the linear's width; ``a``, ``b``:
    arrays of ``max_loras`` buffers in ``csrc/lora.cpp``'s layouts; ``active``: ``max_loras``
    bytes, 1 where the slot's adapter adds here; ``dtype``: their dtype's code, the activations')."""

    _fields_ = [
        ("width", ctypes.c_int64), ("rank", ctypes.c_int64), ("parts", ctypes.c_int64),
        ("features_in", ctypes.c_int64), ("part_cols", ctypes.c_int64 * 5), ("a", _P), ("b", _P), ("active", _P),
        ("dtype", ctypes.c_int32), ("max_loras", ctypes.c_int32),
    ]  # fmt: skip


# The linears of a layer in the order of its LoRALinearArgs (the stack's ``lora`` array).
STACK_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class DecoderLayerArgs(ctypes.Structure):
    """``PagellmLayer`` of ``csrc/decoder_stack.cpp``: one layer's norms, linears, caches and
    attention variant (scale, soft cap: 0 none, window: 0 none; ``mlp_apart``: gate/up's GEMM
    writes gate and up, SiLU-and-mul runs after it; ``rotary_dim``: each head's leading dims the
    rotary turns, 0 none; ``residual_multiplier``: each block's output scaled before it joins the
    residual, 1 none)."""

    _fields_ = [
        ("input_norm", _P), ("post_norm", _P), ("qkv_bias", _P), ("q_norm", _P), ("k_norm", _P), ("key_cache", _P),
        ("value_cache", _P), ("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("window", ctypes.c_int32),
        ("mlp_apart", ctypes.c_int32), ("rotary_dim", ctypes.c_int32),
        ("residual_multiplier", ctypes.c_float),
        ("qkv", LinearArgs), ("o", LinearArgs), ("gate_up", LinearArgs), ("down", LinearArgs),
    ]  # fmt: skip


class DecoderStackArgs(ctypes.Structure):
    """``PagellmStack`` of ``csrc/decoder_stack.cpp``: one step's shapes, indices and buffers."""

    _fields_ = [
        ("layers", ctypes.POINTER(DecoderLayerArgs)), ("num_layers", ctypes.c_int64), ("tokens", ctypes.c_int64),
        ("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_float), ("reserved_f", ctypes.c_float), ("dtype", ctypes.c_int32), ("cache_code", ctypes.c_int32),
        ("num_threads", ctypes.c_int32), ("reserved", ctypes.c_int32), ("x", _P), ("residual", _P), ("cos", _P),
        ("sin", _P), ("slot_mapping", _P), ("block_tables", _P), ("block_table_stride", ctypes.c_int64),
        ("row_token", _P), ("row_req", _P), ("row_start", _P), ("row_ctx", _P), ("num_rows", ctypes.c_int64),
        ("h", _P), ("qkv", _P),
        ("attn", _P), ("act", _P), ("tp_region", _P), ("tp_calls", _P), ("tp_scratch", _P),
        ("tp_slot_elems", ctypes.c_int64), ("tp_timeout_s", ctypes.c_double), ("tp_rank", ctypes.c_int32),
        ("tp_size", ctypes.c_int32), ("gate_up", _P), ("lora", ctypes.POINTER(LoRALinearArgs)), ("lora_groups", _P),
        ("num_lora_groups", ctypes.c_int64),
    ]  # fmt: skip
