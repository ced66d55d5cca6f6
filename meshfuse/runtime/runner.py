"""``FusionRunner``: builds a fusion once, then one per-rank program per input signature.

Build: check the schedule (on every rank alike), derive layouts. Per new input signature:
bind extents and local layouts, check the inputs against them, check that no op needs
resharding, agree on all that across ranks (:mod:`meshfuse.runtime.agreement`), and make the
:class:`Program`, its steps
ordered so that each communication is launched as early as it can be. With
``cuda_graph=True``, the program is captured once (:mod:`meshfuse.runtime.graphs`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from meshfuse.errors import InputError
from meshfuse.explain import explain
from meshfuse.ir.fusion import Fusion
from meshfuse.ir.global_index import GlobalIndex, global_index
from meshfuse.ir.placement import same_sharding
from meshfuse.ir.printer import format_expr, format_fusion
from meshfuse.ir.tensor_view import Scalar, TensorView, Val
from meshfuse.ir.verifier import check_schedule, check_tensor_schedules
from meshfuse.ops.registry import Kind, LocalContext
from meshfuse.passes.layout import infer_allocations
from meshfuse.passes.propagation import propagate_shardings
from meshfuse.passes.resharding import insert_resharding
from meshfuse.passes.sharding_check import check_no_resharding
from meshfuse.runtime.agreement import agreed_inputs
from meshfuse.runtime.binding import (
    Binding,
    bind,
    check_input_values,
    check_strides,
    device_coords,
    held_here,
)
from meshfuse.runtime.collectives import Group, resolved
from meshfuse.runtime.executor import OutputLayout, Program, Step
from meshfuse.runtime.failures import checked_timeout
from meshfuse.runtime.graphs import GraphedProgram
from meshfuse.runtime.resharding import lower_step, plan_resharding


class FusionRunner:
    """Runs one built fusion; see the module doc."""

    def __init__(self, fusion: Fusion):
        self.fusion = fusion
        if any(tv.mesh is not None for tv in fusion.tensors()):
            from meshfuse.runtime.communicator import Communicator

            self.communicator = Communicator.instance()
            self.rank, world = self.communicator.rank, self.communicator.size
        else:
            self.communicator, self.rank, world = None, 0, 1
        self.world_size = world
        check_tensor_schedules(fusion, world)
        propagate_shardings(fusion)
        insert_resharding(fusion)
        check_schedule(fusion, world)
        for v in fusion.inputs():
            if isinstance(v, TensorView) and v.mesh is not None and v.mesh.size < world and \
                    any(i.extent is None for i in v.materialized()):
                raise InputError(
                    f"input {v.name} lives on {v.mesh!r}, not on every rank, and has symbolic "
                    "extents; ranks outside its mesh cannot learn them: declare them static"
                )
        self.allocations = infer_allocations(fusion)
        self._programs: dict[tuple, Program] = {}
        self._graphs: dict[tuple, GraphedProgram] = {}

    def explain(self, inputs: Sequence[Any] | None = None, verbose: bool = False) -> str:
        """This rank's view of the program (:func:`meshfuse.explain.explain`): each tensor's
        shapes, placements and memory order, then the communications it will run; extents
        from ``inputs`` when given. ``verbose`` adds the domains of every tensor and, with
        ``inputs``, the program's steps."""
        extents = program = None
        if inputs is not None:
            key = _signature(inputs)
            if key not in self._programs:
                self._programs[key] = self._make_program(list(inputs), None)
            program = self._programs[key]
            extents = bind(self.fusion, self.allocations, list(inputs), self.rank).extents
        text = explain(self.fusion, self.allocations, self.rank, self.world_size, extents)
        if program is not None:
            text = "\n".join([text, *_random_streams(program)])
        if not verbose:
            return text
        parts = [text, format_fusion(self.fusion, self.allocations)]
        return "\n".join(parts + ([program.describe()] if program is not None else []))

    def execute(self, inputs: Sequence[Any], check_ranks: bool | None = None,
                cuda_graph: bool = False, timeout: float | None = None) -> list[torch.Tensor]:
        if self.communicator is not None:
            self.communicator.set_timeout(None if timeout is None else checked_timeout(timeout))
        key = _signature(inputs)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._make_program(list(inputs), check_ranks)
        if not cuda_graph:
            return program.run(inputs)
        graph_key = (key, tuple(x for x in inputs if not isinstance(x, torch.Tensor)))
        graphed = self._graphs.get(graph_key)
        if graphed is None:
            _check_graphable(self.fusion, inputs)
            graphed = self._graphs[graph_key] = GraphedProgram(program, inputs)
        return graphed.run(inputs)

    def _make_program(self, inputs: list, check_ranks: bool | None) -> Program:
        """Checks and binds ``inputs`` (on every rank, agreeing across ranks unless
        ``check_ranks`` is False), then builds the program (which creates process groups)."""
        binding = agreed_inputs(
            self.communicator, self.fusion, inputs, lambda: self._bind(inputs),
            lambda b, tv: tuple(b.extents.get(i) for i in tv.logical),
            lambda tv: held_here(tv, self.rank), check_ranks,
        )
        return build_program(self.fusion, binding, self.rank, self._lower_set,
                             _device_of(inputs, self.communicator))

    def _bind(self, inputs: list) -> Binding:
        """This rank's checks of ``inputs`` and their binding; communicates nothing."""
        fusion = self.fusion
        check_input_values(fusion, inputs, self.rank)
        binding = bind(fusion, self.allocations, inputs, self.rank)
        for v, x in zip(fusion.inputs(), inputs):
            if isinstance(v, TensorView) and held_here(v, self.rank):
                check_strides(v, x, binding.layouts[v])
        check_no_resharding(fusion, binding.extents)
        return binding

    def _lower_set(self, expr, binding: Binding, donated: bool):
        """The implementation of a resharding ``set``: its plan, bound to this rank.
        ``donated``: the set's input is dead afterwards (not an input or output of the fusion,
        no later use), so its first step may reuse the buffer."""
        src, dst = expr.args[0], expr.outputs[0]
        if src.mesh is None or not src.logical:
            return None
        steps = plan_resharding(src, dst, binding.extents)
        if not steps:
            return None
        whole = functools.partial(torch.empty, [binding.extents[i] for i in src.materialized()],
                                  dtype=src.dtype.torch_dtype, device=self.communicator.device)
        lowered = []
        for index, step in enumerate(steps):
            mesh = step.mesh or src.mesh
            # Every rank takes part in creating a step's groups; members run the step.
            process_group = self.communicator.group_if_member(mesh, step.mesh_axis)
            if self.rank not in mesh:
                continue
            group = Group(process_group, mesh.group_ranks(self.rank, step.mesh_axis),
                          mesh.coordinate(self.rank)[step.mesh_axis], step.mesh_axis)
            lowered.append(lower_step(step, group, self.communicator.device,
                                      donated and index == 0, whole))
        keeps = self.rank in dst.mesh

        def reshard(x):
            for step in lowered:
                x = step(x)
            if keeps:
                return x
            resolved(x)  # a rank that only sends ends its part here
            return None

        return reshard, "; ".join(f"{s.step} (ranks {list(s.group.ranks)})" for s in lowered)


def build_program(fusion: Fusion, binding: Binding, rank: int, lower_set=None,
                  device: torch.device | None = None) -> Program:
    """Numbers the values and turns each expression into a :class:`Step`; ``device`` is
    where ops that make tensors from nothing (random ops) put them."""
    slot_of: dict[Val, int] = {}
    here = _local_context(fusion, binding, rank, device)

    def slot(v: Val) -> int:
        return slot_of.setdefault(v, len(slot_of))

    input_slots = tuple(slot(v) for v in fusion.inputs())
    exprs = communication_first(fusion.exprs)
    last_use: dict[int, int] = {}
    for index, expr in enumerate(exprs):
        for v in expr.inputs:
            last_use[slot(v)] = index
    keep = {slot(v) for v in fusion.outputs()}
    steps = []
    for index, expr in enumerate(exprs):
        lowered = None
        if expr.op.name == "set" and lower_set is not None:
            # Lowered on every rank alike (group creation is collective), run by members.
            src = slot(expr.args[0])
            donated = last_use.get(src) == index and src not in keep and src not in input_slots
            lowered = lower_set(expr, binding, donated)
        if not _takes_part(expr, rank):
            continue
        template, slots = [], []
        for pos, (param, arg) in enumerate(zip(expr.op.params, expr.args)):
            if isinstance(arg, Scalar) and arg.is_constant:
                template.append(arg.value)
            elif isinstance(arg, Val):
                template.append(None)
                slots.append((pos, slot(arg)))
            elif param.kind is Kind.TENSORS:
                template.append(None)
                slots.append((pos, tuple(slot(v) for v in arg)))
            else:
                template.append(arg)
        for pos in _dropped_addends(expr, rank):
            template[pos] = None
            slots = [(p, s) for p, s in slots if p != pos]
        kwargs = {}
        if expr.op.needs_out_shape:
            kwargs["out_shapes"] = [binding.layouts[o].shape for o in expr.tensor_outputs]
        if expr.op.needs_reduced_count:
            kwargs["reduced_count"] = _reduced_count(expr, binding)
        impl = expr.op.make_impl() if expr.op.make_impl is not None else expr.op.impl
        label, note = format_expr(expr), ""
        if expr.op.localize is not None:
            local_kwargs, note = expr.op.localize(expr, here)
            kwargs.update(local_kwargs)
        if lowered is not None:
            impl, plan = lowered
            label = f"{label}: {plan}"
        outs = tuple(slot(o) for o in expr.outputs)
        free = tuple(s for s, last in last_use.items() if last == index and s not in keep)
        steps.append(Step(label, impl, tuple(template), tuple(slots), kwargs, outs, free, note))
    outputs = tuple(
        OutputLayout(slot(tv), binding.layouts[tv].shape, binding.layouts[tv].strides,
                     tv.dtype.torch_dtype, held=tv.mesh is None or rank in tv.mesh)
        for tv in fusion.outputs()
    )
    return Program(len(slot_of), input_slots, tuple(steps), outputs, rank)


def _random_streams(program: Program) -> list[str]:
    """The explain lines naming the random stream of each step that draws (dropout, RNG)."""
    notes = []
    for step in program.steps:
        if step.note:
            outputs, _, call = step.label.partition(" = ")
            notes.append(f"  {call.partition('(')[0]} -> {outputs}: {step.note}")
    return [f"random streams on rank {program.rank}:", *notes] if notes else []


def _local_context(fusion: Fusion, binding: Binding, rank: int, device) -> LocalContext:
    """What ``localize`` rules see of this rank: global positions of its shards."""
    def index(tv: TensorView) -> GlobalIndex:
        return global_index(tv, binding.extents, device_coords(tv, rank))

    return LocalContext(rank, torch.device("cpu") if device is None else device, index)


def _device_of(inputs: Sequence[Any], communicator) -> torch.device:
    """The device of the tensor inputs (all on one), else the communicator's, else the CPU."""
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return communicator.device if communicator is not None else torch.device("cpu")


def communication_first(exprs: Sequence) -> list:
    """``exprs`` (in a valid order) reordered so that each communication is launched as soon
    as it can be: before any expression it does not depend on.

    Communications are kept in their order (every rank issues them alike); before each, the
    expressions it depends on that are not yet placed come in their order; the rest follow in
    theirs. With collectives launched asynchronously, the expressions after a communication
    overlap it: in a Megatron MLP's backward, the input gradient's allreduce overlaps the
    weight gradients' matmuls.
    """
    producer = {o: e for e in exprs for o in e.outputs}
    position = {e: i for i, e in enumerate(exprs)}
    placed: set = set()
    order = []

    def place_with_dependencies(expr) -> None:
        needed, stack = {expr}, [expr]
        while stack:
            for v in stack.pop().inputs:
                dep = producer.get(v)
                if dep is not None and dep not in needed and dep not in placed:
                    needed.add(dep)
                    stack.append(dep)
        for e in sorted(needed - placed, key=position.__getitem__):
            placed.add(e)
            order.append(e)

    for expr in exprs:
        if _communicates(expr):
            place_with_dependencies(expr)
    order += [e for e in exprs if e not in placed]
    return order


def _communicates(expr) -> bool:
    """A ``set`` whose output lies otherwise than its input: a communication (or a slice)."""
    return expr.op.name == "set" and not same_sharding(expr.args[0], expr.outputs[0])


def _takes_part(expr, rank: int) -> bool:
    """Whether ``rank`` runs ``expr``: it holds one of its outputs, or, for a resharding copy,
    its input or output (the ranks of both meshes move the data)."""
    tensors = [t for t in expr.tensor_outputs if t.logical]
    if expr.op.name == "set":
        tensors += [t for t in expr.tensor_inputs if t.logical]
    meshes = [t.mesh for t in tensors]
    return not meshes or any(m is None or rank in m for m in meshes)


def _reduced_count(expr, binding: Binding) -> int:
    """The global number of elements reduced into one element of the op's first output."""
    count = 1
    for id_ in expr.tensor_outputs[0].logical:
        if id_.is_reduction:
            count *= binding.extents[id_]
    return count


def _check_graphable(fusion: Fusion, inputs: Sequence[Any]) -> None:
    """``cuda_graph=True`` needs every tensor input on a CUDA device (checked on every rank,
    before any capture)."""
    for v, x in zip(fusion.inputs(), inputs):
        if isinstance(x, torch.Tensor) and not x.is_cuda:
            raise InputError(
                f"execute(cuda_graph=True): input {v.name} is on {x.device}; CUDA graphs "
                "capture GPU work only: pass CUDA tensors, or run without cuda_graph"
            )
    if not torch.cuda.is_available():
        raise InputError("execute(cuda_graph=True) needs CUDA, which this process lacks")


def _signature(inputs: list) -> tuple:
    return tuple(
        (x.dtype, tuple(x.shape), x.stride(), x.device) if isinstance(x, torch.Tensor)
        else type(x)
        for x in inputs
    )


def _dropped_addends(expr, rank: int) -> tuple[int, ...]:
    """Arguments added to a result (a bias) that this rank leaves out: a partial result
    includes them on coordinate 0 of its partial mesh axes only, so the reduction adds them
    once."""
    from meshfuse.ir.placement import Partial, placements

    out = expr.tensor_outputs[0] if expr.tensor_outputs else None
    if not expr.op.partial_addends or out is None or out.mesh is None:
        return ()
    coord = out.mesh.coordinate(rank)
    if all(c == 0 for c, p in zip(coord, placements(out)) if isinstance(p, Partial)):
        return ()
    return tuple(p for p in expr.op.partial_addends if expr.args[p] is not None)
