"""The per-rank program (records) and its interpreter.

A :class:`Program` is data: a tuple of :class:`Step` records over numbered value slots, built
once per input signature and rank. A record names its op (a registry name, or ``reshard``
for a communication), its arguments (slots, constants, ``None`` where this rank leaves an
argument out), its local attributes (keyword arguments written by the localization pass),
its output slots and the slots it frees. A reshard record also holds its plan: the steps of
:mod:`meshfuse.runtime.comm.reshard_plan`, bound to this rank's groups.

Like torch.fx's ``Interpreter``, ``run`` walks the records and dispatches each to its
implementation (resolved once, when the program is made: the op's ``impl``, a fresh
``make_impl()`` for a stateful one, the bound plan for a reshard), frees values after their
last use, lays fusion outputs out in their allocation order, and on failure re-raises with
the step and the rank.

A communication step returns a :class:`~meshfuse.runtime.comm.pending.Pending` result: the
collective is in flight while the next steps run, and is waited for where its result is first
read (an argument, a fusion output) or freed. A failed collective is raised as a
:class:`~meshfuse.runtime.faults.failures.CollectiveFailed` naming the step that launched it; when a
step fails, the collectives still in flight are waited for before the error propagates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from meshfuse.errors import ExecutionError
from meshfuse.ops.registry import lookup
from meshfuse.runtime.comm.pending import (
    Pending,
    in_flight,
    launched,
    resolved,
    settle_in_flight,
)
from meshfuse.runtime.faults.failures import CollectiveFailed, is_shared
from meshfuse.runtime.interpreter.step_names import named_calls, profiling

RESHARD = "reshard"


@dataclasses.dataclass(frozen=True)
class Slot:
    """A reference to a value slot of the program (printed ``%n``)."""

    index: int

    def __repr__(self) -> str:
        return f"%{self.index}"


@dataclasses.dataclass(frozen=True)
class Step:
    """One record of a per-rank program: ``outputs = op(*args, **attrs)``.

    Attributes:
        op: the op's registry name, or ``"reshard"`` for a communication.
        args: in signature order: a :class:`Slot`, a list of Slots, a constant, or ``None``
            for an argument this rank leaves out.
        attrs: local attributes (keyword arguments), from the localization pass.
        outputs: the slots it defines.
        free: the slots whose last use it is (not fusion outputs).
        label: the IR expression it runs, printed (with its plan, for a reshard).
        plan: a reshard's plan steps on this rank (empty for an op).
        note: this rank's part, from the op's ``localize`` rule (a random op's stream).
    """

    op: str
    args: tuple[Any, ...]
    attrs: Mapping[str, Any]
    outputs: tuple[int, ...]
    free: tuple[int, ...]
    label: str
    plan: tuple[Any, ...] = ()
    note: str = ""  # this rank's part, from the op's localize rule (its random stream)

    @property
    def reads(self) -> list[int]:
        """The slots its arguments read, in order (those of a list of Slots included)."""
        found = []
        for a in self.args:
            if isinstance(a, Slot):
                found.append(a.index)
            elif isinstance(a, list):
                found.extend(s.index for s in a if isinstance(s, Slot))
        return found

    def describe(self) -> str:
        outs = ", ".join(f"%{o}" for o in self.outputs)
        args = ", ".join(repr(a) for a in self.args)
        attrs = "".join(f", {k}={v!r}" for k, v in self.attrs.items())
        free = f"; free {', '.join(f'%{s}' for s in self.free)}" if self.free else ""
        return f"{outs} = {self.op}({args}{attrs}){free}    # {self.label}"


def dispatch(step: Step) -> Callable[..., Any]:
    """The implementation of an op record, from the op registry (a reshard's is its bound
    plan, made by the runtime)."""
    op = lookup(step.op)
    return op.make_impl() if op.make_impl is not None else op.impl


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
    """The per-rank program for one input signature: records and their implementations.

    ``calls[i]`` implements ``steps[i]`` (see :func:`dispatch`); the interpreter's loop reads
    a flat form of both, made once here. ``slot_bytes``: the bytes of each tensor slot on
    this rank, where the binding told them (what the fused segments' cost rules read).
    """

    num_slots: int
    input_slots: tuple[int, ...]
    steps: tuple[Step, ...]
    outputs: tuple[OutputLayout, ...]
    rank: int
    calls: tuple[Callable[..., Any], ...]
    slot_bytes: Mapping[int, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        flat = []
        for step, call in zip(self.steps, self.calls, strict=True):
            template = tuple(None if _reads(a) else a for a in step.args)
            slots = tuple((pos, a.index if isinstance(a, Slot) else tuple(s.index for s in a))
                          for pos, a in enumerate(step.args) if _reads(a))
            flat.append((call, template, slots, dict(step.attrs), step.outputs, step.free))
        object.__setattr__(self, "_flat", tuple(flat))
        object.__setattr__(self, "_profiled", None)  # see _named

    def _named(self) -> Program:
        """This program with each step named in profiler traces (:mod:`.step_names`),
        made at the first profiled call."""
        if self._profiled is None:
            calls = named_calls([s.label for s in self.steps], self.calls)
            object.__setattr__(self, "_profiled", dataclasses.replace(self, calls=calls))
        return self._profiled

    def describe(self) -> str:
        lines = [f"Program (rank {self.rank}): {len(self.steps)} steps"]
        lines += [f"  {i}: {s.label}" + (f"  # {s.note}" if s.note else "")
                  for i, s in enumerate(self.steps)]
        lines += [
            f"  output slot {o.slot}: shape {list(o.shape)} strides {list(o.strides)}"
            for o in self.outputs
        ]
        return "\n".join(lines)

    def records(self) -> str:
        """Every record in full: slots, constants, local attributes, frees."""
        inputs = ", ".join(f"%{s}" for s in self.input_slots)
        lines = [f"Program (rank {self.rank}) inputs {inputs}"]
        lines += [f"  {s.describe()}" for s in self.steps]
        lines.append("  outputs " + ", ".join(f"%{o.slot}" for o in self.outputs))
        return "\n".join(lines)

    def run(self, inputs: Sequence[Any], donate: bool = False) -> list[torch.Tensor]:
        """The outputs of the program on ``inputs`` (this rank's local values), computed
        without autograd (as under ``torch.no_grad()``).

        ``donate``: the caller gives its references up (``inputs``, a list, is emptied once
        read), so that each input is freed after its last use, as an intermediate is (JAX's
        donated arguments): a backward frees each saved residual once it is read.
        """
        # The grad mode is switched directly: torch.no_grad()'s context object costs more
        # host time than a small program's kernels (this is every cached execute's path).
        # Only this run's collectives are settled (``mark``): a caller's may be in flight
        # across it (a pipeline runner's receives, posted before the stage computes).
        grad_enabled, mark = torch.is_grad_enabled(), launched()
        torch._C._set_grad_enabled(False)
        try:
            # while a profiler records, each step's kernels are named after it
            outputs = (self._named() if profiling() else self)._run(inputs, donate)
        except BaseException:
            settle_in_flight(mark)  # none of its own in flight; the first error is reported
            raise
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        if in_flight():
            settle_in_flight(mark)  # a collective whose result no step read (none, normally)
        return outputs

    def _where(self, index: int) -> str:
        """How errors and collectives name step ``index`` (made only when needed)."""
        return f"step {index} ({self.steps[index].label})"

    def _run(self, inputs: Sequence[Any], donate: bool) -> list[torch.Tensor]:
        values: list[Any] = [None] * self.num_slots
        for slot, index in zip(self.input_slots, range(len(inputs))):
            values[slot] = inputs[index]
        if donate:
            inputs.clear()
        for index, (call, template, slots, attrs, outputs, free) in enumerate(self._flat):
            try:
                args = list(template)
                for pos, slot in slots:
                    if isinstance(slot, int):  # _read, inlined: this loop is the hot path
                        value = values[slot]
                        if isinstance(value, Pending):
                            value = values[slot] = value.wait()
                        args[pos] = value
                    else:
                        args[pos] = [_read(values, s) for s in slot]
                result = call(*args, **attrs)
            except CollectiveFailed as e:  # raised here, or by a collective read here
                raise (e if e.what.startswith("step ") else e.at_step(self._where(index))) from e
            except Exception as e:
                if is_shared(e):  # another rank's error, read while waiting for a collective
                    raise
                error = ExecutionError(
                    f"rank {self.rank}, {self._where(index)} failed: {type(e).__name__}: {e}")
                error.where = f"step {index}"  # other ranks failing alike fail at the same step
                raise error from e
            if isinstance(result, Pending):
                result.label = self._where(index)
            if len(outputs) == 1:
                values[outputs[0]] = result
            else:
                for slot, value in zip(outputs, result):
                    values[slot] = value
            for slot in free:
                if isinstance(values[slot], Pending):
                    resolved(values[slot])  # a collective still writing the buffer ends first
                values[slot] = None
        return [_laid_out(_read(values, o.slot), o) if o.held else _nothing(o)
                for o in self.outputs]


def _reads(arg: Any) -> bool:
    """Whether an argument of a record is read from slots (a Slot or a list of Slots)."""
    return isinstance(arg, Slot) or (isinstance(arg, list) and bool(arg)
                                     and all(isinstance(a, Slot) for a in arg))


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
