"""A parallelized module's parameters and buffers by name, read at each call without walking
its module tree.

``dict(module.named_parameters(remove_duplicate=False))`` and the same of the buffers walk
every submodule at every call: on a 16-layer ``transformers`` Llama, a third of a millisecond
of host time before the first kernel of a training step, when the device has nothing else
to do. :class:`NamedMembers` finds once where each name lives (the submodule and its key)
and then reads each value there, so a parameter or buffer replaced in place (``module.weight
= nn.Parameter(...)``, ``model.to(...)``, a checkpoint loaded) is read as it is now. What
moves a name elsewhere, a submodule replaced (``model.layers[0] = ...``) or a member
registered anywhere, goes through ``torch.nn.Module``'s registration, whose process-wide
hooks (installed with the first instance) make every instance look again; a member deleted
(no hook) is noticed as its key goes missing.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as torch_module

# registrations of submodules, parameters and buffers in the process (see the module doc)
_REGISTRATIONS = [0]
_HOOKED: list[bool] = []


def _registered(*_) -> None:
    _REGISTRATIONS[0] += 1


def _hook_registrations() -> None:
    if not _HOOKED:
        torch_module.register_module_module_registration_hook(_registered)
        torch_module.register_module_parameter_registration_hook(_registered)
        torch_module.register_module_buffer_registration_hook(_registered)
        _HOOKED.append(True)


class NamedMembers:
    """Where each parameter and buffer of a module lives: ``read(module)`` gives what
    ``named_parameters`` and ``named_buffers`` (``remove_duplicate=False``: a tied weight
    under each of its names) give, as dicts."""

    def __init__(self) -> None:
        _hook_registrations()
        self._seen = -1  # the registrations counted when the places were found
        self._parameters: list[tuple[str, torch.nn.Module, str]] = []
        self._buffers: list[tuple[str, torch.nn.Module, str]] = []

    def read(self, module: torch.nn.Module) -> tuple[dict[str, torch.Tensor],
                                                     dict[str, torch.Tensor]]:
        """``(parameters, buffers)`` of ``module`` by name."""
        if self._seen != _REGISTRATIONS[0]:
            self._find(module)
        try:
            found = ({name: owner._parameters[key] for name, owner, key in self._parameters},
                     {name: owner._buffers[key] for name, owner, key in self._buffers})
        except KeyError:  # a member deleted since
            self._find(module)
            return self.read(module)
        if any(v is None for part in found for v in part.values()):  # set to None since
            self._find(module)
            return self.read(module)
        return found

    def _find(self, module: torch.nn.Module) -> None:
        self._parameters, self._buffers = [], []
        for prefix, owner in module.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            self._parameters += [(dot + key, owner, key)
                                 for key, v in owner._parameters.items() if v is not None]
            self._buffers += [(dot + key, owner, key)
                              for key, v in owner._buffers.items() if v is not None]
        self._seen = _REGISTRATIONS[0]
