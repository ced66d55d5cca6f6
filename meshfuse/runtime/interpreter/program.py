"""Builds the per-rank :class:`~meshfuse.runtime.interpreter.executor.Program` of a compiled fusion.

From the compiled fusion, its binding (extents, local layouts) and the localization pass's
result for this rank, :func:`build_program` numbers the values (slots), orders the
expressions so that each communication is launched as early as it can be
(:func:`communication_first`), and writes one :class:`~meshfuse.runtime.interpreter.executor.Step`
record per expression this rank runs: the op's name, its arguments as slots or constants (``None``
where localization left one out), its local attributes, and the slots freed after it. A
communication's record gets its plan and its implementation from ``lower_reshard`` (the
runner binds plans to this rank's process groups).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from meshfuse.ir.fusion import Expr, Fusion, Reshard
from meshfuse.ir.printer import format_expr
from meshfuse.ir.tensor_view import Scalar, TensorView, Val
from meshfuse.ops.registry import Kind
from meshfuse.passes.localization import Local
from meshfuse.runtime.interpreter.binding import Binding
from meshfuse.runtime.interpreter.bucketing import (
    Candidate,
    bucketable,
    plan_buckets,
    run_in_buckets,
)
from meshfuse.runtime.interpreter.executor import (
    RESHARD,
    OutputLayout,
    Program,
    Slot,
    Step,
    dispatch,
)

# lower_reshard(expr, binding, donated) -> (implementation, plan steps, plan text), or None
# when no data moves on any rank.
LowerReshard = Callable[[Reshard, Binding, bool], "tuple[Callable, tuple, str] | None"]
# group_loops(exprs, steps, calls, slot_of, kept slots) -> (steps, calls): the steps of each
# stream-parallel loop's body made one loop step (see meshfuse.parallel.overlap.stream_loop).
GroupLoops = Callable[..., "tuple[list[Step], list[Callable]]"]
# lower_op(expr) -> the implementation of an op that communicates itself (ring attention),
# or None for the op's own; called on every rank alike (group creation is collective).
LowerOp = Callable[[Expr], "Callable | None"]
# order(exprs) -> the expressions in the order the program runs them (default
# communication_first); a strategy may move communications (FSDP's prefetch).
Order = Callable[[Sequence[Expr]], "list[Expr]"]


def build_program(fusion: Fusion, binding: Binding, local: Mapping[Expr, Local], rank: int,
                  lower_reshard: LowerReshard | None = None,
                  lower_op: LowerOp | None = None,
                  group_loops: GroupLoops | None = None,
                  order: Order | None = None) -> Program:
    """This rank's program; ``local`` holds the expressions it runs (see
    :func:`meshfuse.passes.localization.localize`). Small allreduces whose results no step
    reads run in buckets (:mod:`meshfuse.runtime.interpreter.bucketing`). ``order`` replaces
    :func:`communication_first`; ``group_loops`` rewrites the steps (stream loops, a
    strategy's buckets)."""
    slot_of: dict[Val, int] = {}

    def slot(v: Val) -> int:
        return slot_of.setdefault(v, len(slot_of))

    input_slots = tuple(slot(v) for v in fusion.inputs())
    exprs = (order or communication_first)(fusion.exprs)
    last_use = {slot(v): index for index, expr in enumerate(exprs) for v in expr.inputs}
    keep = {slot(v) for v in fusion.outputs()}
    readers = Counter(slot(v) for expr in exprs for v in expr.inputs)
    fresh: set[int] = set()  # slots of allreduce results (or local copies): buffers of their own
    steps, calls, ran, candidates = [], [], [], []
    for index, expr in enumerate(exprs):
        lowered = None
        if isinstance(expr, Reshard) and lower_reshard is not None:
            # Lowered on every rank alike (group creation is collective), run by members.
            src = slot(expr.args[0])
            donated = last_use.get(src) == index and src not in keep and src not in input_slots
            lowered = lower_reshard(expr, binding, donated)
            if lowered is None or [s.kind for s in lowered[1]] == ["allreduce"]:
                fresh.add(slot(expr.outputs[0]))  # a new buffer: the local copy, the sum
        elif not isinstance(expr, Reshard) and lower_op is not None:
            lowered = lower_op(expr)
        if expr not in local:
            continue
        outs = tuple(slot(o) for o in expr.outputs)
        free = tuple(s for s, last in last_use.items() if last == index and s not in keep)
        if isinstance(expr, Reshard):
            if lowered is not None and bucketable(lowered[1], readers[outs[0]] > 0, donated):
                candidates.append(_candidate(expr, outs[0], lowered[1][0], binding))
            step, call = _reshard_step(expr, lowered, Slot(slot(expr.args[0])), outs, free)
        else:
            mine = local[expr]
            step = Step(expr.op.name, _args(expr, mine, slot), mine.attrs, outs, free,
                        format_expr(expr), note=mine.note)
            if lowered is None and expr.op.name == "set" and (
                    not keep.intersection(outs) or
                    _owned(slot(expr.args[0]), fresh, readers, keep)):
                lowered = unchanged_view
            call = lowered or dispatch(step)
        steps.append(step)
        calls.append(call)
        ran.append(expr)
    if group_loops is not None:
        steps, calls = group_loops(ran, steps, calls, slot_of, keep)
    steps, calls = run_in_buckets(steps, calls, plan_buckets(candidates), rank)
    outputs = tuple(_output_layout(tv, slot(tv), binding, rank) for tv in fusion.outputs())
    return Program(len(slot_of), input_slots, tuple(steps), outputs, rank, tuple(calls),
                   _slot_bytes(slot_of, binding))


def _slot_bytes(slot_of: Mapping[Val, int], binding: Binding) -> dict[int, int]:
    """The bytes of each tensor slot's local value, as bound (an expanded broadcast axis
    counted at its extent)."""
    sizes = {}
    for v, s in slot_of.items():
        layout = binding.layouts.get(v) if isinstance(v, TensorView) else None
        if layout is not None:
            sizes[s] = math.prod(layout.shape) * v.dtype.torch_dtype.itemsize
    return sizes


def _reshard_step(expr: Reshard, lowered: tuple[Callable, tuple, str] | None, src: Slot,
                  outs: tuple[int, ...], free: tuple[int, ...]) -> tuple[Step, Callable]:
    """The step of a communication and its implementation: as lowered, or, with no data to
    move (meshes of one device), a copy as the user's ``set`` would make."""
    call, plan, text = lowered if lowered is not None else (torch.clone, (), "a local copy")
    return Step(RESHARD, (src,), {}, outs, free, f"{format_expr(expr)}: {text}", plan), call


def _output_layout(tv: TensorView, slot: int, binding: Binding, rank: int) -> OutputLayout:
    """How fusion output ``tv`` (in ``slot``) is returned: its local shape and strides."""
    layout = binding.layouts[tv]
    return OutputLayout(slot, layout.shape, layout.strides, tv.dtype.torch_dtype,
                        held=tv.mesh is None or rank in tv.mesh)


def _candidate(expr: Reshard, out: int, step, binding: Binding) -> Candidate:
    """A bucketable allreduce (its result in slot ``out``) as the bucket planner reads it."""
    src = expr.args[0]
    return Candidate(out, expr.outputs[0].name, step, binding.layouts[src].shape,
                     src.dtype.torch_dtype)


def _owned(src: int, fresh: set[int], readers: Counter, keep: set[int]) -> bool:
    """Whether slot ``src`` is an allreduce's result (or, on a mesh of one device, its local
    copy) that only one expression reads and that is no fusion output: a ``set`` of it into
    a fusion output may return it (the Megatron MLP's ``z`` and ``dx``), as no other value
    shares its buffer."""
    return src in fresh and readers[src] == 1 and src not in keep


def unchanged_view(x: torch.Tensor) -> torch.Tensor:
    """A ``set`` whose result is no fusion output (or whose source is a buffer only it
    reads, see :func:`_owned`): a view of ``x``, not a copy. The values
    of a program are never written in place (an allreduce reuses a buffer only when it is
    no view, see :func:`meshfuse.runtime.comm.collectives.allreduce`), so no step can tell the
    view from a copy, and none is made (the copy's time and memory are saved)."""
    return x.view_as(x)


def _args(expr: Expr, local: Local, slot: Callable[[Val], int]) -> tuple[Any, ...]:
    """An op's arguments as a record holds them: slots for values, constants as they are,
    ``None`` for those this rank leaves out."""
    args = []
    for pos, (param, arg) in enumerate(zip(expr.op.params, expr.args)):
        if pos in local.dropped:
            args.append(None)
        elif isinstance(arg, Scalar) and arg.is_constant:
            args.append(arg.value)
        elif isinstance(arg, Val):
            args.append(Slot(slot(arg)))
        elif param.kind is Kind.TENSORS:
            args.append([Slot(slot(v)) for v in arg])
        else:
            args.append(arg)
    return tuple(args)


def communication_first(exprs: Sequence) -> list:
    """``exprs`` (in a valid order) reordered so that each communication is launched as soon
    as it can be, and has work to hide under.

    Communications are kept in their order (every rank issues them alike); before each, the
    expressions it depends on that are not yet placed come in their order; the rest follow in
    theirs. With collectives launched asynchronously, the expressions after a communication
    overlap it: in a Megatron MLP's backward, the input gradient's allreduce overlaps the
    weight gradients' matmuls.

    Where what the next communication needs reads this one's result at once (a chain: in a
    sequence-parallel backward, the reduce-scatter of a layer's input gradient feeds the
    layer norm's backward, whose result is gathered next), one library call that does not
    need it (a weight gradient's matmul, with what it needs) is placed right after the
    launch, as Megatron orders them, so that the communication runs under it.
    """
    producer = {o: e for e in exprs for o in e.outputs}
    position = {e: i for i, e in enumerate(exprs)}
    placed: set = set()
    order = []

    def unplaced_closure(expr) -> set:
        needed, stack = {expr}, [expr]
        while stack:
            for v in stack.pop().inputs:
                dep = producer.get(v)
                if dep is not None and dep not in needed and dep not in placed:
                    needed.add(dep)
                    stack.append(dep)
        return needed

    def place(needed: set) -> None:
        for e in sorted(needed - placed, key=position.__getitem__):
            placed.add(e)
            order.append(e)

    communications = [e for e in exprs if _communicates(e)]
    for k, comm in enumerate(communications):
        place(unplaced_closure(comm))
        following = communications[k + 1:k + 2]
        if following and _reads_any(unplaced_closure(following[0]), comm.outputs):
            place(_independent_library_call(exprs, comm, placed, unplaced_closure))
    order += [e for e in exprs if e not in placed]
    return order


def _independent_library_call(exprs: Sequence, comm, placed: set, unplaced_closure) -> set:
    """The first library call of ``exprs`` not yet placed that needs neither ``comm``'s
    result nor any communication not yet placed, with what it needs; empty if none."""
    for expr in exprs:
        if expr in placed or _communicates(expr) or not _library_call(expr):
            continue
        needed = unplaced_closure(expr)
        if not any(_communicates(e) for e in needed) and not _reads_any(needed, comm.outputs):
            return needed
    return set()


def _reads_any(exprs, values) -> bool:
    return any(v in values for e in exprs for v in e.inputs)


def _library_call(expr) -> bool:
    """An op that runs as a library kernel (a matrix product, attention): the work worth
    placing under a communication. Pointwise ops and reductions are not."""
    return expr.op.output_layout == "contiguous" or expr.op.make_impl is not None


def _communicates(expr) -> bool:
    """A communication (or a local slice, launched early too: it costs nothing)."""
    return isinstance(expr, Reshard)
