"""The decoder layers in one C++ call (``csrc/decoder_stack.cpp``), where the kernel plan says
``decoder="fused"``: linears on pagellm's GEMMs (integer, bf16, AVX2), the paged attention
kernel, kernel norms and rotary.

The call runs the kernels the Python layers run, in the same order on the same buffers, so its
output is bit for bit theirs; what it removes is the Python between them (module calls,
wrapper checks, ctypes: ~3 ms of a ~10 ms batch-1 step on the default model, benchmarks/NOTES.md,
37). Each layer's variant comes from the same :class:`~pagellm.model.layer_spec.LayerSpec` the
modules are built from (q/k norms, score scale, soft cap, sliding window per layer); a layer
whose spec asks for what the call lacks is refused by name (:func:`stack_refusal`), once, in
the log. The weights' shapes are checked when the stack is built; the step's indices once a
step, as the attention backend checks them. Batches of more rows than the plan's
``quant_max_rows`` use quantized linears' dense copies or AMX tiles, as the modules do; steps
it does not take (a cache dtype the kernels do not read; a prefill of a head dim whose prefill
rows the attention backend sends to SDPA) run the Python layers. LoRA adapters' products are
added in the call (``csrc/lora.cpp``, the kernel the Python layers call too) where each
adapter's rows are a run of the step's rows and the MLP's gate/up is apart from SiLU-and-mul.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.cpu_paged import CPUPagedAttention, checked_kernel_rows
from pagellm.distributed.tensor_parallel import TensorParallel
from pagellm.kernels.arg_checks import CACHE_CODES, DTYPE_CODES
from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.stack_args import LINEAR_KINDS, DecoderLayerArgs, DecoderStackArgs, LinearArgs
from pagellm.kernels.packing import avx2_epilogue, gemm_epilogue
from pagellm.kernels.quant_formats import FORMAT_CODES
from pagellm.kv_layout import kv_row_width
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.cpu_linear import KernelLinear, KernelSiluAndMulLinear
from pagellm.model.layer_spec import LayerSpec, stack_refusal
from pagellm.model.lora import LoRAStep
from pagellm.model.layers import RMSNorm, SiluAndMul, UnitOffsetRMSNorm
from pagellm.model.quant_linear import QuantizedLinear

KVCache = tuple[torch.Tensor, torch.Tensor]

logger = logging.getLogger(__name__)


def _linear_args(module: nn.Module, big: bool, keep: list[LinearArgs]) -> LinearArgs | None:
    """A linear the call multiplies (pagellm's integer, bf16 or AVX2 GEMM), or None; ``big``:
    for batches above the plan's ``quant_max_rows`` (quantized linears may use AMX tiles then).
    A quantized linear of several parts: the first part's struct, the others appended to
    ``keep``, which the caller holds as long as the struct is used."""
    if isinstance(module, QuantizedLinear):
        epilogue = 1 if module.silu_mul else 0
        kind = LINEAR_KINDS[module.amx_tiles if big and module.big_batches_on_amx else "integer"]
        args, rest = None, None
        for part in reversed(module.parts):  # each part names the next (``keep`` holds them alive)
            args = LinearArgs(part.packed.data_ptr(), kind, FORMAT_CODES[part.format], epilogue, 0, part.rows,
                              None if rest is None else ctypes.addressof(rest))  # fmt: skip
            if rest is not None:
                keep.append(rest)
            rest = args
        return args
    if not isinstance(module, (KernelLinear, KernelSiluAndMulLinear)) or module.path not in LINEAR_KINDS:
        return None
    weight = module.packed_weight
    if module.path == "avx2":
        code = avx2_epilogue(module.epilogue)[0]
        return LinearArgs(weight.data_ptr(), LINEAR_KINDS["avx2"], DTYPE_CODES[weight.dtype], code, 0)
    code = gemm_epilogue(module.epilogue, module.path == "amx")[0]
    return LinearArgs(weight.data_ptr(), LINEAR_KINDS[module.path], 0, code, 0)


def _dense_side(module: nn.Module) -> nn.Module:
    """The module a batch above the plan's ``quant_max_rows`` runs: a quantized linear's dense
    copy where it has one, else the module itself."""
    return module.dense if isinstance(module, QuantizedLinear) and module.dense is not None else module


@dataclass(frozen=True)
class _LayerWeights:
    """One layer's spec and the tensors the call reads (held so their storage outlives the pointers)."""

    spec: LayerSpec
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_bias: torch.Tensor | None
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None
    linears: tuple[nn.Module, nn.Module, nn.Module, nn.Module]  # qkv, o, gate_up, down
    mlp_apart: bool  # gate/up's GEMM writes gate and up; SiLU-and-mul on the kernel after it (LoRA)

    def _side(self, dense: bool) -> list[nn.Module]:
        return [_dense_side(m) for m in self.linears] if dense else list(self.linears)

    def fits(self) -> bool:
        """Whether the call multiplies every linear, for small batches and big ones."""
        return all(_linear_args(m, dense, []) is not None for dense in (False, True) for m in self._side(dense))

    def args(self, key_cache: torch.Tensor, value_cache: torch.Tensor, dense: bool, keep: list[LinearArgs]) -> DecoderLayerArgs:
        """The C struct for this layer over these caches (``dense``: the big-batch side; ``keep``:
        as :func:`_linear_args`)."""
        spec = self.spec
        bias = None if self.qkv_bias is None else self.qkv_bias.data_ptr()
        q_norm, k_norm = (None, None) if self.qk_norms is None else (t.data_ptr() for t in self.qk_norms)
        return DecoderLayerArgs(
            self.input_norm.data_ptr(), self.post_norm.data_ptr(), bias, q_norm, k_norm, key_cache.data_ptr(),
            value_cache.data_ptr(), spec.scale, spec.softcap or 0.0, spec.window or 0, int(self.mlp_apart),
            spec.rotary_dim, spec.residual_multiplier, *(_linear_args(m, dense, keep) for m in self._side(dense)),
        )  # fmt: skip


def _kernel_norm(norm: object, dtype: torch.dtype) -> torch.Tensor | None:
    """A kernel RMSNorm's weight (contiguous, in ``dtype``), else None (a scale by 1 + weight:
    the stack multiplies by the weight, Llama's way)."""
    if not isinstance(norm, RMSNorm) or isinstance(norm, UnitOffsetRMSNorm) or norm.kernels is None:
        return None
    weight = norm.weight
    return weight if weight.dtype == dtype and weight.is_contiguous() else None


def _layer_weights(layer: nn.Module, dtype: torch.dtype) -> _LayerWeights | str:
    """The layer's tensors where the call can run it: its spec not refused (:func:`stack_refusal`),
    pagellm's GEMMs for every linear (the MLP's activation in gate_up's epilogue), of the spec's
    shapes, kernel norms, a bias in ``dtype``, the paged kernel and kernel rotary; else why not."""
    spec: LayerSpec = layer.spec
    refusal = stack_refusal(spec)
    if refusal is not None:
        return refusal
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(attn.attn_backend, CPUPagedAttention) or attn.rotary_kernels is None:
        return "attention off the paged kernel or rotary off the kernel"
    input_norm, post_norm = (_kernel_norm(n, dtype) for n in (layer.input_layernorm, layer.post_attention_layernorm))
    q_norm, k_norm = (_kernel_norm(n, dtype) for n in (attn.q_norm, attn.k_norm)) if spec.qk_norm else (None, None)
    if input_norm is None or post_norm is None or (spec.qk_norm and (q_norm is None or k_norm is None)):
        return f"a norm off the kernel or not in {dtype}"
    act = getattr(mlp, "act", None)
    mlp_apart = isinstance(act, SiluAndMul) and act.kernels is not None
    if not isinstance(act, nn.Identity) and not mlp_apart:
        return "SiLU-and-mul neither fused into the gate/up GEMM nor on the kernel"
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    shapes = [(getattr(m, "in_features", None), getattr(m, "out_features", None)) for m in linears]
    hidden, inter = spec.hidden_size, spec.intermediate_size
    gate_up = 2 * inter if mlp_apart else inter
    expected = [(hidden, spec.q_size + 2 * spec.kv_size), (spec.q_size, hidden), (hidden, gate_up), (inter, hidden)]
    if shapes != expected or any(getattr(m, "bias", None) is not None for m in linears[1:]):
        return "linears of other shapes, or a bias past qkv"
    bias = getattr(linears[0], "bias", None)
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return f"a qkv bias not in {dtype}"
    qk_norms = (q_norm, k_norm) if q_norm is not None and k_norm is not None else None
    weights = _LayerWeights(spec, input_norm, post_norm, bias, qk_norms, linears, mlp_apart)
    return weights if weights.fits() else "a linear off pagellm's GEMMs"


# The call's tensor-parallel fields without tensor parallelism (one rank).
_ONE_RANK = (None, None, None, 0, 0.0, 0, 1)


def _cache_addresses(kv_caches: list[KVCache]) -> tuple[int, ...]:
    """Where each layer's key and value caches live (the worker allocates them once)."""
    return tuple([t.data_ptr() for pair in kv_caches for t in pair])


class FusedDecoderStack:
    """Runs a model's decoder layers in one kernel call (see the module docstring)."""

    def __init__(
        self, weights: list[_LayerWeights], arch: ModelArchConfig, lib: KernelLibrary, dtype: torch.dtype,
        tp: TensorParallel | None = None,
    ) -> None:
        if tp is not None and tp.shm is None:
            raise ValueError("the one-call decoder stack joins tensor-parallel ranks through shared memory only")
        self.weights = weights
        self.tp = tp  # this rank's share of each layer (``arch`` is the share's)
        self.arch = arch
        self.kernels = lib
        self.dtype = dtype
        self.windows = tuple(w.spec.window for w in weights)  # each layer's sliding window (None: all)
        # Gate/up apart from SiLU-and-mul (an --enable-lora engine): in every layer, in any.
        self.mlp_apart = all(w.mlp_apart for w in weights)
        self._gate_up_scratch = any(w.mlp_apart for w in weights)
        self.eps = float(arch.rms_norm_eps)
        self.steps = 0  # steps run here (the rest ran the Python layers)
        # Per-layer C structs of each side (small batches, big ones) for the caches at these
        # addresses (None: those caches do not fit the call). The weights do not move: the model
        # is loaded and repacked before the stack is built, and a reload builds a new stack.
        self._args: tuple[tuple[int, ...], dict[bool, ctypes.Array[DecoderLayerArgs]] | None] | None = None
        self._parts: list[LinearArgs] = []

    @classmethod
    def build(
        cls, layers: nn.ModuleList, arch: ModelArchConfig, lib: KernelLibrary, tp: TensorParallel | None = None,
    ) -> FusedDecoderStack | None:
        """The stack for these layers (``arch``: a tensor-parallel rank's share, under ``tp``),
        or None where any layer does not fit the call (logged once, naming the first such layer
        and why)."""
        dtype = layers[0].post_attention_layernorm.weight.dtype if len(layers) else None
        if dtype not in DTYPE_CODES:
            logger.info("decoder: module by module (no kernels for %s)", dtype)
            return None
        weights = []
        for layer in layers:
            fit = _layer_weights(layer, dtype)
            if isinstance(fit, str):
                logger.info("decoder: module by module (layer %d: %s, which the one-call stack lacks)",
                            layer.spec.index, fit)  # fmt: skip
                return None
            weights.append(fit)
        logger.info("decoder: one C++ call for %d layers", len(weights))
        return cls(weights, arch, lib, dtype, tp)

    def fits(self, hidden: torch.Tensor, kv_caches: list[KVCache]) -> bool:
        """Whether the call takes these rows (in the model dtype) over these caches (a pair per
        layer, of one shape and dtype the kernels read, laid out as the model's KV heads);
        checked once per set of caches (once per engine). Which rows' attention the kernel
        takes is the step route's decision (:func:`pagellm.model.step_route.route_step`)."""
        if hidden.shape[0] == 0 or hidden.dtype != self.dtype or len(kv_caches) != len(self.weights):
            return False
        addresses = _cache_addresses(kv_caches)
        if self._args is None or self._args[0] != addresses:
            self._args = (addresses, self._build_args(kv_caches) if self._caches_fit(kv_caches) else None)
        return self._args[1] is not None

    def layer_args(self, big_batch: bool) -> ctypes.Array[DecoderLayerArgs]:
        """The per-layer arguments over the caches :meth:`fits` took (``big_batch``: the
        quantized linears' side for batches above the plan's ``quant_max_rows``)."""
        sides = self._args[1] if self._args is not None else None
        if sides is None:
            raise RuntimeError("layer_args before fits() took the caches")
        return sides[big_batch]

    def _caches_fit(self, kv_caches: list[KVCache]) -> bool:
        key_cache = kv_caches[0][0]
        layout = (self.arch.num_key_value_heads, kv_row_width(self.arch.head_dim, key_cache.dtype))
        return (
            (self.dtype, key_cache.dtype) in CACHE_CODES
            and key_cache.dim() == 4 and tuple(key_cache.shape[2:]) == layout
            and all(
                t.is_contiguous() and t.shape == key_cache.shape and t.dtype == key_cache.dtype
                for pair in kv_caches for t in pair
            )
        )  # fmt: skip

    def _build_args(self, kv_caches: list[KVCache]) -> dict[bool, ctypes.Array[DecoderLayerArgs]]:
        """Each side's C structs over these caches (``True``: batches above ``quant_max_rows``)."""
        sides, self._parts = {}, []  # (the later parts of multi-part linears, which the structs point to)
        for dense in (False, True):
            layers = [w.args(k, v, dense, self._parts) for w, (k, v) in zip(self.weights, kv_caches)]
            sides[dense] = (DecoderLayerArgs * len(layers))(*layers)
        return sides

    def takes(self, lora: LoRAStep | None) -> bool:
        """Whether the call can add this step's adapters (None: none): each group a run of
        rows on pagellm's LoRA kernel, every layer's gate and up apart from the activation."""
        return lora is None or (lora.in_stack and self.mlp_apart)

    def __call__(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[KVCache],
        layers: ctypes.Array[DecoderLayerArgs], metadata: AttentionMetadata, lora: LoRAStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(last layer's output, residual stream)`` for embeddings ``hidden`` [T, hidden]
        (overwritten), as the Python layers return them; ``layers``: :meth:`layer_args`;
        ``lora``: the step's adapters (where :meth:`takes` them)."""
        arch = self.arch
        tokens = hidden.shape[0]
        key_cache = kv_caches[0][0]
        rows = checked_kernel_rows(metadata, key_cache)
        if rows.num_tokens != tokens or metadata.slot_mapping.numel() != tokens:
            raise ValueError(f"hidden has {tokens} tokens but the metadata has {rows.num_tokens} "
                             f"({metadata.slot_mapping.numel()} slots)")  # fmt: skip
        x = hidden.contiguous()
        cos, sin = cos.to(self.dtype).contiguous(), sin.to(self.dtype).contiguous()
        if cos.shape != (tokens, arch.rotary_dim) or sin.shape != cos.shape:
            raise ValueError(f"cos/sin must be [{tokens}, {arch.rotary_dim}]")
        residual = torch.empty_like(x)
        scratch = [torch.empty(tokens, width, dtype=self.dtype) for width in
                   (arch.hidden_size, arch.q_size + 2 * arch.kv_size, arch.q_size, arch.intermediate_size)]  # fmt: skip
        tables = rows.block_tables
        row_start = torch.empty(rows.row_token.numel(), dtype=torch.int32)  # the call's scratch per window
        tp_args, tp_scratch = self._tensor_parallel_args(tokens)
        gate_up = torch.empty(tokens, 2 * arch.intermediate_size, dtype=self.dtype) if self._gate_up_scratch else None
        lora_args, lora_groups = self._lora_args(lora, tokens)
        args = DecoderStackArgs(
            layers, len(self.weights), tokens, arch.hidden_size, arch.num_attention_heads,
            arch.num_key_value_heads, arch.head_dim, arch.intermediate_size, key_cache.shape[1], self.eps,
            0.0, DTYPE_CODES[self.dtype], CACHE_CODES[(self.dtype, key_cache.dtype)],
            torch.get_num_threads(), 0, x.data_ptr(), residual.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            metadata.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0), rows.row_token.data_ptr(),
            rows.row_req.data_ptr(), row_start.data_ptr(), rows.row_ctx.data_ptr(),
            rows.row_token.numel(),
            *(t.data_ptr() for t in scratch), *tp_args, None if gate_up is None else gate_up.data_ptr(), *lora_args,
        )  # fmt: skip
        self.kernels.decoder_stack(args)
        del tp_scratch, gate_up, lora_groups  # alive until the call returned
        self.steps += 1
        return x, residual

    def _lora_args(self, lora: LoRAStep | None, tokens: int) -> tuple[tuple[object, ...], torch.Tensor | None]:
        """The call's LoRA fields (``lora``, ``lora_groups``, ``num_lora_groups``) and the
        tensor they point to."""
        if lora is None:
            return (None, None, 0), None
        if not self.takes(lora):
            raise ValueError("these adapters' rows are not runs of rows on pagellm's LoRA kernel, or an MLP is fused")
        slots = lora.slots
        groups = lora.group_array()
        if any(not 0 <= slot < slots.max_loras or not 0 <= rows.start <= rows.stop <= tokens for slot, rows in lora.groups):
            raise ValueError(f"LoRA groups outside the step's {tokens} rows or {slots.max_loras} slots")
        linears = slots.stack_args([w.spec.index for w in self.weights])
        return (linears, groups.data_ptr(), groups.shape[0]), groups

    def _tensor_parallel_args(self, tokens: int) -> tuple[tuple[object, ...], torch.Tensor | None]:
        """The call's tensor-parallel fields, and the float32 scratch they point to (bf16)."""
        if self.tp is None or self.tp.shm is None:
            return _ONE_RANK, None
        shm = self.tp.shm
        scratch = torch.empty(tokens, self.arch.hidden_size) if self.dtype == torch.bfloat16 else None
        fields = (shm.region.data_ptr(), shm.counter.data_ptr(), None if scratch is None else scratch.data_ptr(),
                  shm.slot_elems, shm.timeout_s, self.tp.rank, self.tp.size)  # fmt: skip
        return fields, scratch
