"""The ctypes table declares every function the C++ exports, with the C prototype's arity."""

from __future__ import annotations

import ctypes
import re
from importlib import resources

from pagellm.kernels.build import _SIGNATURES, _SOURCES


RETURN_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "void": None}


def exported_prototypes() -> dict[str, tuple[object, int]]:
    """``int / int64_t / void pagellm_x(...)`` definitions of the sources: name -> (ctypes return
    type, number of parameters)."""
    folder = resources.files("pagellm.kernels").joinpath("csrc")
    found: dict[str, tuple[object, int]] = {}
    for source in _SOURCES:
        text = folder.joinpath(source).read_text(encoding="utf-8")
        for kind, name, params in re.findall(r"^(int|int64_t|void) (pagellm_\w+)\(([^)]*)\)", text, flags=re.MULTILINE):
            found[name] = (RETURN_TYPES[kind], 0 if not params.strip() else params.count(",") + 1)
    return found


def test_every_export_is_declared_with_its_arity() -> None:
    prototypes = exported_prototypes()
    assert prototypes, "no exported kernel found in the sources"
    assert set(prototypes) == set(_SIGNATURES)
    for name, (restype, arity) in prototypes.items():
        assert _SIGNATURES[name][0] == restype and len(_SIGNATURES[name][1]) == arity, name
