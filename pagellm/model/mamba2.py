"""Mamba-2's mixer: a selective state-space scan in place of attention in a hybrid model's
Mamba layers (Granite-4.0-H).

``in_proj`` makes a gate, x / B / C and one time step a head of each token; a depthwise causal
convolution (:func:`pagellm.model.short_conv.convolve`, the same gather as LFM2's) and a SiLU run
over x, B and C; then each head carries a ``[head_dim, state_size]`` state through the tokens::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t B_t^T        y_t = h_t C_t + D * x_t

and ``y``, gated by SiLU(gate) and RMS-normed per group, goes through ``out_proj``. What a sequence
carries from step to step is its convolution's last ``conv_kernel - 1`` inputs and that state,
one row each of the layer's :class:`~pagellm.model.scan_state.ScanState` (a row a state slot, ``core/state_slots.py``);
a request whose context starts at position 0 starts from zeros.

A step's decode tokens (one token a request) advance their states in one batched update; a
prompt (or a chunk of one) runs the chunked form of the same recurrence (:func:`ssd_scan`: within
a chunk, the outputs as a masked, decayed product of C and B, like attention's scores; between
chunks, the state), a chunk of up to ``chunk_size`` tokens at a time. The state is float32.

Unlike a short convolution's few inputs, this state (heads x head_dim x state_size floats, a few
megabytes a layer at real sizes) is not kept at every KV block's end: the prefix cache keeps
copies sparsely (``core/state_snapshots.py``). With the plan's ``scan="kernel"``, a step's
decode tokens run from the input projection's rows to the output projection's in one C++ call
(``csrc/scan.cpp``), rounding as these tensor ops do; its prompt chunks run apart, by tensor ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.backend import AttentionMetadata
from pagellm.kernels.plan import KernelPlan
from pagellm.model.derived_params import DerivedParams
from pagellm.model.quant_linear import linear_for_plan
from pagellm.model.scan_shapes import MambaShape
from pagellm.model.scan_state import ScanPlan, ScanState, scan_step
from pagellm.model.short_conv import conv_plan, convolve


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens through the recurrence, a chunk at a time; float32 throughout.
    ``x`` [L, heads, head_dim], ``dt`` [L, heads] (after its softplus), ``a`` [heads] (negative),
    ``b``, ``c`` [L, heads, state_size], ``state`` [heads, head_dim, state_size] before the first
    token. Returns ``sum_s C_t B_s decay(s..t) dt_s x_s`` for each token (without the ``D``
    term) and the state after the last."""
    outputs = []
    for start in range(0, x.shape[0], chunk_size):
        xs, dts = x[start : start + chunk_size], dt[start : start + chunk_size]
        bs, cs = b[start : start + chunk_size], c[start : start + chunk_size]
        decay = torch.cumsum(dts * a, dim=0)  # [Q, heads]: log of the decay from the chunk's start
        pairs = decay[:, None, :] - decay[None, :, :]  # [t, s, heads]: log decay from s to t
        causal = torch.ones(len(xs), len(xs), dtype=torch.bool, device=x.device).tril()
        weights = torch.einsum("thn,shn->tsh", cs, bs) * torch.exp(pairs.masked_fill(~causal[..., None], -torch.inf))
        inputs = xs * dts[..., None]  # [Q, heads, head_dim]
        within = torch.einsum("tsh,shp->thp", weights, inputs)
        before = torch.einsum("thn,hpn->thp", cs, state) * torch.exp(decay)[..., None]
        outputs.append(within + before)
        to_end = torch.exp(decay[-1][None, :] - decay)  # [Q, heads]: decay from each token to the chunk's end
        state = state * torch.exp(decay[-1])[:, None, None] + torch.einsum("shn,shp->hpn", bs * to_end[..., None], inputs)
    return torch.cat(outputs), state


class GatedRMSNorm(nn.Module):
    """The scan's output times SiLU(gate), RMS-normed over each of ``groups`` equal groups of
    channels, scaled by ``weight`` (float32 in, float32 out)."""

    def __init__(self, size: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, hidden: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        hidden = hidden * F.silu(gate.float())
        grouped = hidden.view(hidden.shape[0], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view_as(hidden)


class Mamba2Mixer(nn.Module):
    """The mixer of one Mamba-2 layer (see the module docstring); parameters by the checkpoint's
    names (``mamba.in_proj``, ``conv_weight`` / ``conv_bias`` for its Conv1d, ``dt_bias``,
    ``A_log``, ``D``, ``norm``, ``out_proj``)."""

    def __init__(self, shape: MambaShape, hidden_size: int, norm_eps: float, plan: KernelPlan | None) -> None:
        super().__init__()
        self.shape = shape
        self.in_proj = linear_for_plan(hidden_size, shape.in_proj_size, shape.proj_bias, plan)
        self.out_proj = linear_for_plan(shape.inner_size, hidden_size, shape.proj_bias, plan)
        self.conv_weight = nn.Parameter(torch.empty(shape.conv_dim, 1, shape.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(shape.conv_dim)) if shape.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(shape.num_heads))
        self.A_log = nn.Parameter(torch.empty(shape.num_heads))
        self.D = nn.Parameter(torch.empty(shape.num_heads))
        self.norm = GatedRMSNorm(shape.inner_size, shape.num_groups, norm_eps)
        self.kernels = plan.library("scan") if plan is not None else None
        self._floats = DerivedParams()  # -exp(A_log), dt_bias, D: float32

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
        projection's input [T, inner]."""
        shape = self.shape
        gate, xbc, dt = proj.split([shape.inner_size, shape.conv_dim, shape.num_heads], dim=-1)
        conv = conv_plan(metadata, shape.conv_kernel, proj.device)
        xbc, _ = convolve(xbc, state.conv, conv, self.conv_weight, self.conv_bias)
        x, b, c = F.silu(xbc).split([shape.inner_size, *(2 * [shape.num_groups * shape.state_size])], dim=-1)
        y = self._scan(x, b, c, dt, state.ssm, plan)
        return self.norm(y, gate).to(proj.dtype)

    def _decode_on_kernel(self, proj: torch.Tensor, state: ScanState, plan: ScanPlan) -> torch.Tensor:
        """The step's decode tokens on the kernel, from the input projection's rows to the output
        projection's input [T, inner] (the other rows left for the spans)."""
        shape = self.shape
        neg_a, dt_bias, d = self._floats.get(
            (self.A_log, self.dt_bias, self.D), lambda: (-torch.exp(self.A_log.float()), self.dt_bias.float(), self.D.float())
        )
        out = proj.new_empty(proj.shape[0], shape.inner_size)
        assert self.kernels is not None
        self.kernels.scan.mamba2_decode(
            proj, plan.decode_index, plan.decode_slots, plan.decode_fresh, state.conv, self.conv_weight, self.conv_bias,
            state.ssm, neg_a, dt_bias, d, (shape.dt_min, shape.dt_max), self.norm.weight, self.norm.eps,
            shape.num_groups, out,
        )  # fmt: skip
        return out

    def _scan(
        self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, ssm: torch.Tensor, plan: ScanPlan
    ) -> torch.Tensor:
        """The scan's output [T, inner] (float32, the ``D`` term in); the step's requests' rows of
        ``ssm`` left holding their states after their last tokens."""
        shape, tokens = self.shape, x.shape[0]
        x = x.float().view(tokens, shape.num_heads, shape.head_dim)
        per_group = shape.num_heads // shape.num_groups
        b = b.float().view(tokens, shape.num_groups, -1).repeat_interleave(per_group, dim=1)
        c = c.float().view(tokens, shape.num_groups, -1).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(shape.dt_min, shape.dt_max)
        a = -torch.exp(self.A_log.float())
        y = torch.empty_like(x)
        if len(plan.decode_slots):  # one token each: h = exp(dt a) h + dt x B^T, y = h C
            state = plan.decode_states(ssm)  # [D, heads, head_dim, state_size]
            rows, dims = plan.decode_rows, state.shape
            step_dt = rows(dt)
            state.mul_(torch.exp(step_dt * a)[..., None, None])
            flat = state.view(-1, dims[-2], dims[-1])
            flat.baddbmm_((step_dt[..., None] * rows(x)).reshape(-1, dims[-2], 1), rows(b).reshape(-1, 1, dims[-1]))
            read = torch.matmul(flat, rows(c).reshape(-1, dims[-1], 1)).view(-1, shape.num_heads, shape.head_dim)
            y = plan.with_decode_rows(y, read)
            plan.store_decode_states(ssm, state)
        for span in plan.spans:
            rows = slice(span.start, span.end)
            start = plan.span_state(ssm, span)
            y[rows], final = ssd_scan(x[rows], dt[rows], a, b[rows], c[rows], start, shape.chunk_size)
            ssm[span.slot] = final
        y = y + self.D.float()[:, None] * x
        return y.view(tokens, shape.inner_size)


def mamba_weight_names(prefix: str, shape: MambaShape) -> set[str]:
    """The weights a Mamba-2 mixer under ``prefix`` (``model.layers.N.mamba.``) loads."""
    kinds = ("weight", "bias") if shape.proj_bias else ("weight",)
    names = {f"{prefix}{part}.{kind}" for part in ("in_proj", "out_proj") for kind in kinds}
    names |= {prefix + name for name in ("conv_weight", "dt_bias", "A_log", "D", "norm.weight")}
    return names | ({prefix + "conv_bias"} if shape.conv_bias else set())
