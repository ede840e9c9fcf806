"""``--pooler-config`` / ``LLM(pooler_config=...)``: how embeddings are made of a model's hidden
states, with vLLM's keys; what is not given comes from the model (``model/pooler_defaults.py``).

Every model serves ``/v1/embeddings`` and ``LLM.embed``: a decoder embedding model (Qwen3-Embedding
style, whose sentence-transformers files say how it pools) as it was trained, and a plain causal
model by its last token's final hidden state, L2-normalized (vLLM's default for decoders).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagellm.bounded_json import parse_json_text
from pagellm.pooling_params import POOLING_TYPES, Pooling, PoolingParams
from pagellm.utils import is_int

MAX_MATRYOSHKA_DIMENSIONS = 64  # the sizes a matryoshka model lists


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling_type`` (LAST, MEAN or CLS), ``normalize`` (L2), and whether the model's vectors
    may be cut to their first N values (``is_matryoshka``; ``matryoshka_dimensions``: the only
    sizes allowed, None: any). A None field: the model's own, else the default."""

    pooling_type: str | None = None
    normalize: bool | None = None
    is_matryoshka: bool | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                 f"got {self.pooling_type!r}")  # fmt: skip
            object.__setattr__(self, "pooling_type", self.pooling_type.upper())
        for name in ("normalize", "is_matryoshka"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"pooler_config {name} must be true or false, got {value!r}")
        dims = self.matryoshka_dimensions
        if dims is not None:
            if not isinstance(dims, (list, tuple)) or not 0 < len(dims) <= MAX_MATRYOSHKA_DIMENSIONS:
                raise ValueError(f"pooler_config matryoshka_dimensions must be a list of 1 to "
                                 f"{MAX_MATRYOSHKA_DIMENSIONS} sizes, got {dims!r}")  # fmt: skip
            if not all(is_int(d) and d > 0 for d in dims):
                raise ValueError(f"pooler_config matryoshka_dimensions must be positive integers, got {dims!r}")
            object.__setattr__(self, "matryoshka_dimensions", tuple(int(d) for d in dims))

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | PoolerConfig | None) -> PoolerConfig:
        """From the flag's JSON text, a mapping, or None (the model's own pooler)."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            value = parse_json_text(value, "pooler_config")
        if not isinstance(value, Mapping):
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config has unknown keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(**value)

    def or_else(self, fallback: PoolerConfig) -> PoolerConfig:
        """This config with each None field taken from ``fallback``."""
        return PoolerConfig(**{f.name: getattr(fallback, f.name) if getattr(self, f.name) is None
                               else getattr(self, f.name) for f in dataclasses.fields(self)})  # fmt: skip

    def resolve(self, params: PoolingParams, hidden_size: int) -> Pooling:
        """One request's pooling; ValueError naming the field where ``dimensions`` is not one this
        model can give (as vLLM words it)."""
        dims = params.dimensions
        if dims is not None and dims != hidden_size:
            if not self.is_matryoshka:
                raise ValueError("dimensions: this model does not support matryoshka representation, changing "
                                 "output dimensions will lead to poor results")  # fmt: skip
            allowed = self.matryoshka_dimensions
            if dims > hidden_size or (allowed is not None and dims not in allowed):
                sizes = f"one of {list(allowed)}" if allowed is not None else f"at most {hidden_size}"
                raise ValueError(f"dimensions must be {sizes} for this model, got {dims}")
        normalize = self.normalize if params.normalize is None else params.normalize
        return Pooling(self.pooling_type or "LAST", bool(normalize), None if dims == hidden_size else dims)
