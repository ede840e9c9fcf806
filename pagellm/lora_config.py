"""``--enable-lora`` and its limits (vLLM's flags), validated once."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LORAS_LIMIT = 64  # adapters resident at once: each is a set of weight buffers in every layer
MAX_LORA_RANK_LIMIT = 512
MAX_CPU_LORAS_LIMIT = 1024


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras``: adapters one step may mix (each resident in its own slot of weight
    buffers); ``max_lora_rank``: the largest rank an adapter may have (the buffers' width);
    ``max_cpu_loras``: adapters kept loaded in host memory, least recently used evicted (None:
    ``max_loras``)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _integer("max_loras", self.max_loras, 1, MAX_LORAS_LIMIT)
        _integer("max_lora_rank", self.max_lora_rank, 1, MAX_LORA_RANK_LIMIT)
        if self.max_cpu_loras is not None:
            _integer("max_cpu_loras", self.max_cpu_loras, self.max_loras, MAX_CPU_LORAS_LIMIT)

    @property
    def cpu_loras(self) -> int:
        """Adapters kept loaded in host memory."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def _integer(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}, got {value!r}")
