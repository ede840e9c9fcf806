"""Linear layers packed once for CPU inference, on the GEMM the kernel plan names.

bf16 on CPUs with AVX-512 BF16: pagellm's own GEMM, on AMX tiles where there are some
(:class:`KernelLinear`, ...); on AVX2-only CPUs pagellm's AVX2 GEMM for bf16 and float32
weights; otherwise (fp16, a bias on AVX-512, no pagellm GEMM) oneDNN with the weight packed once
(:class:`PackedLinear`, ...). float32 elsewhere keeps ``F.linear``. The choice is the plan's
(``KernelPlan.gemm``); the functions here only carry it out, with a numerical self-check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm import kernels
from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.packing import AVX2_PANEL_COLS, SILU_MUL_HALF_COLS, gemm_epilogue
from pagellm.kernels.plan import OWN_GEMM_PATHS, KernelPlan
from pagellm.model.layers import SiluAndMul

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


def _pack(weight: torch.Tensor, path: str, lib: KernelLibrary) -> torch.Tensor:
    if weight.dtype != torch.bfloat16:
        return kernels.pack_avx2_weight(weight)
    return lib.pack_pairs(weight, AVX2_PANEL_COLS if path == "avx2" else gemm_epilogue("none", path == "amx")[1])


def _pack_silu_mul(gate: torch.Tensor, up: torch.Tensor, path: str, lib: KernelLibrary) -> torch.Tensor:
    if gate.dtype != torch.bfloat16:
        return kernels.pack_avx2_silu_mul_weight(gate, up)
    return lib.pack_pairs(gate, AVX2_PANEL_COLS if path == "avx2" else 2 * SILU_MUL_HALF_COLS, up)


class _KernelGemmLinear(nn.Module):
    """A linear layer on one of pagellm's GEMMs (``path``: amx, avx512-bf16 or avx2) with its
    weight packed once. The AVX2 path also takes float32 weights, and a bias (added after)."""

    epilogue = "none"

    def __init__(
        self, in_features: int, out_features: int, packed_weight: torch.Tensor, bias: torch.Tensor | None,
        lib: KernelLibrary, path: str,
    ) -> None:
        super().__init__()
        if path not in OWN_GEMM_PATHS:
            raise ValueError(f"path must be one of {OWN_GEMM_PATHS}, got {path!r}")
        if bias is not None and path != "avx2":
            raise ValueError(f"the {path} GEMM takes no bias (oneDNN's PackedLinear does)")
        self.in_features = in_features
        self.out_features = out_features
        self.packed_weight = packed_weight
        self.bias = bias
        self.kernels = lib
        self.path = path

    @classmethod
    def from_packed(
        cls, in_features: int, out_features: int, packed_weight: torch.Tensor, lib: KernelLibrary, path: str
    ) -> _KernelGemmLinear:
        """The layer over a weight already in ``path``'s packed layout (bias-free)."""
        layer = cls.__new__(cls)
        _KernelGemmLinear.__init__(layer, in_features, out_features, packed_weight, None, lib, path)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)
        if self.path != "avx2":
            return self.kernels.gemm_bf16(x, self.packed_weight, self.out_features, self.epilogue, self.path == "amx")
        out = self.kernels.gemm_avx2(x, self.packed_weight, self.out_features, self.epilogue)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {self.path}"


class KernelLinear(_KernelGemmLinear):
    """A CPU ``nn.Linear`` on pagellm's GEMM, the weight held only in the packed layout.

    ``amx`` / ``avx512-bf16`` (bias-free bf16): AMX tiles or AVX-512 BF16 dot products, faster
    than oneDNN up to a few hundred rows (at 2048 rows plain ``F.linear`` is up to 1.5x faster
    on AMX, ``benchmarks/NOTES.md``, 19-20); its sums are oneDNN's up to the last bit of about
    one output in 5,000. ``avx2``: float32 or bf16 weights widened in registers, float32 FMAs in
    k order; a bias is added to the rounded product (a bf16 output rounds twice where
    ``F.linear`` rounds once).
    """

    def __init__(self, linear: nn.Linear, lib: KernelLibrary, path: str = "avx512-bf16") -> None:
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        super().__init__(linear.in_features, linear.out_features, _pack(weight, path, lib), bias, lib, path)


class KernelSiluAndMulLinear(_KernelGemmLinear):
    """``silu(x @ W_gate.T) * (x @ W_up.T)`` in one pass of pagellm's GEMM, whose epilogue
    rounds gate, up and silu(gate) to bf16 in turn like the unfused bf16 ops (bias-free)."""

    epilogue = "silu_mul"

    def __init__(self, gate_up: nn.Linear, intermediate_size: int, lib: KernelLibrary, path: str = "avx512-bf16") -> None:
        weight = gate_up.weight.detach()
        packed = _pack_silu_mul(weight[:intermediate_size], weight[intermediate_size:], path, lib)
        super().__init__(gate_up.in_features, intermediate_size, packed, None, lib, path)


def kernel_gemm_fits(linear: nn.Module, path: str, with_bias: bool = False) -> bool:
    """Whether pagellm's GEMM (the plan's ``path``) replaces this CPU ``nn.Linear``: bias-free
    bf16 whose input width the path takes (AMX: a multiple of 32); on AVX2 also float32 weights,
    and a bias where ``with_bias`` (plain linears)."""
    if path not in OWN_GEMM_PATHS or type(linear) is not nn.Linear or linear.weight.device.type != "cpu":
        return False
    dtype, width = linear.weight.dtype, linear.in_features
    if path == "avx2":
        return (linear.bias is None or with_bias) and (dtype == torch.float32 or (dtype == torch.bfloat16 and width % 2 == 0))
    multiple = kernels.GEMM_AMX_K_MULTIPLE if path == "amx" else 2
    return linear.bias is None and dtype == torch.bfloat16 and width % multiple == 0


def _onednn_fits(linear: nn.Module, path: str) -> bool:
    """Whether oneDNN's packed ops take this layer: the plan's GEMM is oneDNN, or pagellm's
    where this layer does not fit it (a bias), for bf16/fp16 CPU weights."""
    return (
        path != "torch"
        and type(linear) is nn.Linear
        and linear.weight.device.type == "cpu"
        and linear.weight.dtype in _PACKED_DTYPES
        and _packed_ops_available()
    )


def _close_to(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to bf16 rounding noise (a broken kernel build is off by far more)."""
    return bool(torch.allclose(got.float(), expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()) + 1e-3))


def _probe(linear: nn.Linear) -> torch.Tensor:
    return torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)


def fuse_silu_and_mul(
    gate_up: nn.Module, intermediate_size: int, plan: KernelPlan, verify: bool = True
) -> nn.Module | None:
    """The fused replacement for ``SiluAndMul()(gate_up(x))``, or None where it does not apply:
    pagellm's GEMM where the plan names it and it fits, else two oneDNN matmuls with fused
    epilogues.

    ``verify`` runs a small numerical self-check (once per model is enough)."""
    if type(gate_up) is not nn.Linear or gate_up.out_features != 2 * intermediate_size:
        return None
    fused: nn.Module
    try:
        if plan.kernels is not None and kernel_gemm_fits(gate_up, plan.gemm):
            fused = KernelSiluAndMulLinear(gate_up, intermediate_size, plan.kernels, plan.gemm)
        elif _onednn_fits(gate_up, plan.gemm):
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


def _kernel_gemm_works(linear: nn.Linear, lib: KernelLibrary, path: str) -> bool:
    """Self-check of pagellm's GEMM on a few rows of one layer."""
    try:
        x = _probe(linear)
        bias = None if linear.bias is None else linear.bias.float()
        with torch.no_grad():
            return _close_to(KernelLinear(linear, lib, path)(x), F.linear(x.float(), linear.weight.float(), bias))
    except (RuntimeError, TypeError):
        return False


def pack_linear_layers(model: nn.Module, plan: KernelPlan, batch_size_hint: int = 64) -> int:
    """Replace the CPU ``nn.Linear`` layers of ``model``, in place, by a :class:`KernelLinear`
    where the plan names pagellm's GEMM and the layer fits it, else (bf16/fp16) by a oneDNN
    :class:`PackedLinear` (unless the plan's GEMM is ``torch``).

    Returns how many were replaced: none for float32 weights unless the plan's GEMM is AVX2
    (elsewhere they keep torch's GEMM and its exact numerics), off the CPU, or where neither
    fast path passes its self-check here. Tied weights (lm_head sharing the embedding) get
    their own packed copy.
    """
    dtypes = (*_PACKED_DTYPES, torch.float32) if plan.gemm == "avx2" else _PACKED_DTYPES
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in dtypes
    ]
    if not targets or plan.gemm == "torch":
        return 0
    first_fit = next((module for _, module in targets if kernel_gemm_fits(module, plan.gemm, True)), None)
    lib = plan.kernels
    use_kernel = first_fit is not None and lib is not None and _kernel_gemm_works(first_fit, lib, plan.gemm)
    use_packed = _onednn_fits(targets[0][1], plan.gemm) and _packs_exactly(targets[0][1])
    replaced = 0
    for name, module in targets:
        if use_kernel and lib is not None and kernel_gemm_fits(module, plan.gemm, True):
            new: nn.Module = KernelLinear(module, lib, plan.gemm)
        elif use_packed:
            new = PackedLinear(module, batch_size_hint)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        replaced += 1
    return replaced
