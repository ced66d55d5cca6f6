"""A captured model's graph cut into pipeline stages at module boundaries.

The whole model is traced once (:func:`meshfuse.capture.trace.capture`, one microbatch);
each split point names a module, and its stage starts at the first op that module's forward
runs. Every op goes to the stage of its position in the graph (the trace's program order),
so what a model computes between its layers (Hugging Face decoders: the rotary position
embeddings, the causal mask, the position ids) runs where the model computes it. The
values a later stage reads are that boundary's *bundle*: every value made before the
boundary and read after it (the hidden states), in graph order, passed on through the
stages in between; a stage takes the previous bundle as its inputs and returns the next
(the last stage returns the model's outputs). But a value that depends on no input and no
parameter (a decoder's causal mask, made from positions alone; its rotary cos and sin, from
positions and a buffer that every stage holds: ``shared``) is computed again by each stage
that reads it, not sent: a few small ops against a message per microbatch, and a stage's
attention then sees its mask made in its own graph, as causal, where a received mask is
any mask. Parameters and buffers are read where the ops reading them run (a parameter read
on both sides of a boundary is refused, but one that each stage reading it holds a copy
of: a weight tied across stages, :mod:`meshfuse.capture.pipeline.ties`); non-tensor
arguments (flags, scales, shapes) are part of the traced ops and need no sending.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Collection, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from meshfuse.capture.partition import static_nodes
from meshfuse.capture.trace import Captured, module_paths
from meshfuse.errors import DefinitionError
from meshfuse.parallel.stages.messages import check_sendable

__all__ = ["StageGraph", "cut_graph"]


@dataclasses.dataclass(frozen=True)
class StageGraph:
    """One stage of a cut graph.

    Attributes:
        captured: the stage's program: the model's parameters, buffers and constants it
            reads, its positional inputs the received bundle (the first stage: the model's
            flattened inputs), its outputs the bundle it passes on (the last: the model's
            flattened outputs, which the whole graph's ``out_spec`` nests).
        receives: the received values' names in the whole graph, in order.
        sends: the passed-on values' names in the whole graph, in order (none for the last).
    """

    captured: Captured
    receives: tuple[str, ...]
    sends: tuple[str, ...]

    def copy(self) -> Captured:
        """The stage's program on a graph of its own (a build simplifies it in place)."""
        graph = torch.fx.Graph()
        out = graph.graph_copy(self.captured.graph, {})
        graph.output(out)
        return dataclasses.replace(self.captured, graph=graph)


def cut_graph(captured: Captured, split_points: Sequence[str],
              copies: Mapping[str, Mapping[int, str]] | None = None,
              shared: Collection[str] = ()) -> list[StageGraph]:
    """The stages of ``captured`` starting at the first op of each module of
    ``split_points`` (dotted module paths, in the order the forward runs them).
    ``copies``: a parameter's name -> the name each stage holding a copy of it reads it by
    (a weight tied across stages, :meth:`~meshfuse.capture.pipeline.ties.Tie.copies`);
    ``shared``: the buffers (by name in the module) that every stage holds, from which a
    stage computes values again rather than receive them (see the module doc).

    Raises:
        DefinitionError: a split point whose module runs no op, split points out of order,
            a parameter read on both sides of a boundary but not held by each side (a
            weight tied across stages that ``copies`` does not name), or a value crossing a
            boundary that is not a tensor.
        ScheduleError: a tensor crossing a boundary that messages cannot carry.
    """
    nodes = list(captured.graph.nodes)
    starts = [_start(nodes, point) for point in split_points]
    if starts != sorted(set(starts)):
        raise DefinitionError(f"pipeline split points {list(split_points)} must name modules in "
                              f"the order the forward runs them (their first ops are at "
                              f"{starts}); reorder them")
    stage = _stages(nodes, starts, captured)
    n = len(starts) + 1
    sources = {p for p, b in captured.buffers.items() if b in set(shared)} | \
        set(captured.constants)
    again = set(static_nodes(captured, sources))  # computed by each stage that reads them
    crossing = [_crossing(nodes, stage, k, n - 1, again) for k in range(n - 1)]
    copies = copies or {}
    _check_parameters(nodes, stage, captured, copies)
    return [_stage_graph(captured, nodes, stage, s, crossing[s - 1] if s else None,
                         crossing[s] if s < n - 1 else None, copies, again)
            for s in range(n)]


def _inside(node: torch.fx.Node, point: str) -> bool:
    return any(p == point or p.startswith(point + ".") for p in module_paths(node))


def _start(nodes: list[torch.fx.Node], point: str) -> int:
    for i, node in enumerate(nodes):
        if node.op == "call_function" and _inside(node, point):
            return i
    ran = list(dict.fromkeys(p for n in nodes for p in module_paths(n)[:3]))
    raise DefinitionError(f"pipeline split point {point!r}: no op of the traced forward runs "
                          f"in a module of that name; split at a module the forward calls, "
                          f"e.g. one of {ran[:12]}")


def _is_state(node: torch.fx.Node, captured: Captured) -> bool:
    """A parameter, buffer, constant or attribute: held by the stages, not sent."""
    return node.op == "get_attr" or (node.op == "placeholder" and (
        node.name in captured.parameters or node.name in captured.buffers or
        node.name in captured.constants))


def _stages(nodes: list[torch.fx.Node], starts: list[int], captured: Captured
            ) -> dict[torch.fx.Node, int]:
    """Each op's stage, by its position (a ``getitem`` by its source's, so tuples never
    cross), and the user inputs' (0); the state goes to every stage that reads it."""
    stage: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node.op == "call_function":
            source = node.args[0] if node.target is operator.getitem else None
            stage[node] = stage[source] if isinstance(source, torch.fx.Node) and \
                source in stage else sum(i >= s for s in starts)
        elif node.op == "placeholder" and not _is_state(node, captured):
            stage[node] = 0
    return stage


def _crossing(nodes: list[torch.fx.Node], stage: dict, k: int, last: int,
              again: Collection[torch.fx.Node]) -> list[torch.fx.Node]:
    """The values made at stage ``k`` or before and read after it, in graph order (but
    those each stage computes ``again``)."""
    out = []
    for node in nodes:
        if node not in stage or stage[node] > k or node in again:
            continue
        readers = [last if u.op == "output" else stage.get(u, 0) for u in node.users]
        if any(r > k for r in readers):
            out.append(node)
    return out


def _check_parameters(nodes: list[torch.fx.Node], stage: dict, captured: Captured,
                      copies: Mapping[str, Mapping[int, str]]) -> None:
    for node in nodes:
        if node.op == "placeholder" and node.name in captured.parameters:
            readers = sorted({stage[u] for u in node.users if u in stage})
            held = copies.get(captured.parameters[node.name], {})
            if len(readers) > 1 and not all(r in held for r in readers):
                raise DefinitionError(
                    f"parameter {captured.parameters[node.name]!r} is read by pipeline stages "
                    f"{readers} (a weight tied across stages, e.g. the embedding and the "
                    f"head); untie it (config tie_word_embeddings=False) or keep its "
                    f"readers in one stage")


def _stage_graph(captured: Captured, nodes: list[torch.fx.Node], stage: dict, s: int,
                 receives: list[torch.fx.Node] | None, sends: list[torch.fx.Node] | None,
                 copies: Mapping[str, Mapping[int, str]],
                 again: Collection[torch.fx.Node]) -> StageGraph:
    graph, env = torch.fx.Graph(), {}
    own = {n for n in nodes if stage.get(n) == s and n not in again}
    (out,) = [n for n in nodes if n.op == "output"]
    wanted = [*own, *(sends or ()), *([out] if sends is None else [])]
    mine_set = own | _made_again(wanted, again)
    mine = [n for n in nodes if n in mine_set]
    state = [n for n in nodes if _is_state(n, captured) and
             any(u in mine_set for u in n.users)]
    for node in state:  # the state this stage reads, then its inputs
        env[node] = _placeholder(graph, node) if node.op == "placeholder" else \
            graph.node_copy(node)
    inputs = _tensor_inputs(mine) if receives is None else receives
    for node in inputs:
        env[node] = _placeholder(graph, node)
    for node in mine:
        if node.op == "call_function":
            env[node] = graph.node_copy(node, lambda x: env[x])
    if sends is None:
        values = tuple(env[x] if isinstance(x, torch.fx.Node) else x for x in out.args[0])
    else:
        _check_tensors(sends, s)
        values = tuple(env[n] for n in sends)
    graph.output(values)
    names = {n.name for n in graph.nodes}
    program = Captured(
        graph,
        {k: copies.get(v, {}).get(s, v) for k, v in captured.parameters.items()
         if k in names},
        {k: v for k, v in captured.buffers.items() if k in names},
        {k: v for k, v in captured.constants.items() if k in names},
        tuple(env[n].name for n in inputs),
        pytree.tree_structure((tuple(range(len(inputs))), {})),
        pytree.tree_structure(tuple(range(len(values)))),
        {k: v for k, v in captured.attributes.items() if k in names})
    return StageGraph(program, tuple(n.name for n in receives or ()),
                      tuple(n.name for n in sends or ()))


def _made_again(wanted: Sequence[torch.fx.Node], again: Collection[torch.fx.Node]
                ) -> set[torch.fx.Node]:
    """The nodes of ``again`` that ``wanted`` read, directly or through each other."""
    found: set[torch.fx.Node] = set()
    todo = [a for n in wanted for a in n.all_input_nodes if a in again]
    while todo:
        node = todo.pop()
        if node not in found:
            found.add(node)
            todo += [a for a in node.all_input_nodes if a in again]
    return found


def _tensor_inputs(mine: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The model's tensor inputs (the first stage's): a non-tensor input (a flag) is part
    of the trace already."""
    inputs = []
    for node in (n for n in mine if n.op == "placeholder"):
        if isinstance(node.meta.get("val"), torch.Tensor):
            inputs.append(node)
        elif node.users:
            raise DefinitionError(f"the model's input {node.name!r} is a "
                                  f"{type(node.meta.get('val')).__name__} its ops read; a "
                                  f"pipelined model takes tensors (and flags fixed at the "
                                  f"trace): make it a tensor")
    return inputs


def _placeholder(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    new = graph.placeholder(node.name)
    new.meta = dict(node.meta)
    return new


def _check_tensors(sends: list[torch.fx.Node], s: int) -> None:
    for node in sends:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            where = module_paths(node)[-1:] or ["the top module"]
            raise DefinitionError(
                f"{node.name} ({node.target}, in {where[0]}) is made before the end of "
                f"pipeline stage {s} and read after it, but it is a "
                f"{type(node.meta.get('val')).__name__}, not a tensor; move the split "
                f"point so that it is made and read in one stage")
        # checked here, where every rank has the whole graph: found by the sending rank
        # alone, the next stage's would wait for the message
        check_sendable(tuple(node.meta["val"].shape), node.meta["val"].dtype)
