"""The gated delta-net: linear attention whose state is written by the delta rule, in place of
attention in Qwen3.5's ``linear_attention`` layers.

``in_proj_qkv`` makes q, k and v, a depthwise causal convolution (:func:`pagellm.model.short_conv.convolve`)
and a SiLU run over them, q and k are L2-normed (q also scaled by ``key_head_dim ** -0.5``), and
each value head carries a ``[key_head_dim, value_head_dim]`` state through the tokens::

    S' = exp(g_t) S_{t-1}       u_t = beta_t (v_t - S'^T k_t)       S_t = S' + k_t u_t^T       o_t = S_t^T q_t

with ``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` from ``in_proj_a`` /
``in_proj_b``: the state decays, then is corrected toward v_t where k_t reads it (the delta rule).
``o``, RMS-normed per head and gated by SiLU(``in_proj_z``), goes through ``out_proj``.

As Mamba-2's (``model/mamba2.py``): a step's decode tokens advance their states in one batched
update; a prompt (or a chunk of one) runs the chunked form (:func:`delta_scan`), and the state
lives a row a state slot in the layer's :class:`~pagellm.model.scan_state.ScanState`, float32
(the prefix cache keeps copies sparsely: ``core/state_snapshots.py``). With the plan's
``scan="kernel"``, a step's decode tokens run from the input projection's rows to the output
projection's in one C++ call (``csrc/scan.cpp``), rounding as these tensor ops do; its prompt
chunks run apart, by tensor ops (:func:`~pagellm.model.scan_state.scan_step`).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.backend import AttentionMetadata
from pagellm.kernels.plan import KernelPlan
from pagellm.model.derived_params import DerivedParams
from pagellm.model.quant_linear import linear_for_plan
from pagellm.model.scan_shapes import DeltaNetShape
from pagellm.model.scan_state import ScanPlan, ScanState, scan_step
from pagellm.model.short_conv import conv_plan, convolve


def delta_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens through the gated delta rule, a chunk at a time; float32.
    ``q``, ``k`` [L, heads, key_dim] (one a value head), ``v`` [L, heads, value_dim], ``g``
    [L, heads] (log decays, <= 0), ``beta`` [L, heads], ``state`` [heads, key_dim, value_dim]
    before the first token. Returns each token's output [L, heads, value_dim] and the state after
    the last.

    Within a chunk the corrections ``u`` solve one unit lower-triangular system a head: ``u_t +
    beta_t sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s = beta_t (v_t - exp(G_t) S_0^T k_t)``, ``G``
    the decays summed from the chunk's start; then ``o_t = exp(G_t) S_0^T q_t + sum_{s<=t}
    exp(G_t - G_s) (q_t . k_s) u_s``."""
    outputs = []
    for start in range(0, q.shape[0], chunk_size):
        qs, ks, vs = q[start : start + chunk_size], k[start : start + chunk_size], v[start : start + chunk_size]
        gs, bs = g[start : start + chunk_size], beta[start : start + chunk_size]
        size = len(qs)
        decay = torch.cumsum(gs, dim=0)  # [Q, heads]
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        pairs = torch.exp((decay[:, None, :] - decay[None, :, :]).masked_fill(~causal[..., None], -torch.inf))
        writes = (torch.einsum("thd,shd->tsh", ks, ks) * pairs * bs[:, None, :]).permute(2, 0, 1)  # [heads, t, s]
        system = writes.tril(-1) + torch.eye(size, dtype=q.dtype, device=q.device)
        read = torch.exp(decay)[..., None] * torch.einsum("thd,hdv->thv", ks, state)
        rhs = (bs[..., None] * (vs - read)).transpose(0, 1)  # [heads, Q, value_dim]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).transpose(0, 1)
        scores = torch.einsum("thd,shd->tsh", qs, ks) * pairs
        outputs.append(torch.exp(decay)[..., None] * torch.einsum("thd,hdv->thv", qs, state)
                       + torch.einsum("tsh,shv->thv", scores, u))  # fmt: skip
        to_end = torch.exp(decay[-1][None, :] - decay)  # [Q, heads]
        state = state * torch.exp(decay[-1])[:, None, None] + torch.einsum("shd,shv->hdv", ks * to_end[..., None], u)
    return torch.cat(outputs), state


def _l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class GatedHeadNorm(nn.Module):
    """Each head of the scan's output RMS-normed, scaled by ``weight``, times SiLU(gate), as the
    reference rounds it: normed in float32, scaled in the model dtype, gated in float32."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``out`` [T, heads, head_dim] in the model dtype, ``gate`` [T, heads * head_dim]."""
        dtype, normed = out.dtype, out.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        scaled = self.weight * normed.to(dtype)
        return (scaled * F.silu(gate.view_as(out).float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The mixer of one gated delta-net layer (see the module docstring). The checkpoint's four
    input projections (``in_proj_qkv``, ``_z``, ``_b``, ``_a``) load into one ``in_proj``
    (:meth:`shard_slices`: one GEMM a step instead of four); the rest by the checkpoint's names
    (``conv_weight`` for its Conv1d, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``)."""

    def __init__(self, shape: DeltaNetShape, hidden_size: int, norm_eps: float, plan: KernelPlan | None) -> None:
        super().__init__()
        self.shape = shape
        self.in_proj = linear_for_plan(hidden_size, sum(self._parts()), False, plan)
        self.out_proj = linear_for_plan(shape.value_size, hidden_size, False, plan)
        self.conv_weight = nn.Parameter(torch.empty(shape.conv_dim, 1, shape.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(shape.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(shape.num_value_heads))
        self.norm = GatedHeadNorm(shape.value_head_dim, norm_eps)
        self.kernels = plan.library("scan") if plan is not None else None
        self._decay = DerivedParams()  # -exp(A_log), dt_bias: float32

    def _parts(self) -> tuple[int, int, int, int]:
        """Rows of ``in_proj``: q/k/v, the output gate z, b (beta) and a (the decay's step)."""
        shape = self.shape
        return shape.conv_dim, shape.value_size, shape.num_value_heads, shape.num_value_heads

    def shard_slices(self) -> dict[str, slice]:
        """Rows of ``in_proj`` holding each checkpoint projection (by its name's suffix)."""
        ends = list(itertools.accumulate(self._parts()))
        return {name: slice(end - size, end) for name, end, size in zip(("qkv", "z", "b", "a"), ends, self._parts())}

    def forward(self, hidden: torch.Tensor, state: ScanState, metadata: AttentionMetadata) -> torch.Tensor:
        """``hidden`` [T, hidden] -> [T, hidden]; each request's state slot is read and left
        holding its state after its last token this step."""
        proj = self.in_proj(hidden)
        on_kernel = self.kernels is not None and proj.dtype == state.conv.dtype == self.conv_weight.dtype
        return self.out_proj(scan_step(proj, state, metadata, on_kernel, self._decode_on_kernel, self._by_tensor_ops))

    def _by_tensor_ops(
        self, proj: torch.Tensor, state: ScanState, metadata: AttentionMetadata, plan: ScanPlan
    ) -> torch.Tensor:
        """The step's tokens by tensor ops, from the input projection's rows to the output
        projection's input [T, value_size]."""
        shape, tokens = self.shape, proj.shape[0]
        qkv, z, b, a = proj.split(self._parts(), dim=-1)
        conv = conv_plan(metadata, shape.conv_kernel, proj.device)
        qkv, _ = convolve(qkv, state.conv, conv, self.conv_weight, None)
        q, k, v = F.silu(qkv).float().split([shape.key_size, shape.key_size, shape.value_size], dim=-1)
        q = self._per_value_head(_l2_normed(q.view(tokens, shape.num_key_heads, -1)) * shape.key_head_dim**-0.5)
        k = self._per_value_head(_l2_normed(k.view(tokens, shape.num_key_heads, -1)))
        v = v.view(tokens, shape.num_value_heads, -1)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        out = self._scan(q, k, v, g, beta, state.ssm, plan).to(proj.dtype)
        return self.norm(out, z).view(tokens, shape.value_size)

    def _decode_on_kernel(self, proj: torch.Tensor, state: ScanState, plan: ScanPlan) -> torch.Tensor:
        """The step's decode tokens on the kernel, from the input projection's rows to the output
        projection's input [T, value_size] (the other rows left for the spans)."""
        neg_a, dt_bias = self._decay.get(
            (self.A_log, self.dt_bias), lambda: (-torch.exp(self.A_log.float()), self.dt_bias.float())
        )
        out = proj.new_empty(proj.shape[0], self.shape.value_size)
        assert self.kernels is not None
        self.kernels.scan.delta_net_decode(
            proj, plan.decode_index, plan.decode_slots, plan.decode_fresh, state.conv, self.conv_weight, state.ssm,
            neg_a, dt_bias, self.norm.weight, self.norm.eps, self.shape.num_key_heads, self.shape.tiled_value_heads, out,
        )  # fmt: skip
        return out

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """Key heads [T, key heads, dim] as one a value head, in the order the value heads come."""
        per_key = self.shape.num_value_heads // self.shape.num_key_heads
        if per_key == 1:
            return x
        return x.repeat(1, per_key, 1) if self.shape.tiled_value_heads else x.repeat_interleave(per_key, dim=1)

    def _scan(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        ssm: torch.Tensor, plan: ScanPlan,
    ) -> torch.Tensor:
        """Each token's output [T, value heads, value_dim] (float32); the step's requests' rows of
        ``ssm`` left holding their states after their last tokens."""
        out = torch.empty_like(v)
        if len(plan.decode_slots):  # one token each: decay, correct toward v where k reads, read with q
            state = plan.decode_states(ssm)  # [D, heads, key_dim, value_dim]
            rows, shape = plan.decode_rows, state.shape
            q1, k1, v1 = rows(q), rows(k), rows(v)
            state.mul_(torch.exp(rows(g))[..., None, None])
            read = torch.matmul(k1.unsqueeze(-2), state).squeeze(-2)
            correction = (v1 - read) * rows(beta)[..., None]
            flat = state.view(-1, shape[-2], shape[-1])
            flat.baddbmm_(k1.reshape(-1, shape[-2], 1), correction.reshape(-1, 1, shape[-1]))
            out = plan.with_decode_rows(out, torch.matmul(q1.unsqueeze(-2), state).squeeze(-2))
            plan.store_decode_states(ssm, state)
        for span in plan.spans:
            rows = slice(span.start, span.end)
            out[rows], final = delta_scan(q[rows], k[rows], v[rows], g[rows], beta[rows], plan.span_state(ssm, span),
                                          self.shape.chunk_size)  # fmt: skip
            ssm[span.slot] = final
        return out


def delta_net_weight_names(prefix: str) -> set[str]:
    """The weights a gated delta-net under ``prefix`` (``model.layers.N.linear_attn.``) loads."""
    linears = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    return {f"{prefix}{name}.weight" for name in linears} | {prefix + n for n in ("conv_weight", "dt_bias", "A_log",
                                                                                  "norm.weight")}  # fmt: skip
