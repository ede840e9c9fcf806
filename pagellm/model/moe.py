"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, GLM-4.5, DeepSeek-V2/V3): a router picks
each token's top-k experts, each expert is an ordinary SwiGLU MLP; GLM-4.5 adds shared experts (one
MLP every token runs) and routes as DeepSeek-V3 does (sigmoid scores, a correction bias, expert
groups), DeepSeek-V2 by softmax scores within groups;
Qwen2-MoE gates its shared expert by a sigmoid per token.

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
    rounding difference here can move a token to another expert. Sigmoid routing (GLM-4.5)
    computes them in float32, and adds its ``e_score_correction_bias`` to the scores it chooses by."""

    def __init__(self, hidden_size: int, num_experts: int, sigmoid: bool = False, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None  # gpt-oss
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts)) if sigmoid else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.e_score_correction_bias is not None:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight, self.bias)


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
        self.scoring = arch.moe_scoring
        self.groups, self.scaling = arch.moe_groups, arch.routed_scaling_factor
        self.gate = Router(arch.hidden_size, arch.num_experts, self.scoring == "sigmoid", arch.moe_router_bias)
        expert_arch = dataclasses.replace(arch, intermediate_size=arch.moe_intermediate_size)
        self.experts = nn.ModuleList(LlamaMLP(expert_arch, plan) for _ in range(arch.num_experts))
        shared = arch.shared_expert_size
        self.shared_experts = LlamaMLP(dataclasses.replace(arch, intermediate_size=shared), plan) if shared else None
        # Qwen2-MoE: the shared MLP's output times sigmoid(a linear of the input), one number a token.
        self.shared_expert_gate = Router(arch.hidden_size, 1) if arch.shared_expert_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], expert ids [T, k])`` for each token, as the reference computes them."""
        if self.scoring == "sigmoid":
            weights, experts = self._sigmoid_route(x)
        elif self.scoring == "softmax_groups":
            weights, experts = self._grouped_softmax_route(x)
        elif self.scoring.startswith("topk_softmax"):  # gpt-oss: the chosen logits softmaxed (in their dtype)
            logits = self.gate(x)
            logits = logits.float() if self.scoring == "topk_softmax_float32" else logits  # (Granite-4.0-H)
            logits, experts = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(logits, dim=-1, dtype=logits.dtype)
        else:
            probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.combine_in_float32 else weights.to(x.dtype)), experts

    def _sigmoid_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's choice: by sigmoid score plus the correction bias, among the experts of
        the ``topk_group`` groups whose two best such scores sum highest; weighted by the plain
        scores (renormalised where the config says), times the routed scaling factor."""
        assert self.gate.e_score_correction_bias is not None
        scores = self.gate(x).sigmoid()
        choice = scores + self.gate.e_score_correction_bias.float()
        if self.groups[0] > 1:  # (a group by the sum of its two best)
            group_scores = choice.view(len(x), self.groups[0], -1).topk(2, dim=-1)[0].sum(dim=-1)
            choice = self._best_groups_only(choice, group_scores, float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts

    def _grouped_softmax_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V2's choice: softmax scores of float32 logits, the top k among the experts of
        the ``topk_group`` groups whose best score is highest (all, with one group), weighted by
        their scores (not renormalised) times the routed scaling factor."""
        scores = torch.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1)
        if self.groups[0] > 1:  # (a group by its best)
            scores = self._best_groups_only(scores, scores.view(len(x), self.groups[0], -1).amax(dim=-1), 0.0)
        weights, experts = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, experts

    def _best_groups_only(self, scores: torch.Tensor, group_scores: torch.Tensor, fill: float) -> torch.Tensor:
        """``scores`` [T, experts] with every expert outside each token's ``topk_group`` groups of
        highest ``group_scores`` [T, groups] set to ``fill``."""
        best = torch.topk(group_scores, self.groups[1], dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return scores.masked_fill(~keep.repeat_interleave(scores.shape[-1] // group_scores.shape[-1], dim=1), fill)

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
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out if self.tp is None else self.tp.all_reduce_(out)

    def fuse_for_cpu(self, plan: KernelPlan, verify: bool = True) -> bool:
        """Fuse every expert's gate/up with its activation (one self-check, on the first)."""
        first, *rest = self.experts
        if not first.fuse_for_cpu(plan, verify):
            return False
        for expert in [*rest, *([self.shared_experts] if self.shared_experts is not None else [])]:
            expert.fuse_for_cpu(plan, verify=False)
        return True
