"""Small readers of ``config.json`` values that configs spell several ways (None, a number, a
list): what :mod:`pagellm.model.arch_config` reads ids and optional numbers with."""

from __future__ import annotations

from typing import Any


def optional_float(value: Any) -> float | None:
    """``float(value)``, None kept."""
    return None if value is None else float(value)


def optional_int(value: Any) -> int | None:
    """``int(value)``, with None (and a one-element list) handled."""
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


def as_id_list(value: Any) -> list[int]:
    """Normalize an eos entry (int, list of ints or None) to a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def merge_eos(config: dict[str, Any], generation_config: dict[str, Any] | None) -> list[int]:
    """Union of config.json's and generation_config.json's eos ids, order kept, no duplicates."""
    ids = as_id_list(config.get("eos_token_id"))
    ids += as_id_list((generation_config or {}).get("eos_token_id"))
    return list(dict.fromkeys(ids))

