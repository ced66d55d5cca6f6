"""nvFuser's execute options that have no meaning in meshfuse: accepted, and named once.

nvFuser's ``execute`` takes ``_enable_options``/``_disable_options`` (its ``NVFUSER_ENABLE``
and ``NVFUSER_DISABLE`` switches of code generation and scheduling), ``device`` and
``save_repro_inputs``. meshfuse runs PyTorch kernels on the inputs' device, so none of them
changes what it does; a program that passes them runs, and the first time each one is seen a
warning names it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

_warned: set[str] = set()


def ignored_options(device=None, save_repro_inputs: bool = False,
                    _enable_options: Sequence[str] = (),
                    _disable_options: Sequence[str] = ()) -> list[str]:
    """Warns once per option that is set and ignored; returns the newly warned names."""
    named = [f"enable:{o}" for o in _enable_options] + [f"disable:{o}" for o in _disable_options]
    if device is not None:
        named.append(f"device={device}")
    if save_repro_inputs:
        named.append("save_repro_inputs")
    new = [n for n in named if n not in _warned]
    if new:
        _warned.update(new)
        warnings.warn(
            f"execute: nvFuser option(s) {', '.join(new)} have no meaning in meshfuse (it runs "
            "PyTorch kernels on the inputs' device) and are ignored",
            stacklevel=3,
        )
    return new
