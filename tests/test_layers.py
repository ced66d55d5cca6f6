"""The package's layers import one way, ``ir`` <- ``ops`` <- ``passes`` <- ``runtime`` <-
``frontend``, and no module of them imports meshfuse inside a function (the way to dodge an
import cycle). Read from the source with ``ast``; type-only imports (``TYPE_CHECKING``) are
not imports at run time and are left out."""

from __future__ import annotations

import ast
from pathlib import Path

import meshfuse

LAYERS = ("ir", "ops", "passes", "runtime", "frontend")
PACKAGE = Path(meshfuse.__file__).parent


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(("meshfuse", *path.relative_to(PACKAGE).with_suffix("").parts))
        if _layer(name) is not None:
            yield name, ast.parse(path.read_text())


def _meshfuse_imports(nodes) -> list[str]:
    return [n.module for n in nodes
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("meshfuse")]


def test_layers_import_one_way():
    upward = [(name, imported) for name, tree in _modules()
              for imported in _meshfuse_imports(tree.body)
              if (_layer(imported) or 0) > _layer(name)]
    assert upward == []


def test_no_function_local_imports_in_the_layers():
    local = [(name, fn.name, imported) for name, tree in _modules()
             for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
             for imported in _meshfuse_imports(ast.walk(fn))]
    assert local == []
