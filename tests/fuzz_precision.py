"""Low-precision programs of the fuzzer (``fuzz_programs.Features.low_precision``).

A program draws one half-precision dtype (BFloat16 or Half). Most of its floating-point
inputs have it (some stay Float, as parameters kept in float32 would), and :func:`downcast`
statements cast values down to it, as programs written for nvFuser do before a matmul. The
ops then follow nvFuser's promotion: arithmetic on half-precision operands computes and
returns Float, while ``where``, ``abs``, ``relu``, reductions, matmuls and attention keep the
dtype. The generator writes each statement's torch code as plain torch first; where torch's
result dtype differs from meshfuse's, :func:`matched` converts the statement's half-precision
operands with ``.float()`` (the same computation, in float32, that meshfuse runs), so the
torch code is the program in the dtypes meshfuse gives.

What is compared (:func:`expectations`). Rounding is legitimate where meshfuse computes in
another order than torch (each shard reduces its part and the partial results are rounded to
the dtype before they are combined; a compiled segment keeps intermediates in float32). So
each output is compared with the program's *exact* value (the torch code run with every
floating-point tensor in float64), and the tolerance is what torch's own result in the
program's dtypes is allowed to be off: ``rtol`` four units of roundoff of the dtype, ``atol``
twice torch's own largest error on that output plus two units of roundoff of the program's
largest magnitude (inputs, intermediates and outputs alike, and the largest sum of absolute
terms of any of its sums: a rounded partial sum is off by a unit of roundoff of the part,
not of the total, and a part may be far larger than the total where terms cancel). A
product is the exception: a shard's partial product may overflow the dtype where the whole
does not (its values above 1 in one shard, those below in another), which no tolerance
covers; a program with a product whose factors above 1 could overflow the dtype is compared
nowhere (its outputs' expectations are None). The output's dtype must be torch's. A
comparison of a rounded value could flip, so in these programs only inputs and integer
values feed comparisons (``Value.exact``).
"""

from __future__ import annotations

import math
import re

import torch
from torch.overrides import TorchFunctionMode

LOW = {"BFloat16": torch.bfloat16, "Half": torch.float16}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
FLOAT_SHARE = 0.2  # new floating-point inputs that stay Float


def input_dtype(g) -> str:
    """The DataType name of a new floating-point input of generator ``g``."""
    return "Float" if g.rng.random() < FLOAT_SHARE else g.low


def downcast(g) -> None:
    """A floating-point value cast to the program's half-precision dtype (a Float one, or a
    half-precision one to Float and back)."""
    x = g.pick_or_input()
    low = LOW[g.low]
    (y,) = g.fresh()
    if x.tensor.dtype == low and g.rng.random() < 0.5:
        g.emit(f"{y} = fd.ops.cast({x.name}, DataType.Float)", f"{y} = {x.name}.float()", [y],
               x.exact)
        return
    g.emit(f"{y} = fd.ops.cast({x.name}, DataType.{g.low})", f"{y} = {x.name}.to({low})", [y],
           x.exact)
    g.features.add(f"cast to {g.low}")


_NAME = re.compile(r"\bt\d+\b")
_TARGETS = re.compile(r"^\s*([\w, ]+?) = ")


def matched(g, torch_code: str, outs: list[str]) -> str:
    """``torch_code`` (already run in ``g.env``, its fusion line in ``g.probe_env``) giving
    each of ``outs`` meshfuse's dtype: each line assigning an output whose dtype differs
    has its half-precision operands converted with ``.float()``; the code is run again."""
    wrong = _wrong_dtypes(g, outs)
    if not wrong:
        return torch_code
    lines = []
    for line in torch_code.split("\n"):
        targets = _TARGETS.match(line)
        if targets and wrong & {t.strip() for t in targets.group(1).split(",")}:
            head, body = line.split(" = ", 1)
            line = f"{head} = " + _NAME.sub(lambda m: _upcast(g, m.group(0), outs), body)
        lines.append(line)
    torch_code = "\n".join(lines)
    with torch.no_grad():
        exec(torch_code, g.env)  # noqa: S102 (the statement's torch code)
    wrong = _wrong_dtypes(g, outs)
    assert not wrong, f"no float32 form of {torch_code!r} gives meshfuse's dtypes of {wrong}"
    return torch_code


def _wrong_dtypes(g, outs: list[str]) -> set[str]:
    return {name for name in outs
            if g.env[name].dtype != g.probe_env[name].dtype.torch_dtype}


def _upcast(g, name: str, outs: list[str]) -> str:
    value = g.env.get(name)
    if name in outs or not isinstance(value, torch.Tensor) or value.dtype not in UNIT_ROUNDOFF:
        return name
    return f"{name}.float()"


# --- what is compared -----------------------------------------------------------------------

class InFloat64(TorchFunctionMode):
    """Runs torch code with every floating-point tensor in float64: each result of a torch
    call is converted, and a conversion to a floating-point dtype (``.float()``,
    ``.to(torch.bfloat16)``) converts to float64 instead. Integer and boolean tensors are
    left as they are.

    ``partial_magnitude``: the largest sum of absolute terms of any sum the code computes
    (reductions, matmuls: the call again on the operands' absolute values). A shard's partial
    sum is never larger, so it bounds the magnitude of the partial results that a sharded
    run rounds to the program's dtype before combining them (a narrowing cast keeps a partial
    sum partial, as DTensor does), which no value of the unsharded program shows.
    ``product_magnitude``: likewise the largest product of ``max(|x|, 1)`` of any product
    the code computes, which bounds a shard's partial product."""

    CONVERSIONS = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
                   torch.Tensor.double)
    SUMS = (torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean, torch.matmul,
            torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm,
            torch.nn.functional.linear)

    PRODUCTS = (torch.prod, torch.Tensor.prod)

    def __init__(self) -> None:
        super().__init__()
        self.partial_magnitude = 0.0
        self.product_magnitude = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.CONVERSIONS:
            return args[0].to(torch.float64)
        if func is torch.Tensor.to:
            args = tuple(_float64_dtype(a) for a in args)
            kwargs = {k: _float64_dtype(v) for k, v in kwargs.items()}
        result = func(*args, **kwargs)
        if func in self.SUMS:
            absolute = func(*(_absolute(a) for a in args), **kwargs)
            self.partial_magnitude = max(self.partial_magnitude, _largest(_float64(absolute)))
        if func in self.PRODUCTS:
            above_one = func(_float64(args[0]).abs().clamp_min(1.0), *args[1:], **kwargs)
            self.product_magnitude = max(self.product_magnitude, float(above_one.max()))
        if isinstance(result, (tuple, list)):
            return type(result)(_float64(r) for r in result)
        return _float64(result)


def _absolute(a):
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        return a.abs()
    return a


def _float64_dtype(a):
    return torch.float64 if isinstance(a, torch.dtype) and a.is_floating_point else a


def _float64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
        return x.to(torch.float64)
    return x


def exact_run(program, inputs: list[torch.Tensor]) -> dict:
    """The program's torch code run on ``inputs`` with every floating-point tensor in
    float64 (:class:`InFloat64`): its namespace, every value by name."""
    env = {"torch": torch, "math": math}
    for (name, _), x in zip(program.inputs, inputs):
        env[name] = _float64(x)
    mode = InFloat64()
    with torch.no_grad(), mode:
        exec("\n".join(program.torch_lines), env)  # noqa: S102 (the program's torch code)
    env[PARTIAL_MAGNITUDE] = mode.partial_magnitude
    env[PRODUCT_MAGNITUDE] = mode.product_magnitude
    return env


PARTIAL_MAGNITUDE = "partial magnitude"  # exact_run's key of InFloat64.partial_magnitude
PRODUCT_MAGNITUDE = "product magnitude"  # and of InFloat64.product_magnitude


def expectations(program, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
                 ) -> list[tuple[torch.Tensor, dict] | None]:
    """For each output (torch's ``outputs`` of the program on ``inputs``, in its dtypes):
    the value to compare with (float64: the exact value; torch's where torch's is not
    finite) and the tolerances of ``torch.testing.assert_close`` (see the module doc); None
    for every output of a program whose partial products could overflow its dtype."""
    exact = exact_run(program, inputs)
    if exact[PRODUCT_MAGNITUDE] > torch.finfo(LOW[program.low]).max:
        return [None] * len(outputs)
    eps = UNIT_ROUNDOFF[LOW[program.low]]
    scale = max([1.0, exact[PARTIAL_MAGNITUDE]] +
                [_largest(v) for k, v in exact.items()
                 if isinstance(v, torch.Tensor) and _NAME.fullmatch(k)])
    result = []
    for name, torch_out in zip(program.outputs, outputs):
        want = exact[name]
        if not torch_out.is_floating_point():
            result.append((torch_out, {"rtol": 0, "atol": 0}))
            continue
        finite = torch.isfinite(torch_out)
        want = torch.where(finite, want, torch_out.double())
        off = (torch_out.double() - want)[finite].abs()
        own = float(off.max()) if off.numel() else 0.0
        result.append((want, {"rtol": 4 * eps, "atol": 2 * own + 2 * eps * scale,
                              "equal_nan": True}))
    return result


def _largest(x: torch.Tensor) -> float:
    if not x.is_floating_point() or not x.numel():
        return 0.0
    finite = x[torch.isfinite(x)]
    return float(finite.abs().max()) if finite.numel() else 0.0
