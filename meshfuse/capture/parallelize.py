"""``meshfuse.parallelize(module, mesh, plan)``: a PyTorch module run as meshfuse fusions.

Like DTensor's ``parallelize_module`` it works in place and returns the module: the
parameters become DTensors laid out as the plan says (so ``state_dict()``,
``torch.distributed.checkpoint`` and any torch optimizer work on them, and gradients are
DTensors laid out alike), and the module's class becomes a subclass of its own whose
``forward`` runs the captured program. The first call with a new input signature (the
flattened inputs' structure, shapes and dtypes, and the non-tensor values) captures and builds
a program (:mod:`.program`); later calls with that signature reuse it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils import _pytree as pytree

from meshfuse.autodiff.derivation import DEFAULT_REMAT, REMAT_POLICIES
from meshfuse.capture.members import NamedMembers
from meshfuse.capture.pipeline import Pipeline, PipelineSpec, pipeline_stages
from meshfuse.capture.plan import ResolvedPlan, outline_of, resolve_plan
from meshfuse.capture.program import Program, argument_name
from meshfuse.capture.report import explain_program
from meshfuse.capture.sharded import batch_placements, fully_shard_plan, split_batch
from meshfuse.capture.trace import Captured, capture, flatten_call, without_cache
from meshfuse.dtensor import mesh_to_torch
from meshfuse.errors import DefinitionError, InputError
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.interpreter.agreement import agreed

__all__ = ["parallelize", "torch_mesh"]


def parallelize(module: torch.nn.Module, mesh: DeviceMesh | TorchDeviceMesh,
                plan: Mapping[str, Any], *, example_inputs: Any = None,
                strict: bool = False, fsdp: str | None = None,
                pipeline: PipelineSpec | None = None,
                remat: str | None = None) -> torch.nn.Module | Pipeline:
    """Runs ``module`` as meshfuse fusions laid out by ``plan`` on ``mesh``.

    Args:
        module: any ``torch.nn.Module`` whose forward ``torch.export`` traces (non-strict).
        mesh: a meshfuse ``DeviceMesh`` or a torch ``DeviceMesh``.
        plan: name patterns to styles (see :mod:`meshfuse.capture.plan`).
        example_inputs: ``(args, kwargs)``, a tuple of args, or a dict of kwargs: capture and
            build now rather than on the first call.
        strict: raise a ``GraphBreakError`` listing every op meshfuse has no rule for, rather
            than running them as PyTorch ops between fusions.
        fsdp: a dimension of ``mesh`` (a torch mesh's ``mesh_dim_names``) to fully shard
            over (:func:`meshfuse.capture.sharded.fully_shard_plan`): every parameter also
            sharded on its first axis over it (``Shard(0)``, as FSDP2's), the inputs' first
            (batch) axis split over it; the plan's tensor parallelism runs on the last mesh
            dimension, which must be another.
        pipeline: cut ``module`` into pipeline stages (:mod:`meshfuse.capture.pipeline`)
            over ``mesh``'s ``pp`` dimension (a torch mesh), each stage laid out by ``plan``
            on the rest of the mesh (with ``fsdp``: sharded over that dimension, gathered
            once per step). Any traceable module, a Hugging Face decoder included: stages
            are cut from its graph at the split points' modules.
        remat: the rematerialization policy of each fusion's derived backward (see
            :mod:`meshfuse.autodiff.derivation`): ``"recompute"``, ``"recompute_fused"``,
            ``"recompute_gathers"`` or ``"save"``. Default: ``"recompute_gathers"`` with
            ``fsdp`` (each layer's parameters gathered again in the backward rather than
            held since the forward: FSDP2's ``reshard_after_forward=True``), else
            ``"recompute_fused"``.

    Returns:
        ``module`` itself, its parameters DTensors, its forward meshfuse's; it gains
        ``explain()``. With ``pipeline``: a :class:`~meshfuse.capture.pipeline.Pipeline`
        of this rank's stages, whose ``step(inputs, targets)`` trains on a batch.

    Example:
        >>> model = meshfuse.parallelize(LlamaForCausalLM(config), mesh, model.tp_plan)
        >>> out = model(input_ids=ids, labels=labels); out.loss.backward()
    """
    if isinstance(module, _Parallel):
        raise DefinitionError(f"{type(module).__name__} is already parallelized")
    if remat is None:
        remat = DEFAULT_REMAT if fsdp is None else "recompute_gathers"
    if remat not in REMAT_POLICIES:
        raise DefinitionError(f"parallelize: remat must be one of {REMAT_POLICIES}, got "
                              f"{remat!r}")
    tmesh = torch_mesh(mesh)
    if pipeline is not None:
        return pipeline_stages(module, tmesh, plan, pipeline, functools.partial(
            parallelize, strict=strict, remat=remat), fsdp=fsdp)
    resolved = resolve_plan(outline_of(module), plan, tmesh.ndim)
    if fsdp is not None:
        resolved = fully_shard_plan(resolved, tmesh, fsdp, plan, module)
    base = type(module)
    module.__class__ = type(f"Parallel{base.__name__}", (_Parallel, base), {})
    module._meshfuse = _State(tmesh, resolved, strict, remat)
    module._meshfuse.batch = None if fsdp is None else batch_placements(tmesh, fsdp)
    _replace_parameters(module, lambda name, p: torch.nn.Parameter(
        distribute_tensor(p.detach(), tmesh, resolved.parameters[name]), p.requires_grad))
    if example_inputs is not None:
        args, kwargs = _split_example(example_inputs)
        module._meshfuse.program(module, args, _uncached(module, kwargs))
    return module


def torch_mesh(mesh: DeviceMesh | TorchDeviceMesh) -> TorchDeviceMesh:
    """torch's mesh for ``mesh`` (a meshfuse one gets one named ``tp`` on its last axis)."""
    if isinstance(mesh, TorchDeviceMesh):
        return mesh
    names = tuple(f"mesh{i}" for i in range(mesh.ndim - 1)) + ("tp",)
    return mesh_to_torch(mesh, mesh_dim_names=names)


class _Parallel:
    """The mixin of a parallelized module's class."""

    def forward(self, *args, **kwargs):
        state: _State = self._meshfuse
        if state.capturing:
            return super().forward(*args, **kwargs)
        if state.batch is not None:
            args, kwargs = split_batch((args, kwargs), state.mesh, state.batch)
        kwargs = _uncached(self, kwargs)
        program = state.program(self, args, kwargs)
        flat = flatten_call(program.captured, args, kwargs)
        parameters, buffers = state.members.read(self)
        mutated = program.captured.mutated_buffers
        if mutated:  # read as copies: a graph break (batch norm) may save them for its
            # backward, which the write below would then fail ("modified by an inplace
            # operation")
            buffers = {**buffers, **{n: buffers[n].clone() for n in mutated if n in buffers}}
        outputs = program.run(parameters, buffers, flat)
        with torch.no_grad():  # the buffers the forward writes in place, written now
            for name, value in zip(mutated, outputs):
                value = value.full_tensor() if isinstance(value, DTensor) else value
                self.get_buffer(name).copy_(value)
        return pytree.tree_unflatten(outputs[len(mutated):], program.captured.out_spec)

    def explain(self, *args, **kwargs) -> str:
        """The captured program of the last signature (or of ``args``/``kwargs``, captured
        if new): each fusion's tensors, placements and communications, every parameter's
        placements, and the graph breaks with their module paths."""
        state: _State = self._meshfuse
        program = state.program(self, args, _uncached(self, kwargs)) \
            if args or kwargs else state.last
        if program is None:
            raise DefinitionError("explain(): nothing captured yet; call the module first, or "
                                  "pass its inputs: model.explain(input_ids=ids)")
        return explain_program(program, dict(self.named_parameters()))


def _uncached(module: torch.nn.Module, kwargs: dict) -> dict:
    """:func:`without_cache` for a parallelized module (its model's own forward read)."""
    return without_cache(module, kwargs, type(module).__bases__[1].forward)


class _State:
    """A parallelized module's plan, mesh and programs by input signature."""

    def __init__(self, mesh: TorchDeviceMesh, plan: ResolvedPlan, strict: bool,
                 remat: str) -> None:
        self.mesh, self.plan, self.strict, self.remat = mesh, plan, strict, remat
        self.programs: dict[Any, Program] = {}
        self.capturing = False
        self.last: Program | None = None
        self.members = NamedMembers()  # the module's parameters and buffers by name
        # its submodules, found once (not the module itself: it holds this state)
        self.submodules: list[torch.nn.Module] | None = None

    def program(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Program:
        # the training flags too: the trace records dropout (and a Hugging Face attention's
        # dropout_p, batch norm's statistics) as the mode at capture gave them (a list of
        # the modules kept: walking them costs a 16-layer Llama 100 us a call, reading it 7)
        if self.submodules is None:
            self.submodules = list(module.modules())[1:]
        key = (_signature(args, kwargs), module.training,
               tuple([m.training for m in self.submodules]))
        if key not in self.programs:
            captured = self._agreed(lambda: self._captured(module, args, kwargs))
            self.programs[key] = Program(captured, self.plan, self.mesh,
                                         dict(module.named_buffers(remove_duplicate=False)),
                                         self.strict, self.remat)
        self.last = self.programs[key]
        return self.last

    def _captured(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Captured:
        _check_devices(module, args, kwargs)
        own = getattr(module, "meshfuse_captured", None)  # a pipeline stage's graph
        if own is not None:
            return own(args, kwargs)
        with self._unsharded(module):
            return capture(module, _global(args), _global(kwargs))

    def _agreed(self, attempt: Callable[[], Captured]) -> Captured:
        """``attempt()``, a new signature's capture, on every rank of the mesh, whose
        ranks agree on whether it failed: an error one rank's inputs or trace raise (inputs
        on another device, a model that cannot be traced) is raised on every rank, instead
        of leaving the others waiting in the program's first collective."""
        comm = Communicator.instance()
        ranks = tuple(sorted(self.mesh.mesh.flatten().tolist()))
        if comm.size == 1 or len(ranks) == 1 or comm.rank not in ranks:
            return attempt()
        return agreed(comm, attempt, lambda _: (), "call the model alike on every rank",
                      ranks=ranks)

    @contextlib.contextmanager
    def _unsharded(self, module: torch.nn.Module):
        """The module's own forward over plain parameters of the global shapes (for the
        trace only: their values are never read)."""
        saved = _replace_parameters(module, lambda name, p: torch.nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device=_local(p).device), p.requires_grad))
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False
            for owner, leaf, param in saved:
                owner._parameters[leaf] = param


def _replace_parameters(module: torch.nn.Module, make) -> list[tuple]:
    """Replaces each parameter ``p`` (first named ``name``) by ``make(name, p)``, one object
    for a parameter held under several names (tied embeddings stay tied); returns
    ``(owner, leaf, old)`` for each name, to put them back."""
    new: dict[int, torch.nn.Parameter] = {}
    first = {id(p): n for n, p in module.named_parameters()}
    saved = []
    with torch.no_grad():
        for name, param in list(module.named_parameters(remove_duplicate=False)):
            owner, leaf = _owner(module, name)
            if id(param) not in new:
                new[id(param)] = make(first[id(param)], param)
            saved.append((owner, leaf, param))
            owner._parameters[leaf] = new[id(param)]
    return saved


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _signature(args: tuple, kwargs: dict) -> Any:
    flat, spec = pytree.tree_flatten((args, kwargs))
    return spec, tuple((tuple(x.shape), x.dtype, isinstance(x, DTensor), _local(x).device)
                       if isinstance(x, torch.Tensor) else x for x in flat)


def _check_devices(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Raises an InputError naming the first tensor input (0-d CPU tensors aside: scalars)
    that does not lie on the device of the module's parameters (the trace would fail inside
    PyTorch, a mix of devices in one op)."""
    device = next((_local(p).device for p in module.parameters()), None)
    if device is None:
        return
    for path, x in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(x, torch.Tensor):
            continue
        here = _local(x).device
        if here != device and not (x.dim() == 0 and here.type == "cpu"):
            raise InputError(f"{type(module).__name__}: {argument_name(path)} is on {here}, "
                             f"the model's parameters on {device}: move the inputs there "
                             f"first (x.to({str(device)!r}))")


def _global(tree: Any) -> Any:
    """Plain tensors of the global shapes for the trace (a DTensor's values are not read)."""
    return pytree.tree_map_only(
        DTensor, lambda x: torch.empty(x.shape, dtype=x.dtype, device=x.to_local().device), tree)


def _split_example(example: Any) -> tuple[tuple, dict]:
    if isinstance(example, dict):
        return (), example
    if isinstance(example, tuple) and len(example) == 2 and isinstance(example[1], dict):
        return tuple(example[0]), example[1]
    return tuple(example), {}
