"""The GEMM-like aten calls a program makes on this rank, as data: recorded, printed, scaled
to other sizes and replayed (the call lists of :mod:`benchmarks.gemm_calls`).

:class:`GemmRecorder` is a ``TorchDispatchMode`` that keeps, in program order, every call of
a matrix-product aten op (:data:`GEMM_OPS`: what ``linear`` and ``matmul`` decompose into, and
what Inductor's generated code calls as extern kernels) with each operand's shape, strides,
dtype and storage offset, its scalar arguments (``alpha``, ``beta``) and its output; and each
collective launched (c10d and functional collectives) and functional wait, so that a list
shows which GEMMs ran while a collective was in flight. A call on DTensors is passed on to
DTensor (the mode answers ``NotImplemented``), so the local call it makes is the one recorded.

A recorded list is replayed at other sizes by :func:`scaled` (each extent mapped to its
counterpart, each operand laid out in the same dimension order) and :func:`replay` (operands
drawn once, the call made as recorded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Matrix products as aten ops (overload packets). ``linear`` and ``matmul`` are composite:
# the dispatcher sees what they decompose into (mm, addmm, bmm, ...).
GEMM_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_addmm_activation",
    "_scaled_mm", "_int_mm", "_grouped_mm", "_scaled_grouped_mm",
})
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as a kernel sees it: shape, strides, dtype, storage offset."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    offset: int = 0

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                   t.storage_offset())

    def order(self) -> list[int]:
        """The dimensions from outermost to innermost in memory (ties, as for extents of 1,
        keep the logical order)."""
        return sorted(range(len(self.shape)), key=lambda d: (-self.stride[d], d))

    def dense(self) -> bool:
        """Whether the tensor covers a block of memory without gaps in :meth:`order`."""
        expected = 1
        for d in reversed(self.order()):
            if self.shape[d] != 1 and self.stride[d] != expected:
                return False
            expected *= self.shape[d]
        return True

    def describe(self) -> str:
        """``bf16[64, 256]`` plus the layout: ``T`` for a transposed matrix (its last two
        dimensions swapped in memory), ``strided`` for any other non-contiguous one, and
        ``+offset`` for a view into a larger buffer."""
        text = f"{self.dtype}{list(self.shape)}"
        contiguous = self.dense() and self.order() == sorted(self.order())
        if not contiguous:
            n = len(self.shape)
            swapped = list(range(n - 2)) + [n - 1, n - 2] if n >= 2 else None
            text += " T" if self.dense() and self.order() == swapped else \
                f" strided{list(self.stride)}"
        return text + (f" +{self.offset}" if self.offset else "")


@dataclasses.dataclass(frozen=True)
class Event:
    """One recorded call: a GEMM (``kind="gemm"``), a collective launch or a wait.

    ``args`` holds a :class:`TensorSpec` per tensor argument and the value of any other;
    ``kwargs`` the keyword arguments likewise (``out=`` as a spec); ``out`` the result's
    spec (GEMMs only).
    """

    kind: str
    op: str
    args: tuple = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    out: TensorSpec | None = None

    def describe(self) -> str:
        def show(a):
            return a.describe() if isinstance(a, TensorSpec) else repr(a)

        if self.kind != "gemm":
            shapes = " ".join(show(a) for a in self.args if isinstance(a, TensorSpec))
            return f"-- {self.kind} {self.op} {shapes}".rstrip()
        parts = [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs]
        return f"{self.op}({', '.join(parts)}) -> {show(self.out)}"

    def problem(self) -> tuple[tuple[int, ...], int]:
        """What the GEMM computes, whatever the call: its output shape and contracted
        extent (``addmm(b, x, w)`` and ``mm(x, w)`` of one ``x`` and ``w`` are one problem)."""
        tensors = [a for a in self.args if isinstance(a, TensorSpec)]
        first = tensors[1] if self.op.split(".")[0] in ("addmm", "baddbmm", "addbmm",
                                                        "addmv", "_addmm_activation") \
            else tensors[0]
        return self.out.shape, first.shape[-1]


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (list, tuple)):
        return tuple(_spec(v) for v in value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def _op_name(func) -> str:
    return f"{func.overloadpacket.__name__}.{func._overloadname}"


class GemmRecorder(TorchDispatchMode):
    """Records this thread's GEMM calls, collective launches and waits (see the module's
    docstring) into :attr:`events` while active."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, torch.distributed.tensor.DTensor) for t in types):
            return NotImplemented  # DTensor runs the local op, which this mode sees
        name = func.overloadpacket.__name__
        if func.namespace in COLLECTIVE_NAMESPACES:
            kind = "wait" if name == "wait_tensor" else "collective"
            if not name.startswith("_wrap"):
                self.events.append(Event(kind, _op_name(func), _spec(tuple(args))))
        out = func(*args, **kwargs)
        if func.namespace == "aten" and name in GEMM_OPS:
            self.events.append(Event(
                "gemm", _op_name(func), _spec(tuple(args)),
                tuple((k, _spec(v)) for k, v in sorted(kwargs.items())),
                TensorSpec.of(out) if isinstance(out, torch.Tensor) else None))
        return out


def gemms(events: Sequence[Event]) -> list[Event]:
    return [e for e in events if e.kind == "gemm"]


def scaled(event: Event, extents: Mapping[int, int]) -> Event:
    """``event`` with every extent ``n`` replaced by ``extents[n]`` (1 stays 1) and every
    tensor laid out as recorded: dense in the same dimension order, offset 0.

    Raises:
        ValueError: an extent without a counterpart, or a tensor that is not dense (a
            slice) or has an offset: its layout at other sizes is not determined.
    """
    def scale(spec):
        if isinstance(spec, tuple):
            return tuple(scale(s) for s in spec)
        if not isinstance(spec, TensorSpec):
            return spec
        if not spec.dense() or spec.offset:
            raise ValueError(f"{event.op}: operand {spec.describe()} is not a dense tensor at "
                             "offset 0; its layout at other sizes is not determined")
        missing = [n for n in spec.shape if n != 1 and n not in extents]
        if missing:
            raise ValueError(f"{event.op}: extent {missing[0]} of {spec.describe()} has no "
                             f"counterpart among {sorted(extents)}")
        shape = tuple(1 if n == 1 else extents[n] for n in spec.shape)
        stride = [0] * len(shape)
        size = 1
        for d in reversed(spec.order()):
            stride[d] = size
            size *= shape[d]
        return TensorSpec(shape, tuple(stride), spec.dtype)

    return dataclasses.replace(event, args=scale(event.args),
                               kwargs=tuple((k, scale(v)) for k, v in event.kwargs),
                               out=scale(event.out))


def _tensor(spec: TensorSpec, device, gen: torch.Generator) -> torch.Tensor:
    order = spec.order()
    dtype = getattr(torch, spec.dtype)
    base = torch.randn([spec.shape[d] for d in order], generator=gen, device=device)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return (base / spec.shape[-1] ** 0.5).to(dtype).permute(inverse)


def replay(event: Event, device, gen: torch.Generator) -> Callable[[], Any]:
    """The GEMM call of ``event`` on fresh operands (drawn now, on ``device``, laid out as
    recorded; ``out=`` tensors allocated so): a callable that makes the call."""
    packet, overload = event.op.split(".")
    func = getattr(getattr(torch.ops.aten, packet), overload)

    def value(a):
        if isinstance(a, TensorSpec):
            return _tensor(a, device, gen)
        return tuple(value(v) for v in a) if isinstance(a, tuple) else a

    args = [value(a) for a in event.args]
    kwargs = {k: value(v) for k, v in event.kwargs}
    return lambda: func(*args, **kwargs)
