"""Per-request options of an embedding request (vLLM's ``PoolingParams``), and ``Pooling``:
those options merged with the model's pooler (``pooler_config.py``), as the worker runs them.

Validation happens once, at construction, so every later layer can trust the values.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.utils import is_int

# How one vector is made of a prompt's final hidden states: its last token's (decoder embedding
# models: Qwen3-Embedding, e5-mistral), their mean, or its first token's (BERT-style [CLS]).
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    """What one embedding request asks (vLLM's names): ``dimensions`` keeps the first N values of
    a matryoshka model's vector (then normalizes); ``normalize`` None: the model's choice."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")


@dataclass(frozen=True)
class Pooling:
    """One sequence's pooling, resolved: how to pool, whether to L2-normalize, and how many of the
    vector's first values to keep (None: all)."""

    pooling_type: str
    normalize: bool
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        PoolingParams(self.dimensions, self.normalize)

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt token's hidden state is read (so none may come from the prefix
        cache, whose blocks hold K/V, not hidden states); LAST reads only the last, always computed."""
        return self.pooling_type != "LAST"
