"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router picks each token's top-k
experts, each expert is an ordinary SwiGLU MLP.

The experts run as one GEMM each over the rows routed to them: the (token, expert) pairs are
sorted by expert, so expert ``e`` multiplies one contiguous slice of gathered rows, and the
weighted outputs are summed back per token with one ``index_add_``. No Python loop runs per
token; the loop is over experts. Each expert is a :class:`~pagellm.model.mlp.LlamaMLP`, so
it runs on the same kernel plan as a dense layer (packed bf16 GEMMs, the int8 GEMM with the
activation in its epilogue) and loads through the same fused gate/up rows.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.tensor_parallel import TensorParallel
from pagellm.kernels.plan import KernelPlan
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.mlp import LlamaMLP


class Router(nn.Module):
    """The expert-choice linear (HF's ``gate``). A module of its own, not an ``nn.Linear``, so
    that CPU repacking leaves it alone: its logits stay the reference's own arithmetic, since a
    rounding difference here can move a token to another expert."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Top-k routing (softmax in float32, optional renormalisation over the chosen experts),
    then each expert over its rows, weighted and summed per token (under tensor parallelism:
    every rank holds its share of every expert, and the block's sum is joined once)."""

    def __init__(
        self, arch: ModelArchConfig, plan: KernelPlan | None = None, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()  # (top-k against the number of experts: checked by the registry)
        self.tp = tp
        self.top_k = arch.num_experts_per_tok
        self.normalize = arch.norm_topk_prob
        self.combine_in_float32 = arch.moe_combine_in_float32
        self.gate = Router(arch.hidden_size, arch.num_experts)
        expert_arch = dataclasses.replace(arch, intermediate_size=arch.moe_intermediate_size)
        self.experts = nn.ModuleList(LlamaMLP(expert_arch, plan) for _ in range(arch.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], expert ids [T, k])`` for each token, as the reference computes them."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.combine_in_float32 else weights.to(x.dtype)), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, expert) pairs grouped by expert
        rows = order // self.top_k  # the token of each pair
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        gathered = x[rows]
        outputs = torch.empty_like(gathered)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                outputs[start : start + count] = expert(gathered[start : start + count])
                start += count
        weighted = (outputs * weights.flatten()[order].unsqueeze(1)).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, rows, weighted)
        return out if self.tp is None else self.tp.all_reduce_(out)

    def fuse_for_cpu(self, plan: KernelPlan, verify: bool = True) -> bool:
        """Fuse every expert's gate/up with its activation (one self-check, on the first)."""
        first, *rest = self.experts
        if not first.fuse_for_cpu(plan, verify):
            return False
        for expert in rest:
            expert.fuse_for_cpu(plan, verify=False)
        return True
