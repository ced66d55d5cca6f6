"""Regions: the higher-order ops of the training IR that wrap a piece of the module's own code.

``torch.export`` keeps a ``with torch.no_grad():`` block (or a ``@torch.no_grad()`` function,
as Hugging Face's rotary embedding of some releases is) as one ``wrap_with_set_grad_enabled``
node, and a ``with torch.autocast(...)`` block as one ``wrap_with_autocast`` node; each calls a
submodule that holds the block's ATen ops. meshfuse inlines both, so that the block's ops are
folded, fused and sharded like the others:

- a block with gradients off: its ops, and a ``detach`` of each value it returns (a
  ``stop_gradient`` in the fusion: no gradient flows back into it);
- an autocast block: its ops, each floating input cast to the dtype its op computed in (the
  trace recorded it as the op's output dtype: autocast casts the inputs of ``linear`` to
  bfloat16, of ``softmax`` to float32). A block with autocast off adds no cast.

Any other higher-order op (``cond``, ``invoke_subgraph``, ...) stays a graph break; its
submodules are in :attr:`Captured.attributes`, so the break calls it with them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch.fx import Graph, GraphModule, Node

__all__ = ["inline_regions"]

aten = torch.ops.aten


def _operands_set_grad(node: Node) -> tuple[Node, tuple, bool, torch.dtype | None]:
    enabled, body, *operands = node.args
    return body, tuple(operands), not enabled, None


def _operands_autocast(node: Node) -> tuple[Node, tuple, bool, torch.dtype | None]:
    _device, _dtype, enabled, _cache, body, *operands = node.args
    return body, tuple(operands), False, _dtype if enabled else None


# The wrapping higher-order ops: name -> (body, operands, detach outputs, autocast dtype).
_WRAPPERS: dict[str, Callable[[Node], tuple]] = {
    "wrap_with_set_grad_enabled": _operands_set_grad,
    "wrap_with_autocast": _operands_autocast,
}


def inline_regions(module: GraphModule) -> None:
    """Inlines the grad-mode and autocast blocks of ``module``'s graph (in place: the graph is
    the capture's own), nested blocks included."""
    graph = module.graph
    for node in list(graph.nodes):
        wrapper = _WRAPPERS.get(_hop_name(node))
        if wrapper is None or not all(_is_getitem(u) for u in node.users):
            continue
        body, operands, detach, autocast = wrapper(node)
        inner = getattr(module, body.target)
        inline_regions(inner)
        with graph.inserting_before(node):
            outputs = _copy_body(graph, module, inner, operands, autocast)
            if detach:
                outputs = [_detached(graph, v) for v in outputs]
        for user in list(node.users):
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not body.users:
            graph.erase_node(body)
    graph.lint()


def _hop_name(node: Node) -> str:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.HigherOrderOperator):
        return ""
    return target.name()


def _is_getitem(node: Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _copy_body(graph: Graph, owner: GraphModule, inner: GraphModule, operands: tuple,
               autocast: torch.dtype | None) -> list:
    """``inner``'s nodes copied into ``graph`` on ``operands``; its returned values."""
    values: dict[Node, object] = {}
    casts: dict[tuple[Node, torch.dtype], Node] = {}
    placeholders = [n for n in inner.graph.nodes if n.op == "placeholder"]
    values.update(zip(placeholders, operands))
    for node in inner.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            return list(torch.fx.node.map_arg(node.args[0], lambda n: values[n]))
        if node.op == "get_attr":  # a nested higher-order op's submodule
            values[node] = _attribute(graph, owner, getattr(inner, node.target))
            continue
        cast = _casts(graph, node, values, casts) if autocast is not None else {}
        values[node] = graph.node_copy(node, lambda n, cast=cast: cast.get(n, values[n]))
    raise AssertionError("a graph without an output node")


def _attribute(graph: Graph, owner: GraphModule, value: torch.nn.Module) -> Node:
    name = f"_region_{len(list(owner.named_children()))}"
    owner.register_module(name, value)
    return graph.get_attr(name)


def _casts(graph: Graph, node: Node, values: dict[Node, object],
           made: dict[tuple[Node, torch.dtype], Node]) -> dict[Node, Node]:
    """Autocast's casts before ``node`` (inner input -> its cast): each floating input of
    another dtype than the floating output the trace recorded is cast to it (one cast per
    value and dtype, in ``made``)."""
    out = node.meta.get("val")
    if node.op != "call_function" or not isinstance(out, torch.Tensor) or \
            not out.dtype.is_floating_point:
        return {}
    casts = {}
    for arg in node.all_input_nodes:
        value = values[arg]
        val = value.meta.get("val") if isinstance(value, Node) else None
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point or \
                val.dtype == out.dtype:
            continue
        if (value, out.dtype) not in made:
            cast = graph.call_function(aten.to.dtype, (value, out.dtype))
            cast.meta = {**value.meta, "val": val.to(out.dtype)}
            cast.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
            made[(value, out.dtype)] = cast
        casts[arg] = made[(value, out.dtype)]
    return casts


def _detached(graph: Graph, value: object) -> object:
    if not isinstance(value, Node):
        return value
    node = graph.call_function(aten.detach.default, (value,))
    node.meta = dict(value.meta)
    return node
