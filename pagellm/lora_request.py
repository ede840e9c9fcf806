"""``LoRARequest``: which fine-tune (a LoRA adapter over the served base model) a request runs
with, as vLLM names it. Plain data: the engine checks the adapter's files (``model/lora_adapter.py``)
before the request is queued, the worker loads them (``worker/lora_manager.py``)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LORA_NAME_CHARS = 256


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name``: what clients call it (the API's ``model``); ``lora_int_id``: a positive id
    that names this one adapter for as long as the engine runs (its KV and prefix-cache entries
    are kept apart by it); ``lora_path``: a PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # what /v1/models lists as its parent (None: the served model)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if len(self.lora_name) > MAX_LORA_NAME_CHARS:
            raise ValueError(f"lora_name is {len(self.lora_name)} characters; at most {MAX_LORA_NAME_CHARS}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if self.lora_int_id >= 1 << 62:
            raise ValueError(f"lora_int_id must be below 2**62, got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be the adapter's folder, got {self.lora_path!r}")

    @property
    def cache_key(self) -> str:
        """What keeps its prefix-cache entries apart from the base model's and other adapters'."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}"
