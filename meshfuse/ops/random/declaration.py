"""Random ops: ``uniform``, ``normal``, ``rand_like``, ``randn_like`` (nvFuser's names and
arguments).

Every value is a function of (seed, offset, the element's global linear index) only
(:mod:`meshfuse.ops.random.rng`), so a sharded run gives bitwise the values of the unsharded run,
whatever the schedule: each rank computes the values at the global positions it holds.

Seed and offset: pass ``rng_seed`` and ``rng_offset`` together (Int scalars or Python ints in
``[0, 2**63)``) for reproducible values; without them each call draws a fresh seed from
torch's default CPU generator (offset 0), so ``torch.manual_seed`` on every rank decides the
values and ranks seeded alike agree. Distinct offsets under one seed give independent values
(the way to draw several tensors from one seed).
"""

from __future__ import annotations

import math

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError, InputError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ops.random import rng
from meshfuse.ops.registry import (
    AxisSpec,
    OpDef,
    OutSpec,
    ScalarMeta,
    Vjp,
    attr,
    register,
    scalar,
    tensor,
)
from meshfuse.ops.shape_rules import require_tensor, same_axes


def check_rng_args(op: str, rng_seed, rng_offset) -> None:
    """Both or neither of ``rng_seed`` and ``rng_offset``, Int and in range when constant."""
    if (rng_seed is None) != (rng_offset is None):
        raise DefinitionError(
            f"{op}: rng_seed and rng_offset must be given together (or neither, to draw a "
            "seed from torch's generator at each call)"
        )
    for name, value in (("rng_seed", rng_seed), ("rng_offset", rng_offset)):
        if isinstance(value, ScalarMeta):
            if value.dtype not in (DataType.Int, DataType.Int32):
                raise DefinitionError(f"{op}: {name} must be an Int scalar, got "
                                      f"{value.dtype.name}")
            value = value.value
        if value is not None:
            try:
                rng.check_seed(name, value)
            except ValueError as err:
                raise DefinitionError(f"{op}: {err}") from None


def _check_dtype(op: str, dtype) -> DataType:
    if not isinstance(dtype, DataType) or not dtype.is_floating:
        raise DefinitionError(
            f"{op}: dtype must be a floating-point DataType (Float, Double, Half, BFloat16), "
            f"got {dtype!r}"
        )
    return dtype


def _static_shape(op: str, shape) -> list[int]:
    """``shape`` as ints: each entry a positive int or a constant Int scalar."""
    if not isinstance(shape, list | tuple):
        raise DefinitionError(f"{op}: shape must be a list of extents, got {shape!r}")
    extents = []
    for axis, entry in enumerate(shape):
        value = getattr(entry, "value", entry)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DefinitionError(
                f"{op}: shape entry {axis} is {entry!r}; random tensors need static positive "
                "extents (ints or constant Int scalars)"
            )
        extents.append(value)
    return extents


def _distribution_infer(op: str):
    def infer(a, b, shape, rng_seed, rng_offset, dtype):
        check_rng_args(op, rng_seed, rng_offset)
        axes = tuple(AxisSpec(n, IterType.Broadcast if n == 1 else IterType.Iteration)
                     for n in _static_shape(op, shape))
        return [OutSpec(_check_dtype(op, dtype), axes)]

    return infer


def _like_infer(op: str):
    def infer(x, rng_seed, rng_offset):
        x = require_tensor(op, "x", x)
        check_rng_args(op, rng_seed, rng_offset)
        return [OutSpec(_check_dtype(op, x.dtype), same_axes(0, x))]

    return infer


def resolve_seed(op: str, rng_seed, rng_offset) -> tuple[int, int]:
    """The (seed, offset) a call uses: the given ones, checked, or a fresh seed and 0."""
    if rng_seed is None:
        return rng.draw_seed(), 0
    try:
        return rng.check_seed("rng_seed", rng_seed), rng.check_seed("rng_offset", rng_offset)
    except ValueError as err:
        raise InputError(f"{op}: {err}") from None


def _number(op: str, name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"{op}: {name} must be a real number, got {value!r}")
    return float(value)


def _sampler(op: str, draw):
    """The implementation of a distribution op: ``draw(key, index, a, b, dtype)``."""
    def impl(a, b, shape, rng_seed, rng_offset, dtype, global_index, device):
        seed, offset = resolve_seed(op, rng_seed, rng_offset)
        return draw(rng.stream_key(seed, offset), global_index.linear(device),
                    _number(op, "first parameter", a), _number(op, "second parameter", b),
                    dtype.torch_dtype, bound=math.prod(global_index.extents))

    return impl


def _like_sampler(op: str, draw, a: float, b: float):
    def impl(x, rng_seed, rng_offset, global_index):
        seed, offset = resolve_seed(op, rng_seed, rng_offset)
        return draw(rng.stream_key(seed, offset), global_index.linear(x.device), a, b, x.dtype,
                    bound=math.prod(global_index.extents))

    return impl


def _seed_note(args) -> str:
    seed, offset = (getattr(a, "value", None) if getattr(a, "is_constant", False) else a
                    for a in args)
    if seed is None:
        return "seed drawn from torch's generator at each call, offset 0"
    return f"seed {getattr(seed, 'name', seed)}, offset {getattr(offset, 'name', offset)}"


def _localize_creation(expr, here):
    index = here.index(expr.outputs[0])
    note = f"values at global {index.describe()}; {_seed_note(expr.args[3:5])}"
    return {"global_index": index, "device": here.device}, note


def _localize_like(expr, here):
    index = here.index(expr.outputs[0])
    note = f"values at global {index.describe()}; {_seed_note(expr.args[1:3])}"
    return {"global_index": index}, note


_DISTRIBUTIONS = {
    "normal": (("mean", "std"), rng.normal, "values from N(mean, std**2)"),
    "uniform": (("minval", "maxval"), rng.uniform, "values uniform in [minval, maxval)"),
}
_LIKE = {
    "rand_like": (rng.uniform, 0.0, 1.0, "values uniform in [0, 1) shaped like x"),
    "randn_like": (rng.normal, 0.0, 1.0, "standard normal values shaped like x"),
}

# Random draws are constants to differentiation (``rand_like(x)`` does not depend on x's
# values), and are saved rather than drawn again in a backward.
RANDOM_VJP = Vjp(lambda d, grads: {}, differentiable=())
RANDOM_SHARDING = ("any: each rank draws the elements of its own shard from the global "
                   "counter-based stream")

for _name, ((_a, _b), _draw, _doc) in sorted(_DISTRIBUTIONS.items()):
    register(OpDef(
        _name,
        (scalar(_a), scalar(_b), attr("shape"), scalar("rng_seed", None),
         scalar("rng_offset", None), attr("dtype", DataType.Float)),
        _distribution_infer(_name), _sampler(_name, _draw),
        doc=f"{_doc}; the same global values whatever the sharding",
        localize=_localize_creation, vjp=RANDOM_VJP, sharding=RANDOM_SHARDING,
    ))
for _name, (_draw, _a, _b, _doc) in sorted(_LIKE.items()):
    register(OpDef(
        _name, (tensor("x"), scalar("rng_seed", None), scalar("rng_offset", None)),
        _like_infer(_name), _like_sampler(_name, _draw, _a, _b),
        doc=f"{_doc}; the same global values whatever the sharding",
        localize=_localize_like, vjp=RANDOM_VJP, sharding=RANDOM_SHARDING,
    ))
