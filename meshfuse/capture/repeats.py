"""Repeated layers traced once: a stack of identical blocks costs one block's trace.

``torch.export`` runs the module's Python for every layer; for a 32-layer model most of the
capture is that. meshfuse traces the first layer of each run of identical ones (the
*template*) and stands the others in with one node each, then copies the template's nodes in
their place, reading the layer's own parameters and buffers:

1. :func:`repeated_layers`: the children of a top-level ``ModuleList``/``ModuleDict`` (the
   numbered blocks, ``model.layers.3``) grouped by structure: class, every submodule's class,
   parameters and buffers (names, shapes, dtypes), and every plain attribute (an attribute
   holding the layer's own index, ``layer_idx``, is allowed to differ, where the forward
   does not compute with it: see 2). A layer whose ``layer_types`` entry, sliding window or
   any other attribute differs is traced itself.
2. :func:`traced_once`: during the trace, the template's call is wrapped in two marker ops
   (``enter``/``exit``, identities), and each other layer's forward is replaced by one
   ``repeat`` op whose outputs have the template's shapes, where its inputs have the
   template's structure, shapes and non-tensor values (else the layer runs its own forward,
   which fails, and the caller traces the module whole). The template's index attributes
   are watched meanwhile (:class:`_WatchedIndex`): a forward that computes with its index
   (ImageGPT's attention divides by ``layer_idx + 1``), which its copies would take as the
   template's, stops the trace, and the caller traces the module whole. The other layers'
   parameters and buffers are hidden from the trace (the tracer would lift each as a
   placeholder and make a fake tensor of it: a cost per layer).
3. :func:`expand_repeats`: on the traced graph, each ``repeat`` node becomes a copy of the
   template's nodes between its markers, with the layer's parameters and buffers (new
   placeholders, like the template's) and its module paths (so that plans, fusions per
   block and explain see ``model.layers.3``).

The plan plays no part: the trace of a layer does not depend on it (the build reads the
plan per copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.utils import _pytree as pytree

__all__ = ["expand_repeats", "repeated_layers", "traced_once"]

_NS = "meshfuse_capture"
# template path -> the record of its traced call, read by the repeat op's fake kernel.
_RECORDS: dict[str, _Record] = {}


@torch.library.custom_op(f"{_NS}::enter", mutates_args=())
def _enter(xs: list[torch.Tensor], path: str) -> list[torch.Tensor]:
    return [x.clone() for x in xs]


@_enter.register_fake
def _enter_fake(xs, path):
    return [torch.empty_like(x) for x in xs]


@torch.library.custom_op(f"{_NS}::exit", mutates_args=())
def _exit(xs: list[torch.Tensor], path: str) -> list[torch.Tensor]:
    return [x.clone() for x in xs]


@_exit.register_fake
def _exit_fake(xs, path):
    return [torch.empty_like(x) for x in xs]


@torch.library.custom_op(f"{_NS}::repeat", mutates_args=())
def _repeat(xs: list[torch.Tensor], template: str, path: str) -> list[torch.Tensor]:
    raise AssertionError("meshfuse's repeat marker runs only under torch.export")


@_repeat.register_fake
def _repeat_fake(xs, template, path):
    return [torch.empty(s, dtype=d, device=v) for s, d, v in _RECORDS[template].outputs]


@dataclasses.dataclass
class _Record:
    """What the template's traced call took and returned (tensors by metadata)."""

    spec: Any
    leaves: list  # the input leaves, tensors as (shape, dtype, device)
    out_spec: Any
    out_leaves: list  # the output leaves, tensors as None
    out_tensors: list[bool]  # which output leaves are tensors
    outputs: list  # (shape, dtype, device) of each output tensor


def _meta(x: Any) -> Any:
    return (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else x


def repeated_layers(module: torch.nn.Module) -> dict[str, list[str]]:
    """Template path -> the paths of the later layers identical to it (see the module doc)."""
    groups: dict[str, list[str]] = {}
    for path, container in module.named_modules():
        if not isinstance(container, torch.nn.ModuleList | torch.nn.ModuleDict) or \
                any(part.isdigit() for part in path.split(".")):
            continue
        templates: list[tuple[str, torch.nn.Module, int]] = []
        for name, layer in container.named_children():
            if not name.isdigit():
                continue
            child = f"{path}.{name}" if path else name
            match = next((t for t in templates if _same(t[1], int(t[2]), layer, int(name))),
                         None)
            if match is None:
                templates.append((child, layer, int(name)))
                groups[child] = []
            else:
                groups[match[0]].append(child)
    return {t: copies for t, copies in groups.items() if copies}


def _same(a: torch.nn.Module, i: int, b: torch.nn.Module, j: int, depth: int = 0) -> bool:
    """``a`` (layer ``i``) and ``b`` (layer ``j``) trace alike (``depth``: how deep in the
    attributes of the layers compared, see :func:`_same_value`)."""
    mods_a, mods_b = dict(a.named_modules()), dict(b.named_modules())
    if mods_a.keys() != mods_b.keys():
        return False
    for name, m in mods_a.items():
        n = mods_b[name]
        if type(m) is not type(n) or type(m).forward is not type(n).forward:
            return False
        if "forward" in vars(m) or "forward" in vars(n):
            return False
        if not _same_tensors(m._parameters, n._parameters) or \
                not _same_tensors(m._buffers, n._buffers):
            return False
        if not _same_attributes(m, i, n, j, depth):
            return False
        if any(getattr(m, h) or getattr(n, h) for h in _HOOKS):
            return False
    return True


_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def _same_tensors(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        (a[k] is None) == (b[k] is None) and (a[k] is None or (
            a[k].shape == b[k].shape and a[k].dtype == b[k].dtype
            and a[k].requires_grad == b[k].requires_grad)) for k in a)


# what every module holds of its own (parameters, buffers, submodules, hooks): compared by
# _same itself, not as attributes
_MODULE_STATE = frozenset(vars(torch.nn.Module()))
_MAX_DEPTH = 4  # containers and helper modules within the layers' attributes compared


def _same_attributes(m: torch.nn.Module, i: int, n: torch.nn.Module, j: int,
                     depth: int = 0) -> bool:
    """Whether modules ``m`` (of layer ``i``) and ``n`` (of layer ``j``) hold the same
    attributes, private ones included (a forward reading ``self._gain`` would take the
    template's in a copy), but the layers' own indices (:func:`_holds_index`)."""
    va = {k: v for k, v in vars(m).items() if k not in _MODULE_STATE}
    vb = {k: v for k, v in vars(n).items() if k not in _MODULE_STATE}
    return va.keys() == vb.keys() and all(
        _holds_index(x, vb[key], i, j) or _same_value(x, vb[key], depth)
        for key, x in va.items())


def _same_value(x: Any, y: Any, depth: int) -> bool:
    """Whether attribute values ``x`` and ``y`` of two layers let one's trace stand for the
    other's: the same object or equal values of one type; lists, tuples and dicts item by
    item, and helper modules without tensors held outside the module tree (a dict of
    function modules, one instance per layer: Llama's ``_kernel_funcs``) as layers are;
    never tensors (a copy would read the template's), nor values deeper than
    :data:`_MAX_DEPTH` or that cannot be compared."""
    if x is y:
        return True
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or type(x) is not type(y) \
            or depth >= _MAX_DEPTH:
        return False
    if isinstance(x, torch.nn.Module):
        held = itertools.chain(x.parameters(), x.buffers(), y.parameters(), y.buffers())
        return next(held, None) is None and _same(x, -1, y, -1, depth + 1)
    if isinstance(x, list | tuple):
        return len(x) == len(y) and all(_same_value(a, b, depth + 1) for a, b in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same_value(x[k], y[k], depth + 1) for k in x)
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - an object whose == is not a truth value
        return False


def _holds_index(x: Any, y: Any, i: int, j: int) -> bool:
    """Whether attribute values ``x`` of layer ``i`` and ``y`` of layer ``j`` are the
    layers' own indices (``layer_idx``): the one attribute copies may differ in, watched
    while the template is traced (:func:`traced_once`)."""
    return type(x) is int and type(y) is int and (x, y) == (i, j)


class IndexReadError(RuntimeError):
    """A template's forward read the layer index its copies hold otherwise (its trace is
    not theirs: the caller traces every layer)."""


class _WatchedIndex(int):
    """A template's layer index while its forward is traced (:func:`traced_once`): the same
    int, which notes any use of its value (arithmetic, comparison, hashing, formatting,
    conversion) in :data:`_INDEX_READS`. Copies of a layer may hold another index
    (``layer_idx``) only where the forward never computes with it: ImageGPT's attention
    divides by ``layer_idx + 1``, which a copy traced as the template would take as the
    template's."""

    path: str


_INDEX_READS: set[str] = set()  # templates whose forward used their watched index


def _watching(name: str):
    method = getattr(int, name)

    def watched(self, *args):
        _INDEX_READS.add(self.path)
        return method(self, *args)
    return watched


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
              "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__", "__invert__",
              "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__",
              "__rlshift__", "__rshift__", "__rrshift__", "__eq__", "__ne__", "__lt__",
              "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__index__", "__int__",
              "__float__", "__str__", "__repr__", "__format__", "__round__", "__trunc__",
              "__floor__", "__ceil__", "__divmod__", "__rdivmod__"):
    setattr(_WatchedIndex, _name, _watching(_name))


def _watched(index: int, path: str) -> _WatchedIndex:
    value = _WatchedIndex(index)
    value.path = path
    return value


def _index_attributes(module: torch.nn.Module, template: str, copy: str) -> list:
    """(submodule, attribute name) of the template layer's int attributes that hold its
    index where the copy's hold the copy's (what :func:`_same_attributes` lets differ)."""
    i, j = int(template.rsplit(".", 1)[-1]), int(copy.rsplit(".", 1)[-1])
    theirs = dict(module.get_submodule(copy).named_modules())
    found = []
    for name, m in module.get_submodule(template).named_modules():
        other = vars(theirs[name])
        found += [(m, key) for key, value in vars(m).items()
                  if _holds_index(value, other.get(key), i, j)]
    return found


@contextlib.contextmanager
def traced_once(module: torch.nn.Module, groups: Mapping[str, list[str]]) -> Iterator[None]:
    """During a trace of ``module``: templates marked, their copies stood in, the templates'
    layer indices watched (module doc)."""
    patched, hidden, indices = [], [], []
    try:
        for template, copies in groups.items():
            layer = module.get_submodule(template)
            layer.forward = _marked(layer.forward, template)
            patched.append(layer)
            for m, key in _index_attributes(module, template, copies[0]):
                indices.append((m, key, vars(m)[key]))
                vars(m)[key] = _watched(vars(m)[key], template)
            for path in copies:
                copy = module.get_submodule(path)
                copy.forward = _stand_in(copy.forward, template, path)
                patched.append(copy)
                for m in copy.modules():
                    hidden.append((m, m._parameters, m._buffers))
                    m._parameters, m._buffers = {}, {}
        yield
    finally:
        for m, key, value in indices:
            vars(m)[key] = value
        for m, parameters, buffers in hidden:
            m._parameters, m._buffers = parameters, buffers
        for layer in patched:
            vars(layer).pop("forward", None)
        for template in groups:
            _RECORDS.pop(template, None)


def _marked(forward, path: str):
    def marked(*args, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        flat = _through(torch.ops.meshfuse_capture.enter, flat, path)
        args, kwargs = pytree.tree_unflatten(flat, spec)
        _INDEX_READS.discard(path)
        out = forward(*args, **kwargs)
        if path in _INDEX_READS:
            raise IndexReadError(f"{path}'s forward computes with its layer index: each "
                                 "layer is traced itself")
        out_flat, out_spec = pytree.tree_flatten(out)
        _RECORDS[path] = _Record(
            spec, [_meta(x) for x in flat], out_spec,
            [None if isinstance(x, torch.Tensor) else x for x in out_flat],
            [isinstance(x, torch.Tensor) for x in out_flat],
            [_meta(x) for x in out_flat if isinstance(x, torch.Tensor)])
        out_flat = _through(torch.ops.meshfuse_capture.exit, out_flat, path)
        return pytree.tree_unflatten(out_flat, out_spec)
    return marked


def _through(op, flat: list, path: str) -> list:
    """``flat`` with its tensors passed through the marker ``op``."""
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if not tensors:
        return flat
    marked = iter(op(tensors, path))
    return [next(marked) if isinstance(x, torch.Tensor) else x for x in flat]


def _stand_in(forward, template: str, path: str):
    def stand_in(*args, **kwargs):
        record = _RECORDS.get(template)
        flat, spec = pytree.tree_flatten((args, kwargs))
        if record is None or spec != record.spec or not _same_leaves(flat, record.leaves):
            return forward(*args, **kwargs)
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        outs = iter(torch.ops.meshfuse_capture.repeat(tensors, template, path))
        leaves = [next(outs) if tensor else x
                  for x, tensor in zip(record.out_leaves, record.out_tensors)]
        return pytree.tree_unflatten(leaves, record.out_spec)
    return stand_in


def _same_leaves(flat: list, leaves: list) -> bool:
    if len(flat) != len(leaves):
        return False
    for x, y in zip(flat, leaves):
        x = _meta(x)
        try:
            if not (x is y or bool(x == y)):
                return False
        except Exception:  # noqa: BLE001 - an object whose == is not a truth value
            return False
    return True


class RepeatError(Exception):
    """The stood-in layers could not be expanded (the caller traces every layer instead)."""


def expand_repeats(graph: Graph, parameters: Mapping[str, str], buffers: Mapping[str, str]
                   ) -> tuple[dict[str, str], dict[str, str]]:
    """Each ``repeat`` node of ``graph`` replaced by a copy of its template's nodes (module
    doc); ``parameters``/``buffers``: placeholder -> name in the module.

    Returns:
        ``parameters`` and ``buffers`` with the placeholders added for the copies' own.

    Raises:
        RepeatError: a template traced more than once.
    """
    parameters, buffers = dict(parameters), dict(buffers)
    markers = _markers(graph)
    if not markers["repeat"]:
        if markers["enter"] or markers["exit"]:
            _unmark(graph, markers)
        return parameters, buffers
    nodes = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    bodies = _bodies(graph, markers)
    for repeat in markers["repeat"]:
        _, template, path = repeat.args
        if template not in bodies:
            raise RepeatError(f"no traced call of {template}")
        enter, exit_ = markers["enter"][template], markers["exit"][template]
        body = bodies[template]
        values: dict[Node, Any] = {u: repeat.args[0][u.args[1]] for u in enter.users}
        for table in (parameters, buffers):
            for p, name in list(table.items()):
                if name.startswith(f"{template}."):
                    own = path + name[len(template):]
                    values[nodes[p]] = _placeholder(graph, nodes[p], own, table)
        with graph.inserting_before(repeat):
            for n in body:
                values[n] = graph.node_copy(n, lambda a, v=values: v.get(a, a))
                values[n].meta["nn_module_stack"] = _moved(n.meta, template, path)
        outputs = [values.get(a, a) for a in exit_.args[0]]
        for user in list(repeat.users):
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(repeat)
    _unmark(graph, markers)
    graph.lint()
    return parameters, buffers


def _placeholder(graph: Graph, like: Node, name: str, table: dict[str, str]) -> Node:
    """A placeholder for the module's ``name`` (a copy's parameter or buffer), with the
    metadata of ``like`` (its template's), entered in ``table``."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        node = graph.placeholder(f"{like.name[:2]}{name.replace('.', '_')}")
    node.meta = dict(like.meta)
    table[node.name] = name
    return node


def _bodies(graph: Graph, markers: Mapping[str, Any]) -> dict[str, list[Node]]:
    """Each template's nodes: those between its markers (the enter's getitems left out)."""
    bodies: dict[str, list[Node]] = {}
    inside: str | None = None
    for node in graph.nodes:
        if node.target is torch.ops.meshfuse_capture.exit.default:
            inside = None
        if inside is not None and not (node.target is operator.getitem and
                                       node.args[0] is markers["enter"][inside]):
            bodies[inside].append(node)
        if node.target is torch.ops.meshfuse_capture.enter.default:
            if inside is not None:
                raise RepeatError(f"{node.args[1]} is called inside {inside}")
            inside = node.args[1]
            bodies[inside] = []
    return {t: b for t, b in bodies.items() if t in markers["exit"]}


def _markers(graph: Graph) -> dict[str, Any]:
    ops = torch.ops.meshfuse_capture
    found: dict[str, Any] = {"enter": {}, "exit": {}, "repeat": []}
    for node in graph.nodes:
        for kind, op in (("enter", ops.enter.default), ("exit", ops.exit.default)):
            if node.target is op:
                if node.args[1] in found[kind]:
                    raise RepeatError(f"{node.args[1]} was called more than once")
                found[kind][node.args[1]] = node
        if node.target is ops.repeat.default:
            found["repeat"].append(node)
    return found


def _unmark(graph: Graph, markers: Mapping[str, Any]) -> None:
    """The templates' markers replaced by the values they pass on."""
    for kind in ("enter", "exit"):
        for node in markers[kind].values():
            for user in list(node.users):
                user.replace_all_uses_with(node.args[0][user.args[1]])
                graph.erase_node(user)
            graph.erase_node(node)


def _moved(meta: Mapping[str, Any], template: str, path: str) -> dict:
    """A copied node's module stack, with the template's path as the layer's."""
    moved = {}
    for key, (where, kind) in (meta.get("nn_module_stack") or {}).items():
        if where == template or where.startswith(f"{template}."):
            where = path + where[len(template):]
        moved[key] = (where, kind)
    return moved
