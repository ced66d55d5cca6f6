"""The per-rank program and its interpreter.

A :class:`Program` is data: a list of :class:`Step` records over numbered value slots, built
once per input signature. ``run`` walks the steps, calls each op's torch implementation,
frees values after their last use, lays fusion outputs out in their allocation order, and on
failure re-raises with the step and the rank.

A communication step returns a :class:`~meshfuse.runtime.collectives.Pending` result: the
collective is in flight while the next steps run, and is waited for where its result is first
read (an argument, a fusion output) or freed. A failed collective is raised as a
:class:`~meshfuse.runtime.failures.CollectiveFailed` naming the step that launched it; when a
step fails, the collectives still in flight are waited for before the error propagates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshfuse.errors import ExecutionError
from meshfuse.runtime.collectives import Pending, resolved, settle_in_flight
from meshfuse.runtime.failures import CollectiveFailed


@dataclasses.dataclass(frozen=True)
class Step:
    """One op call: ``impl(*args, **kwargs)``; ``args`` holds constants where ``slots`` is
    ``None``, and slot numbers (or lists of them) where it is not."""

    label: str
    impl: Callable[..., Any]
    template: tuple[Any, ...]
    slots: tuple[tuple[int, int | tuple[int, ...]], ...]
    kwargs: dict[str, Any]
    outputs: tuple[int, ...]
    free: tuple[int, ...]
    note: str = ""  # this rank's part, from the op's localize rule (its random stream)


@dataclasses.dataclass(frozen=True)
class OutputLayout:
    """Where a fusion output lives and how it must be laid out."""

    slot: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    held: bool = True  # False on a rank outside the tensor's mesh: an empty tensor comes back


@dataclasses.dataclass(frozen=True)
class Program:
    """The per-rank program for one input signature."""

    num_slots: int
    input_slots: tuple[int, ...]
    steps: tuple[Step, ...]
    outputs: tuple[OutputLayout, ...]
    rank: int

    def describe(self) -> str:
        lines = [f"Program (rank {self.rank}): {len(self.steps)} steps"]
        lines += [f"  {i}: {s.label}" + (f"  # {s.note}" if s.note else "")
                  for i, s in enumerate(self.steps)]
        lines += [
            f"  output slot {o.slot}: shape {list(o.shape)} strides {list(o.strides)}"
            for o in self.outputs
        ]
        return "\n".join(lines)

    @torch.no_grad()
    def run(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        try:
            return self._run(inputs)
        except BaseException:
            settle_in_flight()  # nothing left in flight; the first error is the one to report
            raise

    def _run(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        values: list[Any] = [None] * self.num_slots
        for slot, x in zip(self.input_slots, inputs):
            values[slot] = x
        for index, step in enumerate(self.steps):
            where = f"step {index} ({step.label})"
            try:
                args = list(step.template)
                for pos, slot in step.slots:
                    args[pos] = _read(values, slot) if isinstance(slot, int) else \
                        [_read(values, s) for s in slot]
                result = step.impl(*args, **step.kwargs)
            except CollectiveFailed as e:  # raised here, or by a collective read here
                raise (e if e.what.startswith("step ") else e.at_step(where)) from e
            except Exception as e:
                raise ExecutionError(
                    f"rank {self.rank}, {where} failed: {type(e).__name__}: {e}"
                ) from e
            if isinstance(result, Pending):
                result.label = where
            if len(step.outputs) == 1:
                values[step.outputs[0]] = result
            else:
                for slot, value in zip(step.outputs, result):
                    values[slot] = value
            for slot in step.free:
                resolved(values[slot])  # a collective still writing the buffer ends first
                values[slot] = None
        return [_laid_out(_read(values, o.slot), o) if o.held else _nothing(o)
                for o in self.outputs]


def _read(values: list[Any], slot: int) -> Any:
    """The value of ``slot``; a pending collective's result is waited for (once)."""
    value = values[slot]
    if isinstance(value, Pending):
        value = values[slot] = value.wait()
    return value


def _nothing(out: OutputLayout) -> torch.Tensor:
    """The output of a rank that does not hold it: an empty tensor of its dtype."""
    return torch.empty(0, dtype=out.dtype)


def _laid_out(x: torch.Tensor, out: OutputLayout) -> torch.Tensor:
    """``x`` itself if it already has the output's strides (axes of extent 1 aside), else a
    copy with them."""
    if x.stride() == out.strides and x.dtype == out.dtype:
        return x
    if tuple(x.shape) != out.shape or x.dtype != out.dtype:
        raise ExecutionError(
            f"internal error: an output is {x.dtype} of local shape {list(x.shape)}, expected "
            f"{out.dtype} of shape {list(out.shape)}"
        )
    if all(n == 1 or s == e for n, s, e in zip(x.shape, x.stride(), out.strides)):
        return x
    y = torch.empty_strided(out.shape, out.strides, dtype=x.dtype, device=x.device)
    y.copy_(x)
    return y
