"""The runner's settings from ``execute`` options and the environment: which torch.compile
backend fuses a program (``compile=``, ``MESHFUSE_COMPILE``), and whether cached programs
replay from CUDA graphs automatically (``MESHFUSE_CUDA_GRAPH``)."""

from __future__ import annotations

import torch

from meshfuse.errors import InputError

AUTO = "auto"  # compile=...: Inductor for programs on CUDA tensors, the interpreter on CPU


CUDA_GRAPH_ENV = "MESHFUSE_CUDA_GRAPH"
# The default backend of ``execute(compile=None)``; unset: ``auto`` (Inductor for programs on
# CUDA tensors, the interpreter on CPU ones); ``0`` turns fusion off everywhere.
COMPILE_ENV = "MESHFUSE_COMPILE"


def cuda_graph_setting(value: str | None) -> bool:
    """Whether ``execute(cuda_graph=None)`` replays automatically (:mod:`replay`), from
    ``MESHFUSE_CUDA_GRAPH``: yes when unset or ``auto``, no for ``0``."""
    text = (value or "").strip().lower()
    if text in ("", AUTO):
        return True
    if text in ("0", "false", "off"):
        return False
    raise InputError(f"{CUDA_GRAPH_ENV}={value!r}: use '0' (never replay automatically) or "
                     "leave it unset (or 'auto': replay every program where it is safe)")


def compile_setting(value: bool | str | None) -> str | None:
    """The torch.compile backend an ``execute(compile=...)`` option or ``MESHFUSE_COMPILE``
    value asks for: None (the interpreter) for False/"0"/"", "inductor" for True/"1",
    ``"auto"`` (Inductor on CUDA, the interpreter on CPU), else the backend it names
    ("aot_eager" runs the same lowering without generating kernels)."""
    if value in (None, False, "0", "", "false", "False"):
        return None
    if value in (True, "1", "true", "True"):
        return "inductor"
    if value in ("inductor", AUTO) or value in _BACKENDS_SEEN:
        return value
    if isinstance(value, str):
        # torch._dynamo is imported here, by a program that asks for a compiler by name.
        if value not in torch._dynamo.list_backends(exclude_tags=()):
            raise InputError(f"execute(compile={value!r}): no torch.compile backend of that "
                             "name; pass True (Inductor), 'auto', False or one of "
                             f"{sorted(torch._dynamo.list_backends(exclude_tags=()))}")
        _BACKENDS_SEEN.add(value)
        return value
    raise InputError(f"execute(compile={value!r}): pass True, False or a torch.compile "
                     "backend name such as 'inductor'")


_BACKENDS_SEEN: set[str] = set()  # names checked against torch.compile's backends


def backend_for(setting: str | None, device: torch.device) -> str | None:
    """The backend that fuses a program on ``device``'s tensors under ``setting`` (a
    :func:`compile_setting` result): ``"auto"`` is Inductor on CUDA, none elsewhere."""
    if setting == AUTO:
        return "inductor" if device.type == "cuda" else None
    return setting
