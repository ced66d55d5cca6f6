"""``torch.compile(model, backend=meshfuse.backend(mesh, plan))``: the capture as a Dynamo
backend.

Dynamo hands each graph it captures (between its own graph breaks) to the backend, with the
module's parameters and buffers among the graph's inputs (their sources name them). The
backend traces that graph to the ATen training IR as :func:`meshfuse.parallelize` does,
reads the plan against the parameters' names and the modules of Dynamo's module stacks, and
runs the fusions.

The module stays as the user built it: its parameters are whole, plain tensors on every
rank. Each call takes this rank's shard of each parameter (no communication) and, in the
backward, gathers the parameter's gradient whole (so every rank's optimizer step is the
same). That is the price of leaving the module untouched; ``meshfuse.parallelize`` keeps
parameters and gradients sharded (DTensors) instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils import _pytree as pytree

from meshfuse.capture.parallelize import torch_mesh
from meshfuse.capture.plan import ModelOutline, expert_entries, resolve_plan
from meshfuse.capture.program import Program
from meshfuse.capture.trace import capture, module_stack, refuse_mutations, source_name
from meshfuse.errors import DefinitionError
from meshfuse.ir.mesh import DeviceMesh

__all__ = ["backend"]


def backend(mesh: DeviceMesh | TorchDeviceMesh, plan: Mapping[str, Any], *,
            strict: bool = False):
    """A ``torch.compile`` backend running each Dynamo graph as meshfuse fusions laid out by
    ``plan`` on ``mesh`` (see :func:`meshfuse.parallelize` for the plan).

    Example:
        >>> compiled = torch.compile(model, backend=meshfuse.backend(mesh, model.tp_plan))
        >>> compiled(input_ids=ids, labels=labels).loss.backward()
    """
    tmesh = torch_mesh(mesh)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        return _Compiled(gm, example_inputs, tmesh, plan, strict)

    return compile_graph


class _Compiled:
    """One Dynamo graph as a meshfuse program."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, mesh: TorchDeviceMesh,
                 plan: Mapping[str, Any], strict: bool) -> None:
        if not all(isinstance(x, torch.Tensor) for x in example_inputs):
            raise DefinitionError(
                "meshfuse.backend got a graph with symbolic sizes (Dynamo's dynamic shapes); "
                "meshfuse captures one program per input shape: compile with "
                "torch.compile(model, backend=..., dynamic=False)")
        sources = [_source(n) for n in gm.graph.nodes if n.op == "placeholder"]
        self.roles = sources  # per input: ("parameters"|"buffers", name) or None
        # A Dynamo graph does not carry the model's config, whose own plan parallelize
        # compares entries with: Hugging Face's expert styles are read as the model's own
        # (its experts replicated, as the plans of versions without them leave them).
        outline = ModelOutline(
            _module_kinds(gm),
            {s[1]: x.ndim for s, x in zip(sources, example_inputs)
             if s is not None and s[0] == "parameters"}, family_plan=expert_entries(plan))
        # Dynamo may cut the model into several graphs: a key may match none of this one.
        self.plan = resolve_plan(outline, plan, mesh.ndim, every_key=False)
        self.mesh = mesh
        plain = [x.detach() if isinstance(x, torch.Tensor) else x for x in example_inputs]
        captured = capture(gm, tuple(plain), {})
        refuse_mutations(captured, "meshfuse.backend")
        placeholders = list(captured.user_inputs)
        roles = dict(zip(placeholders, sources))
        captured = dataclasses.replace(
            captured,
            parameters={p: r[1] for p, r in roles.items() if r and r[0] == "parameters"},
            buffers={p: r[1] for p, r in roles.items() if r and r[0] == "buffers"},
            user_inputs=tuple(p for p in placeholders if roles[p] is None))
        buffers = {r[1]: x for r, x in zip(sources, example_inputs) if r and r[0] == "buffers"}
        self.program = Program(captured, self.plan, mesh, buffers, strict)

    def __call__(self, *inputs):
        parameters, buffers, flat = {}, {}, []
        for role, x in zip(self.roles, inputs):
            if role is None:
                flat.append(x)
            elif role[0] == "parameters":
                parameters[role[1]] = _Shard.apply(x, self.mesh, self.plan.parameters[role[1]])
            else:
                buffers[role[1]] = x
        outputs = self.program.run(parameters, buffers, flat)
        outputs = [x.full_tensor() if isinstance(x, DTensor) else x for x in outputs]
        return pytree.tree_unflatten(outputs, self.program.captured.out_spec)


class _Shard(torch.autograd.Function):
    """A whole parameter (the same on every rank) as a DTensor of ``placements`` (this rank's
    shard, no communication); its gradient comes back whole (gathered)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: TorchDeviceMesh, placements) -> DTensor:
        return distribute_tensor(x.detach(), mesh, placements, src_data_rank=None)

    @staticmethod
    def backward(ctx, grad: DTensor):
        whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
        return whole, None, None


def _source(node: torch.fx.Node) -> tuple[str, str] | None:
    arg = node.meta.get("grapharg")
    return source_name(arg.source.name) if arg is not None and arg.source is not None else None


def _module_kinds(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Module path -> class name, from the module stacks of Dynamo's nodes."""
    kinds: dict[str, str] = {}
    for node in gm.graph.nodes:
        for path, kind in module_stack(node):
            kinds.setdefault(path, kind)
    return kinds
