"""Run programs written for nvFuser unchanged: ``nvfuser`` and ``nvfuser_direct`` as names of
meshfuse.

``install()`` adds an import hook so that ``import nvfuser_direct as nvfuser``,
``from nvfuser_direct.pytorch_utils import torch_dtype_to_nvfuser_dtype`` and ``import nvfuser``
give meshfuse's modules themselves (one module object per file, whatever the name used), for
scripts and test suites written against nvFuser's Python frontends::

    import meshfuse.testing.nvfuser_alias as alias
    alias.install()
    import nvfuser_direct as nvfuser      # meshfuse

Call it before the first import of an aliased name (a ``conftest.py`` or a ``sitecustomize``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterable

ALIASES = ("nvfuser", "nvfuser_direct")


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``<alias>[.sub]`` to the already importable ``meshfuse[.sub]``."""

    def __init__(self, aliases: Iterable[str]) -> None:
        self.aliases = tuple(aliases)

    def _target(self, fullname: str) -> str | None:
        head, _, tail = fullname.partition(".")
        if head not in self.aliases:
            return None
        return "meshfuse" + (f".{tail}" if tail else "")

    def find_spec(self, fullname, path=None, target=None):
        target_name = self._target(fullname)
        if target_name is None:
            return None
        if importlib.util.find_spec(target_name) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = importlib.import_module(self._target(spec.name))
        return module

    def exec_module(self, module) -> None:
        # The module is meshfuse's own, already executed; the import system registers it
        # under the alias as well.
        return None


_installed: _AliasFinder | None = None


def install(aliases: Iterable[str] = ALIASES) -> None:
    """Makes each name in ``aliases`` (and its submodules) import as meshfuse; idempotent."""
    global _installed
    if _installed is None:
        _installed = _AliasFinder(aliases)
        sys.meta_path.insert(0, _installed)
