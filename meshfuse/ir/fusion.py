"""The fusion graph: values, expressions, inputs and outputs.

Expressions are kept in definition order, which is a topological order: an op can only use
values defined before it. Each expression carries its op's *domain map*: which logical ID of an
input tensor is which logical ID of an output tensor (``Expr.id_map``).

An expression is an op application (:class:`Expr`), or a :class:`Reshard` that the
compiler inserted: one tensor moved from one sharding to another, with no op.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Protocol

from meshfuse.errors import DefinitionError
from meshfuse.ir.placement import Placement, placements
from meshfuse.ir.printer import format_expr, format_fusion
from meshfuse.ir.tensor_view import Scalar, TensorView, Val

if TYPE_CHECKING:
    from meshfuse.ir.iter_domain import IterDomain
    from meshfuse.ir.mesh import DeviceMesh


class Op(Protocol):
    """What the IR reads of an op's declaration (:class:`meshfuse.ops.registry.OpDef`, which
    the IR does not import: ops stand on the IR)."""

    name: str
    params: tuple
    partial_reduce: Any


@dataclasses.dataclass(eq=False)
class Expr:
    """One op application.

    Attributes:
        op: the op's declaration (None for a :class:`Reshard`).
        args: the op's arguments in signature order: Vals, or Python constants.
        outputs: the values it defines.
        attrs: keyword arguments that are static Python values (dims, shapes, flags).
        id_map: output logical ID -> the input logical IDs it maps from (the op's domain map,
            first source first).
    """

    op: Op | None
    args: tuple[Any, ...]
    outputs: tuple[Val, ...]
    attrs: dict[str, Any]
    id_map: dict[IterDomain, tuple[IterDomain, ...]]

    def __repr__(self) -> str:
        return format_expr(self)

    def __setattr__(self, name: str, value: Any) -> None:
        # The passes read an expression's values far more often than they rewire it: what
        # the properties below derive from ``args`` and ``outputs`` is kept until either is
        # assigned (neither is changed in place).
        if name in ("args", "outputs"):
            self.__dict__.pop("_derived", None)
        object.__setattr__(self, name, value)

    def _values(self) -> tuple[tuple[Val, ...], tuple[TensorView, ...], tuple[TensorView, ...]]:
        derived = self.__dict__.get("_derived")
        if derived is None:
            flat = []
            for a in self.args:
                flat.extend(a if isinstance(a, list | tuple) else [a])
            inputs = tuple(a for a in flat if isinstance(a, Val))
            derived = self.__dict__["_derived"] = (
                inputs, tuple(a for a in inputs if isinstance(a, TensorView)),
                tuple(o for o in self.outputs if isinstance(o, TensorView)))
        return derived

    @property
    def inputs(self) -> tuple[Val, ...]:
        """The values it reads, in signature order, lists (``cat``'s tensors) flattened."""
        return self._values()[0]

    @property
    def tensor_inputs(self) -> tuple[TensorView, ...]:
        return self._values()[1]

    @property
    def tensor_outputs(self) -> tuple[TensorView, ...]:
        return self._values()[2]


@dataclasses.dataclass(eq=False, repr=False)
class Reshard(Expr):
    """``target = source`` laid out otherwise: the data movement between two shardings of one
    tensor (same logical IDs, possibly another mesh). It has no op (``op`` is None); the
    runtime plans it from its two tensors and runs the plan.

    Attributes:
        source_mesh, target_mesh: where the tensor lives before and after.
        source, target: the placements before (a partial one names its reduction) and after.
    """

    source_mesh: DeviceMesh | None = None
    target_mesh: DeviceMesh | None = None
    source: tuple[Placement, ...] = ()
    target: tuple[Placement, ...] = ()

    @classmethod
    def between(cls, src: TensorView, dst: TensorView) -> Reshard:
        """The communication from ``src`` to ``dst`` (both scheduled, same logical shape)."""
        id_map = {d: (s,) for s, d in zip(src.logical, dst.logical)}
        reduce_op = partial_reduce_op(src)  # a partial dst combines as src does
        return cls(None, (src,), (dst,), {}, id_map, src.mesh, dst.mesh,
                   placements(src, reduce_op), placements(dst, reduce_op))


def partial_reduce_op(tv: TensorView) -> str:
    """How partial values of ``tv`` combine: the ``partial_reduce`` of the op that made them
    (through communications and copies)."""
    expr = tv.definition
    while expr is not None and (expr.op is None or expr.op.name == "set"):
        expr = expr.args[0].definition
    return "sum" if expr is None else expr.op.partial_reduce or "sum"


_USER_NAME = re.compile(r"[A-Za-z_][\w.]*")
_AUTOMATIC_NAME = re.compile(r"[TS]\d+")


def is_user_name(name: object) -> bool:
    """Whether a user may name a tensor ``name`` (see ``define_tensor``)."""
    return isinstance(name, str) and bool(_USER_NAME.fullmatch(name)) and \
        not _AUTOMATIC_NAME.fullmatch(name)


def checked_name(name: object, what: str = "define_tensor") -> str:
    """``name`` if a user may name a tensor so (see ``define_tensor``); else a
    DefinitionError that names ``what`` gave it."""
    if not is_user_name(name):
        raise DefinitionError(
            f"{what}: name={name!r} cannot name a tensor; use letters, digits, '_' "
            "and '.', starting with a letter or '_', and not T<n> (the automatic names)"
        )
    return name


class Fusion:
    """A graph of ops over TensorViews and Scalars, with declared inputs and outputs."""

    def __init__(self) -> None:
        self.exprs: list[Expr] = []
        self._inputs: list[Val] = []
        self._outputs: list[TensorView] = []
        self._counts = {"T": 0, "S": 0}
        # The names set_name gave, and to which value; automatic names skip them.
        self._given: dict[str, Val] = {}
        # Set once sharding propagation has filled the unscheduled tensors: the schedule is
        # final from then on.
        self.propagated = False
        self.user_scheduled: set[TensorView] = set()

    def inputs(self) -> list[Val]:
        """Fusion inputs, in the order ``execute`` takes them."""
        return list(self._inputs)

    def outputs(self) -> list[TensorView]:
        """Fusion outputs, in the order ``execute`` returns them."""
        return list(self._outputs)

    def name(self, val: Val) -> Val:
        """Gives ``val`` the next automatic name (``T<n>`` or ``S<n>``), skipping names
        that :meth:`set_name` gave."""
        prefix = "T" if isinstance(val, TensorView) else "S"
        while True:
            name = f"{prefix}{self._counts[prefix]}"
            self._counts[prefix] += 1
            if name not in self._given:
                val.name = name
                return val

    def set_name(self, val: Val, name: str) -> Val:
        """Names ``val`` ``name`` (a user's name, or a derived program's name after the value
        it stands for); no two values of a fusion get one name this way, and automatic names
        skip it from then on.

        Raises:
            DefinitionError: if another value of this fusion was given ``name``.
        """
        if self._given.get(name, val) is not val:
            raise DefinitionError(
                f"the name {name!r} is taken by another tensor of this fusion; give each "
                "tensor its own name"
            )
        if self._given.get(val.name) is val:
            del self._given[val.name]
        self._given[name] = val
        val.name = name
        return val

    def given_names(self) -> frozenset[str]:
        """The names :meth:`set_name` gave (the others are automatic)."""
        return frozenset(self._given)

    def add_input(self, val: Val) -> Val:
        self._inputs.append(self.name(val))
        return val

    def add_constant(self, val: Scalar) -> Scalar:
        return self.name(val)

    def copied_arg(self, arg: Any, copies: dict[Val, Val]) -> Any:
        """An argument of another fusion's expr, as this fusion's: each value through
        ``copies`` (old value -> this fusion's), a constant scalar not yet there added as a
        constant (and recorded in ``copies``), lists of values mapped element by element,
        anything else as it is."""
        if isinstance(arg, Scalar) and arg.is_constant and arg not in copies:
            copies[arg] = self.add_constant(Scalar(arg.dtype, arg.value))
        if isinstance(arg, Val):
            return copies[arg]
        if isinstance(arg, list | tuple) and any(isinstance(x, Val) for x in arg):
            return [self.copied_arg(x, copies) for x in arg]
        return arg

    def add_output(self, tv: TensorView) -> None:
        self._outputs.append(tv)

    def add_expr(self, expr: Expr, position: int | None = None) -> Expr:
        """Names the outputs of ``expr`` and inserts it at ``position`` (default: last)."""
        for out in expr.outputs:
            if out.name.endswith("?"):
                self.name(out)
            out.definition = expr
        self.exprs.insert(len(self.exprs) if position is None else position, expr)
        return expr

    def tensors(self) -> list[TensorView]:
        """Every TensorView of the fusion: inputs first, then op outputs in order."""
        seen = [v for v in self._inputs if isinstance(v, TensorView)]
        for e in self.exprs:
            seen.extend(e.tensor_outputs)
        return seen

    def uses(self) -> dict[Val, list[Expr]]:
        """Each value's consumer expressions, in order."""
        result: dict[Val, list[Expr]] = {}
        for e in self.exprs:
            for v in e.inputs:
                result.setdefault(v, []).append(e)
        return result

    def copy(self) -> tuple[Fusion, dict[Val, Val]]:
        """A private copy for the compiler's passes, and each value's counterpart in it.

        Every value and expression is new: the passes may schedule the copy's tensors and
        insert expressions without touching this fusion. IterDomains and transform records are
        immutable and shared; tensors keep their names (the copy prints alike).
        """
        counterpart: dict[Val, Val] = {}

        def val(v: Val) -> Val:
            if v not in counterpart:
                counterpart[v] = v.copy_into(copy)
            return counterpart[v]

        def arg(a: Any) -> Any:
            if isinstance(a, Val):
                return val(a)
            if isinstance(a, list | tuple) and any(isinstance(x, Val) for x in a):
                return type(a)(arg(x) for x in a)
            return a

        copy = Fusion()
        copy._counts = dict(self._counts)
        copy._inputs = [val(v) for v in self._inputs]
        for e in self.exprs:
            new = dataclasses.replace(e, args=tuple(arg(a) for a in e.args),
                                      outputs=tuple(val(o) for o in e.outputs),
                                      attrs=dict(e.attrs), id_map=dict(e.id_map))
            for out in new.outputs:
                out.definition = new
            copy.exprs.append(new)
        copy._outputs = [val(o) for o in self._outputs]
        copy._given = {n: counterpart[v] for n, v in self._given.items() if v in counterpart}
        return copy, counterpart

    def __str__(self) -> str:
        return format_fusion(self)

    def print_math(self) -> None:
        print(self)
