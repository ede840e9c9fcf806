"""The CPU kernel library of one build (one ``-march``) behind small, checked Python wrappers.

The wrappers check shapes, dtypes, strides and every index the C++ will follow, so a wrong call
raises a Python exception instead of reading stray memory. A :class:`KernelLibrary` is made by
:func:`pagellm.kernels.load` and carried by the kernel plan to the modules that use it.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from pagellm.kernels.arg_checks import (
    DTYPE_CODES,
    cache_code,
    check_gemm_input,
    check_int,
    check_logits_rows,
    check_paged_attention_rows,
    check_rows,
    check_slots,
)
from pagellm.kernels.packing import (
    GEMM_AMX_K_MULTIPLE,
    GEMM_AMX_PANEL_COLS,
    SILU_MUL_HALF_COLS,
    avx2_epilogue,
    avx2_packed_shape,
    gemm_epilogue,
)
from pagellm.kernels.scan_calls import ScanKernels
from pagellm.kernels.quant_formats import (
    AMX_FORMATS, BLOCK, FORMAT_CODES, QUANT_TILES, SUPER_BLOCKS, SUPER_FORMATS, TILE_COLS, checked_gguf_rows, packed_shape,
)
from pagellm.kernels.stack_args import DecoderStackArgs, LoRALinearArgs
from pagellm.kernels.weight_memory import empty_weight
from pagellm.kv_layout import cache_head_dim

# pagellm_gemm_q_isa() -> the integer GEMM's path name (kernel plan: ``qgemm``).
GEMM_Q_PATHS = ("none", "avx2", "avx-vnni", "avx512-vnni")


class KernelLibrary:
    """One loaded build of the kernels: its target (``march``), what it offers, and its calls."""

    def __init__(self, lib: ctypes.CDLL, march: tuple[str, ...]) -> None:
        self._lib = lib
        self.march = march
        self.gemm_bf16_available = bool(lib.pagellm_gemm_bf16_available())
        self.gemm_amx_available = bool(lib.pagellm_gemm_bf16_amx_available())
        self.gemm_avx2_available = bool(lib.pagellm_gemm_avx2_available())
        # The integer GEMM's path: "none" where the build has none (no AVX2/FMA/F16C) or this CPU
        # lacks what it executes (a -march asked for more than the CPU has).
        self.gemm_q_built = GEMM_Q_PATHS[lib.pagellm_gemm_q_isa()]
        self.gemm_q_path = self.gemm_q_built if lib.pagellm_gemm_q_runs_here() else "none"
        self.gemm_q_amx_available = bool(lib.pagellm_gemm_q_amx_available())  # the same GEMM on AMX tiles
        self.scan = ScanKernels(lib)  # the scan layers' decode calls

    def __repr__(self) -> str:
        return f"KernelLibrary({' '.join(self.march)})"

    @property
    def build_id(self) -> str:
        """Names this build (its sources, compiler, flags and CPU): what it packs is its own."""
        return os.path.basename(str(self._lib._name))

    def paged_attention(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        row_token: torch.Tensor,
        row_req: torch.Tensor,
        row_ctx: torch.Tensor,
        scale: float,
        *,
        row_start: torch.Tensor | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        rows_checked: bool = False,
    ) -> None:
        """For each row r: ``out[row_token[r]]`` = attention of ``query[row_token[r]]`` ([H, D])
        over positions ``row_start[r]`` (0 without it: a sliding window's first) to
        ``row_ctx[r] - 1`` of request ``row_req[r]``, read in place from the paged cache
        ([num_blocks, block_size, H_kv, row], pagellm/kv_layout.py) through ``block_tables[row_req[r]]``; scores capped
        by ``softcap * tanh(score / softcap)`` with a ``softcap``; with ``sinks`` (float32 [H]), each
        head's sink logit joins its softmax, over no value (gpt-oss).

        Every index is range-checked (:func:`check_paged_attention_rows`) unless ``rows_checked``
        says the caller already did so for these exact index tensors (once per engine step).
        """
        num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
        head_dim, num_heads = cache_head_dim(key_cache), query.shape[1]
        code = cache_code(query.dtype, key_cache, value_cache)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        check_rows("query", query, (num_heads, head_dim), query.dtype)
        check_rows("out", out, (num_heads, head_dim), query.dtype)
        if out.shape[0] != query.shape[0]:
            raise ValueError("out and query must have the same number of rows")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive, got {softcap}")
        if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_heads,)
                                  or not sinks.is_contiguous() or sinks.device.type != "cpu"):  # fmt: skip
            raise ValueError(f"sinks must be a contiguous float32 CPU tensor of shape ({num_heads},)")
        if not rows_checked:
            check_paged_attention_rows(query.shape[0], key_cache, block_tables, row_token, row_req, row_ctx, row_start)
        rc = self._lib.pagellm_paged_attention(
            query.data_ptr(), query.stride(0), out.data_ptr(), out.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            row_token.data_ptr(), row_req.data_ptr(), None if row_start is None else row_start.data_ptr(),
            row_ctx.data_ptr(), row_token.numel(), num_heads, num_kv_heads, head_dim, block_size, float(scale),
            float(softcap or 0.0), None if sinks is None else sinks.data_ptr(), code, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_paged_attention failed with code {rc}")

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        slots_checked: bool = False,
    ) -> None:
        """Store ``key``/``value`` ([T, H_kv, D], any row stride) at ``slot_mapping`` (int64 [T]);
        slots are range-checked (:func:`check_slots`) unless ``slots_checked``."""
        num_kv_heads, head_dim = key_cache.shape[2], cache_head_dim(key_cache)
        code = cache_code(key.dtype, key_cache, value_cache)
        check_rows("key", key, (num_kv_heads, head_dim), key.dtype)
        check_rows("value", value, (num_kv_heads, head_dim), key.dtype)
        if value.shape[0] != key.shape[0]:
            raise ValueError(f"key has {key.shape[0]} rows but value has {value.shape[0]}")
        check_int("slot_mapping", slot_mapping, torch.int64, key.shape[0])
        if not slots_checked:
            check_slots(slot_mapping, key_cache)
        rc = self._lib.pagellm_write_kv(
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
            key.shape[0], num_kv_heads, head_dim, code, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_write_kv failed with code {rc}")

    def add_rms_norm(
        self,
        x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """RMSNorm of ``x + residual`` (``residual`` updated in place to that sum) or of ``x``.

        x, residual: contiguous [N, hidden]; weight: [hidden]; all of one dtype, or ``weight``
        float32 for bf16 ``x``: a scale (Gemma's and Qwen3.5's ``1 + weight``, taken in float32)
        the normed values are multiplied by before they are rounded. Returns a new tensor.
        """
        dtype = x.dtype
        if dtype not in DTYPE_CODES or x.dim() != 2 or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("x must be a contiguous 2-D CPU float32/bfloat16 tensor")
        rows, n = x.shape
        if residual is not None and (residual.shape != x.shape or residual.dtype != dtype or not residual.is_contiguous()):
            raise ValueError("residual must be contiguous, with x's shape and dtype")
        _check_norm_weight(weight, n, dtype)
        out = torch.empty_like(x)
        rc = self._lib.pagellm_add_rms_norm(
            x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(), out.data_ptr(),
            rows, n, float(eps), DTYPE_CODES[dtype], torch.get_num_threads(), weight.dtype != dtype,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_add_rms_norm failed with code {rc}")
        return out

    def head_rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """RMSNorm of each head of ``x`` ([T, heads, D], row-contiguous heads, any row stride) in
        place, one ``weight`` [D] for all (Qwen3's q and k norms; a float32 scale as
        :meth:`add_rms_norm`'s): per head what :meth:`add_rms_norm` gives its rows, without
        copying the heads out and back."""
        dtype = x.dtype
        if dtype not in DTYPE_CODES or x.dim() != 3:
            raise ValueError("x must be a [T, heads, D] float32 or bfloat16 tensor")
        rows, heads, head_dim = x.shape
        check_rows("x", x, (heads, head_dim), dtype)
        _check_norm_weight(weight, head_dim, dtype)
        rc = self._lib.pagellm_head_rms_norm(
            x.data_ptr(), x.stride(0), rows, heads, head_dim, weight.data_ptr(), float(eps), DTYPE_CODES[dtype],
            torch.get_num_threads(), weight.dtype != dtype,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_head_rms_norm failed with code {rc}")

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``x`` ([T, heads, D], row-contiguous heads, any row stride) in place by ``cos``/``sin``
        ([T, R]): each head's first R dims (R = D, or fewer: partial rotary; R even)."""
        dtype = x.dtype
        if dtype not in DTYPE_CODES:
            raise ValueError(f"rotary supports float32 and bfloat16, not {dtype}")
        rows, heads, head_dim = x.shape
        check_rows("x", x, (heads, head_dim), dtype)
        rotary_dim = cos.shape[-1] if cos.dim() == 2 else -1
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"cos must be [{rows}, R] with R even, 2 to {head_dim}: got {tuple(cos.shape)}")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.shape != (rows, rotary_dim) or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous [{rows}, {rotary_dim}] {dtype} tensor")
        rc = self._lib.pagellm_rotary(
            x.data_ptr(), x.stride(0), rows, heads, head_dim, rotary_dim, cos.data_ptr(), sin.data_ptr(),
            DTYPE_CODES[dtype], torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_rotary failed with code {rc}")

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Index of each row's first maximum (its first NaN if it holds one), as ``x.max(-1).indices``:
        one pass over 2-D float32/bfloat16 CPU rows (contiguous within a row) -> int64 [rows]."""
        dtype = x.dtype
        rows, n = check_logits_rows("argmax_rows", x)
        out = torch.empty(rows, dtype=torch.int64)
        if rows == 0:
            return out
        rc = self._lib.pagellm_argmax_rows(
            x.data_ptr(), x.stride(0), rows, n, out.data_ptr(), DTYPE_CODES[dtype], torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError(f"pagellm_argmax_rows failed with code {rc}")
        return out

    def apply_token_bitmask_(self, logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor) -> None:
        """Set to -inf, in place, the logits of tokens row ``r``'s grammar forbids: bit ``t % 32``
        of word ``t // 32`` of ``bitmask[mask_rows[r]]`` clear (tokens past its words too); rows
        with ``mask_rows[r] < 0`` are untouched. As ``sample.grammar_mask.apply_token_bitmask``."""
        dtype = logits.dtype
        rows, n = check_logits_rows("apply_token_bitmask_", logits)
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_contiguous() or bitmask.device.type != "cpu":
            raise ValueError("the bitmask must be a contiguous 2-D CPU int32 tensor")
        if mask_rows.dtype != torch.int64 or mask_rows.shape != (rows,) or not mask_rows.is_contiguous():
            raise ValueError(f"mask_rows must be a contiguous int64 tensor of {rows} entries")
        if rows == 0:
            return
        if int(mask_rows.max()) >= bitmask.shape[0]:
            raise ValueError(f"mask_rows point past the bitmask's {bitmask.shape[0]} rows")
        rc = self._lib.pagellm_apply_token_bitmask(
            logits.data_ptr(), logits.stride(0), rows, n, bitmask.data_ptr(), bitmask.shape[1], mask_rows.data_ptr(),
            DTYPE_CODES[dtype], torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_apply_token_bitmask failed with code {rc}")

    def gemm_bf16(
        self,
        x: torch.Tensor, packed: torch.Tensor, out_features: int, epilogue: str = "none", amx: bool = False
    ) -> torch.Tensor:
        """``x [M, K] @ W.T`` for a packed bf16 ``W`` -> new ``[M, out_features]`` bf16 tensor.

        ``epilogue="silu_mul"`` takes a ``packing.pack_silu_mul_weight`` weight and returns
        ``silu(x @ gate.T) * (x @ up.T)``, each intermediate rounded to bf16 as the unfused ops do.
        ``amx`` runs on AMX tiles (``gemm_amx_available``, K a multiple of 32), same layout.
        """
        code, cols = gemm_epilogue(epilogue, amx)
        if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError("x must be a 2-D CPU bfloat16 tensor")
        rows, k = x.shape
        panels = -(-out_features // (cols if code == 0 else SILU_MUL_HALF_COLS))
        expected = (panels, k // 2, cols, 2)
        if packed.dtype != torch.bfloat16 or tuple(packed.shape) != expected or not packed.is_contiguous():
            raise ValueError(f"packed weight must be a contiguous bf16 tensor of shape {list(expected)} for x {list(x.shape)}")
        if k % 2 != 0 or (rows > 1 and x.stride(0) < k) or (k > 1 and x.stride(1) != 1):
            raise ValueError("x needs an even number of columns, each row contiguous")
        if amx and k % GEMM_AMX_K_MULTIPLE != 0:
            raise ValueError(f"the AMX path needs K a multiple of {GEMM_AMX_K_MULTIPLE}, got {k}")
        out = torch.empty(rows, out_features, dtype=torch.bfloat16)
        rc = self._lib.pagellm_gemm_bf16(
            x.data_ptr(), x.stride(0) if rows > 1 else k, rows, k, packed.data_ptr(), out_features, out.data_ptr(),
            out_features, code, torch.get_num_threads(), int(amx),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_gemm_bf16 failed with code {rc}")
        return out


    def gemm_avx2(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, epilogue: str = "none") -> torch.Tensor:
        """``x [M, K] @ W.T`` on the AVX2 GEMM for a packed float32/bf16 ``W``
        (``packing.pack_avx2_weight``) -> new ``[M, out_features]`` tensor of x's dtype.

        ``epilogue="silu_mul"`` takes a ``packing.pack_avx2_silu_mul_weight`` weight and returns
        ``silu(x @ gate.T) * (x @ up.T)`` (bf16: gate, up and silu(gate) rounded as the unfused ops).
        """
        code, _ = avx2_epilogue(epilogue)
        rows, k = check_gemm_input(x)
        if packed.dtype not in DTYPE_CODES or packed.device.type != "cpu" or not packed.is_contiguous():
            raise ValueError("packed weight must be a contiguous CPU float32 or bfloat16 tensor")
        if packed.dtype == torch.bfloat16 and k % 2 != 0:
            raise ValueError(f"a bfloat16 packed weight needs an even K, got {k}")
        expected = avx2_packed_shape(out_features, k, packed.dtype, epilogue)
        if out_features <= 0 or tuple(packed.shape) != expected:
            raise ValueError(f"packed weight must have shape {list(expected)} for x {list(x.shape)}, got {list(packed.shape)}")
        out = torch.empty(rows, out_features, dtype=x.dtype)
        rc = self._lib.pagellm_gemm_avx2(
            x.data_ptr(), x.stride(0) if rows > 1 else k, rows, k, packed.data_ptr(), out_features, out.data_ptr(),
            out_features, DTYPE_CODES[x.dtype], DTYPE_CODES[packed.dtype], code, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_gemm_avx2 failed with code {rc}")
        return out


    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a gate/up output ``x`` [M, 2 * d] (float32 or bf16) -> [M, d]:
        the AVX2 GEMM's silu_mul epilogue run apart, to its bits."""
        rows, width = check_gemm_input(x)
        if width % 2 != 0 or not x.is_contiguous():
            raise ValueError(f"x must be contiguous with an even width, got {list(x.shape)}")
        out = torch.empty(rows, width // 2, dtype=x.dtype)
        rc = self._lib.pagellm_silu_mul(x.data_ptr(), rows, width // 2, out.data_ptr(), DTYPE_CODES[x.dtype],
                                        torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_silu_mul failed with code {rc}")
        return out

    def bias_gelu_tanh(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``gelu_tanh(x + bias)`` of ``x`` [M, n] (float32 or bf16; ``bias``: [n] of its dtype),
        in place: a vision encoder's MLP activation with its first linear's bias."""
        rows, width = check_gemm_input(x)
        if not x.is_contiguous():
            raise ValueError(f"x must be contiguous, got strides {x.stride()}")
        if bias is not None and (bias.shape != (width,) or bias.dtype != x.dtype or not bias.is_contiguous()):
            raise ValueError(f"bias must be a contiguous [{width}] tensor of {x.dtype}, got {list(bias.shape)} {bias.dtype}")
        rc = self._lib.pagellm_bias_gelu_tanh(x.data_ptr(), rows, width, None if bias is None else bias.data_ptr(),
                                              x.data_ptr(), DTYPE_CODES[x.dtype], torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_bias_gelu_tanh failed with code {rc}")
        return x

    def lora_add(self, linear: LoRALinearArgs, slot: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out += B(A x)`` with slot ``slot``'s A and B of ``linear`` (``csrc/lora.cpp``), B's
        product rounded to x's dtype and added as ``out.add_``; ``x`` [M, K] and ``out`` [M, N]
        of the linear's dtype and widths, rows contiguous. Returns ``out``."""
        rows, k = check_gemm_input(x)
        n = linear.part_cols[linear.parts] if 1 <= linear.parts <= 4 else -1
        if not 0 <= slot < linear.max_loras or linear.width <= 0 or DTYPE_CODES[x.dtype] != linear.dtype:
            raise ValueError(f"slot {slot} of {linear.max_loras}, or a linear without adapters or of another dtype "
                             f"than {x.dtype}")  # fmt: skip
        if k != linear.features_in:
            raise ValueError(f"x has {k} columns, the linear's adapters take {linear.features_in}")
        if out.dtype != x.dtype or out.device.type != "cpu" or out.shape != (rows, n) or (n > 1 and out.stride(1) != 1):
            raise ValueError(f"out must be a [{rows}, {n}] {x.dtype} tensor with contiguous rows")
        if rows > 1 and out.stride(0) < n:
            raise ValueError("out's rows must not overlap")
        rc = self._lib.pagellm_lora_add(
            ctypes.byref(linear), slot, x.data_ptr(), x.stride(0) if rows > 1 else k, rows, k, out.data_ptr(),
            out.stride(0) if rows > 1 else n, n, DTYPE_CODES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_lora_add failed with code {rc}")
        return out

    def quantize_rows(self, x: torch.Tensor, super_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The integer GEMM's activation quantization of ``x`` [M, K] (float32/bf16; with
        ``super_scale``, q4k's and q6k's: a scale per 256): (q int8 [M, blocks * 32], d float32 [M, blocks],
        sum(q) int32 [M, blocks]), for tests."""
        rows, k = check_gemm_input(x)
        blocks = -(-k // BLOCK)
        q = torch.empty(rows, blocks * BLOCK, dtype=torch.int8)
        d = torch.empty(rows, blocks, dtype=torch.float32)
        sums = torch.empty(rows, blocks, dtype=torch.int32)
        rc = self._lib.pagellm_quantize_rows(
            x.data_ptr(), x.stride(0) if rows > 1 else k, rows, k, DTYPE_CODES[x.dtype], q.data_ptr(), d.data_ptr(),
            sums.data_ptr(), int(super_scale), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_quantize_rows failed with code {rc}")
        return q, d, sums

    def gemm_q(
        self, x: torch.Tensor, packed: torch.Tensor, fmt: str, out_features: int, epilogue: str = "none",
        tiles: str = "none", out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [M, K] @ W.T`` for a quantized ``W`` (``quant_formats.pack``, format ``fmt``: q4, q8,
        q4f, q5f, q6k, q4s or q4k), in integer dot products on activations quantized per block of 32 (q4k, q6k: a scale per 256) -> new
        ``[M, out_features]`` tensor of x's dtype (float32 or bf16). ``epilogue="silu_mul"``
        takes a ``quant_formats.pack_silu_mul`` weight and returns ``silu(x @ gate.T) * (x @ up.T)``.
        ``tiles`` (``gemm_q_amx_available``): "int8" computes the same bits on AMX-INT8 tiles (formats
        in ``AMX_FORMATS``); "bf16" multiplies bf16 ``x`` by the weight dequantized to bf16 on AMX-BF16
        tiles (any format, K a multiple of 32; the dense bf16 copy's product). ``out``: written
        instead of a new tensor, [M, out_features] of x's dtype with contiguous rows (columns of a
        wider tensor: one part of a linear's outputs)."""
        if epilogue not in ("none", "silu_mul"):
            raise ValueError(f"epilogue must be 'none' or 'silu_mul', got {epilogue!r}")
        if self.gemm_q_path == "none":
            raise RuntimeError(f"the integer GEMM of this kernel build ({' '.join(self.march)}) does not run on this CPU "
                               f"(built: {self.gemm_q_built}; it needs AVX2, FMA and F16C at least)")
        if fmt not in FORMAT_CODES:
            raise ValueError(f"format must be one of {sorted(FORMAT_CODES)}, got {fmt!r}")
        if tiles not in QUANT_TILES:
            raise ValueError(f"tiles must be one of {sorted(QUANT_TILES)}, got {tiles!r}")
        if tiles == "int8" and fmt not in AMX_FORMATS:
            raise ValueError(f"AMX-INT8 tiles take {sorted(AMX_FORMATS)} weights, not {fmt}")
        if tiles != "none" and not self.gemm_q_amx_available:
            raise RuntimeError(f"the integer GEMM on AMX tiles is not available in this kernel build ({' '.join(self.march)})")
        rows, k = check_gemm_input(x)
        if tiles == "bf16" and (x.dtype != torch.bfloat16 or k % BLOCK):
            raise ValueError(f"AMX-BF16 tiles take bf16 rows of a multiple of {BLOCK} values, got {x.dtype} k={k}")
        if fmt in SUPER_FORMATS and k % (SUPER_BLOCKS * BLOCK):
            raise ValueError(f"{fmt} weights hold super-blocks of {SUPER_BLOCKS * BLOCK} along k, got k={k}")
        expected = packed_shape(fmt, out_features, k, silu_mul=epilogue == "silu_mul")
        if out_features <= 0 or packed.dtype != torch.uint8 or tuple(packed.shape) != expected or not packed.is_contiguous():
            raise ValueError(f"packed weight must be a contiguous uint8 tensor of shape {list(expected)} for x "
                             f"{list(x.shape)}, got {packed.dtype} {list(packed.shape)}")  # fmt: skip
        if out is None:
            out = torch.empty(rows, out_features, dtype=x.dtype)
        elif out.dtype != x.dtype or tuple(out.shape) != (rows, out_features) or (out_features > 1 and out.stride(1) != 1) \
                or (rows > 1 and out.stride(0) < out_features):  # fmt: skip
            raise ValueError(f"out must be a {x.dtype} [{rows}, {out_features}] tensor with contiguous rows")
        ldc = out.stride(0) if rows > 1 else out_features
        rc = self._lib.pagellm_gemm_q(
            x.data_ptr(), x.stride(0) if rows > 1 else k, rows, k, packed.data_ptr(), out_features, out.data_ptr(),
            ldc, DTYPE_CODES[x.dtype], FORMAT_CODES[fmt], int(epilogue == "silu_mul"), torch.get_num_threads(),
            QUANT_TILES[tiles],
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_gemm_q failed with code {rc}")
        return out

    def pack_gguf(
        self, fmt: str, source: np.ndarray, row_offsets: torch.Tensor, k: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """GGUF rows of ``k`` weights straight into ``fmt``'s packed layout (``csrc/gguf_rows.cpp``;
        what ``quant_formats.pack`` makes of the same rows): ``source`` a contiguous uint8 array
        (a memory-mapped file), ``row_offsets`` int64 [tiles * 16] each packed column's first
        byte in it, -1 for a zero column; into ``out`` where given (a contiguous uint8 tensor of
        the packed shape). Load-time work: it runs on every CPU this process may use (a busy one
        slows it little: tiles are handed out as threads finish them)."""
        offsets = checked_gguf_rows(fmt, source, row_offsets, k, zero_rows=True)
        if offsets.numel() % TILE_COLS:
            raise ValueError("pack_gguf takes 16 row offsets a tile")
        tiles = offsets.numel() // TILE_COLS
        shape = packed_shape(fmt, tiles * TILE_COLS, k)
        if out is None:
            out = empty_weight(shape)  # huge pages: streamed faster
        elif out.dtype != torch.uint8 or tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous uint8 tensor of shape {list(shape)}")
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else torch.get_num_threads()
        rc = self._lib.pagellm_pack_gguf(FORMAT_CODES[fmt], source.ctypes.data, offsets.data_ptr(), tiles, k,
                                         out.data_ptr(), threads)  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_pack_gguf failed with code {rc}")
        return out

    def pack_pairs(self, first: torch.Tensor, cols: int, second: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 ``[n, k]`` weights in the GEMMs' pair panels ``[P, k / 2, cols, 2]``, in C++, bit for
        bit ``packing``'s torch layout: ``cols`` rows of ``first`` a panel, or with ``second``
        (``silu_mul``: gate, up) ``cols / 2`` rows of each."""
        bf16_rows = first.dim() == 2 and first.dtype == torch.bfloat16 and first.device.type == "cpu"
        if not bf16_rows or first.shape[0] == 0 or first.shape[1] % 2:
            raise ValueError("first must be a 2-D CPU bfloat16 tensor with rows and an even width")
        if second is not None and (second.shape != first.shape or second.dtype != first.dtype or second.device != first.device):
            raise ValueError("second must be a tensor of first's shape, dtype and device")
        width = cols // 2 if second is not None else cols
        if width <= 0 or (second is not None and cols % 2):
            raise ValueError(f"cols must be positive (and even with second), got {cols}")
        n, k = first.shape
        first = first.contiguous()
        second = second.contiguous() if second is not None else None
        shape = (-(-n // width), k // 2, cols)
        out = empty_weight((*shape, 4)).view(torch.bfloat16)  # huge pages: streamed faster
        rc = self._lib.pagellm_pack_pairs(first.data_ptr(), None if second is None else second.data_ptr(), n, k, cols,
                                          out.data_ptr(), torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_pack_pairs failed with code {rc}")
        return out

    def dequant_packed(self, packed: torch.Tensor, fmt: str, rows: int, k: int, silu_mul: bool = False) -> torch.Tensor:
        """A packed weight (``rows`` outputs) dequantized to bf16 (``dequantize()`` rounded: the
        dense copy's weight; AMX builds) straight into the dense AMX GEMM's packed panels:
        ``pack_gemm_weight(w, amx=True)``, or with ``silu_mul`` ``pack_silu_mul_weight(gate, up)``."""
        expected = packed_shape(fmt, rows, k, silu_mul)
        if packed.dtype != torch.uint8 or tuple(packed.shape) != expected or not packed.is_contiguous():
            raise ValueError(f"packed must be a contiguous uint8 {list(expected)} tensor, got {list(packed.shape)}")
        width = 2 * SILU_MUL_HALF_COLS if silu_mul else GEMM_AMX_PANEL_COLS
        tiles = packed.shape[0]
        out = empty_weight((-(-tiles * TILE_COLS // width), k // 2, width, 4)).view(torch.bfloat16)  # as pack_pairs
        rc = self._lib.pagellm_dequant_q_bf16(packed.data_ptr(), tiles, k, FORMAT_CODES[fmt], int(silu_mul),
                                              out.data_ptr(), torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_dequant_q_bf16 failed with code {rc}")
        return out

    def dequant_gguf_rows(self, fmt: str, source: np.ndarray, row_offsets: torch.Tensor, k: int) -> torch.Tensor:
        """GGUF rows of ``k`` weights (``row_offsets``: each row's first byte in ``source``) as
        float32 [rows, k], exactly as gguf-py dequantizes them (an embedding's looked-up rows)."""
        offsets = checked_gguf_rows(fmt, source, row_offsets, k, zero_rows=False)
        out = torch.empty(offsets.numel(), k, dtype=torch.float32)
        rc = self._lib.pagellm_dequant_gguf_rows(FORMAT_CODES[fmt], source.ctypes.data, offsets.data_ptr(),
                                                 offsets.numel(), k, out.data_ptr(), torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pagellm_dequant_gguf_rows failed with code {rc}")
        return out

    def read_sum(self, buffer: torch.Tensor, num_threads: int | None = None) -> int:
        """The wrapping sum of a contiguous CPU buffer's 64-bit words (its bytes a multiple of
        64), read with the kernels' vector loads by ``num_threads`` threads (torch's count by
        default): timed, it gives the read bandwidth the kernels see (``benchmarks.floor``)."""
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("read_sum needs a contiguous CPU tensor")
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes == 0 or nbytes % 64:
            raise ValueError(f"read_sum needs a positive multiple of 64 bytes, got {nbytes}")
        out = ctypes.c_uint64()
        threads = num_threads or torch.get_num_threads()
        rc = self._lib.pagellm_read_sum(buffer.data_ptr(), nbytes, threads, ctypes.byref(out))
        if rc != 0:
            raise RuntimeError(f"pagellm_read_sum failed with code {rc}")
        return out.value

    def shm_region_bytes(self, ranks: int, slot_elems: int) -> int:
        """Bytes of a shared-memory all-reduce region (``csrc/shm_all_reduce.cpp``)."""
        return int(self._lib.pagellm_shm_region_bytes(ranks, slot_elems))

    def shm_register(self, region: torch.Tensor, rank: int, pid: int) -> None:
        """Record this rank's pid in the region (its peers watch it while they wait)."""
        self._lib.pagellm_shm_register(region.data_ptr(), rank, pid)

    def shm_all_reduce_(self, region: torch.Tensor, rank: int, ranks: int, data: torch.Tensor, slot_elems: int,
                        seq: int, timeout_s: float) -> None:  # fmt: skip
        """Sum the contiguous float32 ``data`` (at most ``slot_elems`` values) over the ranks
        mapping ``region``, in place; call number ``seq`` (from 1, the same on every rank)."""
        if data.dtype != torch.float32 or not data.is_contiguous() or data.numel() > slot_elems:
            raise ValueError(f"shm_all_reduce_ takes a contiguous float32 tensor of at most {slot_elems} values")
        if region.numel() < self.shm_region_bytes(ranks, slot_elems):
            raise ValueError("the shared-memory region is smaller than its ranks and slots need")
        rc = self._lib.pagellm_shm_all_reduce(region.data_ptr(), rank, ranks, data.data_ptr(), data.numel(), slot_elems,
                                              seq, timeout_s)  # fmt: skip
        _raise_for("pagellm_shm_all_reduce", rc, timeout_s)

    def decoder_stack(self, stack: DecoderStackArgs) -> None:
        """Run ``stack.num_layers`` decoder layers in one call (``csrc/decoder_stack.cpp``).

        Unchecked here: the caller (``model.fused_stack``) builds ``stack`` from the model's own
        packed weights, whose shapes it checked, and the step's indices, checked once a step.
        """
        rc = self._lib.pagellm_decoder_stack(ctypes.byref(stack))
        _raise_for("pagellm_decoder_stack", rc, stack.tp_timeout_s)


def _raise_for(function: str, rc: int, timeout_s: float) -> None:
    """The error a kernel's return code means (the all-reduce's own codes named), if any."""
    if rc == -3:
        raise TimeoutError(f"tensor-parallel all-reduce: a rank did not arrive within {timeout_s:g} s")
    if rc == -4:
        raise RuntimeError("tensor-parallel all-reduce: a rank's process is gone")
    if rc != 0:
        raise RuntimeError(f"{function} failed with code {rc}")


def _check_norm_weight(weight: torch.Tensor, n: int, dtype: torch.dtype) -> None:
    """A norm's weight: ``n`` values of the activations' dtype, or float32 (a scale)."""
    if weight.shape != (n,) or weight.dtype not in (dtype, torch.float32) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{n}] {dtype} or float32 tensor")
