"""The package is layered (docs/architecture.md, Layers): each module imports only modules of
lower layers, at module level. This test reads the imports (nothing is run) and fails on an
import of a higher or equal layer, a function-local import of the package, or a module missing
from the list below."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "aiotinyrt"

#: Lowest first. A module may import any module of an earlier layer. Modules in one layer do not
#: import each other.
LAYERS: list[list[str]] = [
    ["helpers", "dtype", "cachedir", "lifetime"],
    ["native", "recorder"],
    ["signal"],
    ["queue"],
    ["driverqueue", "compiler", "hazards", "kernel", "copies"],
    ["allocator"],
    ["registry"],
    ["buffer"],
    ["program"],
    ["graph"],
    ["device"],
    ["host"],
    ["backends"],
    ["tinygrad", "trace", "machine", "digits", "ray"],
    ["demo"],
    ["__init__"],
    ["__main__"],
]


def _layer_of(module: str) -> int:
    """The layer of a module (``aiotinyrt.backends.ops_cpu`` -> its package ``backends``)."""
    top = module.split(".")[1] if module.count(".") else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"aiotinyrt.{top} is in no layer of tests/test_layers.py: add it")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from_package(name: str) -> str:
    """``from aiotinyrt import name``: a submodule, or a name ``__init__`` re-exports."""
    is_module = (PACKAGE / f"{name}.py").exists() or (PACKAGE / name / "__init__.py").exists()
    return f"aiotinyrt.{name}" if is_module else "aiotinyrt"


def _imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """``(module, at module level)`` of every import of the package."""
    found: list[tuple[str, bool]] = []
    top_level = {id(node) for node in tree.body}

    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = (
                [node.module] if node.module != "aiotinyrt" else [_from_package(a.name) for a in node.names]
            )
        for name in names:
            if name == "aiotinyrt" or name.startswith("aiotinyrt."):
                found.append((name, id(node) in top_level))
    return found


def test_every_module_imports_only_lower_layers_at_module_level() -> None:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        layer = _layer_of(name)
        for imported, top in _imports(ast.parse(path.read_text())):
            other = _layer_of(imported)
            same_package = imported.split(".")[:2] == name.split(".")[:2]
            if not top:
                problems.append(f"{name}: function-local import of {imported}")
            elif other >= layer and not same_package:
                problems.append(f"{name} (layer {layer}) imports {imported} (layer {other})")
    assert problems == []


def test_the_layer_check_sees_a_violation(tmp_path: Path) -> None:
    tree = ast.parse("def f():\n    from aiotinyrt.device import Compiled\n")
    assert _imports(tree) == [("aiotinyrt.device", False)]
    assert _layer_of("aiotinyrt.device") > _layer_of("aiotinyrt.buffer")
