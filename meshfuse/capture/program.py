"""The program of one captured signature: folded constants, fusions and graph breaks, run in
order under torch autograd.

Values between steps are DTensors on the plan's mesh (a plain tensor enters a fusion as a
replicated DTensor). A fusion runs as ``fd.as_autograd_function()``: its backward is the
derived backward fusion, with its sharding and the transposed communications. A graph break
runs the PyTorch op on whole tensors (``full_tensor()``: the replicated fallback, correct and
only slower), so autograd differentiates it as PyTorch does.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.fx import Node
from torch.utils import _pytree as pytree

from meshfuse.autodiff.derivation import DEFAULT_REMAT
from meshfuse.capture.build import BuiltSegment, build_segment, segment_key
from meshfuse.capture.partition import Break, Segment, fold, partition, simplify, static_nodes
from meshfuse.capture.plan import ResolvedPlan
from meshfuse.capture.trace import Captured
from meshfuse.dtensor import mesh_from_torch
from meshfuse.errors import GraphBreakError, InputError

__all__ = ["GraphBreakWarning", "Program", "argument_name"]


class GraphBreakWarning(UserWarning):
    """Ops of a captured model that run as PyTorch ops between fusions (listed once)."""


class Program:
    """One captured signature of a module, ready to run.

    Args:
        captured: the trace (its graph is simplified in place: it is the capture's own).
        plan: the resolved plan.
        mesh: the torch mesh DTensors live on.
        buffers: the module's buffers by name (read by the folded constants).
        strict: raise on graph breaks instead of warning.
        remat: the rematerialization policy of the fusions' derived backwards.
    """

    def __init__(self, captured: Captured, plan: ResolvedPlan, mesh: TorchDeviceMesh,
                 buffers: Mapping[str, torch.Tensor], strict: bool = False,
                 remat: str = DEFAULT_REMAT) -> None:
        self.captured, self.plan, self.mesh, self.remat = captured, plan, mesh, remat
        simplify(captured.graph)
        self._static = static_nodes(captured)
        self._versions: tuple[int, ...] | None = None
        self.constants = self._fold(buffers)
        self.partition = partition(captured.graph, self.constants)
        _report_breaks(self.partition.breaks, strict)
        self._mf_mesh = mesh_from_torch(mesh)
        self.keys = {s.index: segment_key(s, plan, self.constants, captured.parameters)
                     for s in self.partition.segments}
        # (key, input layouts) -> the built fusion and its autograd function, shared by the
        # segments of that key (identical layers) whose inputs lie alike.
        self.built: dict[tuple, tuple[BuiltSegment, Any]] = {}
        self.ran: dict[int, tuple] = {}  # segment index -> the (key, layouts) it ran
        # folded constant (node name) -> (its tensor, version, the replicated DTensor on it)
        self._replicas: dict[str, tuple[torch.Tensor, int, DTensor]] = {}

    def _fold(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The folded values, recomputed when a buffer changed since the last fold."""
        versions = tuple(b._version for b in buffers.values())
        if versions != self._versions:
            inputs = {**{p: buffers[n] for p, n in self.captured.buffers.items()},
                      **self.captured.constants, **self.captured.attributes}
            self._folded = fold(self._static, inputs)
            self._versions = versions
        return self._folded

    def run(self, parameters: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
            flat_inputs: Sequence[Any]) -> list[Any]:
        """The flat outputs on ``flat_inputs`` (the call's flattened user inputs) with the
        module's ``parameters`` (DTensors) and ``buffers``."""
        c = self.captured
        env: dict[str, Any] = {**self._fold(buffers), **c.constants, **c.attributes}
        env.update({p: parameters[n] for p, n in c.parameters.items()})
        env.update({p: buffers[n] for p, n in c.buffers.items()})
        env.update(zip(c.user_inputs, flat_inputs))
        for step in self.partition.steps:
            if isinstance(step, Segment):
                self._run_segment(step, env)
            else:
                self._run_break(step, env)
        output = next(n for n in c.graph.nodes if n.op == "output")
        return [_returned(env[a.name]) if isinstance(a, Node) else a for a in output.args[0]]

    def _run_segment(self, segment: Segment, env: dict[str, Any]) -> None:
        values = [self._dtensor(env[n.name], n.name) for n in segment.inputs]
        layouts = tuple((x.device_mesh, x.placements) if isinstance(x, DTensor) else None
                        for x in values)
        found = (self.keys[segment.index], layouts)
        if found not in self.built:
            built = build_segment(segment, self.plan, self._mf_mesh, self.constants,
                                  dict(self.captured.parameters), self._batch(segment, layouts))
            self.built[found] = (built, built.fd.as_autograd_function(remat=self.remat))
        built, function = self.built[found]
        self.ran[segment.index] = found
        try:
            outputs = function([values[i] for i in built.tensor_inputs])
        except InputError as error:  # raised alike on every rank: each names it alike
            raise InputError(self._named(str(error), built)) from error
        env.update((n.name, v) for n, v in zip(segment.outputs, outputs))

    def _named(self, message: str, built: BuiltSegment) -> str:
        """``message`` with each input of ``built``'s fusion it names (``T3``) followed by
        what the user knows it as: the model's argument (``'input_ids'``), parameter or
        buffer, else the traced value's name."""
        c = self.captured
        arguments = self._argument_names()
        names = {}
        for tv, i in zip(built.fd.fusion.inputs(), built.tensor_inputs):
            node = built.segment.inputs[i].name
            names[tv.name] = arguments.get(node) or c.parameters.get(node) or \
                c.buffers.get(node) or node
        return re.sub(r"\bT\d+\b", lambda m: f"{m[0]} ({names[m[0]]!r})" if m[0] in names
                      else m[0], message)

    def _argument_names(self) -> dict[str, str]:
        """Placeholder name -> the model argument it is (``input_ids``, or a path into one:
        ``batch['ids']``), from how the call's ``(args, kwargs)`` flattened."""
        c = self.captured
        numbered = pytree.tree_unflatten(list(range(len(c.user_inputs))), c.in_spec)
        return {c.user_inputs[index]: argument_name(path)
                for path, index in pytree.tree_flatten_with_path(numbered)[0]}

    def _batch(self, segment: Segment, layouts: tuple) -> frozenset[int]:
        """The inputs of ``segment`` (not parameters) whose first axis is split over the
        plan's data-parallel mesh axis (fully sharded: the batch)."""
        axis = self.plan.batch_axis
        if axis is None:
            return frozenset()
        return frozenset(i for i, (node, layout) in enumerate(zip(segment.inputs, layouts))
                         if layout is not None and node.name not in self.captured.parameters
                         and layout[1][axis] == Shard(0))

    def _run_break(self, step: Break, env: dict[str, Any]) -> None:
        node = step.node
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                             lambda a: _whole(env[a.name]))
        env[node.name] = node.target(*args, **kwargs)

    def _dtensor(self, x: Any, name: str) -> Any:
        """A fusion input (the value of node ``name``): a DTensor, row-major as the fusion
        declares its inputs (a break's output may be a strided view). A folded constant's
        replicated DTensor is made once while the constant stays (the rotary tables and the
        masks every layer reads: two DTensors per layer and step otherwise)."""
        if not isinstance(x, torch.Tensor):
            return x
        if not isinstance(x, DTensor):
            kept = self._replicas.get(name)
            if kept is not None and kept[0] is x and kept[1] == x._version:
                return kept[2]
            replica = DTensor.from_local(x.contiguous(), self.mesh,
                                         [Replicate()] * self.mesh.ndim, run_check=False)
            if (name in self.constants or name in self.captured.constants) and \
                    not x.requires_grad and x.is_contiguous():
                self._replicas[name] = (x, x._version, replica)
            return replica
        if x._local_tensor.is_contiguous():  # read without to_local's autograd node
            return x
        return DTensor.from_local(x.to_local().contiguous(), x.device_mesh, x.placements,
                                  run_check=False, shape=x.shape, stride=x.stride())


def argument_name(path: tuple) -> str:
    """The model argument a pytree ``path`` into a call's ``(args, kwargs)`` leads to:
    ``input_ids`` (a keyword, or a path into one: ``batch['ids']``), else ``argument [0]``
    (a positional argument, or a path into one)."""
    args_or_kwargs, *rest = path
    keyword = getattr(rest[0], "key", None) if rest else None
    if getattr(args_or_kwargs, "idx", 0) == 1 and isinstance(keyword, str):
        return keyword + pytree.keystr(tuple(rest[1:]))
    return f"argument {pytree.keystr(tuple(rest))}"


def _whole(x: Any) -> Any:
    return _Gathered.apply(x) if isinstance(x, DTensor) else x


class _Gathered(torch.autograd.Function):
    """``x.full_tensor()`` for a graph break, whose backward passes a missing gradient on as
    missing. ``full_tensor``'s own redistribution node makes a missing gradient (a break's
    output that no loss reads: a router's mask) a plain tensor of zeros, then fails on it as
    not a DTensor. The gradient that comes is the whole one; each rank keeps its part (a
    partial input's gradient is the whole one, replicated)."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.layout = (x.device_mesh, x.placements)
        return x.full_tensor()

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> DTensor | None:
        if grad is None:
            return None
        mesh, placements = ctx.layout
        whole = DTensor.from_local(grad.contiguous(), mesh, [Replicate()] * mesh.ndim,
                                   run_check=False)
        kept = [Replicate() if p.is_partial() else p for p in placements]
        return whole.redistribute(mesh, kept)


def _returned(x: Any) -> Any:
    """An output: a replicated DTensor as its (whole) local tensor, others as they are."""
    if isinstance(x, DTensor) and all(p.is_replicate() for p in x.placements):
        return x.to_local()
    return x


def _report_breaks(breaks: list[Break], strict: bool) -> None:
    if not breaks:
        return
    lines = break_lines(breaks)
    if strict:
        raise GraphBreakError(
            f"{len(lines)} op(s) of the model have no meshfuse rule (strict=True):\n  "
            + "\n  ".join(lines) + "\nrun with strict=False to run them as PyTorch ops "
            "between fusions (replicated, correct but slower), or add their rules to "
            "meshfuse.capture.aten_ops.TABLE")
    warnings.warn(GraphBreakWarning(
        f"{len(lines)} op(s) run as PyTorch ops between fusions (graph breaks):\n  "
        + "\n  ".join(lines)), stacklevel=4)


def break_lines(breaks: list[Break]) -> list[str]:
    """One line per (op, module path, reason), with a count where it repeats."""
    counts: dict[str, int] = {}
    for b in breaks:
        line = b.describe()
        counts[line] = counts.get(line, 0) + 1
    return [line if n == 1 else f"{line} (x{n})" for line, n in counts.items()]
