"""Capture: a module and example inputs traced into one ATen graph.

meshfuse traces with ``torch.export`` (non-strict: the module's Python runs under PyTorch's
own tracer, so any Python the module uses works, and data-dependent Python branches are read
at the example inputs). The graph is PyTorch's *training IR*: ATen ops before PyTorch's own
decompositions, so ``linear``, ``scaled_dot_product_attention``, ``embedding``,
``cross_entropy_loss``, ``layer_norm`` stay one node each and map to one meshfuse op with its
sharding and gradient rules (decomposing them would merge the batch and sequence axes of a
linear, spell attention out as a softmax, and, for PyTorch's fused CPU attention, give wrong
gradients). The graph is forward-only: meshfuse derives the backward of each fusion itself.

A :class:`Captured` holds the graph and what its placeholders are: a parameter or buffer of
the module (by name), a constant, or the n-th flattened user input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from meshfuse.capture.regions import inline_regions
from meshfuse.capture.repeats import expand_repeats, repeated_layers, traced_once
from meshfuse.errors import DefinitionError

__all__ = ["Captured", "capture", "module_path", "refuse_mutations", "without_cache"]


@dataclasses.dataclass(frozen=True)
class Captured:
    """One traced program.

    Attributes:
        graph: the ATen graph (placeholders, ``call_function`` nodes, one ``output``).
        parameters: placeholder name -> parameter name in the module.
        buffers: placeholder name -> buffer name in the module.
        constants: placeholder name -> constant tensor (lifted by the trace).
        user_inputs: the placeholders of the flattened user inputs, in order.
        in_spec: how the call's ``(args, kwargs)`` flatten.
        out_spec: how the flat outputs nest back (a ``ModelOutput`` stays one).
        attributes: ``get_attr`` node name -> its value (the submodule a higher-order op that
            :mod:`.regions` does not inline calls; its graph break passes it).
        mutated_buffers: the buffers the forward writes in place (a MoE's token counts,
            batch norm's running statistics), by name in the module: the graph's first
            outputs are their new values, in this order; the user's outputs follow.
    """

    graph: torch.fx.Graph
    parameters: Mapping[str, str]
    buffers: Mapping[str, str]
    constants: Mapping[str, torch.Tensor]
    user_inputs: tuple[str, ...]
    in_spec: Any
    out_spec: Any
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mutated_buffers: tuple[str, ...] = ()


def capture(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> Captured:
    """Traces ``module(*args, **kwargs)`` (plain tensors, the global values) into a
    :class:`Captured` graph; identical layers are traced once (:mod:`.repeats`).

    Raises:
        DefinitionError: if PyTorch cannot trace the module, with its reason and the fix.
    """
    groups = repeated_layers(module)
    if groups:
        # Any failure: traced layer by layer below, which says why. The records of the
        # templates' calls are read again by the functional pass's trace of the exported
        # program (a forward writing in place, ImageGPT's): it runs inside traced_once.
        with contextlib.suppress(Exception), traced_once(module, groups):
            exported = torch.export.export(module, tuple(args), dict(kwargs), strict=False)
            return _collected(_from_exported(exported))
    try:
        exported = torch.export.export(module, tuple(args), dict(kwargs), strict=False)
    except Exception as error:  # PyTorch's tracer raises many types; say what to do
        raise DefinitionError(
            f"meshfuse could not trace {type(module).__name__} with torch.export: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}. "
            "A model that returns a cache (use_cache=True) or branches on tensor values "
            "cannot be captured whole: pass use_cache=False, or use "
            "torch.compile(model, backend=meshfuse.backend(mesh, plan)), where Dynamo "
            "breaks the graph around such code"
        ) from error
    return _collected(_from_exported(exported))


def _collected(captured: Captured) -> Captured:
    """``captured``, once the garbage the trace left is collected: ``torch.export``'s tracer
    leaves reference cycles (the tracer, the attribute proxies' class it makes, the wrapper
    module around the traced one) that hold the user's module, which would otherwise stay
    alive after the user drops it, with its parameters' memory, until Python's next full
    collection (seen with torch 2.13)."""
    gc.collect()
    return captured


def _from_exported(exported: ExportedProgram) -> Captured:
    exported = _functional(exported)
    parameters, buffers, constants, user = {}, {}, {}, []
    for spec in exported.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind is InputKind.PARAMETER:
            parameters[name] = spec.target
        elif spec.kind is InputKind.BUFFER:
            buffers[name] = spec.target
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constants[name] = exported.constants[spec.target]
        else:
            user.append(name)
    signature = exported.graph_signature
    if signature.user_inputs_to_mutate:
        raise DefinitionError(
            f"the module modifies its input(s) {sorted(signature.user_inputs_to_mutate.values())} "
            "in place during its forward; meshfuse captures forwards that return what they "
            "compute: return the new value instead, or keep that part out of the "
            "parallelized module")
    mutated = tuple(spec.target for spec in signature.output_specs
                    if spec.kind is OutputKind.BUFFER_MUTATION)
    module = exported.graph_module
    inline_regions(module)
    parameters, buffers = expand_repeats(module.graph, parameters, buffers)
    attributes = {n.name: _attribute(module, n.target) for n in module.graph.nodes
                  if n.op == "get_attr"}
    return Captured(module.graph, parameters, buffers, constants, tuple(user),
                    exported.call_spec.in_spec, exported.call_spec.out_spec, attributes,
                    mutated)


def without_cache(module: torch.nn.Module, kwargs: Mapping[str, Any],
                  forward: Any = None) -> dict[str, Any]:
    """``kwargs`` with ``use_cache=False`` where ``module`` is a Hugging Face model whose
    config asks for a cache (``from_pretrained``'s default), whose forward takes it (by name
    or among its ``**kwargs``: GraniteMoE's) and the call does not say: a
    captured model trains, and a cache (a ``DynamicCache`` object among the outputs) is
    neither traceable nor read by a training step. Its output's ``past_key_values`` is
    None; a call passing ``use_cache=True`` is traced as asked (and refused). ``forward``:
    the model's own (default ``module.forward``)."""
    config = getattr(module, "config", None)
    forward = module.forward if forward is None else forward
    if "use_cache" in kwargs or not getattr(config, "use_cache", False) or \
            not _takes_use_cache(getattr(forward, "__func__", forward)):
        return dict(kwargs)
    return {**kwargs, "use_cache": False}


@functools.cache
def _takes_use_cache(forward: Any) -> bool:
    """Whether the function ``forward`` takes ``use_cache``, by name or among its
    ``**kwargs`` (read once per function: every call of a parallelized model asks)."""
    parameters = inspect.signature(forward).parameters
    return "use_cache" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def refuse_mutations(captured: Captured, where: str) -> None:
    """Raises DefinitionError if ``captured`` writes buffers, which ``where`` cannot."""
    if captured.mutated_buffers:
        raise DefinitionError(
            f"the module modifies its buffer(s) {list(captured.mutated_buffers)} in place "
            f"during its forward (running statistics, token counts), which {where} does not "
            "carry out; meshfuse.parallelize does (without a pipeline)")


def _functional(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` with its in-place writes into values the forward made (DeepSeek's
    attention fills ``q = k.new_empty(...)`` by ``q[..., :d] = q_pass``: ``copy_`` into a
    slice) rewritten by PyTorch's functionalization (``run_decompositions({})``, which
    decomposes no op: ``copy`` and ``slice_scatter`` nodes); as traced where nothing is
    written in place. A fusion's outputs are values, not memory a later op may write into:
    the write would change neither what the fusion computed nor its gradient."""
    if not any(_writes_in_place(n) for n in exported.graph.nodes):
        return exported
    with warnings.catch_warnings():  # PyTorch's own deprecation inside its pytree copy
        warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)
        return exported.run_decompositions({})


def _writes_in_place(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and node.target._schema.is_mutable


def _attribute(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def flatten_call(captured: Captured, args: tuple, kwargs: Mapping[str, Any]) -> list:
    """The flat user inputs of a call, as the trace saw them (None where an optional input
    was left out)."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    if spec != captured.in_spec:
        flat = _reorder(captured.in_spec, args, kwargs)
    return flat


def _reorder(in_spec, args: tuple, kwargs: Mapping[str, Any]) -> list:
    """Keyword arguments given in another order than at capture: flatten them in its order."""
    names = in_spec.children_specs[1].context
    ordered = {k: kwargs[k] for k in names if k in kwargs}
    flat, spec = pytree.tree_flatten((tuple(args), ordered))
    if spec != in_spec:
        raise DefinitionError(
            f"the call's arguments {spec} do not have the structure of the captured ones "
            f"{in_spec}; call the parallelized module as it was first called"
        )
    return flat


def module_path(node: torch.fx.Node) -> str:
    """The dotted path of the innermost module whose forward ran ``node`` ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _clean(path)


def block_path(node: torch.fx.Node) -> str | None:
    """The repeated block ``node`` is in: its module path up to the first numbered part
    (``model.layers.3`` of ``model.layers.3.mlp.up_proj``); None outside numbered modules."""
    parts = module_path(node).split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return None


def module_paths(node: torch.fx.Node) -> list[str]:
    """The dotted paths of every module whose forward ran ``node``, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [_clean(v[0]) for v in stack.values() if _clean(v[0])]


_DYNAMO_ROOT = re.compile(r"^(L\['\w+'\](\[\d+\])?|self)\.?")
_DYNAMO_ATTR = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")


def module_stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    """``(path, class name)`` of every module whose forward ran ``node``, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(_clean(path), kind.rpartition(".")[2] if isinstance(kind, str) else kind.__name__)
            for path, kind in stack.values() if _clean(path)]


def _clean(path: str) -> str:
    """Dynamo's ``L['self'].model.layers[0]`` (or ``L['args'][0].model``) as
    ``model.layers.0``."""
    path = _DYNAMO_ROOT.sub("", path)
    return path.replace("[", ".").replace("]", "").replace("'", "")


def source_name(source: str) -> tuple[str, str] | None:
    """A Dynamo graph input's source (``L['self']._modules['lm_head']._parameters['weight']``)
    as ``("parameters", "lm_head.weight")`` (or ``"buffers"``); None for another input."""
    parts = _DYNAMO_ATTR.findall(source)
    kind = re.findall(r"\._(parameters|buffers)\['", source)
    if not parts or not kind:
        return None
    return kind[-1], ".".join(parts)
