"""What crosses a stage boundary: several tensors per message, their layout agreed once.

A stage takes and returns a *bundle*: one tensor or a tuple of them (a decoder layer's
hidden states, the rotary position embeddings, the attention mask, ...). Between two stages
on different ranks each microbatch's bundle travels as one message: a lone tensor as itself,
several packed into one byte buffer (each value's bytes aligned to 16). The first message
of a boundary is preceded by its :class:`Layout` (two small int64 headers: the number of
values, then each value's dimensions, dtype, whether it carries a gradient and extents), so
the receiver allocates the buffer; every microbatch of a step has the same layout.

The backward message of a microbatch holds the gradients of the values that carry one
(floating values that required a gradient on the sending side), in the same order, packed
alike (a value the receiving stage did not use gets zeros).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from meshfuse.errors import ScheduleError

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.int32, torch.bool, torch.int8, torch.uint8, torch.complex64, torch.complex128)
MAX_DIMS = 6
_ENTRY = 3 + MAX_DIMS  # ndim, dtype, gradient, extents
_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class Value:
    """One value of a bundle: its shape, dtype and whether a gradient comes back for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The values of a boundary's bundle, in the order the stage returns them."""

    values: tuple[Value, ...]

    @staticmethod
    def of(bundle: tuple[torch.Tensor, ...]) -> Layout:
        return Layout(tuple(Value(tuple(x.shape), x.dtype, _carries_grad(x)) for x in bundle))

    def gradients(self) -> Layout:
        """The layout of the backward message: the values that carry a gradient."""
        return Layout(tuple(v for v in self.values if v.grad))

    def header(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two headers: ``[count]`` and each value's entry."""
        rows = []
        for v in self.values:
            check_sendable(v.shape, v.dtype)
            entry = [len(v.shape), DTYPES.index(v.dtype), int(v.grad), *v.shape]
            rows += entry + [0] * (_ENTRY - len(entry))
        return (torch.tensor([len(self.values)], dtype=torch.int64),
                torch.tensor(rows, dtype=torch.int64))

    @staticmethod
    def read(entries: torch.Tensor) -> Layout:
        values = []
        for row in entries.view(-1, _ENTRY).tolist():
            values.append(Value(tuple(row[3:3 + row[0]]), DTYPES[row[1]], bool(row[2])))
        return Layout(tuple(values))

    def buffer_spec(self) -> tuple[list[int], torch.dtype]:
        """The shape and dtype of the message that carries a bundle of this layout."""
        if _alone(self.values):
            return list(self.values[0].shape), self.values[0].dtype
        return [sum(_padded(v.nbytes) for v in self.values)], torch.uint8


def check_sendable(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raises ScheduleError unless a value of ``shape`` and ``dtype`` can cross stages."""
    if len(shape) > MAX_DIMS or dtype not in DTYPES:
        raise ScheduleError(f"a pipeline stage's output of shape {tuple(shape)} and dtype "
                            f"{dtype} cannot cross stages; use at most {MAX_DIMS} "
                            f"dimensions and one of {list(DTYPES)}")


def _alone(values: tuple) -> bool:
    """Whether a bundle travels as its one tensor itself: one real value (communicators
    send no complex dtype: a complex value travels as bytes)."""
    return len(values) == 1 and not values[0].dtype.is_complex


def entries_size(count: torch.Tensor) -> list[int]:
    """The shape of the second header, from the first."""
    return [int(count[0]) * _ENTRY]


def pack(bundle: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The message of a bundle (a lone real tensor is its own message)."""
    if _alone(bundle):
        return bundle[0].contiguous()
    if not bundle:  # no value carries a gradient back
        return torch.empty(0, dtype=torch.uint8)
    parts = []
    for x in bundle:
        raw = x.detach().contiguous().reshape(-1).view(torch.uint8)
        parts += [raw, raw.new_zeros(_padded(raw.numel()) - raw.numel())]
    return torch.cat(parts)


def unpack(message: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
    """The bundle a message of ``layout`` holds (views of the message)."""
    if _alone(layout.values):
        return (message,)
    out, offset = [], 0
    for v in layout.values:
        raw = message[offset:offset + v.nbytes]
        out.append(raw.view(v.dtype).view(v.shape))
        offset += _padded(v.nbytes)
    return tuple(out)


def as_bundle(value: torch.Tensor | tuple | list) -> tuple[torch.Tensor, ...]:
    """A stage's input or output as a tuple of tensors."""
    if isinstance(value, torch.Tensor):
        return (value,)
    bundle = tuple(value)
    bad = [type(x).__name__ for x in bundle if not isinstance(x, torch.Tensor)]
    if bad:
        raise ScheduleError(f"a pipeline stage returned a {bad[0]} among its outputs; a stage "
                            f"passes on tensors only (one, or a tuple of them): keep other "
                            f"values inside the stage or make them tensors")
    return bundle


def _carries_grad(x: torch.Tensor) -> bool:
    return x.requires_grad and (x.is_floating_point() or x.is_complex())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
