"""The kernel plan: which implementation each part of a forward pass runs, chosen once.

The engine builds one plan at start-up from the CPU's features, the kernel configuration and
the model's dtype (:func:`pagellm.worker.kernel_plan.plan_kernels`) and passes it into model
construction; modules keep what it gives them and never decide again. It is shown in the
start-up log line, ``/version`` and the benchmark JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.kernels.library import KernelLibrary

# The implementations a plan names for each part.
OWN_GEMM_PATHS = ("amx", "avx512-bf16", "avx2")  # pagellm's own GEMMs
GEMM_PATHS = (*OWN_GEMM_PATHS, "onednn", "torch")  # and oneDNN packed, F.linear
ELEMENTWISE_PATHS = ("kernel", "torch")  # norm, rotary, argmax: pagellm's C++ or PyTorch
# How the linears' weights are held: dense (the compute dtype), gguf (the file's blocks: Q4_0,
# Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K as they are, other types as int8 blocks) or int8 (int8 blocks quantized at load); the
# quantized ones run the integer GEMM.
WEIGHT_FORMATS = ("dense", "gguf", "int8")
DECODER_PATHS = ("layers", "fused")
# What runs quantized linears' batches above ``quant_max_rows``: a dense bf16 copy on the plan's
# GEMM, or the integer GEMM on AMX tiles (no copy).
QUANT_LARGE_PATHS = ("dense", "integer-amx", "dequant-amx")


@dataclass(frozen=True)
class WeightRequest:
    """How the user wants the linears' weights held (``KernelPlan.weights``), and whether
    falling back to dense weights is an error (an explicit ``--quantization``) or not (auto)."""

    weights: str = "dense"
    required: bool = False
    dense_copy_bytes: int = 0  # what a dense bf16 copy of the linears would take (AMX plans)


@dataclass(frozen=True)
class KernelPlan:
    """What runs where. ``kernels`` is the library the ``kernel`` / pagellm GEMM entries call."""

    device: str  # "cpu" or "cuda"
    cpu: str  # the usable CPU features that matter, e.g. "avx2+fma+f16c" ("-" off the CPU)
    dtype: torch.dtype  # the model's compute dtype
    attention: str  # attention backend name (cpu_paged, torch_sdpa, reference)
    gemm: str  # GEMM_PATHS
    norm: str = "torch"  # ELEMENTWISE_PATHS, also for rotary and argmax
    rotary: str = "torch"
    argmax: str = "torch"
    scan: str = "torch"  # ELEMENTWISE_PATHS: a gated delta-net layer's decode tokens (csrc/scan.cpp)
    weights: str = "dense"  # WEIGHT_FORMATS
    qgemm: str = "none"  # the integer GEMM's path (KernelLibrary.gemm_q_path) where weights are quantized
    # Batches of more rows than this run quantized linears on ``quant_large``: a dense bf16 copy
    # (the ``gemm`` path), the integer GEMM on AMX-INT8 tiles ("integer-amx"), or the weights
    # dequantized to bf16 on AMX-BF16 tiles ("dequant-amx", bf16 models); None: the integer
    # GEMM's dot products at every batch size.
    quant_max_rows: int | None = None
    quant_large: str = "dense"  # QUANT_LARGE_PATHS
    # "fused": the decoder layers in one C++ call (quantized weights or pagellm's dense GEMMs,
    # cpu_paged attention, kernel norm and rotary); "layers": module by module.
    decoder: str = "layers"
    # LoRA adapters add to linears' outputs (--enable-lora): the MLP's gate/up stay apart from
    # its activation (SiLU-and-mul on the ``norm`` kernel, where the one-call stack runs it too).
    lora: bool = False
    kernels: KernelLibrary | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.gemm not in GEMM_PATHS:
            raise ValueError(f"gemm must be one of {GEMM_PATHS}, got {self.gemm!r}")
        for part in ("norm", "rotary", "argmax", "scan"):
            path = getattr(self, part)
            if path not in ELEMENTWISE_PATHS:
                raise ValueError(f"{part} must be one of {ELEMENTWISE_PATHS}, got {path!r}")
            if path == "kernel" and self.kernels is None:
                raise ValueError(f"{part}='kernel' needs a kernel library")
        if self.gemm in OWN_GEMM_PATHS and self.kernels is None:
            raise ValueError(f"gemm={self.gemm!r} needs a kernel library")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.weights != "dense" and (self.kernels is None or self.qgemm == "none"):
            raise ValueError(f"weights={self.weights!r} needs a kernel library with the integer GEMM")
        if self.quant_large not in QUANT_LARGE_PATHS:
            raise ValueError(f"quant_large must be one of {QUANT_LARGE_PATHS}, got {self.quant_large!r}")
        if self.quant_max_rows is not None and self.weights == "dense":
            raise ValueError("quant_max_rows needs quantized weights")
        if self.quant_max_rows is not None and self.quant_large == "dense" and self.gemm not in OWN_GEMM_PATHS:
            raise ValueError("quant_max_rows with dense copies needs one of pagellm's dense GEMMs")
        tiles = self.quant_large in ("integer-amx", "dequant-amx")
        if tiles and (self.kernels is None or not self.kernels.gemm_q_amx_available):
            raise ValueError(f"quant_large={self.quant_large!r} needs a kernel library with the integer GEMM on AMX tiles")
        if self.quant_large == "dequant-amx" and self.dtype != torch.bfloat16:
            raise ValueError("quant_large='dequant-amx' multiplies bf16 rows: it needs dtype bfloat16")
        if self.decoder not in DECODER_PATHS:
            raise ValueError(f"decoder must be one of {DECODER_PATHS}, got {self.decoder!r}")
        if self.decoder == "fused" and not (
            (self.weights != "dense" or self.gemm in OWN_GEMM_PATHS)
            and self.attention == "cpu_paged" and self.norm == self.rotary == "kernel"
        ):  # fmt: skip
            raise ValueError(
                "decoder='fused' needs quantized weights or pagellm's GEMM, cpu_paged attention and kernel norm and rotary"
            )

    @property
    def quantized(self) -> bool:
        """Whether the linears hold quantized weights (and run the integer GEMM)."""
        return self.weights != "dense"

    def library(self, part: str) -> KernelLibrary | None:
        """The kernel library if ``part`` (norm, rotary, argmax, scan) runs on it, else None."""
        return self.kernels if getattr(self, part) == "kernel" else None

    def as_dict(self) -> dict[str, str]:
        """Plain strings for JSON (``/version``, benchmark reports)."""
        return {
            "device": self.device,
            "cpu": self.cpu,
            "kernel_target": " ".join(self.kernels.march) if self.kernels is not None else "none",
            "dtype": str(self.dtype).removeprefix("torch."),
            "gemm": self.gemm,
            "attention": self.attention,
            "norm": self.norm,
            "rotary": self.rotary,
            "argmax": self.argmax,
            "scan": self.scan,
            "weights": self.weights,
            "qgemm": self.qgemm,
            "quant_max_rows": "none" if self.quant_max_rows is None else str(self.quant_max_rows),
            "quant_large": "none" if self.quant_max_rows is None else self.quant_large,
            "decoder": self.decoder,
            **({"lora": "on"} if self.lora else {}),
        }

    def describe(self) -> str:
        """One line for the start-up log: ``cpu=avx2+fma gemm=avx2 attention=cpu_paged ...``."""
        return " ".join(f"{k}={v.replace(' ', ',')}" for k, v in self.as_dict().items() if k != "device")
