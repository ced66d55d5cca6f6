"""Dropout in a program replayed from a CUDA graph: the host work of each replay, as data.

A captured kernel replays the arguments it was captured with, so a graph holding a dropout
kernel would replay one mask forever, unless the kernel draws from a generator *registered*
with the graph before its capture: PyTorch then makes the captured kernel read its Philox seed
and offset from device memory, which each replay fills from the generator's seed and offset
of that moment. meshfuse's fused dropout (:class:`~meshfuse.ops.attention.dropout.FusedDropout`)
gives each attention step a private generator of its own and, outside a graph, seeds it with
the step's stream key at every call, then runs the kernel from offset 0. A replayed graph does
the same on the host, before each replay, in the interpreter's order (:meth:`StreamPlan.prepare`):

- for each dropout forward of the program, in step order: its seed and offset (the given
  ones, read from the call's inputs, or a fresh seed drawn from torch's default CPU generator:
  the draw the interpreter makes, so ``torch.manual_seed`` decides the masks alike and the
  calls after it draw what they would have drawn);
- the stream key (hashed only when the seed or offset changed, as the interpreter does), and
  the step's generator seeded with it: the replayed kernel draws from ``(key, 0)``, exactly the
  interpreter's mask, and returns the same RNG state to its backward.

A backward draws nothing: its fused kernel replays the RNG state its forward returned, in
device memory, inside the graph or from the graph's outputs.

What may replay is decided twice, from the program's records: before any call
(:func:`static_reason`: a random op drawing with meshfuse's own generator, or the global
dropout mask, computes its values from a seed on the host, which a graph would freeze, so a
random op replays only with its seed given, a constant or an input, which a graph is
captured for, and the global mask never; a seed computed inside the program cannot be read
before the replay) and at each capture, once the
first call bound the kernels (:func:`plan_streams`: a fused kernel whose RNG state is
graph-safe, cuDNN or flash, with a private generator; the math kernel reads its seed on the
host). The capture itself runs under :meth:`StreamPlan.capturing`: the warm-up and the capture
draw seeds that are thrown away (torch's CPU generator is restored afterwards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from meshfuse.ops.attention.dropout import GLOBAL, GRAPH_SAFE_KERNELS, FusedDropout
from meshfuse.ops.random.declaration import resolve_seed
from meshfuse.ops.registry import lookup
from meshfuse.runtime.interpreter.executor import Program, Slot, Step

ATTENTION = ("sdpfa_fwd", "sdpfa_bwd")
SEED_ARGS = ("rng_seed", "rng_offset")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a call's seed (or offset) comes from: the program's input at ``position``, a
    ``constant``, or neither (None: a seed drawn from torch's generator at each call)."""

    constant: Any = None
    position: int | None = None

    def value(self, inputs: Sequence[Any]) -> Any:
        return self.constant if self.position is None else inputs[self.position]

    def describe(self) -> str:
        if self.position is not None:
            return f"input {self.position}"
        return "drawn" if self.constant is None else repr(self.constant)


@dataclasses.dataclass(frozen=True)
class GraphStream:
    """One dropout forward of a captured graph: step ``step`` draws from ``dropout``'s
    generator, seeded before each replay from ``seed`` and ``offset``."""

    step: int
    seed: Source
    offset: Source
    dropout: FusedDropout

    @property
    def draws(self) -> bool:
        """Whether a call draws its seed from torch's generator."""
        return self.seed.position is None and self.seed.constant is None

    @functools.cached_property
    def fixed_key(self) -> int | None:
        """The stream key when the seed and offset are constants (hashed once), else None."""
        if self.draws or self.seed.position is not None or self.offset.position is not None:
            return None
        return self.dropout.key(*resolve_seed("sdpfa_fwd", self.seed.constant,
                                              self.offset.constant))


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """The dropout streams of one captured graph, in step order (none: the graph draws
    nothing, and a replay has no host work)."""

    streams: tuple[GraphStream, ...] = ()

    @property
    def generators(self) -> list[torch.Generator]:
        """The generators to register with the graph before its capture."""
        return [s.dropout.swap.generator for s in self.streams]

    def prepare(self, inputs: Sequence[Any]) -> list[int]:
        """Seeds every stream's generator for a replay on ``inputs``, drawing seeds as the
        interpreter would at this call; returns the stream keys."""
        keys = []
        for stream in self.streams:
            key = stream.fixed_key
            if key is not None:
                stream.dropout.swap.seed(key)
            else:
                seed, offset = resolve_seed("sdpfa_fwd", stream.seed.value(inputs),
                                            stream.offset.value(inputs))
                key = stream.dropout.seed_stream(seed, offset)
            keys.append(key)
        return keys

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Around a warm-up and capture: each stream's kernel may be captured (its generator
        is registered, see ``generators``), and the seeds they draw are given back to
        torch's CPU generator afterwards (the replay draws the call's own)."""
        with contextlib.ExitStack() as stack:
            if any(s.draws for s in self.streams):
                stack.enter_context(torch.random.fork_rng(devices=[]))
            for stream in self.streams:
                stack.enter_context(stream.dropout.swap.capturing())
            yield

    def describe(self) -> str:
        """explain's words for what each replay seeds, or "" when nothing."""
        if not self.streams:
            return ""
        steps = ", ".join(f"step {s.step} (" + ("seed drawn at each call" if s.draws else
                                                f"seed {s.seed.describe()}, offset "
                                                f"{s.offset.describe()}") + ")"
                          for s in self.streams)
        return f"each replay seeds the dropout streams of {steps}"


def static_reason(step: Step, input_slots: Sequence[int]) -> str | None:
    """Why a step that draws random numbers (a step with a random stream, see ``explain``)
    keeps its program from replaying, judged from its record alone; None when it may
    replay (confirmed at the capture by :func:`plan_streams`). A random op replays when its
    seed and offset are given (constants, or inputs: a graph is captured per value of them)."""
    if not draws_random(step):
        return None
    if step.op not in ATTENTION:
        if any(_arg(step, n) is None or _source(step, n, input_slots) is None
               for n in SEED_ARGS):
            return f"it draws random numbers ({step.label}: {step.note})"
        return None
    site = step.attrs.get("site")
    if site is not None and site.mode == GLOBAL:
        return (f"it draws the global dropout mask on the host ({step.label}: the math "
                "kernel reads the seed back)")
    if step.op == "sdpfa_fwd":
        for name in ("rng_seed", "rng_offset", "dropout_p"):
            if _source(step, name, input_slots) is None:
                return f"its {name} is computed inside the program ({step.label})"
    return None


def draws_random(step: Step) -> bool:
    """Whether ``step`` has a random stream: a random op or an attention whose record notes
    its part of a stream. Other ops note their part too (a lookup, the positions of the
    axis it holds): a note alone says nothing of random numbers."""
    if not step.note:
        return False
    names = {p.name for p in lookup(step.op).params}
    return step.op in ATTENTION or names.issuperset(SEED_ARGS)


def seed_inputs(program: Program) -> frozenset[int]:
    """Positions of the program's inputs that it reads only as the ``rng_seed`` or
    ``rng_offset`` of dropout forwards. A replayed program's forwards all draw through fused
    kernels (:func:`plan_streams` refuses the others), so such an input is read on the host
    by each replay (:meth:`StreamPlan.prepare`), never by the graph: a graph need not be
    captured per value of it."""
    seeds, other = set(), set()
    for step in program.steps:
        names = [p.name for p in lookup(step.op).params] if step.op in ATTENTION else ()
        for position, arg in enumerate(step.args):
            slots = arg if isinstance(arg, list) else [arg]
            for slot in (s for s in slots if isinstance(s, Slot)):
                is_seed = step.op == "sdpfa_fwd" and names[position] in ("rng_seed",
                                                                         "rng_offset")
                (seeds if is_seed else other).add(slot.index)
    slots = list(program.input_slots)
    return frozenset(slots.index(s) for s in seeds - other if s in slots)


def plan_streams(program: Program, inputs: Sequence[Any]) -> StreamPlan | str:
    """The :class:`StreamPlan` of ``program`` captured for ``inputs`` (its kernels bound by
    an earlier call with the same scalar values), or why it cannot be captured."""
    streams = []
    for index, (step, call) in enumerate(zip(program.steps, program.calls)):
        reason = static_reason(step, program.input_slots)
        if reason is not None:
            return reason
        if draws_random(step) and step.op not in ATTENTION:  # a random op, its seed given
            if any(isinstance(_source(step, n, program.input_slots).value(inputs),
                              torch.Tensor) for n in SEED_ARGS):
                return (f"its seed is a tensor, read on the host by the capture only "
                        f"({step.label})")
            continue
        if not draws_random(step) or not _drops(step, program.input_slots, inputs):
            continue
        bound = getattr(call, "dropout_kernel", lambda: None)()
        if bound is None:
            return f"its dropout kernel is not bound yet ({step.label})"
        backend, fused = bound
        if step.op == "sdpfa_bwd":
            if backend not in GRAPH_SAFE_KERNELS:
                return (f"its {backend.value} backward reads the dropout seed on the host "
                        f"({step.label})")
            continue
        if fused is None:
            return f"its {backend.value} kernel draws the dropout mask on the host ({step.label})"
        unsafe = fused.graph_unsafe()
        if unsafe is not None:
            return f"{unsafe} ({step.label})"
        seed, offset = (_source(step, n, program.input_slots) for n in ("rng_seed", "rng_offset"))
        streams.append(GraphStream(index, seed, offset, fused))
    return StreamPlan(tuple(streams))


def _arg(step: Step, name: str) -> Any:
    names = [p.name for p in lookup(step.op).params]
    return step.args[names.index(name)]


def _source(step: Step, name: str, input_slots: Sequence[int]) -> Source | None:
    """Where argument ``name`` of ``step`` comes from; None for a value computed by an
    earlier step (unknown until the graph has run)."""
    arg = _arg(step, name)
    if not isinstance(arg, Slot):
        return Source(constant=arg)
    if arg.index not in input_slots:
        return None
    return Source(position=list(input_slots).index(arg.index))


def _drops(step: Step, input_slots: Sequence[int], inputs: Sequence[Any]) -> bool:
    """Whether ``step`` applies dropout on ``inputs`` (its ``dropout_p`` may be an input)."""
    p = _source(step, "dropout_p", input_slots)
    return p is None or float(p.value(inputs)) > 0.0
