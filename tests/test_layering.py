"""The layering of pagellm, as a test: imports point down only, no two modules import each other
(directly or round a longer circle), no source file grows past ``MAX_LINES``.

``LAYERS`` is the one table of the rules; ``docs/architecture.md`` states the same table (checked
below), so the picture a newcomer reads is the one the code keeps. The imports are read from the
source with ``ast`` (nothing is imported), all of them: at module level, under
``if TYPE_CHECKING:`` (a type-only name still ties the two modules together) and inside functions
(a lazy import is still a dependency; it only delays it). A module imports the layers at or below
its own; within one layer any direction goes as long as it makes no circle. The package root runs
before every module of the package, so it imports only plain data at once.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pagellm"
DOC = ROOT / "docs" / "architecture.md"
MAX_LINES = 600
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".js", ".css", ".html", ".jinja")  # what MAX_LINES bounds


@dataclass(frozen=True)
class Layer:
    """One floor of the house: the packages and modules on it (a package covers its modules; the
    package root, ``pagellm``, only itself)."""

    name: str
    modules: tuple[str, ...]


# Top to bottom. A module may import from its own layer and the layers below, never above.
LAYERS: tuple[Layer, ...] = (
    Layer("programs", ("pagellm", "pagellm.entrypoints", "pagellm.benchmarks", "pagellm.engine_args")),
    Layer("engine", ("pagellm.engine",)),
    Layer("worker", ("pagellm.worker",)),
    Layer("bookkeeping and compute", ("pagellm.core", "pagellm.model", "pagellm.sample", "pagellm.structured_output")),
    Layer("attention and ranks", ("pagellm.attention", "pagellm.distributed")),
    Layer("kernels", ("pagellm.kernels",)),
    Layer(
        "plain data",
        (
            "pagellm.step", "pagellm.step_codec", "pagellm.outputs", "pagellm.sampling_params",
            "pagellm.structured_outputs_params", "pagellm.config", "pagellm.bounded_json",
            "pagellm.utils", "pagellm.metrics", "pagellm.kv_layout", "pagellm.speculative_config",
            "pagellm.pooling_params", "pagellm.pooler_config", "pagellm.lora_request", "pagellm.lora_config",
            "pagellm.multimodal_inputs", "pagellm.disk_tier_files",
        ),
    ),
)


@dataclass(frozen=True)
class Import:
    """One import statement's target inside the package, and how it is written."""

    source: str
    target: str
    line: int
    kind: str  # "module", "type-only" (under TYPE_CHECKING) or "lazy" (inside a function)

    def __str__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target} ({self.kind})"


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _statements(body: list[ast.stmt], kind: str) -> Iterator[tuple[ast.stmt, str]]:
    """Every statement with the kind its imports get: lazy inside a function, type-only under
    ``if TYPE_CHECKING:`` (lazy wins: a function's import is lazy wherever the function is)."""
    for node in body:
        yield node, kind
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _statements(node.body, "lazy")
        elif isinstance(node, ast.If) and kind == "module" and _is_type_checking(node.test):
            yield from _statements(node.body, "type-only")
            yield from _statements(node.orelse, kind)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _statements(getattr(node, field, []), kind)


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join([*parts, node.module] if node.module else parts)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest module of the package that ``name`` is or lies in; None outside the package."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def _targets(module: str, node: ast.stmt, modules: dict[str, Path]) -> list[str]:
    """The package's modules one import statement loads (``from p import m`` loads ``p.m``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = _base(module, modules[module].name == "__init__.py", node)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    else:
        return []
    found = (_known(name, modules) for name in names)
    return sorted({target for target in found if target is not None and target != module})


@lru_cache(maxsize=1)
def package_imports() -> tuple[Import, ...]:
    """Every import from one module of the package to another (read once per test session)."""
    modules = module_files()
    imports: list[Import] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, kind in _statements(tree.body, "module"):
            imports.extend(Import(module, t, node.lineno, kind) for t in _targets(module, node, modules))
    return tuple(imports)


def _covers(prefix: str, module: str) -> bool:
    return module == prefix or (prefix != PACKAGE and module.startswith(prefix + "."))


def rank(module: str) -> int:
    """The module's floor counted from the bottom (0: plain data), by its longest listed prefix."""
    best: tuple[int, int] | None = None  # (length of the prefix, floor)
    for floor, layer in enumerate(reversed(LAYERS)):
        for prefix in layer.modules:
            if _covers(prefix, module) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), floor)
    if best is None:
        raise LookupError(module)
    return best[1]


def upward(imports: Sequence[Import]) -> list[Import]:
    """The imports from a lower layer to a higher one."""
    return [imp for imp in imports if rank(imp.target) > rank(imp.source)]


def cycles(imports: Sequence[Import]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group: list[str] = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def doc_rows() -> list[str]:
    """The start of each table row the doc must hold, top layer first: floor, name, modules."""
    rows = []
    for floor, layer in zip(range(len(LAYERS) - 1, -1, -1), LAYERS, strict=True):
        rows.append(f"| {floor} | {layer.name} | {', '.join(f'`{m}`' for m in layer.modules)} |")
    return rows


def test_every_module_has_a_layer() -> None:
    unplaced = []
    for module in module_files():
        try:
            rank(module)
        except LookupError:
            unplaced.append(module)
    assert not unplaced, f"place these in LAYERS (and in docs/architecture.md): {unplaced}"


def test_imports_point_down() -> None:
    found = upward(package_imports())
    assert not found, "imports from a lower layer to a higher one:\n" + "\n".join(map(str, found))


def test_the_package_root_loads_only_plain_data() -> None:
    """Python runs ``pagellm/__init__.py`` before any module of the package, so what it imports
    at once is imported by every module, of every layer: only plain data, the rest lazily."""
    eager = [str(i) for i in package_imports() if i.source == PACKAGE and i.kind == "module" and rank(i.target) > 0]
    assert not eager, "the package root imports above plain data at once:\n" + "\n".join(eager)


def test_no_import_cycles() -> None:
    imports = package_imports()
    found = cycles(imports)
    details = [
        " <-> ".join(group) + "\n  " + "\n  ".join(str(i) for i in imports if i.source in group and i.target in group)
        for group in found
    ]
    assert not found, "modules that import each other (round a circle):\n" + "\n".join(details)


def test_no_file_is_too_long() -> None:
    sources = [p for p in (ROOT / PACKAGE).rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts]
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in sources}
    long = {path: n for path, n in lengths.items() if n > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them along a seam): {long}"


def test_the_architecture_doc_states_the_same_layers() -> None:
    lines = [line for line in DOC.read_text().splitlines() if line.startswith("| ")]
    found = [next((i for i, line in enumerate(lines) if line.startswith(row)), -1) for row in doc_rows()]
    missing = [row for row, at in zip(doc_rows(), found, strict=True) if at < 0]
    assert not missing, "docs/architecture.md lacks these rows of the layer table:\n" + "\n".join(missing)
    assert found == sorted(found), "docs/architecture.md lists the layers out of order"


def test_the_checks_see_what_they_should() -> None:
    """The reader itself: a circle and an upward import are found, each kind of import is read."""
    fake = [Import("a", "b", 1, "module"), Import("b", "c", 1, "lazy"), Import("c", "a", 1, "type-only")]
    assert cycles(fake) == [["a", "b", "c"]]
    assert cycles(fake[:2]) == []
    kinds = {imp.kind for imp in package_imports()}
    assert kinds == {"module", "type-only", "lazy"}
    up, down = Import("pagellm.core.scheduler", "pagellm.engine.protocol", 1, "type-only"), Import("pagellm", "pagellm.step", 1, "module")
    assert upward([up, down]) == [up]
    with pytest.raises(LookupError):
        rank("pagellm.on_no_floor")
