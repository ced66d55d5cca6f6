"""The op registry: one declaration per op, with all of its rules together.

An :class:`OpDef` holds an op's signature (:class:`Param` list), its *shape rule* (``infer``:
output dtypes, extents and the domain map, from argument metadata) and its torch
implementation (``impl``). ``infer`` runs once when the op is added to a fusion (extents may be
``None`` there: symbolic) and again when execute binds concrete global extents, so a shape
mismatch with real sizes is caught before anything runs.

Domain map: each output axis lists its *sources*, the ``(tensor input, logical axis)`` pairs
it maps from (see :class:`AxisSpec`); propagation and sharding rules are derived from it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError
from meshfuse.ir.iter_domain import IterDomain, IterType


class Kind(enum.Enum):
    """What a parameter accepts."""

    TENSOR = "tensor"  # a TensorView
    TENSORS = "tensors"  # a list of TensorViews
    OPERAND = "operand"  # a TensorView, a Scalar or a Python number
    SCALAR = "scalar"  # a Scalar or a Python value, read at run time
    ATTR = "attr"  # a static Python value (axes, shapes, flags)


_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: Kind
    default: Any = _REQUIRED

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


def tensor(name: str) -> Param:
    return Param(name, Kind.TENSOR)


def tensors(name: str) -> Param:
    return Param(name, Kind.TENSORS)


def operand(name: str) -> Param:
    return Param(name, Kind.OPERAND)


def scalar(name: str, default: Any = _REQUIRED) -> Param:
    return Param(name, Kind.SCALAR, default)


def attr(name: str, default: Any = _REQUIRED) -> Param:
    return Param(name, Kind.ATTR, default)


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What a shape rule sees of a tensor argument: global extents (``None`` if symbolic),
    the kind of each axis, and the dtype.

    ``partial_axes`` are the extents of the tensor's reduction axes (a matmul's contracted
    axis, a sum's): where one is sharded over a mesh axis, each device holds a partial sum
    over it, whose reduction is pending. The rules of ``add`` and ``sub`` (linear in their
    tensor arguments) carry them to their output with
    :func:`~meshfuse.ops.shape_rules.carried_partials`, so that partial sums combine before
    their one reduction. An :class:`AxisSpec` source names reduction axis ``k`` of an
    argument as axis ``ndim + k``.
    """

    shape: tuple[int | None, ...]
    iter_types: tuple[IterType, ...]
    dtype: DataType
    partial_axes: tuple[int | None, ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def is_broadcast(self, axis: int) -> bool:
        return self.iter_types[axis] is IterType.Broadcast


@dataclasses.dataclass(frozen=True)
class ScalarMeta:
    """What a shape rule sees of a scalar argument: its dtype and constant value (or None)."""

    dtype: DataType
    value: Any = None


@dataclasses.dataclass(frozen=True)
class SymbolicSize:
    """The extent of a tensor axis that is symbolic at definition (``fd.ops.size(t, i)`` of a
    ``-1`` axis), as a shape argument: ``broadcast_in_dim``/``expand`` take it where an input
    axis of that extent goes (like ``-1``), ``slice`` as the end of that axis."""

    id: IterDomain

    def __repr__(self) -> str:
        return f"size(i{self.id.uid})"


@dataclasses.dataclass(frozen=True)
class AxisSpec:
    """One output axis: its extent, kind, and the input axes it maps from.

    ``sources`` holds ``(tensor input, axis)`` pairs: the position of the input among the op's
    tensor arguments (in signature order, lists flattened) and its logical axis.
    """

    extent: int | None
    iter_type: IterType = IterType.Iteration
    sources: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class OutSpec:
    """One output: a tensor (``axes`` given) or a scalar (``axes`` is None)."""

    dtype: DataType
    axes: tuple[AxisSpec, ...] | None


InferFn = Callable[..., Sequence[OutSpec]]


@dataclasses.dataclass(frozen=True)
class Vjp:
    """An op's derivative: its vector-Jacobian product written with fusion ops.

    Attributes:
        rule: ``rule(d, grads) -> {param name: gradient}``. ``grads`` holds one cotangent per
            output (a TensorView of the backward fusion, or None where the output gets no
            gradient: an unused, integer or boolean output); ``d`` is the derivation's view of
            this application of the op (see ``meshfuse.autodiff.context.VjpContext``):
            ``d.ops`` adds ops to the backward fusion, ``d.arg(name)`` is the primal argument
            (for shapes and dtypes), ``d.value(name)`` / ``d.out(i)`` its value in the backward
            (a saved residual or a recomputation), ``d.attrs`` the static arguments. Each
            gradient is given as a *thunk* (a function of no arguments returning a TensorView,
            or None for a gradient that is zero by structure), called only where that
            gradient is needed; a ``tensors`` parameter takes a list of thunks. A gradient may
            have the output's broadcast shape and dtype: the derivation sums it down to the
            argument's shape and casts it to the argument's dtype.
        recompute: True for ops cheap enough to run again in the backward (pointwise, casts,
            shape ops): the default rematerialization policy recomputes their results from
            saved values instead of saving them.
        differentiable: the outputs that carry gradients (None: every floating-point one).
            The others are constants to differentiation, as integer and boolean outputs
            always are (``sdpfa_fwd``'s log-sum-exp, as in PyTorch).
        communication: the op is a resharding point (``set``): where its output lies
            otherwise than its argument, the derivation copies the gradient back into the
            argument's sharding, a partial argument's made replicated: the transposed
            communication (an allgather's gradient is reduce-scattered, a partial sum's
            resolution gets a replicated cotangent, a local slice's gradient is gathered).
    """

    rule: Callable[..., dict[str, Any]]
    recompute: bool = False
    differentiable: tuple[int, ...] | None = None
    communication: bool = False

    def is_differentiable(self, index: int, dtype) -> bool:
        """Whether output ``index`` (of ``dtype``) carries a gradient."""
        return dtype.is_floating and (self.differentiable is None or
                                      index in self.differentiable)


@dataclasses.dataclass(frozen=True)
class LocalContext:
    """What an op's ``localize`` rule knows of the rank it runs on.

    Attributes:
        rank: the global rank.
        device: where the rank's tensors live (for ops that create tensors).
        index: ``index(tv)``, the :class:`~meshfuse.ir.global_index.GlobalIndex` of ``tv``'s
            local shard on this rank (global extents bound).
        extents: every ID's bound global extent (for rules that need other ranks' shards).
    """

    rank: int
    device: Any
    index: Callable[[Any], Any]
    extents: Any = None


@dataclasses.dataclass(frozen=True)
class OpDef:
    """An op's declaration.

    Attributes:
        name: the name under ``fd.ops``.
        params: the signature.
        infer: the shape rule; called with the arguments in signature order, tensors as
            :class:`TensorMeta`, scalars as :class:`ScalarMeta`, attrs as given. It raises
            :class:`DefinitionError` for bad arguments and returns one OutSpec per output.
        impl: the torch implementation; called with the arguments in signature order, tensors
            as local ``torch.Tensor``s and scalars as Python values. With ``needs_out_shape``
            it also gets ``out_shapes=`` (the local output shapes, for ops whose arguments
            speak of global shapes).
        doc: one line for the op table (and the op reference, docs/ops.md).
        sharding: one line for the op reference: how the op's sharding follows from its
            domain map (what a sharded input axis gives, what is gathered first); empty:
            the reference derives one from the fields below.
        prefer_inputs: tensor inputs whose sharding propagation prefers, in order, when
            inputs shard equally many axes (``linear`` prefers its weight, so weights stay put).
        partial_reduce: how partial results of this op combine when it reduces over a sharded
            axis ("sum", "max", "min", "prod"), or None if it cannot run on a sharded
            reduction axis (its inputs are gathered there instead).
        needs_reduced_count: the implementation also gets ``reduced_count=``, the *global*
            number of elements reduced into each output element (for ``mean`` on shards).
        partial_addends: arguments added to the result (``linear``'s bias): when the result is
            partial, only coordinate 0 of the partial mesh axes adds them, so the reduction
            counts them once. The other ranks pass ``None`` for them and the implementation
            also gets ``dropped_addends=`` (their positions).
        output_layout: ``"follow"``: outputs are laid out like the inputs they map from (what
            PyTorch's pointwise and attention kernels do); ``"contiguous"``: row-major (what
            its matrix products return, whatever the operands' strides).
        contiguous_outputs: the positions of outputs laid out row-major whatever
            ``output_layout`` says for the others (attention's log-sum-exp, ``[B, H, S]``
            as the CUDA kernels write and read it, where its output follows a BSHE q).
        make_impl: a factory of a stateful implementation, called once per program step;
            used instead of ``impl`` when set (attention validates its inputs and picks its
            kernel on the first call, then calls the kernel directly).
        whole_axes: the op's own sharding rule, beyond its domain map:
            ``whole_axes(expr)`` returns the input logical IDs the implementation must see
            whole (attention's key/value sequence and head dims, and its query sequence when
            causal). The engine gathers shards of them before the op (and slices outputs
            after, where they are pinned sharded), never refuses and never computes on them.
        replays: ``replays(expr) -> (source, axes)`` or None: the op replays per-shard state
            that an earlier op made (attention's backward redraws its forward's per-shard
            dropout streams), so its first output must lie on the logical ``axes`` exactly as
            ``source`` (that earlier op's output, as it was computed) does. The engine
            computes the op that way, resharding its inputs before and its outputs after,
            whatever the user pinned.
        check_sharding: an extra rule, ``check_sharding(expr)``, raising ShardingError for a
            sharding the implementation cannot handle (checked after resharding, as a
            safety net: e.g. a backward sharded otherwise than the forward it replays).
        vjp: the derivative (:class:`Vjp`), or None for an op that cannot be differentiated
            (a gradient flowing into it is a DefinitionError naming it).
        expands_broadcasts: a pointwise op of several operands (``pointwise_call``), or
            ``matmul`` (its batch axes): where an operand has an expanded broadcast axis
            (``broadcast_in_dim``'s new axis of an extent above 1, every element the
            same), the implementation also gets
            ``out_shapes=``, and broadcasts that axis against the output's local extent (a
            shard's: its own local extent is the global one).
        plan: ``plan(expr)``, an op's planning on the compiler's copy after propagation and
            before resharding: it may check the propagated shardings (raising
            ShardingError) and rewrite ``expr.id_map`` or its outputs' unpinned
            parallelization (grouped-query attention with replicated key/value heads).
            It runs on the build and again on each copy whose symbolic extents are bound,
            so it decides there what it could not without them and leaves what it decided
            (idempotent).
        own_partials: ``own_partials(expr, out)``, called on the schedule the engine derives
            for output ``out`` from the op's inputs (resharding's natural output): marks the
            partial sums the implementation leaves that the domain map does not show (an
            expert-parallel ``moe_experts`` whose tokens are also split over data-parallel
            mesh axes: its per-expert outputs, mapped from no token axis by its ``plan``, are
            partial over those).
        view: the result is a view of the op's first input (of a contiguous one, for
            ``reshape``): shape ops, which run no kernel and whose memory is the input's.
        localize: per-rank attributes, ``localize(expr, here) -> (kwargs, note)``: keyword
            arguments the implementation gets on the rank described by ``here`` (a
            :class:`LocalContext`), and a note for that rank's program in ``explain`` (random
            ops get the global positions of their local elements and their RNG stream).
    """

    name: str
    params: tuple[Param, ...]
    infer: InferFn
    impl: Callable[..., Any]
    doc: str = ""
    sharding: str = ""
    needs_out_shape: bool = False
    prefer_inputs: tuple[int, ...] = ()
    partial_reduce: str | None = "sum"
    needs_reduced_count: bool = False
    partial_addends: tuple[int, ...] = ()
    whole_axes: Callable[[Any], set] | None = None
    replays: Callable[[Any], tuple[Any, tuple[int, ...]] | None] | None = None
    check_sharding: Callable[[Any], None] | None = None
    make_impl: Callable[[], Callable[..., Any]] | None = None
    output_layout: str = "follow"
    contiguous_outputs: tuple[int, ...] = ()
    vjp: Vjp | None = None
    localize: Callable[[Any, LocalContext], tuple[dict[str, Any], str]] | None = None
    expands_broadcasts: bool = False
    plan: Callable[[Any], None] | None = None
    own_partials: Callable[[Any, Any], None] | None = None
    view: bool = False

    @property
    def fusible(self) -> bool:
        """Whether a fused kernel may compute this op among others: its torch implementation
        is a pure, stateless function of its local arguments laid out as PyTorch's
        pointwise kernels lay them out. Matrix products, attention and random ops are not:
        they run on their own, reading operands written to memory."""
        return self.make_impl is None and self.localize is None and \
            self.output_layout == "follow"

    def follows_inputs(self, output: int) -> bool:
        """Whether output ``output`` is laid out like the inputs it maps from (see
        ``output_layout``); else it is row-major."""
        return self.output_layout == "follow" and output not in self.contiguous_outputs

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """Matches call arguments to the signature; returns them in signature order."""
        if len(args) > len(self.params):
            raise DefinitionError(
                f"{self.name} takes at most {len(self.params)} arguments "
                f"({self.signature()}), got {len(args)}"
            )
        bound = list(args) + [_REQUIRED] * (len(self.params) - len(args))
        names = [p.name for p in self.params]
        for key, value in kwargs.items():
            if key not in names:
                raise DefinitionError(
                    f"{self.name} got an unknown argument {key!r}; its signature is "
                    f"{self.signature()}"
                )
            pos = names.index(key)
            if pos < len(args):
                raise DefinitionError(f"{self.name} got argument {key!r} twice")
            bound[pos] = value
        for pos, param in enumerate(self.params):
            if bound[pos] is _REQUIRED:
                if param.required:
                    raise DefinitionError(
                        f"{self.name} is missing argument {param.name!r}; its signature is "
                        f"{self.signature()}"
                    )
                bound[pos] = param.default
        return bound

    def signature(self) -> str:
        parts = [p.name if p.required else f"{p.name}={p.default!r}" for p in self.params]
        return f"{self.name}({', '.join(parts)})"


REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    """Adds ``op`` to the registry; each name once."""
    assert op.name not in REGISTRY, f"op {op.name} registered twice"
    REGISTRY[op.name] = op
    return op


def lookup(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise AttributeError(f"meshfuse has no op {name!r}") from None
