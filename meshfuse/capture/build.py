"""Build: one fusion segment of a captured graph as a meshfuse ``FusionDefinition``.

Each input of the segment becomes a ``define_tensor`` with its global shape and dtype (a
Python number stays a constant); each node adds the meshfuse ops of its translation
(:mod:`.aten_ops`). Where the plan pins a module's boundary layout
(:class:`~meshfuse.capture.plan.ModuleLayouts`), the value crossing it is copied (``set``)
and the copy is scheduled with the placements: the module's nodes read the copy of an
input, the nodes after it read the copy of an output, and propagation fills the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Placement, Shard
from torch.fx import Node

from meshfuse.capture.aten_ops import as_traced, translation
from meshfuse.capture.partition import Segment
from meshfuse.capture.plan import ResolvedPlan
from meshfuse.capture.trace import module_paths
from meshfuse.dtensor import schedule_from_placements
from meshfuse.dtypes import DataType
from meshfuse.errors import MeshfuseError
from meshfuse.frontend.fusion_definition import FusionDefinition
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.tensor_view import TensorView
from meshfuse.parallel.fsdp.transform import carry_batch

__all__ = ["BuiltSegment", "build_segment"]


@dataclasses.dataclass(frozen=True)
class BuiltSegment:
    """A segment's fusion: its inputs are ``segment.inputs`` whose positions are in
    ``tensor_inputs`` (the others are constants of the fusion), its outputs
    ``segment.outputs``."""

    segment: Segment
    fd: FusionDefinition
    tensor_inputs: tuple[int, ...]


def build_segment(segment: Segment, plan: ResolvedPlan, mesh: DeviceMesh,
                  constants: Mapping[str, Any], parameters: Mapping[str, str],
                  batch: frozenset[int] = frozenset()) -> BuiltSegment:
    """The fusion of ``segment``; ``constants`` are the folded values (a Python number
    among them is inlined), ``parameters`` the placeholders that are parameters (-> their
    names), ``batch`` the positions of the inputs whose first axis is the batch split over
    ``plan.batch_axis`` (fully sharded: the pinned copies of activations keep that split)."""
    fd = FusionDefinition()
    values: dict[str, Any] = {}
    positions = []
    with fd:
        for i, node in enumerate(segment.inputs):
            value = constants.get(node.name, node.meta.get("val"))
            if isinstance(value, torch.Tensor):
                values[node.name] = fd.define_tensor(list(value.shape),
                                                     dtype=DataType.from_torch(value.dtype))
                positions.append(i)
            else:
                values[node.name] = value
        pins = _Pins(plan, mesh, fd, parameters)
        pins.carried = {values[segment.inputs[i].name].materialized()[0] for i in batch
                        if isinstance(values.get(segment.inputs[i].name), TensorView)}
        for node in segment.nodes:
            _emit(fd, node, values, pins, constants)
        for node in segment.outputs:
            fd.add_output(pins.outside(node, values[node.name]))
    return BuiltSegment(segment, fd, tuple(positions))


def _emit(fd: FusionDefinition, node: Node, values: dict[str, Any], pins: _Pins,
          constants: Mapping[str, Any]) -> None:
    entry, _ = translation(node, constants)
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                         lambda a: pins.inside(a, node, values[a.name]))
    try:
        out = node.meta.get("val")
        values[node.name] = as_traced(fd.ops, out, entry.emit(fd.ops, out, *args, **kwargs))
    except MeshfuseError as error:
        raise type(error)(f"{node.target} ({node.name}, in {module_paths(node)[-1:] or 'the top'}"
                          f" module): {error}") from error


class _Pins:
    """The ``set`` copies of values crossing pinned module boundaries, made once each."""

    def __init__(self, plan: ResolvedPlan, mesh: DeviceMesh, fd: FusionDefinition,
                 parameters: Mapping[str, str]) -> None:
        self.plan, self.mesh, self.fd, self.parameters = plan, mesh, fd, parameters
        self.copies: dict[tuple[str, str], TensorView] = {}
        self.carried: set = set()  # the IDs that are the batch axis split over batch_axis
        self._seen = 0  # the fusion's expressions whose outputs were looked at for them

    def inside(self, source: Node, reader: Node, value: Any) -> Any:
        """What ``reader`` reads of ``source``: the pinned copy where ``source`` enters a
        module with an input layout (a parameter never does), else the value, or the
        pinned output copy where ``source`` leaves such a module."""
        if not isinstance(value, TensorView):
            return value
        layout = self.plan.gathered.get(self.parameters.get(source.name))
        if layout is not None:  # a fully sharded parameter, read gathered
            return self._copy(("param", source.name), value, layout)
        inner = set(module_paths(reader))
        outer = set(module_paths(source))
        if source.name not in self.parameters:
            for path in sorted(inner - outer, key=len):
                layouts = self.plan.modules.get(path)
                if layouts is not None and layouts.inputs is not None:
                    # One copy per value and layout: q, k and v read one gathered input.
                    return self._copy(("in", source.name, layouts.inputs), value,
                                      layouts.inputs)
        return self._leaving(source, outer - inner, value)

    def outside(self, node: Node, value: Any) -> Any:
        """``node``'s value as read after every module it is in (a segment output)."""
        return self._leaving(node, set(module_paths(node)), value)

    def _leaving(self, node: Node, paths: set[str], value: Any) -> Any:
        for path in sorted(paths, key=len, reverse=True):
            layouts = self.plan.modules.get(path)
            if layouts is not None and layouts.outputs is not None and \
                    isinstance(value, TensorView):
                value = self._copy(("out", path, node.name), value, layouts.outputs)
        return value

    def _copy(self, key, value: TensorView, placement: Placement | tuple) -> TensorView:
        """The copy of ``value`` pinned to ``placement`` on the plan's axis (or a whole
        layout, one placement per mesh axis)."""
        if isinstance(placement, tuple):
            if key not in self.copies:
                self.copies[key] = self.fd.ops.set(value)
                schedule_from_placements(self.copies[key], self.mesh, placement)
            return self.copies[key]
        if key not in self.copies:
            axis = getattr(placement, "dim", 0)
            if value.ndim <= (axis if axis >= 0 else -axis - 1) or not value.dtype.is_floating:
                self.copies[key] = value
                return value
            copy = self.fd.ops.set(value)
            schedule_from_placements(copy, self.mesh, self._layout(value, placement))
            self.copies[key] = copy
        return self.copies[key]

    def _layout(self, value: TensorView, placement: Placement) -> tuple:
        """``placement`` on the plan's axis; on the data-parallel one ``Shard(0)`` where
        ``value``'s first axis is the split batch (else the pin would gather the batch, and
        every rank compute the whole of it), replicated elsewhere."""
        layout = self.plan.layout(placement)
        axis = self.plan.batch_axis
        if axis is None or not self.carried or axis == self.plan.ndim - 1:
            return layout
        exprs = self.fd.fusion.exprs
        carry_batch(exprs[self._seen:], self.carried)
        self._seen = len(exprs)
        first = value.materialized()[0] if value.materialized() else None
        if first not in self.carried:
            return layout
        return tuple(Shard(0) if i == axis else p for i, p in enumerate(layout))


def segment_key(segment: Segment, plan: ResolvedPlan, constants: Mapping[str, Any],
                parameters: Mapping[str, str]) -> tuple:
    """Everything the fusion of ``segment`` is built from, with the names of its values and
    its block's path left out: two layers of a stack get the same key, and share one built
    program. ``parameters``: placeholder -> parameter name."""
    index = {n.name: i for i, n in enumerate(segment.inputs)}
    index.update({n.name: len(index) + j for j, n in enumerate(segment.nodes)})
    block = segment.block

    def relative(path: str) -> str:
        return path.removeprefix(block)

    items: list[tuple] = []
    for node in segment.inputs:
        layout = plan.parameters.get(parameters.get(node.name, ""))
        items.append(("input", _meta(constants.get(node.name, node.meta.get("val"))), layout))
    for node in segment.nodes:
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{index[a.name]}")
        pins = tuple((relative(p), plan.modules.get(p)) for p in module_paths(node))
        items.append((str(node.target), repr(args), _meta(node.meta.get("val")), pins))
    items.append(("outputs", *(index[n.name] for n in segment.outputs)))
    return tuple(items)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, list | tuple):
        return tuple(_meta(v) for v in value)
    return repr(value)
