"""The gated feed-forward of the Llama family: a dense layer's MLP, and each expert of a
mixture-of-experts block (``pagellm.model.moe``)."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed.tensor_parallel import TensorParallel
from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.plan import KernelPlan
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.cpu_linear import fuse_silu_and_mul
from pagellm.model.layers import GATED_ACTIVATIONS, ClampedSwiGLU, SiluAndMul
from pagellm.model.lora import LoRAStep
from pagellm.model.quant_linear import linear_for_plan, quantized_plan


class LlamaMLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU for Gemma) with gate and up fused into one matmul."""

    def __init__(self, arch: ModelArchConfig, plan: KernelPlan | None = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp  # this rank's part of the intermediate width; the down projection's sums joined
        if arch.hidden_act not in GATED_ACTIVATIONS:
            raise NotImplementedError(f"hidden_act {arch.hidden_act!r} is not supported; supported: "
                                      f"{', '.join(GATED_ACTIVATIONS)}")  # fmt: skip
        self.intermediate_size = arch.intermediate_size
        # The kernels fuse SiLU-and-mul only (gpt-oss's clamped SwiGLU is another activation).
        self.silu = arch.hidden_act == "silu" and arch.swiglu_limit is None
        # Quantized: SiLU-and-mul runs in the integer GEMM's epilogue (bias-free MLPs); never
        # where adapters add to gate and up before the activation (``plan.lora``).
        self.lora = plan is not None and plan.lora
        fused = quantized_plan(plan) and not arch.mlp_bias and self.silu and not self.lora
        self.gate_up_proj = linear_for_plan(arch.hidden_size, 2 * arch.intermediate_size, arch.mlp_bias, plan, fused)
        # Apart for adapters, SiLU-and-mul runs on the kernel where the norms do (the bits the
        # one-call decoder stack computes).
        self.act: nn.Module = (
            nn.Identity() if fused
            else ClampedSwiGLU(arch.swiglu_limit, arch.swiglu_alpha) if arch.swiglu_limit is not None
            else SiluAndMul(_silu_kernels(plan)) if self.silu and self.lora and plan is not None
            else GATED_ACTIVATIONS[arch.hidden_act]()
        )  # fmt: skip
        self.down_proj = linear_for_plan(arch.intermediate_size, arch.hidden_size, arch.mlp_bias, plan)

    def shard_slices(self) -> dict[str, slice]:
        """Rows of ``gate_up_proj`` holding each of gate, up."""
        size = self.intermediate_size
        return {"gate": slice(0, size), "up": slice(size, 2 * size)}

    def forward(self, x: torch.Tensor, lora: LoRAStep | None = None, layer: int = 0) -> torch.Tensor:
        """``lora``: the step's adapters, added to gate/up and down of the rows that have one
        (this MLP being layer ``layer``'s)."""
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.add_(gate_up, x, layer, "gate_up_proj")
        hidden = self.act(gate_up)
        out = self.down_proj(hidden)
        if lora is not None:
            lora.add_(out, hidden, layer, "down_proj")
        return out if self.tp is None else self.tp.all_reduce_(out)

    def fuse_for_cpu(self, plan: KernelPlan, verify: bool = True) -> bool:
        """Swap gate_up + SiluAndMul for one fused packed module (bf16/fp16 on CPU); True if done
        (never for another activation: the GEMM's epilogue is SiLU's; nor where adapters add to
        gate and up)."""
        fused = fuse_silu_and_mul(self.gate_up_proj, self.intermediate_size, plan, verify) if self.silu and not self.lora else None
        if fused is None:
            return False
        self.gate_up_proj, self.act = fused, nn.Identity()
        return True


def _silu_kernels(plan: KernelPlan) -> KernelLibrary | None:
    """The library SiLU-and-mul runs on apart from gate/up: the norm's, where its build has the
    AVX2 kernels (a baseline build has none: torch runs it, and the Python layers run)."""
    lib = plan.library("norm")
    return lib if lib is not None and lib.gemm_avx2_available else None
