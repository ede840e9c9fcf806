"""Values a kernel takes that derive from a module's parameters (float32 copies, ``1 + weight``,
``-exp(A_log)``), computed once and again only when a parameter is loaded or replaced (its
storage or its version changes), not at every step."""

from __future__ import annotations

from collections.abc import Callable

import torch


class DerivedParams:
    """One module's derived values (see the module docstring)."""

    def __init__(self) -> None:
        self._key: tuple[tuple[int, int], ...] | None = None
        self._values: tuple[torch.Tensor, ...] = ()

    def get(
        self, params: tuple[torch.Tensor, ...], build: Callable[[], tuple[torch.Tensor, ...]]
    ) -> tuple[torch.Tensor, ...]:
        """``build()``'s values, built again where one of ``params`` changed since the last call."""
        key = tuple((p.data_ptr(), p._version) for p in params)
        if key != self._key:
            with torch.no_grad():
                self._key, self._values = key, tuple(v.contiguous() for v in build())
        return self._values
