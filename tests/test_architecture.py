"""The architecture holds (docs/design.md, "Map of the code"): import-linter's contracts in
pyproject.toml are kept (layers, the runtime's layers, independent strategies, no circles),
and fail when a module imports a layer above it; no function-local import of meshfuse; the
type-only references the circle check leaves out are type-only; the map lists exactly the
packages of the tree; no package holds many more than a dozen modules."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "meshfuse"
MOST_MODULES = 13  # "about 12" per package (ir/ holds 13)


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the package under ``root``, with the contracts of ``root``'s
    pyproject.toml, in a process of its own (it imports nothing of meshfuse)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    script = "import sys; from importlinter.cli import lint_imports_command; " \
             "sys.exit(lint_imports_command(['--config', 'pyproject.toml', '--no-cache']))"
    return subprocess.run([sys.executable, "-c", script], check=False, cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def _contract_names() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [c["name"] for c in config["tool"]["importlinter"]["contracts"]]


def test_the_contracts_are_kept():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in _contract_names():
        assert f"{name} KEPT" in result.stdout, result.stdout


@pytest.mark.parametrize(("importer", "line", "broken"), [
    # the IR reaching up to the frontend
    ("ir/iter_domain.py", "import meshfuse.frontend.fusion_definition",
     "meshfuse.ir is not allowed to import meshfuse.frontend"),
    # the core naming a strategy
    ("passes/propagation.py", "import meshfuse.parallel.context.record",
     "meshfuse.passes is not allowed to import meshfuse.parallel"),
    # one strategy using another
    ("parallel/overlap/cost.py", "import meshfuse.parallel.context.cost",
     "meshfuse.parallel.overlap is not allowed to import meshfuse.parallel.context"),
])
def test_an_upward_import_breaks_a_contract(tmp_path, importer, line, broken):
    shutil.copytree(PACKAGE, tmp_path / "meshfuse",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    module = tmp_path / "meshfuse" / importer
    module.write_text(module.read_text() + f"\n{line}  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout
    assert "BROKEN" in result.stdout


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _function_local_imports(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("meshfuse"):
                found.append((inner.lineno, inner.module))
            elif isinstance(inner, ast.Import):
                found += [(inner.lineno, a.name) for a in inner.names
                          if a.name.startswith("meshfuse")]
    return found


def test_no_function_imports_meshfuse():
    """An import inside a function hides a dependency (often one that dodges a circle): every
    module imports what it uses at its top."""
    local = {str(p.relative_to(ROOT)): _function_local_imports(ast.parse(p.read_text()))
             for p in _modules()}
    assert {path: found for path, found in local.items() if found} == {}


def _type_checking_imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            names |= {n.module for n in ast.walk(node) if isinstance(n, ast.ImportFrom)}
    return names


def _runtime_imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_the_imports_the_circle_check_ignores_are_annotations_only():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ignored = [i for c in config["tool"]["importlinter"]["contracts"]
               for i in c.get("ignore_imports", [])]
    assert ignored
    for rule in ignored:
        importer, imported = (part.strip() for part in rule.split("->"))
        tree = ast.parse((ROOT / (importer.replace(".", "/") + ".py")).read_text())
        assert imported in _type_checking_imports(tree), rule
        assert imported not in _runtime_imports(tree), rule


def _packages() -> set[str]:
    return {str(p.parent.relative_to(ROOT)) + "/" for p in PACKAGE.rglob("__init__.py")}


def _mapped_packages() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## 11. Map of the code", 1)[1]
    return set(re.findall(r"^\| `(meshfuse/(?:[a-z_]+/)*)`", section, re.MULTILINE))


def test_the_map_lists_every_package_and_only_those():
    assert _mapped_packages() == _packages()


def test_the_map_names_modules_that_exist():
    text = (ROOT / "docs" / "design.md").read_text().split("## 11. Map of the code", 1)[1]
    for row in re.findall(r"^\| `meshfuse/` \(([^)]*)\)", text, re.MULTILINE):
        for name in re.findall(r"`([a-z_]+\.py)`", row):
            assert (PACKAGE / name).exists(), name
    for path in re.findall(r"`((?:passes|runtime|engine|parallel|ops|ir)/[a-z_/]+\.py)`", text):
        assert (PACKAGE / path).exists(), path


def test_no_package_holds_many_more_than_a_dozen_modules():
    sizes = {package: len([p for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"])
             for package in _packages()}
    assert {p: n for p, n in sizes.items() if n > MOST_MODULES} == {}
