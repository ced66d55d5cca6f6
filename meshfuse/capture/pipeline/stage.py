"""One stage of a pipelined module: the model's modules whose parameters it trains, and the
piece of the model's graph it runs (:mod:`meshfuse.capture.pipeline.cut`).

Each parameter belongs to the stage of the module that holds it, the modules taken in the
order the model registers them (the split points' modules start stages 1, 2, ...), and the
stage's graph may read only those (:func:`check_owners`); a
module holding buffers only (a rotary embedding's frequencies) is held by every stage. The
modules are registered in the stage under their names in the model, so parameter names and
plan keys are the model's, and an optimizer over either sees the same tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from meshfuse.capture.pipeline.cut import StageGraph
from meshfuse.capture.trace import Captured
from meshfuse.errors import DefinitionError, ScheduleError

__all__ = ["GraphStage", "check_owners", "owners_by_stage", "plain_parameters",
           "shared_buffers"]


def owners_by_stage(model: torch.nn.Module, points: Sequence[str]) -> list[list[str]]:
    """The modules each of the ``len(points) + 1`` stages holds (by name in ``model``)."""
    order = [name for name, _ in model.named_modules()]
    starts = [order.index(p) for p in points]
    owners: list[list[str]] = [[] for _ in range(len(points) + 1)]
    for i, (name, module) in enumerate(model.named_modules()):
        if next(module.parameters(recurse=False), None) is not None:
            owners[sum(i >= s for s in starts)].append(name)
        elif next(module.buffers(recurse=False), None) is not None:
            for held in owners:
                held.append(name)
    return owners


def shared_buffers(model: torch.nn.Module, owners: Sequence[Sequence[str]]) -> set[str]:
    """The buffers (by name in ``model``) of the modules that every stage holds (those
    holding buffers only: a rotary embedding's frequencies)."""
    everywhere = set(owners[0]).intersection(*owners[1:])
    return {f"{m}.{n}" if m else n for m in everywhere
            for n, _ in model.get_submodule(m).named_buffers(recurse=False)}


def check_owners(graphs: Sequence[StageGraph], model: torch.nn.Module,
                 owners: Sequence[Sequence[str]]) -> None:
    """Every stage's graph reads only parameters and buffers of the modules it holds."""
    for s, (graph, held) in enumerate(zip(graphs, owners)):
        mine = {f"{m}.{n}" if m else n for m in held
                for n, _ in model.get_submodule(m).named_parameters(recurse=False)}
        mine |= {f"{m}.{n}" if m else n for m in held
                 for n, _ in model.get_submodule(m).named_buffers(recurse=False)}
        read = list(graph.captured.parameters.values()) + list(graph.captured.buffers.values())
        for name in read:
            if name not in mine:
                raise DefinitionError(
                    f"{name!r} is read by pipeline stage {s}, but its module goes to another "
                    f"stage (modules go to stages in the order the model registers them, "
                    f"from the split points on); move a split point so that the module "
                    f"and the ops reading it are in one stage")


class GraphStage(torch.nn.Module):
    """The modules ``owners`` of ``model`` (under their names) and, once the pipeline has
    cut the model's graph (:meth:`set_graph`), the stage's piece of it: ``forward(*bundle)``
    runs it on the received values and returns the values to pass on (a tuple)."""

    def __init__(self, model: torch.nn.Module, owners: Sequence[str]) -> None:
        super().__init__()
        self.owners = list(owners)
        for name in owners:
            if name:
                _register(self, name, model.get_submodule(name))
            else:  # the model's own parameters and buffers (not its children's)
                for key, p in model.named_parameters(recurse=False):
                    self.register_parameter(key, p)
                for key, b in model.named_buffers(recurse=False):
                    self.register_buffer(key, b, persistent=key not in
                                         model._non_persistent_buffers_set)
        self.__dict__["graph"] = None  # not a submodule
        self.register_forward_hook(_plain_outputs)

    def set_graph(self, graph: StageGraph) -> None:
        program = graph.copy()
        root = torch.nn.Module()
        for node in program.graph.nodes:
            if node.op == "get_attr":
                setattr(root, node.target, program.attributes[node.name])
        for path in _call_linears(program, self):
            _register(root, path, self.get_submodule(path))
        for node in program.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.copy.default:
                node.target = _copied
        self.__dict__["graph"] = graph
        self.__dict__["_run"] = torch.fx.GraphModule(root, program.graph)
        self.__dict__["_reads"] = [_source(n.name, program) for n in program.graph.nodes
                                   if n.op == "placeholder"]

    def meshfuse_captured(self, args: tuple, kwargs: Mapping) -> Captured:
        """The stage's trace, for :func:`meshfuse.parallelize` (which runs it as fusions)."""
        return self._graph().copy()

    def forward(self, *bundle: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self._graph()
        values, given = [], iter(bundle)
        for kind, key in self._reads:
            values.append(self.get_parameter(key) if kind == "parameter" else
                          self.get_buffer(key) if kind == "buffer" else
                          key if kind == "constant" else next(given))
        return tuple(self._run(*values))

    def _graph(self) -> StageGraph:
        if self.graph is None:
            raise ScheduleError("a pipeline stage runs once the pipeline has cut the model: "
                                "call the Pipeline's step(inputs, targets)")
        return self.graph

    def extra_repr(self) -> str:
        """The stage's blocks (``model.embed_tokens, model.layers.0``)."""
        blocks = []
        for name in self.owners:
            if next(self.get_submodule(name).parameters(False), None) is None:
                continue  # held by every stage
            parts = name.split(".")
            cut = next((i + 1 for i, part in enumerate(parts) if part.isdigit()), len(parts))
            blocks.append(".".join(parts[:cut]))
        return ", ".join(dict.fromkeys(blocks)) or "no parameters"


def _call_linears(program: Captured, stage: torch.nn.Module) -> list[str]:
    """Rewrites each ``aten.linear`` on the weight (and bias) of a ``torch.nn.Linear`` of
    the stage whose forward is Linear's (not a subclass computing more: Llama-4's router
    returns its top-k too) as a call of that module, so that its forward hooks run (a
    zero-bubble schedule notes the Linears' inputs and outputs to defer their weight
    gradients); returns the modules' paths."""
    params, paths = program.parameters, []
    for node in list(program.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        weight = node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        name = params.get(getattr(weight, "name", None), "")
        path, _, leaf = name.rpartition(".")
        module = stage.get_submodule(path) if path and leaf == "weight" else None
        if not isinstance(module, torch.nn.Linear) or \
                type(module).forward is not torch.nn.Linear.forward or \
                (bias is None) != (module.bias is None) or \
                (bias is not None and params.get(bias.name) != f"{path}.bias"):
            continue
        with program.graph.inserting_before(node):
            call = program.graph.call_module(path, (node.args[0],))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        program.graph.erase_node(node)
        paths.append(path)
    return paths


def _copied(x: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy`` (what functionalization makes of ``x[...] = src``), differentiable:
    ``src``'s values in ``x``'s shape, dtype and device (ATen's ``copy`` has no derivative,
    and a stage's graph runs under autograd)."""
    return src.to(dtype=x.dtype, device=x.device).expand(x.shape).clone()


def _register(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    """``module`` under ``root`` at the dotted ``path`` (empty modules made on the way)."""
    owner = root
    *parents, leaf = path.split(".")
    for part in parents:
        if part not in owner._modules:
            owner.add_module(part, torch.nn.Module())
        owner = owner._modules[part]
    owner.add_module(leaf, module)


def _source(name: str, program: Captured) -> tuple[str, object]:
    if name in program.parameters:
        return "parameter", program.parameters[name]
    if name in program.buffers:
        return "buffer", program.buffers[name]
    if name in program.constants:
        return "constant", program.constants[name]
    return "input", name


def _plain_outputs(module, args, outputs):
    """A tensor-parallel stage's outputs as whole tensors, to send."""
    return tuple(x.full_tensor() if isinstance(x, DTensor) else x for x in outputs)


@contextlib.contextmanager
def plain_parameters(model: torch.nn.Module,
                     shapes: Mapping[str, tuple[torch.Size, torch.dtype]]):
    """The model over plain parameters of their whole shapes (for the trace only: their
    values are never read), whatever the stages made of them (DTensors, freed shards)."""
    saved, made = [], {}
    first = {id(p): n for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, param in list(model.named_parameters(remove_duplicate=False)):
            path, _, leaf = name.rpartition(".")
            owner = model.get_submodule(path) if path else model
            if id(param) not in made:  # one for a parameter of several names (tied)
                local = param.to_local() if isinstance(param, DTensor) else param
                shape, dtype = shapes[first[id(param)]]
                made[id(param)] = torch.nn.Parameter(
                    torch.empty(shape, dtype=dtype, device=local.device), param.requires_grad)
            saved.append((owner, leaf, param))
            owner._parameters[leaf] = made[id(param)]
    try:
        yield
    finally:
        for owner, leaf, param in saved:
            owner._parameters[leaf] = param
