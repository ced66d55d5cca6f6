"""Partition: a captured graph as fusions and graph breaks, in the order they run.

Three passes over the graph (none changes the user's module):

1. :func:`simplify`: ops with no value (metadata asserts) are dropped, and ops that return
   their input (``clone``, ``contiguous``, ``alias``...) are replaced by it.
2. :func:`fold`: every node that depends on no parameter and no user input (masks built with
   ``arange`` and comparisons, position ids, RoPE tables from a buffer) is computed once, at
   capture, with PyTorch; the program reads the values. They are recomputed when a buffer
   they read changes (its version counter moves).
3. :func:`partition`: each remaining node with a translation (:mod:`.aten_ops`) joins a
   fusion, each other node is a graph break that runs as the PyTorch op. A node's fusion is
   the earliest that runs after everything it reads, so the breaks split the program only
   where data flows through them: a break that reads only inputs runs before the first
   fusion. Fusions are then cut per repeated block (``model.layers.3``), so that identical
   layers build one program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.fx import Node

from meshfuse.capture.aten_ops import DROPPED, IDENTITIES, translation
from meshfuse.capture.trace import Captured, block_path, module_path

__all__ = ["Break", "Partition", "Segment", "fold", "partition", "simplify"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """A fusion: its nodes in graph order, the values it reads (``inputs``: nodes of other
    steps, placeholders, folded constants) and those others read (``outputs``)."""

    index: int
    nodes: tuple[Node, ...]
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]

    @property
    def block(self) -> str:
        """The repeated block (``model.layers.3``) or module the segment computes."""
        return block_path(self.nodes[0]) or "the top module"


@dataclasses.dataclass(frozen=True)
class Break:
    """An ATen op run as PyTorch runs it, between fusions."""

    node: Node
    reason: str

    @property
    def path(self) -> str:
        return module_path(self.node)

    def describe(self) -> str:
        where = self.path or "the top module"
        return f"{self.node.target} in {where}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Partition:
    """The steps in the order they run."""

    steps: tuple[Segment | Break, ...]

    @property
    def segments(self) -> list[Segment]:
        return [s for s in self.steps if isinstance(s, Segment)]

    @property
    def breaks(self) -> list[Break]:
        return [s for s in self.steps if isinstance(s, Break)]


def simplify(graph: torch.fx.Graph) -> None:
    """Drops value-less ops and forwards identities (on the capture's own graph)."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in DROPPED and not node.users:
            graph.erase_node(node)
        elif node.target in IDENTITIES and isinstance(node.args[0], Node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _static_placeholders(captured: Captured) -> set[str]:
    return set(captured.buffers) | set(captured.constants) | set(captured.attributes)


def static_nodes(captured: Captured) -> list[Node]:
    """The call nodes that depend on no parameter and no user input, in graph order
    (random ops excluded: each call draws anew)."""
    static = _static_placeholders(captured)
    result = []
    for node in captured.graph.nodes:
        if node.op != "call_function":
            continue
        seeded = isinstance(node.target, torch._ops.OpOverload) and \
            torch.Tag.nondeterministic_seeded in node.target.tags
        if not seeded and all(a.name in static for a in node.all_input_nodes):
            static.add(node.name)
            result.append(node)
    return result


def fold(nodes: list[Node], placeholders: Mapping[str, Any]) -> dict[str, Any]:
    """The values of ``nodes`` (see :func:`static_nodes`), computed with PyTorch from the
    ``placeholders``' values (buffers and constants, by placeholder name)."""
    values: dict[str, Any] = dict(placeholders)
    load = _loader(values)
    with torch.no_grad():
        for node in nodes:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), load)
            values[node.name] = node.target(*args, **kwargs)
    return {n.name: values[n.name] for n in nodes}


def _loader(values: Mapping[str, Any]) -> Callable[[Node], Any]:
    return lambda n: values[n.name]


def partition(graph: torch.fx.Graph, constants: Mapping[str, Any]) -> Partition:
    """The fusions and breaks of ``graph`` (see the module doc); ``constants`` holds the
    folded nodes' values (they and the placeholders are read by steps, never run)."""
    level: dict[str, int] = {}
    broken: dict[str, Break] = {}
    members: dict[int, list[Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.name in constants:
            continue
        entry, reason = translation(node, constants)
        inputs = [a for a in node.all_input_nodes if a.name in level]
        if entry is None or any(a.name in broken for a in inputs) and _reads_break(node):
            base = max((level[a.name] + (a.name not in broken) for a in inputs), default=0)
            level[node.name] = base
            broken[node.name] = Break(node, reason or "it reads a graph break's tuple")
            continue
        level[node.name] = max((level[a.name] for a in inputs), default=0)
        members.setdefault(level[node.name], []).append(node)
    return Partition(tuple(_steps(graph, level, broken, members)))


def _reads_break(node: Node) -> bool:
    """A getitem on a break's tuple runs with the break (as Python indexing)."""
    return node.target.__name__ == "getitem" if callable(node.target) else False


def _steps(graph, level, broken, members) -> list[Segment | Break]:
    steps: list[Segment | Break] = []
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    last = max([*level.values(), -1]) + 1
    for k in range(last + 1):
        steps += sorted((b for name, b in broken.items() if level[name] == k),
                        key=lambda b: order[b.node.name])
        for run in _block_runs(members.get(k, [])):
            steps.append(_segment(len([s for s in steps if isinstance(s, Segment)]), run))
    return steps


def _block_runs(nodes: list[Node]) -> list[list[Node]]:
    """``nodes`` (graph order) cut where the repeated block they are in changes: one fusion
    per layer, so that identical layers share one built program (:mod:`.program`)."""
    runs: list[list[Node]] = []
    current = object()
    for node in nodes:
        block = block_path(node)
        if block != current:
            runs.append([])
            current = block
        runs[-1].append(node)
    return runs


def _segment(index: int, nodes: list[Node]) -> Segment:
    inside = {n.name for n in nodes}
    inputs: dict[str, Node] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.name not in inside:
                inputs.setdefault(a.name, a)
    outputs = [n for n in nodes if any(u.name not in inside for u in n.users)]
    return Segment(index, tuple(nodes), tuple(inputs.values()), tuple(outputs))
