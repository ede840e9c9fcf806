"""The ctypes table declares every function the C++ exports, with the C prototype's arity."""

from __future__ import annotations

import re
from importlib import resources

from pagellm.kernels.build import _SIGNATURES, _SOURCES


def exported_prototypes() -> dict[str, int]:
    """``int pagellm_x(...)`` definitions of the sources: name -> number of parameters."""
    folder = resources.files("pagellm.kernels").joinpath("csrc")
    found: dict[str, int] = {}
    for source in _SOURCES:
        text = folder.joinpath(source).read_text(encoding="utf-8")
        for name, params in re.findall(r"^int (pagellm_\w+)\(([^)]*)\)", text, flags=re.MULTILINE):
            found[name] = 0 if not params.strip() else params.count(",") + 1
    return found


def test_every_export_is_declared_with_its_arity() -> None:
    prototypes = exported_prototypes()
    assert prototypes, "no exported kernel found in the sources"
    assert set(prototypes) == set(_SIGNATURES)
    for name, arity in prototypes.items():
        assert len(_SIGNATURES[name][1]) == arity, name
