"""Compiled segments shared by every program of the process.

A model of identical blocks (a GPT stack: one ``FusionModule`` per block) builds one
forward and one backward program per block; their fused segments are the same graphs on
the same local shapes. Compiling each anew multiplied the first call's compile time by the
number of blocks. :data:`SHARED` keeps each compiled segment under a key of its graph and
its inputs, so a segment met again (another block, another fusion, another signature with
the same local shapes) runs the code compiled the first time.

The key is what the compiled code depends on: the graph's nodes in order (each op's torch
implementation, its arguments with values referring to earlier nodes by position, Python
constants with their types, so ``1``, ``1.0`` and ``True`` differ, and ``-0.0`` is not
``0.0``), each input tensor's shape, strides, dtype, device and whether its address is
16-byte aligned (Inductor's generated code assumes what it saw at compile time), the
backend and its settings, and torch's deterministic switch. A graph holding a value with no faithful key (an object that
is not a number, string, dtype, device, slice or container of those) is not shared: it is
compiled for its program alone, as before.

Across processes, Inductor's own caches (its FX-graph cache and Triton's kernel cache,
under ``TORCHINDUCTOR_CACHE_DIR``, on by default) make a second run's compilations cheap:
the compilation is still counted, its time is what the cache takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

MAX_ENTRIES = 4096  # compiled segments kept for sharing (beyond: compiled, not kept)


class _NoKey(Exception):
    """A value of a graph that has no faithful key."""


class SegmentCache:
    """Compiled segments by :meth:`key`; ``hits``: segments found compiled."""

    def __init__(self) -> None:
        self._compiled: dict[tuple, Callable] = {}
        self.hits = 0

    def key(self, graph: fx.GraphModule, tensors: Sequence[torch.Tensor], backend: str,
            settings: dict[str, Any]) -> tuple | None:
        """The key of ``graph`` compiled by ``backend`` with ``settings`` for ``tensors``,
        or None where it has none (see the module doc)."""
        try:
            nodes = _nodes_key(graph)
            options = tuple(sorted((k, _value_key(v, {})) for k, v in settings.items()))
        except _NoKey:
            return None
        inputs = tuple((tuple(t.shape), t.stride(), t.dtype, str(t.device),
                        t.data_ptr() % 16 == 0) for t in tensors)
        # Inductor generates other code for reductions under torch's deterministic switch
        deterministic = torch.are_deterministic_algorithms_enabled()
        return backend, options, deterministic, inputs, nodes

    def get(self, key: tuple | None) -> Callable | None:
        compiled = None if key is None else self._compiled.get(key)
        if compiled is not None:
            self.hits += 1
        return compiled

    def put(self, key: tuple | None, compiled: Callable) -> None:
        if key is not None and len(self._compiled) < MAX_ENTRIES:
            self._compiled[key] = compiled

    def clear(self) -> None:
        self._compiled.clear()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._compiled)


SHARED = SegmentCache()


def _nodes_key(graph: fx.GraphModule) -> tuple:
    position: dict[fx.Node, int] = {}
    parts = []
    for node in graph.graph.nodes:
        position[node] = len(position)
        parts.append((node.op, _target_key(node), _value_key(node.args, position),
                      _value_key(node.kwargs, position)))
    return tuple(parts)


def _target_key(node: fx.Node) -> Any:
    if node.op == "placeholder" or node.op == "output":
        return node.op
    try:
        hash(node.target)
    except TypeError as e:
        raise _NoKey from e
    return node.target


_PLAIN = (bool, int, str, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout)


def _value_key(value: Any, position: dict[fx.Node, int]) -> Any:
    if isinstance(value, fx.Node):
        return ("node", position[value])
    if isinstance(value, float):
        return (float, repr(value))
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_value_key(v, position) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _value_key(v, position)) for k, v in value.items()))
    if isinstance(value, slice):
        return (slice, _value_key((value.start, value.stop, value.step), position))
    raise _NoKey(type(value).__name__)
