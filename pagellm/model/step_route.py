"""What runs one step's forward, decided once per step from the kernel plan and the batch.

Three choices depend on the step and not only on the plan: whether the decoder layers run in
one C++ call or module by module (the fused stack takes the step or not), which GEMM the
linears run (quantized weights: the integer GEMM's dot products for small batches, AMX tiles or
a dense copy above the plan's ``quant_max_rows``), and which attention implementation runs which
rows. :func:`route_step` decides them in one place at the top of the model's forward; the model
follows ``decoder`` and hands ``big_batch`` to the stack, and the route goes back with the
step's output (``ModelRunnerOutput.route``) into the engine's counts
(``EngineStats.step_routes``), the debug log and the benchmarks' reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.kernels.plan import KernelPlan


@dataclass(frozen=True)
class StepRoute:
    """One step's route (``rows``: the tokens its forward runs)."""

    rows: int
    decoder: str  # "fused" (one C++ call for the layers) or "layers" (module by module)
    linears: str  # "integer", "integer-amx", "dequant-amx", "dense-copy/<gemm>" (quantized weights), or the dense GEMM path
    attention: str  # the backend's name; "cpu_paged+torch_sdpa-prefill": prefill rows on SDPA

    @property
    def big_batch(self) -> bool:
        """Whether quantized linears run their big-batch side (AMX tiles or the dense copy)."""
        return self.linears.startswith(("integer-amx", "dequant-amx", "dense-copy"))

    def describe(self) -> str:
        """``decoder=fused linears=integer attention=cpu_paged`` (the engine counts steps by it)."""
        return f"decoder={self.decoder} linears={self.linears} attention={self.attention}"


def linear_path(plan: KernelPlan | None, rows: int) -> str:
    """The GEMM the plan runs a batch of ``rows`` rows' linears on (quantized linears whose
    format or shape the big-batch side does not take stay on the integer GEMM's dot products)."""
    if plan is None:
        return "torch"
    if not plan.quantized:
        return plan.gemm
    if plan.quant_max_rows is None or rows <= plan.quant_max_rows:
        return "integer"
    return plan.quant_large if plan.quant_large != "dense" else f"dense-copy/{plan.gemm}"


def route_step(
    plan: KernelPlan | None, backend: AttentionBackend, metadata: AttentionMetadata, rows: int, dtype: torch.dtype,
    cache_dtype: torch.dtype, head_dim: int, stack_fits: bool,
) -> StepRoute:
    """The route of a step of ``rows`` tokens in ``dtype`` over caches of ``cache_dtype``;
    ``stack_fits``: the one-call stack exists and takes these rows and caches. The stack runs
    every row on the paged kernel, so it takes the step only where the backend would too."""
    attention = backend.route(metadata, dtype, cache_dtype, head_dim)
    return StepRoute(
        rows=rows,
        decoder="fused" if stack_fits and attention == backend.name else "layers",
        linears=linear_path(plan, rows),
        attention=attention,
    )
