"""Partition: a captured graph as fusions and graph breaks, in the order they run.

Three passes over the graph (none changes the user's module):

1. :func:`simplify`: ops with no value (metadata asserts) are dropped, and ops that return
   their input (``clone``, ``contiguous``, ``alias``...) are replaced by it; grouped-query
   attention is read as such (:func:`read_grouped_heads`: an attention whose keys and
   values the model repeated over the query heads' groups reads the key/value heads).
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
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch.fx import Node

from meshfuse.capture.aten_ops import DROPPED, IDENTITIES, translation
from meshfuse.capture.trace import Captured, block_path, module_path

aten = torch.ops.aten

__all__ = ["Break", "Partition", "Segment", "fold", "partition", "read_grouped_heads",
           "simplify"]


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
    """Drops value-less ops, forwards identities and reads grouped-query attention as such
    (on the capture's own graph)."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in DROPPED and not node.users:
            graph.erase_node(node)
        elif node.target in IDENTITIES and isinstance(node.args[0], Node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    read_grouped_heads(graph)


# Grouped-query attention. ``transformers``' Llama, Qwen2, Mistral (and most grouped-query
# decoders) repeat each key/value head over its group before attention (``repeat_kv``:
# ``unsqueeze(2)``, ``expand``, ``reshape``), so the captured program would copy the keys
# and values ``H / Hkv`` times at every layer, and the attention's backward would read the
# copies (on a Llama-3.2-1B step: 32 copy kernels of 32 MiB each, and their memory).
# meshfuse's attention takes ``Hkv`` key/value heads as they are (PyTorch's
# ``enable_gqa=True``: query head ``h`` attends with key/value head ``h // (H / Hkv)``, as
# the repeat lays them out), and its backward sums each group's gradients inside the kernel.

_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def read_grouped_heads(graph: torch.fx.Graph) -> int:
    """Rewrites each ``scaled_dot_product_attention`` of ``graph`` (the capture's own) whose
    ``k`` and ``v`` are both repeats of ``[B, Hkv, S, E]`` tensors over the query heads'
    groups to read those tensors; returns how many it rewrote."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.scaled_dot_product_attention.default:
            continue
        q, k, v = node.args[:3]
        sources = [_repeated(x, _heads(q)) for x in (k, v)]
        if None in sources or node.kwargs.get("enable_gqa", False):
            continue
        node.args = (q, *sources, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for repeat in dict.fromkeys((k, v)):  # one repeat may feed both
            _drop_unused(graph, repeat)
        rewritten += 1
    return rewritten


def _heads(x) -> int | None:
    val = x.meta.get("val") if isinstance(x, Node) else None
    return int(val.shape[1]) if val is not None and val.dim() == 4 else None


def _repeated(x, heads: int | None) -> Node | None:
    """The ``[B, Hkv, S, E]`` tensor that ``x`` repeats over ``heads / Hkv`` groups as
    ``repeat_kv`` does (``reshape(expand(unsqueeze(t, 2), [B, Hkv, G, S, E]), [B, Hkv * G, S,
    E])``), or None."""
    if heads is None or not isinstance(x, Node) or x.target not in _RESHAPES:
        return None
    expand = x.args[0]
    if not isinstance(expand, Node) or expand.target != aten.expand.default:
        return None
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, Node) or unsqueeze.target != aten.unsqueeze.default \
            or unsqueeze.args[1] not in (2, -3):
        return None
    source = unsqueeze.args[0]
    vals = [n.meta.get("val") if isinstance(n, Node) else None
            for n in (source, expand, x)]
    if any(v is None for v in vals):
        return None
    src, expanded, out = (tuple(int(d) for d in v.shape) for v in vals)
    if len(src) != 4 or len(expanded) != 5:
        return None
    b, kv_heads, s, e = src
    group = expanded[2]
    if expanded != (b, kv_heads, group, s, e) or out != (b, kv_heads * group, s, e) \
            or kv_heads * group != heads:
        return None
    return source


def _drop_unused(graph: torch.fx.Graph, node: Node) -> None:
    """Erases ``node`` and then its inputs, as long as nothing else uses them (the repeat's
    reshape, expand and unsqueeze)."""
    while isinstance(node, Node) and node.op == "call_function" and not node.users:
        source = node.args[0]
        graph.erase_node(node)
        node = source


def _static_placeholders(captured: Captured) -> set[str]:
    return set(captured.buffers) | set(captured.constants) | set(captured.attributes)


def static_nodes(captured: Captured, sources: Collection[str] | None = None) -> list[Node]:
    """The call nodes that depend on no parameter and no user input, in graph order
    (random ops excluded: each call draws anew); ``sources``: the placeholders they may
    read (default: every buffer, constant and attribute)."""
    static = _static_placeholders(captured) if sources is None else set(sources)
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
