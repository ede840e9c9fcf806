"""The engine's check of each request's LoRA adapter, at the boundary: adapters enabled, the
adapter's files fit the model (``model/lora_adapter.py``, read once per adapter), and one id
naming one adapter (its KV and prefix-cache entries are kept apart by it). An id whose adapter
the worker could not load is retired: the prefix cache may hold blocks computed under its key
without it, so it is never served again (load the adapter under a new id)."""

from __future__ import annotations

from collections import OrderedDict

from pagellm.lora_config import LoRAConfig
from pagellm.lora_request import LoRARequest
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.lora_adapter import inspect_adapter

MAX_KNOWN_ADAPTERS = 4096  # adapters remembered as checked (least recently used forgotten)


class LoRARegistry:
    """Adapters checked so far (see the module docstring); ``config`` None: LoRA is off."""

    def __init__(self, config: LoRAConfig | None, arch: ModelArchConfig) -> None:
        self.config = config
        self.arch = arch
        self._checked: OrderedDict[int, LoRARequest] = OrderedDict()
        self._retired: OrderedDict[int, None] = OrderedDict()

    def check(self, request: LoRARequest | None) -> None:
        """Raise ValueError naming what is wrong with ``request``'s adapter (None: the base model)."""
        if request is None:
            return
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if self.config is None:
            raise ValueError(f"request names LoRA adapter {request.lora_name!r}, but LoRA is off: start the engine "
                             "with --enable-lora (LLM(enable_lora=True))")  # fmt: skip
        if request.lora_int_id in self._retired:
            raise ValueError(f"LoRA adapter id {request.lora_int_id} ({request.lora_name!r}) failed to load in the "
                             "worker and is retired: load the adapter again under a new id")  # fmt: skip
        known = self._checked.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} at "
                             f"{known.lora_path!r}; give {request.lora_name!r} another id")  # fmt: skip
        if known is None:
            inspect_adapter(request.lora_path, self.arch, self.config.max_lora_rank)
            self._checked[request.lora_int_id] = request
            while len(self._checked) > MAX_KNOWN_ADAPTERS:
                self._checked.popitem(last=False)
        self._checked.move_to_end(request.lora_int_id)

    def retire(self, lora_int_id: int) -> None:
        """The worker could not load this id's adapter: refuse it from now on."""
        self._checked.pop(lora_int_id, None)
        self._retired[lora_int_id] = None
        while len(self._retired) > MAX_KNOWN_ADAPTERS:
            self._retired.popitem(last=False)
