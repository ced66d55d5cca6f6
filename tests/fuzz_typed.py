"""Statements of the fuzzer's optional features (``fuzz_programs.Features``), each a function
of the generator ``g`` (``fuzz_programs._Gen``: ``pick``, ``new_input``, ``fresh``, ``emit``):

- :func:`integers`: integer (int64, int32) and boolean values: arithmetic with broadcasting
  and Python numbers, sum/max/min reductions (partial integer maxima where the reduced axis
  is sharded: their identity is the dtype's least value, not -inf), comparisons, logical
  ops, ``where`` between integers, and casts into the floating-point part of the program;
- :func:`extrema`: ``add`` or ``sub`` of two reductions of one kind over the same axes
  (partial maxima, minima, products or sums where the reduced axes are sharded).

Integer results are exact, so comparisons of them are stable between the sharded and the
global run.
"""

from __future__ import annotations

import torch

INTS = (torch.int64, torch.int32)
INT_NAMES = ("Int", "Int32")
INT_BINARY = ["add", "sub", "mul", "maximum", "minimum"]
INT_REDUCTIONS = {"sum": "torch.sum", "max": "torch.amax", "min": "torch.amin"}
COMPARE = {"gt": ">", "lt": "<", "ge": ">=", "eq": "=="}
LOGICAL = ["logical_and", "logical_or"]


def integers(g) -> None:
    """One integer or boolean statement."""
    g.rng.choice([_int_binary, _int_binary, _int_reduction, _int_reduction, _compare,
                  _logical, _int_where, _to_float])(g)


def _int_value(g):
    v = g.pick(dtypes=INTS) if g.rng.random() < 0.7 else None
    if v is not None:
        return v
    ndim = g.rng.randint(1, 3)
    return g.new_input(tuple(g.extent() for _ in range(ndim)), g.rng.choice(INT_NAMES))


def _partner(g, a, dtypes, names):
    """A value of one of ``dtypes`` that broadcasts with ``a``: one of its shape and axis
    kinds, or a new input (some axes of extent 1)."""
    shape = tuple(a.tensor.shape)
    same = g.pick(lambda v: tuple(v.tensor.shape) == shape and v.broadcast == a.broadcast
                  and v is not a, dtypes=dtypes)
    if same is not None and g.rng.random() < 0.5:
        return same
    return g.new_input(tuple(1 if g.rng.random() < 0.3 else e for e in shape),
                       g.rng.choice(names))


def _int_binary(g) -> None:
    a = _int_value(g)
    (y,) = g.fresh()
    op = g.rng.choice(INT_BINARY)
    if g.rng.random() < 0.2:
        c = g.rng.choice([2, -3])
        g.emit(f"{y} = fd.ops.{op}({a.name}, {c})", f"{y} = torch.{op}({a.name}, "
               f"torch.tensor({c}, dtype={a.name}.dtype))", [y], True)
        return
    b = _partner(g, a, INTS, INT_NAMES)
    g.emit(f"{y} = fd.ops.{op}({a.name}, {b.name})", f"{y} = torch.{op}({a.name}, {b.name})",
           [y], True)


def _int_reduction(g) -> None:
    x = _int_value(g)
    n = x.tensor.ndim
    if n == 0:
        return
    dims = sorted(g.rng.sample(range(n), g.rng.randint(1, n)))
    keep = g.rng.random() < 0.4
    op = g.rng.choice(list(INT_REDUCTIONS))
    (y,) = g.fresh()
    g.emit(f"{y} = fd.ops.{op}({x.name}, dims={dims}, keepdim={keep})",
           f"{y} = {INT_REDUCTIONS[op]}({x.name}, dim={dims}, keepdim={keep})", [y], True)
    g.features.add(f"integer {op}")


def _compare(g) -> None:
    a = _int_value(g)
    b = _partner(g, a, INTS, INT_NAMES)
    op = g.rng.choice(list(COMPARE))
    (y,) = g.fresh()
    g.emit(f"{y} = fd.ops.{op}({a.name}, {b.name})", f"{y} = {a.name} {COMPARE[op]} {b.name}",
           [y], True)


def _bool_value(g):
    v = g.pick(dtypes=(torch.bool,)) if g.rng.random() < 0.7 else None
    if v is not None:
        return v
    return g.new_input(tuple(g.extent() for _ in range(g.rng.randint(1, 3))), "Bool")


def _logical(g) -> None:
    a = _bool_value(g)
    b = _partner(g, a, (torch.bool,), ("Bool",))
    op = g.rng.choice(LOGICAL)
    (y,) = g.fresh()
    g.emit(f"{y} = fd.ops.{op}({a.name}, {b.name})", f"{y} = torch.{op}({a.name}, {b.name})",
           [y], True)


def _int_where(g) -> None:
    """``where`` between integers, on a boolean condition of the integers' shape."""
    a = _int_value(g)
    b = _partner(g, a, (a.tensor.dtype,), (INT_NAMES[INTS.index(a.tensor.dtype)],))
    shape = tuple(a.tensor.shape)
    cond = g.pick(lambda v: tuple(v.tensor.shape) == shape and v.broadcast == a.broadcast,
                  dtypes=(torch.bool,)) or g.new_input(shape, "Bool")
    (y,) = g.fresh()
    g.emit(f"{y} = fd.ops.where({cond.name}, {a.name}, {b.name})",
           f"{y} = torch.where({cond.name}, {a.name}, {b.name})", [y], True)


def _to_float(g) -> None:
    """An integer or boolean value cast into the floating-point part of the program."""
    x = g.pick(dtypes=(*INTS, torch.bool)) or _int_value(g)
    (y,) = g.fresh()
    g.emit(f"{y} = fd.ops.cast({x.name}, DataType.Float)", f"{y} = {x.name}.float()", [y],
           True)


def extrema(g, reduce_code) -> None:
    """``add``/``sub`` of two ``op`` reductions over the same axes of two tensors of one
    shape; ``reduce_code(op, value, dims, keepdim)`` is torch's reduction."""
    x = g.pick_or_input(lambda v: v.tensor.ndim >= 1)
    if x.tensor.ndim == 0:
        return
    shape = tuple(x.tensor.shape)
    y = g.pick(lambda v: tuple(v.tensor.shape) == shape and v.broadcast == x.broadcast
               and v is not x) or g.new_input(shape)
    n = x.tensor.ndim
    dims = sorted(g.rng.sample(range(n), g.rng.randint(1, n)))
    keep = g.rng.random() < 0.4
    op = g.rng.choice(["max", "min", "prod", "sum"])
    combine = g.rng.choice(["add", "sub"])
    a, b, out = g.fresh(3)
    for name, v in ((a, x), (b, y)):
        g.emit(f"{name} = fd.ops.{op}({v.name}, dims={dims}, keepdim={keep})",
               f"{name} = {reduce_code(op, v, dims, keep)}", [name], False)
    g.emit(f"{out} = fd.ops.{combine}({a}, {b})", f"{out} = torch.{combine}({a}, {b})", [out],
           False)
    g.features.add(f"{combine} of {op}")
