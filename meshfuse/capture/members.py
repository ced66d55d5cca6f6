"""A parallelized module's parameters and buffers by name, read at each call without walking
its module tree.

``dict(module.named_parameters(remove_duplicate=False))`` and the same of the buffers walk
every submodule through generators at every call: on a 16-layer ``transformers`` Llama, a
third of a millisecond of host time before the first kernel of a training step, when the
device has nothing else to do. :class:`NamedMembers` finds once where each name lives (the
submodule and its key) and then reads each value there, so a parameter or buffer replaced
in place (``module.weight = nn.Parameter(...)``, ``model.to(...)``, a checkpoint loaded) is
read as it is now. What would move a name elsewhere (a submodule replaced or added, a
member registered or deleted) changes a submodule's own dicts, which each read compares
with what it found (their sizes, and the submodules themselves): then it looks again. No
process-wide registration hook: ``transformers`` slices its layer list at each forward,
which registers a new container each time (a hook counting registrations made
``torch.compile`` recompile the model at every step).
"""

from __future__ import annotations

import weakref

import torch

# a member's name, and the submodule (weakly: the module's own state holds these) and key
# it is at
Place = tuple[str, weakref.ref, str]


class NamedMembers:
    """Where each parameter and buffer of a module lives: ``read(module)`` gives what
    ``named_parameters`` and ``named_buffers`` (``remove_duplicate=False``: a tied weight
    under each of its names) give, as dicts. It holds the submodules weakly (a parallelized
    module keeps it: strong references would make the module a reference cycle, freed only
    by the garbage collector)."""

    def __init__(self) -> None:
        self._root: weakref.ref | None = None
        self._parameters: list[Place] = []
        self._buffers: list[Place] = []
        # each submodule found, the ids of its submodules then, its numbers of parameters
        # and of buffers
        self._tree: list[tuple[weakref.ref, tuple[int, ...], int, int]] = []

    def read(self, module: torch.nn.Module) -> tuple[dict[str, torch.Tensor],
                                                     dict[str, torch.Tensor]]:
        """``(parameters, buffers)`` of ``module`` by name."""
        if self._root is None or self._root() is not module or not self._unchanged():
            self._find(module)
        try:
            found = ({name: owner()._parameters[key] for name, owner, key in self._parameters},
                     {name: owner()._buffers[key] for name, owner, key in self._buffers})
        except (KeyError, AttributeError):  # a member renamed, a submodule gone
            self._find(module)
            return self.read(module)
        if any(v is None for part in found for v in part.values()):  # set to None since
            self._find(module)
            return self.read(module)
        return found

    def _unchanged(self) -> bool:
        for ref, children, params, buffers in self._tree:
            m = ref()
            if m is None or len(m._parameters) != params or len(m._buffers) != buffers \
                    or tuple(map(id, m._modules.values())) != children:
                return False
        return True

    def _find(self, module: torch.nn.Module) -> None:
        self._root = weakref.ref(module)
        self._parameters, self._buffers, self._tree = [], [], []
        for prefix, owner in module.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            ref = weakref.ref(owner)
            self._parameters += [(dot + key, ref, key)
                                 for key, v in owner._parameters.items() if v is not None]
            self._buffers += [(dot + key, ref, key)
                              for key, v in owner._buffers.items() if v is not None]
            self._tree.append((ref, tuple(map(id, owner._modules.values())),
                               len(owner._parameters), len(owner._buffers)))
