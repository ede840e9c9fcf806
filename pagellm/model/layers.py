"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, SiLU-and-mul.

Each one mirrors Hugging Face's arithmetic (same dtype casts, same order of operations)
so that float32 outputs match the reference implementation to rounding noise.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm import kernels
from pagellm.utils import usable_cpu_flags

SUPPORTED_ROPE_TYPES = ("default", "llama3")


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back like HF's LlamaRMSNorm.

    ``forward(x, residual)`` also does the residual add that precedes every norm of a decoder
    (vLLM's fused_add_rms_norm): it returns ``(norm(x + residual), x + residual)``. With
    ``use_kernel`` (bf16 on CPU, set by ``optimize_for_cpu_inference``) both run in one C++
    pass that updates ``residual`` in place; the sum is rounded exactly as a separate add.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_kernel = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.use_kernel and x.dim() == 2 and x.is_contiguous() and x.dtype == self.weight.dtype:
            out = kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` on a fused ``[..., 2 * d]`` gate_up projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    """Fail early (before weights load) on rope scaling variants we do not implement."""
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies, computed exactly as HF does (float32)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1 frequency rescaling: slow down low frequencies, blend the middle band."""
    factor = float(rope_scaling["factor"])
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_context_len = float(rope_scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies for the configured rope variant."""
    check_rope_scaling(rope_scaling)
    inv_freq = default_inv_freq(head_dim, theta)
    if rope_scaling is not None and rope_scaling.get("rope_type") == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Produces per-token cos/sin tables from absolute positions (any position, no cache limit).

    The inverse frequencies are a plain attribute, not a buffer, so a model built on the
    meta device and materialized with ``to_empty`` still gets correct values.
    """

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.rope_scaling = rope_scaling
        check_rope_scaling(rope_scaling)
        self._inv_freq: torch.Tensor | None = None

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = compute_inv_freq(self.head_dim, self.theta, self.rope_scaling).to(device)
        return self._inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[T, head_dim]`` (halves duplicated, HF layout) in ``dtype``."""
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq_on(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (the HF "rotate half" convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, use_kernel: bool) -> torch.Tensor:
    """``apply_rotary`` that may work in place (one C++ pass with ``use_kernel``); returns the result."""
    if use_kernel and x.dtype == cos.dtype and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        kernels.rotary_(x, cos, sin)
        return x
    return apply_rotary(x, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([T, heads, D]) by per-token ``cos``/``sin`` ([T, D])."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


# ---- pre-packed linear layers for CPU inference -----------------------------------------------
# bf16 on CPUs with AVX-512 BF16: pagellm's own GEMM, on AMX tiles where there are some
# (KernelLinear, ...); otherwise (fp16, no AVX-512 BF16, a bias) oneDNN with the weight packed
# once (PackedLinear, ...).

_PACKED_DTYPES = (torch.bfloat16, torch.float16)


def _packed_ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def packed_ops_supported(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear ops exist and run for ``dtype`` on this CPU.

    They exist in every CPU build of torch, but a bf16 weight reorder needs AVX-512 (BW/VL/DQ)
    or AVX-NE-CONVERT: on an AVX2-only CPU it raises. Probed on a tiny weight (microseconds).
    """
    if not _packed_ops_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """A CPU ``nn.Linear`` whose bf16/fp16 weight is packed once into oneDNN's blocked layout.

    ``F.linear`` on bf16 CPU tensors already runs oneDNN, but repacks the weight on every call;
    packing once saves that (about 20% of a decode step's matmul time at batch 64, less for big
    prefill batches) and gives bit-identical results. Inference only (no autograd through the
    packed weight); the packed tensor is an attribute, not a parameter, so it is not in the
    state dict.
    """

    def __init__(self, linear: nn.Linear, batch_size_hint: int = 64) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            out = self.forward(x.reshape(-1, shape[-1]))
            return out.view(*shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedSiluAndMulLinear(nn.Module):
    """``silu(x @ W_gate.T) * (x @ W_up.T)`` from a fused gate_up ``nn.Linear``, as two packed
    oneDNN matmuls with the activation and the product done in their epilogues.

    Replaces ``SiluAndMul()(gate_up_proj(x))``: no [T, 2 * intermediate] intermediate and no
    separate elementwise passes (about 20% of the MLP's time on a 2048-token prefill step).
    The epilogues work on float32 accumulators, so results differ from the unfused bf16 chain
    by at most about one bf16 rounding step.
    """

    def __init__(self, gate_up: nn.Linear, intermediate_size: int, batch_size_hint: int = 64) -> None:
        super().__init__()
        self.in_features = gate_up.in_features
        self.out_features = intermediate_size
        weight = gate_up.weight.detach()
        bias = None if gate_up.bias is None else gate_up.bias.detach()
        self.gate_weight = torch.ops.mkldnn._reorder_linear_weight(weight[:intermediate_size].contiguous(), batch_size_hint)
        self.up_weight = torch.ops.mkldnn._reorder_linear_weight(weight[intermediate_size:].contiguous(), batch_size_hint)
        self.gate_bias = None if bias is None else bias[:intermediate_size].clone()
        self.up_bias = None if bias is None else bias[intermediate_size:].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)
        gate = torch.ops.mkldnn._linear_pointwise(x, self.gate_weight, self.gate_bias, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.up_weight, self.up_bias, "mul")


class _KernelGemmLinear(nn.Module):
    """A linear layer on pagellm's GEMM (:func:`kernels.gemm_bf16`) with a weight packed once."""

    epilogue = "none"

    def __init__(self, in_features: int, out_features: int, packed_weight: torch.Tensor, amx: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.packed_weight = packed_weight
        self.amx = amx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)
        return kernels.gemm_bf16(x, self.packed_weight, self.out_features, self.epilogue, self.amx)

    def extra_repr(self) -> str:
        isa = "amx" if self.amx else "avx512_bf16"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False, {isa}"


class KernelLinear(_KernelGemmLinear):
    """A bias-free bf16 CPU ``nn.Linear`` on pagellm's GEMM: AMX tiles where the CPU has them,
    else AVX-512 BF16 dot products. Faster than oneDNN up to a few hundred rows; at 2048 rows
    plain ``F.linear`` is up to 1.5x faster on AMX (``benchmarks/NOTES.md``, 19-20). Its sums
    are oneDNN's up to the last bit of about one output in 5,000. The weight is held only in
    the packed layout.
    """

    def __init__(self, linear: nn.Linear, amx: bool = False) -> None:
        weight = linear.weight.detach()
        super().__init__(linear.in_features, linear.out_features, kernels.pack_gemm_weight(weight, amx), amx)


class KernelSiluAndMulLinear(_KernelGemmLinear):
    """``silu(x @ W_gate.T) * (x @ W_up.T)`` in one pass of pagellm's GEMM, whose epilogue
    rounds gate, up and silu(gate) to bf16 in turn like the unfused bf16 ops."""

    epilogue = "silu_mul"

    def __init__(self, gate_up: nn.Linear, intermediate_size: int, amx: bool = False) -> None:
        weight = gate_up.weight.detach()
        packed = kernels.pack_silu_mul_weight(weight[:intermediate_size], weight[intermediate_size:])
        super().__init__(gate_up.in_features, intermediate_size, packed, amx)


GEMM_CHOICES = ("auto", "pagellm", "onednn")


def kernel_gemm_mode(gemm: str = "auto") -> str | None:
    """Which of pagellm's GEMM paths bf16 linears take: "amx", "avx512" or None (oneDNN).

    ``auto`` and ``pagellm``: AMX tiles where this process may use them, else AVX-512 BF16 dot
    products; but ``auto`` leaves a CPU that has AMX which the kernels cannot use to oneDNN,
    which then is 3-4x faster than dot products (``benchmarks/NOTES.md``, 19).
    """
    if gemm not in GEMM_CHOICES:
        raise ValueError(f"gemm must be one of {GEMM_CHOICES}, got {gemm!r}")
    if gemm == "onednn" or not kernels.gemm_available():
        return None
    if kernels.gemm_amx_available():
        return "amx"
    return "avx512" if gemm == "pagellm" or "amx_bf16" not in usable_cpu_flags() else None


def _kernel_gemm_fits(linear: nn.Module, mode: str | None) -> bool:
    """Whether pagellm's GEMM (``mode`` from :func:`kernel_gemm_mode`) replaces this layer: a
    bias-free bf16 CPU ``nn.Linear`` whose input width the path takes (AMX: a multiple of 32)."""
    if mode is None:
        return False
    multiple = kernels.GEMM_AMX_K_MULTIPLE if mode == "amx" else 2
    return (
        type(linear) is nn.Linear
        and linear.bias is None
        and linear.weight.device.type == "cpu"
        and linear.weight.dtype == torch.bfloat16
        and linear.in_features % multiple == 0
    )


def _close_to(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to bf16 rounding noise (a broken kernel build is off by far more)."""
    return bool(torch.allclose(got.float(), expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()) + 1e-3))


def _probe(linear: nn.Linear) -> torch.Tensor:
    return torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)


def fuse_silu_and_mul(
    gate_up: nn.Module, intermediate_size: int, verify: bool = True, gemm: str = "auto"
) -> nn.Module | None:
    """The fused replacement for ``SiluAndMul()(gate_up(x))``, or None where it does not apply:
    pagellm's GEMM where it fits (``gemm`` as in :func:`kernel_gemm_mode`), else two oneDNN
    matmuls with fused epilogues.

    ``verify`` runs a small numerical self-check (once per model is enough)."""
    if type(gate_up) is not nn.Linear or gate_up.out_features != 2 * intermediate_size:
        return None
    fused: nn.Module
    try:
        mode = kernel_gemm_mode(gemm)
        if _kernel_gemm_fits(gate_up, mode):
            fused = KernelSiluAndMulLinear(gate_up, intermediate_size, amx=mode == "amx")
        elif (
            _packed_ops_available()
            and gate_up.weight.device.type == "cpu"
            and gate_up.weight.dtype in _PACKED_DTYPES
        ):
            fused = PackedSiluAndMulLinear(gate_up, intermediate_size)
        else:
            return None
        if not verify:
            return fused
        x = _probe(gate_up)
        with torch.no_grad():
            expected = SiluAndMul()(F.linear(x.float(), gate_up.weight.float(), None if gate_up.bias is None else gate_up.bias.float()))
            if not _close_to(fused(x), expected):
                return None
    except (RuntimeError, TypeError):
        return None
    return fused


def _packs_exactly(linear: nn.Linear) -> bool:
    """Self-check on a few rows: the packed op must reproduce ``F.linear`` bit for bit."""
    try:
        packed = PackedLinear(linear, batch_size_hint=4)
        x = _probe(linear)
        with torch.no_grad():
            return bool(torch.equal(packed(x), F.linear(x, linear.weight, linear.bias)))
    except (RuntimeError, TypeError):
        return False


def _kernel_gemm_works(linear: nn.Linear, amx: bool) -> bool:
    """Self-check of pagellm's GEMM on a few rows of one layer."""
    try:
        x = _probe(linear)
        with torch.no_grad():
            return _close_to(KernelLinear(linear, amx)(x), F.linear(x.float(), linear.weight.float()))
    except (RuntimeError, TypeError):
        return False


def pack_linear_layers(model: nn.Module, batch_size_hint: int = 64, gemm: str = "auto") -> int:
    """Replace every bf16/fp16 CPU ``nn.Linear`` in ``model``, in place, by a :class:`KernelLinear`
    where pagellm's GEMM fits (``gemm`` as in :func:`kernel_gemm_mode`), else by a oneDNN
    :class:`PackedLinear`.

    Returns how many were replaced (0 for float32 weights, which keep torch's default path and
    its exact numerics, off the CPU, or where neither fast path is available here).
    Tied weights (lm_head sharing the embedding) get their own packed copy.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in _PACKED_DTYPES
    ]
    if not targets:
        return 0
    mode = kernel_gemm_mode(gemm)
    first_fit = next((module for _, module in targets if _kernel_gemm_fits(module, mode)), None)
    use_kernel = first_fit is not None and _kernel_gemm_works(first_fit, mode == "amx")
    use_packed = _packed_ops_available() and _packs_exactly(targets[0][1])
    replaced = 0
    for name, module in targets:
        if use_kernel and _kernel_gemm_fits(module, mode):
            new: nn.Module = KernelLinear(module, amx=mode == "amx")
        elif use_packed:
            new = PackedLinear(module, batch_size_hint)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        replaced += 1
    return replaced
