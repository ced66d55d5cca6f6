"""Reverse-mode differentiation of a fusion at global shapes.

``derive(fusion, wrt, remat)`` reads a user's fusion (never changing it) and builds two new
fusions:

- the **forward**: a clone of the user's program (same ops, same pins) whose outputs are the
  user's outputs followed by the *residuals*, the intermediate values the backward reads;
- the **backward**: inputs are the cotangents of the differentiable outputs, then the
  residuals (forward inputs and intermediates, as this rank's local shards); outputs are the
  gradients of the ``wrt`` inputs that receive one. Each op's derivative is its ``vjp`` rule,
  applied in reverse definition order; contributions to one value are added.

Shardings: each gradient is pinned to its primal input's sharding, each cotangent to its
output's, each residual to the sharding the forward gave it (read from the compiled forward);
every other tensor of the backward is left to propagation, which inserts the communications
as for any fusion. The transposes of the forward's communications follow from those pins: a
weight gathered for a matmul in the forward gets its gradient reduce-scattered, a partial sum
resolved into a replicated output gets a replicated cotangent used locally.

Rematerialization (``remat``): ``"save"`` saves every intermediate the backward reads;
``"recompute"`` recomputes the results of cheap ops (``Vjp.recompute``:
pointwise ops, casts, shape ops, local slices) in the backward from saved values, so only
inputs and the results of expensive ops (matrix products, attention, reductions) and of
communications are saved: no matrix product and no collective runs twice (DTensor's
schedule: a sequence-parallel layer's gathered input is saved for its weight gradient).
``"recompute_fused"`` (the default) recomputes only the cheap values that the forward's
fused kernels never write to memory, and saves those the forward writes anyway, because an
op that runs on its own reads them (a matrix product's operand, such as a layer norm's
output or an MLP's activation; attention's; a communication's) or the user gets them: the
backward reads them back rather than computing and writing them again (the hand-written
layers' and Megatron-LM's selective recomputation), for the memory of holding them until
the backward.
``"recompute_gathers"`` also recomputes the forward's communications (Megatron-LM's
sequence-parallel schedule: the input is gathered again in the backward), which saves the
gathered copies' memory at the cost of running those collectives again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

from meshfuse.autodiff.context import VjpContext, materialized_like, op_of, sum_to
from meshfuse.autodiff.naming import BackwardNames, gradient_name
from meshfuse.autodiff.schedules import copy_schedule, is_pinned
from meshfuse.engine.runner import FusionRunner
from meshfuse.errors import DefinitionError
from meshfuse.ir.fusion import Expr, Fusion, Reshard
from meshfuse.ir.iter_domain import IterDomain, IterType
from meshfuse.ir.placement import Partial, placements, shard_signature
from meshfuse.ir.tensor_view import Allocation, Scalar, TensorView, Val
from meshfuse.ops.namespace import Ops, add_op
from meshfuse.ops.registry import Kind
from meshfuse.passes.pipeline import compiled_for

REMAT_POLICIES = ("recompute", "recompute_fused", "recompute_gathers", "save")
# As fast as "recompute" or faster in the runs of benchmarks/results/ (the GPT layer on an
# H100: 7% at the small size, 3% at the medium one; on an H200 alike to 2.5% faster;
# Llama-3.2-1B's step on an H200: 1.5%), for the memory of the values the forward writes.
DEFAULT_REMAT = "recompute_fused"


@dataclasses.dataclass(frozen=True)
class Residual:
    """Where the value of one residual input of the backward comes from: forward input
    ``index`` (``kind="input"``) or forward output ``index`` (``kind="output"``)."""

    kind: str
    index: int


@dataclasses.dataclass
class Derivation:
    """A fusion's forward-with-residuals and backward, and how their values correspond.

    Attributes:
        forward: the user's program; outputs: the user's ``num_outputs`` outputs, then the
            residuals it computes. Compiled (its runner is ``forward_runner``; None for a
            preview, derived with ``world_size``).
        backward: inputs: ``cotangents`` then ``residuals``; outputs: the gradients.
        num_outputs: how many outputs the user's fusion has.
        cotangents: for each cotangent input of the backward, the user output it belongs to.
        residuals: for each residual input of the backward, where its value comes from.
        gradients: for each input of the user's fusion, the position of its gradient among
            the backward's outputs, or None (not differentiated, or zero by structure).
    """

    forward: Fusion
    forward_runner: FusionRunner | None
    backward: Fusion
    num_outputs: int
    cotangents: tuple[int, ...]
    residuals: tuple[Residual, ...]
    gradients: tuple[int | None, ...]
    # what derives a backward for fewer cotangents (see zero_cotangents)
    source: BackwardSource | None = None


@dataclasses.dataclass(frozen=True)
class BackwardSource:
    """What :func:`zero_cotangents` derives another backward of a derivation from: the
    compiled forward, the values differentiated (by the user's input order: None where not),
    the rematerialization policy, the forward's allocations, and the residuals' values (in
    the backward's input order)."""

    forward: Fusion
    wrt: tuple[TensorView | None, ...]
    remat: str
    allocations: Any
    residuals: tuple[Val, ...]


@dataclasses.dataclass(frozen=True)
class PartialBackward:
    """A backward of a derivation for some of its cotangents (the others zero): its fusion,
    which of the derivation's cotangents and residuals are its inputs (positions among
    them, in its input order), and the gradients' positions among its outputs, per input of
    the user's fusion (None: zero)."""

    backward: Fusion
    cotangents: tuple[int, ...]
    residuals: tuple[int, ...]
    gradients: tuple[int | None, ...]


def zero_cotangents(derivation: Derivation, zero: frozenset[int]) -> PartialBackward | None:
    """The backward of ``derivation`` where the cotangents at positions ``zero`` (among
    ``derivation.cotangents``) are zero: derived without them, so that no zero tensor of an
    output's size is made, copied in or added (an output nothing differentiates, such as
    the logits a causal language model returns beside its loss). None where the
    derivation cannot be derived again (a preview), or the partial backward would read a
    value the forward does not save."""
    source = derivation.source
    if source is None:
        return None
    outputs = source.forward.outputs()[:derivation.num_outputs]
    absent = {derivation.cotangents[k] for k in zero}
    builder = _BackwardBuilder(source.forward, {v for v in source.wrt if v is not None},
                               source.remat)
    builder.build(outputs, absent)
    if any(v not in source.residuals for v in builder.residuals):
        return None
    _pin_backward(builder, source.allocations)
    cotangents = tuple(derivation.cotangents.index(j) for j in builder.cotangent_of)
    residuals = tuple(source.residuals.index(v) for v in builder.residuals)
    gradients = tuple(None if v is None else builder.gradient_index.get(v)
                      for v in source.wrt)
    return PartialBackward(builder.backward, cotangents, residuals, gradients)


def derive(fusion: Fusion, wrt: Sequence[TensorView] | None = None,
           remat: str = DEFAULT_REMAT, world_size: int | None = None) -> Derivation:
    """The forward and backward of ``fusion``; see the module doc.

    Args:
        fusion: the user's fusion (read only).
        wrt: the input TensorViews to differentiate; default every floating-point tensor input.
        remat: ``"recompute"``, ``"recompute_fused"`` (default), ``"recompute_gathers"``
            or ``"save"``.
        world_size: derive for a preview of this many ranks from one process (to explain,
            not to run: the forward has no runner); default: this process's world.
    """
    if remat not in REMAT_POLICIES:
        raise DefinitionError(f"remat must be one of {REMAT_POLICIES}, got {remat!r}")
    inputs = fusion.inputs()
    if wrt is None:
        wrt = [v for v in inputs if isinstance(v, TensorView) and v.dtype.is_floating]
    for v in wrt:
        if not isinstance(v, TensorView) or v not in inputs:
            raise DefinitionError(
                f"wrt: {getattr(v, 'name', repr(v))} is not a tensor input of the fusion; "
                "differentiate with respect to tensors made by its define_tensor"
            )
        if not v.dtype.is_floating:
            raise DefinitionError(
                f"wrt: {v.name} is {v.dtype.name}; only floating-point inputs have gradients"
            )
    forward, primal = clone_fusion(fusion)
    _pin_ends_as_executed(fusion, primal, world_size)
    # The backward is derived from the compiled forward: its communications are explicit
    # Reshard expressions there (whose gradients are the transposed communications), and every tensor
    # has its final sharding, which the backward's inputs and outputs are pinned to.
    runner = FusionRunner(forward) if world_size is None else None
    compiled = runner.compiled if runner is not None else compiled_for(forward, world_size)
    forward = compiled.fusion  # the compiled copy, with its Reshard expressions
    primal = {v: compiled[p] for v, p in primal.items()}
    builder = _BackwardBuilder(forward, {primal[v] for v in wrt}, remat)
    builder.build(forward.outputs())
    num_outputs = len(forward.outputs())
    residuals = _add_residual_outputs(forward, builder.residuals)
    _pin_backward(builder, compiled.allocations)
    gradients = tuple(builder.gradient_index.get(primal[v]) for v in inputs)
    source = BackwardSource(forward, tuple(primal[v] if v in wrt else None for v in inputs),
                            remat, compiled.allocations, tuple(builder.residuals))
    return Derivation(forward, runner, builder.backward, num_outputs,
                      tuple(builder.cotangent_of), residuals, gradients, source)


def clone_fusion(fusion: Fusion) -> tuple[Fusion, dict[Val, Val]]:
    """A new fusion with ``fusion``'s inputs, ops, outputs and user pins; and the map from
    ``fusion``'s values to the clone's. ``fusion`` is not changed."""
    clone = Fusion()
    mapped: dict[Val, Val] = {}
    for v in fusion.inputs():
        if isinstance(v, TensorView):
            new = TensorView(clone, [i.like() for i in v.logical], v.dtype)
            ids = dict(zip(v.logical, new.logical))
            if v.allocation is not None and all(i in ids for i in v.allocation.ids):
                new.allocation = Allocation(tuple(ids[i] for i in v.allocation.ids),
                                            v.allocation.contiguity)
        else:
            new = Scalar(v.dtype)
        mapped[v] = clone.add_input(new)

    for expr in _read_exprs(fusion):
        outs = add_op(clone, expr.op, [clone.copied_arg(a, mapped) for a in expr.args], {})
        outs = outs if isinstance(outs, tuple) else (outs,)
        mapped.update(zip(expr.outputs, outs))
    for v, new in mapped.items():  # the user's names, given or automatic
        if new.name != v.name:
            clone.set_name(new, v.name)
    for tv in fusion.tensors():
        if is_pinned(tv):
            copy_schedule(tv, mapped[tv])
    for out in fusion.outputs():
        clone.add_output(mapped[out])
    return clone, mapped


def _pin_ends_as_executed(fusion: Fusion, mapped: dict[Val, Val],
                          world_size: int | None) -> None:
    """Pins the clone's inputs and outputs that the user left unscheduled as ``execute``
    lays them out (``compiled_for(fusion)``), as a fusion with symbolic extents has them
    pinned (``FusionFunction.derivation``): propagation over the clone, whose unread cheap
    expressions are dropped (:func:`_read_exprs`), may choose other layouts, and an
    autograd function takes its inputs and gives its outputs as ``execute`` does (and as
    ``shard_tensor`` and ``explain`` say). Found by the gradient fuzzer (seed 680268: an
    embedding's output came back split over the rows where ``execute`` returns it whole)."""
    ends = [v for v in (*fusion.inputs(), *fusion.outputs())
            if isinstance(v, TensorView) and not is_pinned(v)]
    if not ends:
        return
    executed = compiled_for(fusion, world_size)
    for v in ends:
        if not mapped[v].is_scheduled:  # (an output given twice, or an input returned)
            copy_schedule(executed[v], mapped[v])


def _read_exprs(fusion: Fusion) -> list[Expr]:
    """``fusion``'s expressions but the cheap pure ones (``Vjp.recompute``: pointwise,
    casts, shape ops) whose results nothing reads, in order. A composite may leave such
    values behind (a cross entropy reads half-precision logits where it was given their
    float32 cast). Only chains of one-input ops hanging from a value that kept expressions
    read are dropped, and none whose result the user scheduled: propagation may carry a
    sharding through an op from one input to another, or from a pin, and the derived
    forward lays its inputs out as the user's fusion does."""
    forced: set[int] = set()
    while True:
        dropped = _unread(fusion, forced)
        read = set(fusion.outputs())
        for expr in fusion.exprs:
            if id(expr) not in dropped:
                read.update(expr.inputs)
        unsafe = {id(e) for e in fusion.exprs
                  if id(e) in dropped and not _hangs_from(e, dropped, read)}
        if not unsafe:
            return [e for e in fusion.exprs if id(e) not in dropped]
        forced |= unsafe


def _unread(fusion: Fusion, forced: set[int]) -> set[int]:
    """The ids of the cheap pure expressions whose results nothing reads (transitively), the
    user did not pin, and that are not in ``forced``."""
    read = set(fusion.outputs())
    unread = set()
    for expr in reversed(fusion.exprs):
        vjp = op_of(expr).vjp if expr.op is not None else None
        if id(expr) not in forced and vjp is not None and vjp.recompute and not any(
                o in read or isinstance(o, TensorView) and is_pinned(o) for o in expr.outputs):
            unread.add(id(expr))
            continue
        read.update(expr.inputs)
    return unread


def _hangs_from(expr: Expr, dropped: set[int], read: set) -> bool:
    """Whether ``expr`` has one tensor input, read by a kept expression or itself the result
    of such a dropped one-input chain."""
    (x, *more) = expr.tensor_inputs or (None,)
    if x is None or more:
        return False
    if x in read:
        return True
    source = x.definition
    return source is not None and id(source) in dropped and _hangs_from(source, dropped, read)


class _BackwardBuilder:
    """Builds the backward fusion from the forward clone (see the module doc)."""

    def __init__(self, forward: Fusion, wrt: set[TensorView], remat: str) -> None:
        self.forward = forward
        self.wrt = wrt
        self.remat = remat
        self.backward = Fusion()
        self.ops = Ops(self.backward)
        self.values: dict[Val, Val] = {}  # primal value -> its value in the backward
        self.residuals: list[Val] = []  # primal values passed in, in input order
        self.grads: dict[TensorView, TensorView] = {}
        self.cotangent_of: list[int] = []
        self.pins: list[tuple[TensorView, TensorView]] = []  # (backward tensor, primal)
        self.gradient_index: dict[TensorView, int] = {}
        self.active = _active(forward, wrt)
        self.written = _written(forward) if remat == "recompute_fused" else set()
        self.names = BackwardNames(self.backward)

    def build(self, outputs: Sequence[TensorView], zero: Collection[int] = ()) -> None:
        """Builds the backward of the forward's ``outputs`` (its user's outputs), each with
        a cotangent input but those at positions ``zero``."""
        for index, out in enumerate(outputs):
            if out in self.active and index not in zero:
                self.cotangent_of.append(index)
                self._accumulate(out, self._new_input(out, cotangent=True))
        for expr in reversed(self.forward.exprs):
            self._apply_rule(expr)
        for tv in sorted(self.wrt, key=self.forward.inputs().index):
            start = self.names.mark()
            grad = self.gradient(tv)
            if grad is None:
                continue
            grad = materialized_like(self.ops, grad, tv)
            taken = set(self.backward.inputs()) | set(self.backward.outputs())
            if grad in taken or self.backward.uses().get(grad):
                grad = self.ops.set(grad)
            self.names.steps(start, tv.name)
            self.names.gradient(grad, tv, output=True)
            self.gradient_index[tv] = len(self.backward.outputs())
            self.backward.add_output(grad)
            self.pins.append((grad, tv))
        _remove_unused(self.backward)
        self.names.apply()

    # ----- primal values in the backward ---------------------------------------------------
    def fetch(self, v: Val) -> Val:
        """The backward's value of primal ``v``: a constant, a residual input, or a
        recomputation of a cheap op from other primal values."""
        if v in self.values:
            return self.values[v]
        if isinstance(v, TensorView) and _is_partial(v):
            # A rule reading an op's own partial result (max's gradient reads the maximum)
            # reads the copy that resolves it; its global value is the same.
            self.values[v] = self.fetch(self._resolution(v))
        elif isinstance(v, Scalar) and v.is_constant:
            self.values[v] = self.backward.add_constant(Scalar(v.dtype, v.value))
        elif isinstance(v, TensorView) and v not in self.written and \
                self._recomputable(v.definition):
            self._recompute(v.definition)
        else:
            self.residuals.append(v)
            self.values[v] = self._new_input(v)
        return self.values[v]

    def _resolution(self, v: TensorView) -> TensorView:
        """The forward's copy of partial ``v`` that reduces it (resharding made one),
        possibly through copies that are partial still (a partial result resharded to
        the partial sharding the user pinned, then reduced)."""
        copies = [v]
        for expr in self.forward.exprs:
            if op_of(expr).vjp is not None and op_of(expr).vjp.communication and \
                    expr.args[0] in copies:
                if not _is_partial(expr.outputs[0]):
                    return expr.outputs[0]
                copies.append(expr.outputs[0])
        raise DefinitionError(
            f"the backward needs {v.name}, a partial sum in the forward (its reduction axis is "
            "parallelized and it is never reduced); resolve it with fd.ops.set before using it"
        )

    def _recomputable(self, expr: Expr | None) -> bool:
        """Cheap ops are recomputed, unless they read a partial value (the resolution of a
        partial sum is saved instead: recomputing it would mean saving the partial), or
        they communicate and the policy saves communications' results."""
        if self.remat == "save" or expr is None or op_of(expr).vjp is None:
            return False
        vjp = op_of(expr).vjp
        if not vjp.recompute or any(_is_partial(t) for t in expr.tensor_inputs):
            return False
        return not (vjp.communication and self.remat in ("recompute", "recompute_fused")
                    and _moves_data(expr.tensor_inputs[0], expr.outputs[0]))

    def _recompute(self, expr: Expr) -> None:
        args = [[self.fetch(x) for x in a] if isinstance(a, list | tuple) and a and
                isinstance(a[0], Val) else self.fetch(a) if isinstance(a, Val) else a
                for a in expr.args]
        outs = add_op(self.backward, op_of(expr), args, {})
        outs = outs if isinstance(outs, tuple) else (outs,)
        self.values.update(zip(expr.outputs, outs))
        for new, old in zip(outs, expr.outputs):
            if isinstance(new, TensorView):
                self.names.value(new, old.name)
        # A recomputation lies as its primal did in the forward (and communicates alike).
        self.pins.extend((new, old) for new, old in zip(outs, expr.outputs)
                         if isinstance(new, TensorView) and new.logical)

    def _new_input(self, v: Val, cotangent: bool = False) -> Val:
        """A backward input shaped like primal ``v`` (its schedule is pinned later). A
        cotangent varies along ``v``'s expanded broadcast axes (extent above 1): those are
        iteration axes of it."""
        if isinstance(v, Scalar):
            return self.backward.add_input(Scalar(v.dtype))
        new = TensorView(self.backward, [
            IterDomain(i.extent, IterType.Iteration if cotangent and i.is_broadcast and
                       i.extent not in (1, None) else i.iter_type)
            for i in v.materialized()], v.dtype)
        self.pins.append((new, v))
        self.names.value(new, gradient_name(v.name) if cotangent else v.name)
        return self.backward.add_input(new)

    # ----- gradients -----------------------------------------------------------------------
    def gradient(self, primal: TensorView) -> TensorView | None:
        """The complete gradient of ``primal`` (its contributions all added), in
        ``primal``'s dtype, as torch's autograd gives it: contributions are added in the
        promoted type (nvFuser adds bf16 in float), and the sum is rounded once, so that
        the collectives and matmuls it feeds run in the primal's dtype."""
        grad = self.grads.get(primal)
        if grad is not None and grad.dtype != primal.dtype:
            grad = self.grads[primal] = self.ops.cast(grad, primal.dtype)
        return grad

    def _accumulate(self, primal: TensorView, grad: TensorView) -> None:
        grad = sum_to(self.ops, grad, primal)
        old = self.grads.get(primal)
        self.grads[primal] = grad if old is None else self.ops.add(old, grad)

    def _apply_rule(self, expr: Expr) -> None:
        start = self.names.mark()
        cotangents = tuple(self.gradient(o) if isinstance(o, TensorView) else None
                           for o in expr.outputs)
        for o, g in zip(expr.outputs, cotangents):
            if g is not None:
                self.names.gradient(g, o)
        wanted = [t for t in expr.tensor_inputs if t in self.active]
        if not wanted or all(g is None for g in cotangents):
            return
        op = op_of(expr)
        if op.vjp is None:
            raise DefinitionError(
                f"{op.name} has no derivative rule, and a gradient flows through it "
                f"({', '.join(o.name for o, g in zip(expr.outputs, cotangents) if g)}); "
                "differentiate a fusion that does not use it, or leave its inputs out of wrt"
            )
        context = VjpContext(expr, self.ops, self.fetch)
        thunks = op.vjp.rule(context, cotangents)
        self.names.steps(start, expr.outputs[0].name)
        for param, arg in zip(op.params, expr.args):
            if param.kind not in (Kind.TENSOR, Kind.TENSORS, Kind.OPERAND):
                continue
            pairs = zip(arg, thunks.get(param.name) or [None] * len(arg)) \
                if param.kind is Kind.TENSORS else [(arg, thunks.get(param.name))]
            for primal, thunk in pairs:
                if primal in self.active and thunk is not None:
                    start = self.names.mark()
                    grad = thunk()
                    if grad is not None and op.vjp.communication:
                        grad = self._transposed_communication(grad, primal, expr.outputs[0])
                    if grad is not None:
                        self._accumulate(primal, grad)
                    self.names.steps(start, primal.name)

    def _transposed_communication(self, grad: TensorView, src: TensorView,
                                  dst: TensorView) -> TensorView:
        """The gradient of ``dst = set(src)``: ``grad`` copied into ``src``'s sharding (a
        partial ``src`` made replicated), which the backward's resharding lowers to the
        transposed communication; ``grad`` itself where the set moved nothing."""
        if src.mesh is None or (_alike_resolved(src, dst) and not _is_partial(dst)):
            return grad  # a replicated cotangent of a resolved partial sum is used as it is
        copy = self.ops.set(materialized_like(self.ops, grad, src))
        self.pins.append((copy, src))
        return copy


def _remove_unused(fusion: Fusion) -> None:
    """Drops the expressions whose results nothing reads (a rule's intermediate that a
    simplification made unnecessary, such as a cast undone by the next rule)."""
    needed: set[Val] = set(fusion.outputs())
    kept = []
    for expr in reversed(fusion.exprs):
        if any(o in needed for o in expr.outputs):
            kept.append(expr)
            needed.update(expr.inputs)
    fusion.exprs[:] = reversed(kept)


def _active(forward: Fusion, wrt: set[TensorView]) -> set[TensorView]:
    """The floating-point tensors that depend on a ``wrt`` input."""
    active = set(wrt)
    for expr in forward.exprs:
        if any(t in active for t in expr.tensor_inputs):
            vjp = op_of(expr).vjp
            active.update(o for i, o in enumerate(expr.outputs) if isinstance(o, TensorView) and
                          (o.dtype.is_floating if vjp is None else
                           vjp.is_differentiable(i, o.dtype)))
    return active


def _alike_resolved(src: TensorView, dst: TensorView) -> bool:
    """Whether ``dst`` lies as ``src`` would once its partial sums (if any) were resolved:
    the same mesh, and each materialized axis sharded alike."""
    return src.mesh == dst.mesh and all(
        shard_signature(src, a) == shard_signature(dst, b)
        for a, b in zip(src.materialized(), dst.materialized(), strict=True))


def _written(forward: Fusion) -> set[TensorView]:
    """The forward's values that it writes to memory whatever fuses: its outputs and what
    the ops that run on their own read (matrix products, attention, random ops,
    communications: not :attr:`~meshfuse.ops.registry.OpDef.fusible`); for a view of a
    value (made by an op whose :attr:`~meshfuse.ops.registry.OpDef.view` is set), the value
    it views (the reshaped logits a loss reads are the logits' memory: those are saved, the
    view recomputed)."""
    written = {v for v in forward.outputs() if isinstance(v, TensorView)}
    for expr in forward.exprs:
        if isinstance(expr, Reshard) or not expr.op.fusible:
            written.update(_viewed(t) for t in expr.tensor_inputs)
    return written


def _viewed(tv: TensorView) -> TensorView:
    """The value whose memory ``tv`` views through shape ops (``tv`` itself if none)."""
    while tv.definition is not None and not isinstance(tv.definition, Reshard) and \
            tv.definition.op.view:
        tv = tv.definition.tensor_inputs[0]
    return tv


def _moves_data(src: TensorView, dst: TensorView) -> bool:
    """Whether ``dst = set(src)`` runs a collective: ``dst`` lies on another mesh, or an
    axis sharded in ``src`` lies otherwise in ``dst`` (a local slice of a replicated axis
    moves nothing)."""
    if src.mesh is None or dst.mesh is None:
        return src.mesh != dst.mesh
    if src.mesh != dst.mesh:
        return True
    return any(shard_signature(src, a) and shard_signature(src, a) != shard_signature(dst, b)
               for a, b in zip(src.materialized(), dst.materialized(), strict=True))


def _is_partial(tv: TensorView) -> bool:
    return tv.mesh is not None and any(isinstance(p, Partial) for p in placements(tv))


def _add_residual_outputs(forward: Fusion, residuals: list[Val]) -> tuple[Residual, ...]:
    """Makes each intermediate residual an output of the compiled ``forward`` (its program
    is built at the first execute, from the outputs then); says where each comes from."""
    inputs = forward.inputs()
    result = []
    for v in residuals:
        if v in inputs:
            result.append(Residual("input", inputs.index(v)))
            continue
        outputs = forward.outputs()
        if v not in outputs:
            forward.add_output(v)
            outputs = forward.outputs()
        result.append(Residual("output", outputs.index(v)))
    return tuple(result)


def _pin_backward(builder: _BackwardBuilder, allocations) -> None:
    """Pins the backward's cotangents, residuals and gradients to their primals' schedules
    in the compiled forward."""
    for tv, primal in builder.pins:
        if tv.is_scheduled:  # pinned twice to one primal (a gradient that is a copy)
            continue
        allocation = allocations.get(primal)
        if allocation is not None and tv.definition is not None:
            allocation = Allocation(allocation.ids, tuple(
                None if c is None else True for c in allocation.contiguity))
        copy_schedule(primal, tv, allocation)
