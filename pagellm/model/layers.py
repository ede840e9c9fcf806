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

from pagellm.kernels import KernelLibrary, supports_dtype
from pagellm.model.derived_params import DerivedParams
from pagellm.model.rope_config import yarn_mscale

SUPPORTED_ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope", "yarn")


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back like HF's LlamaRMSNorm.

    ``forward(x, residual)`` also does the residual add that precedes every norm of a decoder
    (vLLM's fused_add_rms_norm): it returns ``(norm(x + residual), x + residual)``. With a
    kernel library (the plan's ``norm="kernel"``) both run in one C++ pass that updates
    ``residual`` in place; the sum is rounded exactly as a separate add.
    """

    def __init__(self, hidden_size: int, eps: float, lib: KernelLibrary | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels = lib

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._on_kernel(x) and x.dim() == 2 and x.is_contiguous():
            assert self.kernels is not None
            out = self.kernels.add_rms_norm(x, residual, self._kernel_weight(), self.eps)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def norm_heads_(self, x: torch.Tensor) -> None:
        """Norm each head of ``x`` ([T, heads, D], a view into a wider row) in place: on the
        kernel without copying the heads out (the same rows :meth:`forward` gives), else
        through :meth:`forward` and back."""
        if self._on_kernel(x):
            assert self.kernels is not None
            self.kernels.head_rms_norm_(x, self._kernel_weight(), self.eps)
        else:
            x.copy_(self(x.reshape(-1, x.shape[-1])).view(x.shape))

    def _on_kernel(self, x: torch.Tensor) -> bool:
        return self.kernels is not None and x.dtype == self.weight.dtype and supports_dtype(x.dtype)

    def _kernel_weight(self) -> torch.Tensor:
        """What the kernel multiplies by: the weight itself (Llama's order)."""
        return self.weight


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's (and Qwen3.5's) RMSNorm: scales by ``1 + weight`` (weights stored around 0), the
    product taken in float32 before the cast back, as HF's Gemma2RMSNorm does. On the kernel
    where ``lib``, with ``1 + weight`` in float32 as its scale (the same order: normed values
    are not rounded before the product)."""

    def __init__(self, hidden_size: int, eps: float, lib: KernelLibrary | None = None) -> None:
        super().__init__(hidden_size, eps, lib)
        self._scale = DerivedParams()  # 1 + weight, float32

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)

    def _kernel_weight(self) -> torch.Tensor:
        """``1 + weight`` in float32, taken again whenever the weight is loaded or replaced."""
        return self._scale.get((self.weight,), lambda: (1.0 + self.weight.float(),))[0]


def make_rms_norm(hidden_size: int, eps: float, unit_offset: bool, lib: KernelLibrary | None) -> RMSNorm:
    """The family's RMSNorm, Gemma's (``unit_offset``) or Llama's, on the kernel where ``lib``."""
    return UnitOffsetRMSNorm(hidden_size, eps, lib) if unit_offset else RMSNorm(hidden_size, eps, lib)


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` on a fused ``[..., 2 * d]`` gate_up projection output; on the kernel
    where ``kernels`` is given (the GEMMs' silu_mul epilogue run apart: the bits the one-call
    decoder stack computes), else torch."""

    def __init__(self, kernels: KernelLibrary | None = None) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu":
            return self.kernels.silu_mul(x.contiguous())
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` (GeGLU, Gemma's ``gelu_pytorch_tanh``) on a fused gate_up output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class ClampedSwiGLU(nn.Module):
    """gpt-oss's gated activation on a fused ``[gate | up]`` output: the gate capped at ``limit``
    and the up part within ``±limit``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    def __init__(self, limit: float, alpha: float) -> None:
        super().__init__()
        self.limit, self.alpha = limit, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# HF activation name -> the gated activation over a fused gate_up output.
GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


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


def yarn_inv_freq(head_dim: int, theta: float, rope_scaling: dict[str, Any], max_position: int) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies by ``factor``, keep the high ones,
    a linear ramp between the dimensions that turn ``beta_slow`` and ``beta_fast`` times over the
    original context (HF's arithmetic, float32)."""
    factor = _scale_factor(rope_scaling, max_position)
    original = float(rope_scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = rope_scaling.get("beta_fast") or 32, rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the extrapolated (unscaled) share of each frequency
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def longrope_inv_freq(head_dim: int, theta: float, rope_scaling: dict[str, Any], long: bool) -> torch.Tensor:
    """LongRoPE (Phi-3): each frequency divided by its own factor, the short list within the
    original context, the long one beyond it (HF's arithmetic, float32)."""
    factors = torch.tensor(rope_scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (factors * theta**shape)


def _scale_factor(rope_scaling: dict[str, Any], max_position: int) -> float:
    """YaRN's and LongRoPE's context factor: given, else the context's growth over the original."""
    factor = rope_scaling.get("factor")
    return max_position / rope_scaling["original_max_position_embeddings"] if factor is None else float(factor)


def rope_attention_factor(rope_scaling: dict[str, Any] | None, max_position: int) -> float:
    """What the cos/sin tables are multiplied by: YaRN's and LongRoPE's attention temperature, else 1."""
    rope_type = (rope_scaling or {}).get("rope_type")
    if rope_scaling is None or rope_type not in ("yarn", "longrope"):
        return 1.0
    given = rope_scaling.get("attention_factor")
    if given is not None:
        return float(given)
    if rope_type == "longrope":
        factor = _scale_factor(rope_scaling, max_position)
        original = rope_scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor, mscale, mscale_all_dim = _scale_factor(rope_scaling, max_position), rope_scaling.get("mscale"), \
        rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def dynamic_ntk_inv_freq(head_dim: int, theta: float, factor: float, max_position: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK scaling: the base grows with the sequence's length once it passes the
    context, one row of frequencies per entry of ``seq_lens`` ([N] -> [N, head_dim / 2]); HF's
    float32 arithmetic, element by element."""
    length = torch.clamp(seq_lens.to(torch.int64), min=max_position)
    base = theta * ((factor * length / max_position) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=seq_lens.device, dtype=torch.float) / head_dim
    return 1.0 / (base[:, None] ** exponents[None, :])


def compute_inv_freq(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None, max_position: int = 2048
) -> torch.Tensor:
    """Inverse frequencies for the configured rope variant."""
    check_rope_scaling(rope_scaling)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "yarn":
        return yarn_inv_freq(head_dim, theta, rope_scaling or {}, max_position)
    if rope_type == "longrope":  # within the original context; RotaryEmbedding switches beyond it
        return longrope_inv_freq(head_dim, theta, rope_scaling or {}, long=False)
    # (dynamic: the plain frequencies within the context; RotaryEmbedding rescales beyond it)
    inv_freq = default_inv_freq(head_dim, theta)
    if rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, rope_scaling or {})
    elif rope_type == "linear":
        inv_freq = inv_freq / float((rope_scaling or {})["factor"])
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Produces per-token cos/sin tables from absolute positions (any position, no cache limit).

    The inverse frequencies are a plain attribute, not a buffer, so a model built on the
    meta device and materialized with ``to_empty`` still gets correct values. Rows for
    positions are looked up in a table of every position so far (grown by doubling): one
    gather a step instead of six small ops, with the same values (each row is computed alone).
    """

    def __init__(
        self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None, max_position: int = 2048
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.rope_scaling = rope_scaling
        self.max_position = max_position  # YaRN without a factor derives it from this
        check_rope_scaling(rope_scaling)
        self.attention_factor = rope_attention_factor(rope_scaling, max_position)
        # LongRoPE: positions from the original context on turn at the long factors' frequencies.
        longrope = rope_scaling is not None and rope_scaling.get("rope_type") == "longrope"
        self.long_from = int(rope_scaling["original_max_position_embeddings"]) if longrope else None  # type: ignore[index]
        # Dynamic NTK: each token turns by the base of its sequence's length in the step that
        # computes it (as HF's per-forward update does for one sequence), beyond the context.
        dynamic = rope_scaling is not None and rope_scaling.get("rope_type") == "dynamic"
        self.dynamic_factor = float(rope_scaling["factor"]) if dynamic else None  # type: ignore[index]
        self._inv_freq: torch.Tensor | None = None
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}  # cos, sin

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = compute_inv_freq(self.head_dim, self.theta, self.rope_scaling, self.max_position).to(device)
        return self._inv_freq

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``positions`` computed directly: ``[T, head_dim]`` (halves duplicated, HF
        layout); under dynamic NTK, ``seq_lens`` (each token's sequence length) sets the base."""
        inv_freq = self._inv_freq_on(positions.device)[None, :]
        if self.long_from is not None:
            long = longrope_inv_freq(self.head_dim, self.theta, self.rope_scaling or {}, long=True).to(positions.device)
            inv_freq = torch.where((positions >= self.long_from)[:, None], long[None, :], inv_freq)
        if self.dynamic_factor is not None and seq_lens is not None:
            scaled = dynamic_ntk_inv_freq(self.head_dim, self.theta, self.dynamic_factor, self.max_position, seq_lens)
            inv_freq = torch.where((seq_lens > self.max_position)[:, None], scaled, inv_freq)
        freqs = positions.to(torch.float32)[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[T, head_dim]`` in ``dtype``, equal to :meth:`cos_sin`'s (dynamic
        NTK: ``seq_lens``, given where a sequence has passed the context, sets each token's base)."""
        if seq_lens is not None:
            return self.cos_sin(positions, dtype, seq_lens)
        if positions.numel() == 0:
            return self.cos_sin(positions, dtype)
        key = (positions.device, dtype)
        tables = self._tables.get(key)
        last = int(positions.max())
        if tables is None or last >= tables[0].shape[0]:
            tables = self._tables[key] = self.cos_sin(torch.arange(1 << max(8, last.bit_length()), device=positions.device), dtype)
        return tables[0][positions], tables[1][positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (the HF "rotate half" convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lib: KernelLibrary | None) -> torch.Tensor:
    """``apply_rotary`` over each head's first ``cos.shape[-1]`` dims (all, or fewer: partial
    rotary; the rest pass), in place where it can (one C++ pass with a kernel library); returns
    the result."""
    if (
        lib is not None
        and x.dtype == cos.dtype
        and supports_dtype(x.dtype)
        and x.stride(-1) == 1
        and x.stride(-2) == x.shape[-1]
    ):
        lib.rotary_(x, cos, sin)
        return x
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    x[..., :rotary_dim] = apply_rotary(x[..., :rotary_dim], cos, sin)
    return x


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([T, heads, D]) by per-token ``cos``/``sin`` ([T, D])."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)
