"""The names a server answers to: the base model's, and each LoRA adapter's (``--lora-modules``,
and ``/v1/load_lora_adapter`` where ``--allow-runtime-lora-updating`` lets clients add them).

One owner of that list: every endpoint resolves a request's ``model`` here, into the name it
answers with and the adapter (if any) its request runs with. Each adapter gets a new id (never
reused after an unload), so the engine keeps its KV and prefix-cache entries apart from every
other adapter's, including one loaded later under the same name.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass

from pagellm.config import EngineConfig
from pagellm.entrypoints.openai.errors import BadRequestError, NotFoundError
from pagellm.entrypoints.openai.protocol import ModelCard
from pagellm.lora_request import LoRARequest
from pagellm.model.loader import load_arch_config
from pagellm.model.lora_adapter import inspect_adapter

MAX_SERVED_ADAPTERS = 1024  # names listed and resolved (loaded in memory: the engine's --max-cpu-loras)


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path``, or vLLM's JSON form with a ``base_model_name``."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``; ValueError naming the form."""
        if text.lstrip().startswith("{"):
            try:
                data = json.loads(text)
                return cls(str(data["name"]), str(data["path"]), data.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"--lora-modules {text!r}: a JSON entry needs \"name\" and \"path\" ({exc})") from None
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: each entry is name=path (or a JSON object)")
        return cls(name, path)


class ServedModels:
    """The base model's names and the adapters (see the module docstring). ``check``: raises
    ValueError naming what is wrong with an adapter folder for this model (None: LoRA is off)."""

    def __init__(self, base_names: list[str], check: Callable[[str], None] | None = None) -> None:
        self.base_names = base_names
        self.check = check
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def names(self) -> list[str]:
        return [*self.base_names, *self.adapters]

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The model name to answer with and the adapter the request runs with (None: the base
        model), looked up once (an unload meanwhile does not change what a request runs); 404
        for a name this server does not serve."""
        if requested is None:
            return self.base_names[0], None
        if requested in self.base_names:
            return requested, None
        lora = self.adapters.get(requested)
        if lora is None:
            raise NotFoundError(f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return requested, lora

    def cards(self, max_model_len: int) -> list[ModelCard]:
        """``/v1/models``: the base model's names, then each adapter with its base as parent
        (``root`` names the model as served, never a path on this machine)."""
        base = self.base_names[0]
        cards = [ModelCard(id=name, root=base, max_model_len=max_model_len) for name in self.base_names]
        cards += [ModelCard(id=name, root=name, parent=lora.base_model_name or base, max_model_len=max_model_len)
                  for name, lora in self.adapters.items()]  # fmt: skip
        return cards

    def check_files(self, path: str) -> None:
        """400 naming what is wrong with the adapter folder at ``path`` for this model (reads
        its files: call it off the event loop)."""
        if self.check is None:
            raise BadRequestError("LoRA adapters are off: start the server with --enable-lora", param="lora_name")
        try:
            self.check(path)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="lora_path") from exc

    def add(self, name: str, path: str, base_model_name: str | None = None, files_checked: bool = False) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name`` (its files checked first, unless
        ``files_checked``); 400 naming the problem."""
        if self.check is None:
            raise BadRequestError("LoRA adapters are off: start the server with --enable-lora", param="lora_name")
        if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path:
            raise BadRequestError("lora_name and lora_path must be non-empty strings", param="lora_name")
        if name in self.base_names or name in self.adapters:
            raise BadRequestError(f"the name {name!r} is already served; unload it first", param="lora_name",
                                  code="lora_name_in_use")  # fmt: skip
        if base_model_name is not None and base_model_name not in self.base_names:
            raise BadRequestError(f"base_model_name {base_model_name!r} is not served here", param="base_model_name")
        if len(self.adapters) >= MAX_SERVED_ADAPTERS:
            raise BadRequestError(f"{MAX_SERVED_ADAPTERS} adapters are served already; unload one first",
                                  param="lora_name")  # fmt: skip
        if not files_checked:
            self.check_files(path)
        try:
            request = LoRARequest(name, next(self._ids), path, base_model_name)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="lora_name") from exc
        self.adapters[name] = request
        return request

    def remove(self, name: str) -> None:
        """Stop serving adapter ``name`` (requests already running with it finish); 404 if unknown."""
        if self.adapters.pop(name, None) is None:
            raise NotFoundError(f"no LoRA adapter named {name!r} is served", param="lora_name", code="model_not_found")


def adapter_check(config: EngineConfig) -> Callable[[str], None]:
    """What ``ServedModels`` checks an adapter folder with: its files against the engine's model
    and --max-lora-rank (the engine checks each request's adapter again, the same way)."""
    if config.lora is None:
        raise ValueError("LoRA is off: start with --enable-lora")
    arch, max_rank = load_arch_config(config.model.model), config.lora.max_lora_rank

    def check(path: str) -> None:
        inspect_adapter(path, arch, max_rank)

    return check
