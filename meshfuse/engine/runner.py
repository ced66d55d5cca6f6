"""``FusionRunner``: builds a fusion once, then one per-rank program per input signature.

Build: compile the fusion (:func:`meshfuse.passes.pipeline.compiled_for`: a private copy
checked, propagated, resharded, with its memory orders, built once per definition and
schedule; the user's fusion is not changed). Per new input signature, once: bind extents
and local layouts (:func:`~meshfuse.runtime.interpreter.binding.bind`), check the inputs against
them, check that every op is local (:func:`~meshfuse.passes.sharding_check.check_no_resharding`),
agree on all that across ranks (:func:`~meshfuse.runtime.interpreter.agreement.agreed_inputs`),
localize (:func:`~meshfuse.passes.localization.localize`), and build the :class:`Program` records
(:func:`~meshfuse.runtime.interpreter.program.build_program`), each communication's plan bound to
this rank's groups. With ``cuda_graph=True``, the program is captured once
(:mod:`meshfuse.runtime.replay.graphs`).

A fusion with symbolic extents: the binding (its global extents, an uneven split's learnt
from every rank's shard: :func:`~meshfuse.runtime.interpreter.agreement.exchanged`) picks
the build of those extents (:mod:`meshfuse.engine.builds`), which the rest of the steps
above use in place of the fusion's own.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Collection, Sequence
from typing import Any, Self

import torch

from meshfuse.engine.builds import Build, Builds
from meshfuse.engine.explaining import BUILD_FAILURES
from meshfuse.engine.settings import (
    AUTO,
    COMPILE_ENV,
    CUDA_GRAPH_ENV,
    backend_for,
    compile_setting,
    cuda_graph_setting,
)
from meshfuse.errors import InputError
from meshfuse.explain import describe_program, explain
from meshfuse.ir.fusion import Fusion, Reshard
from meshfuse.ir.printer import format_fusion
from meshfuse.ir.tensor_view import TensorView
from meshfuse.parallel import context, experts, fsdp
from meshfuse.parallel.overlap import group_stream_loops
from meshfuse.passes.localization import localize
from meshfuse.passes.pipeline import compiled_for
from meshfuse.passes.sharding_check import check_no_resharding
from meshfuse.runtime.comm import Communicator, Group, group_along, lower_reshard
from meshfuse.runtime.faults import BEFORE_RUNNING, OutOfStep, checked_timeout
from meshfuse.runtime.interpreter import (
    FUSED,
    Binding,
    CompileStats,
    HostLog,
    Program,
    agreed_inputs,
    agreement_ranks,
    bind,
    bucket_lines,
    build_program,
    check_inputs,
    check_strides,
    exchanged,
    fuse_program,
    has_symbolic_extents,
    held_here,
    input_facts,
    is_cpu_scalar,
    local_context,
    local_extents,
    out_of_step,
    required_device,
    shard_extents,
    sharded_symbolic_axes,
)
from meshfuse.runtime.replay import (
    AutoReplay,
    GraphBudget,
    GraphedProgram,
    draws_random,
    replay_lines,
    replay_wanted,
)


class FusionRunner:
    """Runs one built fusion; see the module doc."""

    def __init__(self, fusion: Fusion):
        if any(tv.mesh is not None for tv in fusion.tensors()):
            self.communicator = Communicator.instance()
            self.rank, world = self.communicator.rank, self.communicator.size
        else:
            self.communicator, self.rank, world = None, 0, 1
        self.compiled = compiled_for(fusion, world)
        self._source = weakref.ref(fusion)  # what a strategy registered its facts on
        self.fusion = self.compiled.fusion
        self._scope: tuple[int, ...] | None = None
        self.allocations = self.compiled.allocations
        self.world_size = world
        # The build of each set of bound extents (the fusion's own when they are static),
        # with its stream loops and the communications it may run as loops (docs/overlap.md).
        self.builds = Builds(self.compiled)
        self.overlap = self.builds.base.overlap
        # Symbolic input axes split over devices: their extents are learnt from every rank.
        self._shared_axes = sharded_symbolic_axes(self.fusion) if self.builds.symbolic else []
        self._signatures: dict[tuple, tuple[Build, Binding]] = {}
        self._bound: dict[tuple, dict] = {}  # see bound_extents
        # nvFuser's offset_stream_indexing_by_rank: allgathers decomposed in ring order.
        self.ring_order = False
        # How stream loops' decomposed communications move data (CommunicatorBackend).
        self.loop_transport = "auto"
        self.compile = compile_setting(os.environ.get(COMPILE_ENV, AUTO))
        self._programs: dict[tuple, Program] = {}
        self._fused: dict[tuple, tuple[Program, CompileStats]] = {}
        self._graphs: dict[tuple, GraphedProgram] = {}
        self._replays: dict[tuple, AutoReplay] = {}
        self._host: dict[tuple, HostLog] = {}  # host time of cached calls, per signature
        self._devices: dict[tuple, torch.device] = {}  # of each signature called
        self._keys: dict[_Key, _Key] = {}  # each signature's key, one object (see _Key)
        self._graph_budget = GraphBudget()
        self.cuda_graph = cuda_graph_setting(os.environ.get(CUDA_GRAPH_ENV))
        self._generation = 0  # of the communicator's groups, which the programs are bound to

    def explain(self, inputs: Sequence[Any] | None = None, verbose: bool = False) -> str:
        """This rank's view of the program (:func:`meshfuse.explain.explain`): each tensor's
        shapes, placements and memory order, then the communications it will run; extents
        from ``inputs`` when given. ``verbose`` adds the domains of every tensor and, with
        ``inputs``, the program's steps."""
        extents = program = None
        build = self.builds.base
        # Without inputs, the device is the communicator's (where a multi-rank program's
        # tensors live); a lone process does not know it yet.
        device = self.communicator.device if self.communicator is not None else None
        if inputs is not None:
            key, known = self._key(inputs, False)
            if key not in self._programs:
                try:
                    self._programs[key] = self._make_program(list(inputs), None, known, key)
                except BUILD_FAILURES as error:
                    return self._explain_unbuilt_program(inputs, error, verbose)
            program = self._programs[key]
            build, binding = self._signatures[key]
            extents = binding.extents
            device = _device_of(inputs, self.communicator)
        text = explain(build.fusion, build.allocations, self.rank, self.world_size, extents,
                       device)
        text = "\n".join([text, *self._loop_lines(key if inputs is not None else None)])
        if program is not None:
            text = "\n".join([text, *_random_streams(program), *bucket_lines(program),
                              *self._fusion_lines(key, device)])
        if not verbose:
            return text
        parts = [text, format_fusion(build.fusion, build.allocations)]
        if program is not None:
            parts.append(describe_program(program, self.fusion.outputs()))
        return "\n".join(parts)

    def _explain_unbuilt_program(self, inputs: Sequence[Any], error: Exception,
                                 verbose: bool) -> str:
        """explain's view when no program can be built for ``inputs``: the compiled fusion
        (extents from the inputs where they bind, else from the definition), then why."""
        try:
            extents = bind(self.fusion, self.allocations, list(inputs), self.rank).extents
        except BUILD_FAILURES:
            extents = None
        text = explain(self.fusion, self.allocations, self.rank, self.world_size, extents,
                       _device_of(inputs, self.communicator))
        lines = [text, *self._loop_lines(None),
                 (f"no program for these inputs on rank {self.rank}: "
                 f"{type(error).__name__}: {error}")]
        if verbose:
            lines.append(format_fusion(self.fusion, self.allocations))
        return "\n".join(lines)

    def execute(self, inputs: Sequence[Any], check_ranks: bool | None = None,
                cuda_graph: bool | str | None = None, compile: bool | str | None = None,
                donate: bool = False, timeout: float | None = None,
                staged: Sequence[int] = (), overwrite: Collection[int] = (),
                key: tuple | None = None) -> list[torch.Tensor]:
        """This rank's outputs on ``inputs``; ``donate``: ``inputs`` (a list) is emptied once
        read so that each input is freed after its last use (see :meth:`Program.run`; a call
        replayed from a CUDA graph empties it once the replay is launched, and
        ``cuda_graph=True``'s graph keeps copies of its inputs anyway); ``timeout``: see
        :meth:`~meshfuse.runtime.comm.communicator.Communicator.set_timeout`; ``staged``: the
        positions of inputs whose addresses change from call to call (a backward's
        cotangents), copied into a replayed graph's own buffers (see
        :meth:`~meshfuse.runtime.replay.automatic.AutoReplay.run`); ``overwrite``: the
        positions of donated inputs that nothing else holds (a cotangent autograd handed
        over), whose memory a replayed graph may give an output of the same layout;
        ``key``: what :meth:`layout_key` gave for inputs laid out as these (a caller that
        knows their layouts without reading them: an autograd backward, whose inputs are
        its forward's outputs), else None.

        An error raised on this rank only reaches the others (see
        :mod:`meshfuse.runtime.faults.lone_failures`)."""
        communicator = self.communicator
        if communicator is None or communicator.size == 1:
            return self._execute(inputs, check_ranks, cuda_graph, compile, donate, timeout,
                                 staged, overwrite, key)
        if self._scope is None:  # the ranks whose calls are counted with this one's
            self._scope = agreement_ranks(self.fusion, communicator.size)
        call = communicator.lone.begin_call(self._scope)
        if self._generation != communicator.generation:  # recover() made new groups
            self._programs.clear()
            self._signatures.clear()
            self._fused.clear()
            self._graphs.clear()
            self._replays.clear()
            self._host.clear()
            self._devices.clear()
            self._keys.clear()
            self._graph_budget = GraphBudget()
            self._generation = communicator.generation
        try:
            return self._execute(inputs, check_ranks, cuda_graph, compile, donate, timeout,
                                 staged, overwrite, key)
        except Exception as e:
            error = self._out_of_step(e, inputs) if isinstance(e, OutOfStep) else e
            told = communicator.lone.told(error, call, getattr(error, "where", BEFORE_RUNNING))
            if told is e:
                raise
            raise told from e

    def _execute(self, inputs: Sequence[Any], check_ranks: bool | None,
                 cuda_graph: bool | str | None,
                 compile: bool | str | None, donate: bool, timeout: float | None,
                 staged: Sequence[int] = (), overwrite: Collection[int] = (),
                 key: tuple | None = None) -> list[torch.Tensor]:
        start = time.perf_counter_ns()  # the call's host time (host_time.py)
        key, known = self._key(inputs, True) if key is None else (key, {})
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._make_program(
                list(inputs), check_ranks, known, key,
                lambda: _checked_options(timeout, compile), True)
        else:
            _checked_options(timeout, compile)
        if self.communicator is not None:
            self.communicator.set_timeout(None if timeout is None else checked_timeout(timeout))
        device = self._devices.get(key)  # the signature's devices decide it: found once
        if device is None:
            device = self._devices[key] = _device_of(inputs, self.communicator)
        backend = backend_for(self.compile if compile is None else compile_setting(compile),
                              device)
        if backend is not None:
            fused = self._fused.get((key, backend))
            if fused is None:
                fused = self._fused[key, backend] = self._fuse(program, backend)
            program = fused[0]
        if cuda_graph is True:
            return self._graphed(key, backend, program, inputs)
        host = self._host.get((key, backend))
        fresh = host is None  # the first call (binding, building, compiling): not counted
        if fresh:
            host = self._host[key, backend] = HostLog()
        if replay_wanted(cuda_graph, self.cuda_graph):
            outputs = self._replayed(key, backend, device, program, inputs, staged, host,
                                     start, donate, overwrite)
            if outputs is not None:
                if donate:  # given up after the replay (see automatic.py: donation)
                    inputs.clear()
                return outputs
        if fresh:
            return program.run(inputs, donate)
        outputs = host.run(program, inputs, donate, start)
        host.interpreted.add(time.perf_counter_ns() - start)
        return outputs

    def _replayed(self, key: tuple, backend: str | None, device: torch.device,
                  program: Program, inputs: Sequence[Any], staged: Sequence[int],
                  host: HostLog, start: int, donate: bool,
                  overwrite: Collection[int] = ()) -> list[torch.Tensor] | None:
        """The outputs of the automatic replay (see :class:`AutoReplay`), or None where the
        interpreter must run the call; a replay that captured nothing counts its host time."""
        replay = self._replays.get((key, backend))
        if replay is None:
            replay = self._replays[key, backend] = AutoReplay(program, device,
                                                              self._graph_budget)
        captured = replay.graphs
        outputs = replay.run(inputs, staged, donate, overwrite)
        if outputs is not None and replay.graphs == captured:
            host.replayed.add(time.perf_counter_ns() - start)
        return outputs

    def _graphed(self, key: tuple, backend: str | None, program: Program,
                 inputs: Sequence[Any]) -> list[torch.Tensor]:
        """``cuda_graph=True``: the program captured once with its own input buffers."""
        # scalar values, and torch's deterministic switch (it picks kernels a graph keeps)
        graph_key = (key, backend, tuple(x for x in inputs if not isinstance(x, torch.Tensor)),
                     torch.are_deterministic_algorithms_enabled())
        graphed = self._graphs.get(graph_key)
        if graphed is None:
            _check_graphable(self.fusion, inputs)
            graphed = self._graphs[graph_key] = GraphedProgram(program, inputs)
        return graphed.run(inputs)

    def _make_program(self, inputs: list, check_ranks: bool | None, known: dict, key: tuple,
                      check_options=lambda: None, in_call: bool = False) -> Program:
        """Checks ``check_options()`` and binds ``inputs`` (agreeing across ranks unless
        ``check_ranks`` is False; ``in_call``: for ``execute``; ``known``, ``key``: see
        ``_key``), then builds the program (which creates process groups)."""
        device = _device_of(inputs, self.communicator)

        def prepare() -> tuple[Binding, dict, Build]:
            # Localizing reads the environment (context parallelism's options): a rank
            # whose value is bad or differs fails in the agreement, not in a transfer.
            check_options()
            build, binding = self._bind(inputs, known)
            here = local_context(binding, self.rank, device)
            return binding, localize(build.fusion, binding.extents, binding.layouts,
                                     here), build

        binding, local, build = agreed_inputs(
            self.communicator, self.fusion, inputs, prepare,
            lambda prepared, tv: _extents_of(prepared[0], prepared[2].compiled[tv]),
            self._shape_known, check_ranks, in_call,
            lambda prepared: context.agreed_facts(prepared[2].fusion.exprs, prepared[1]),
        )
        fusion = build.fusion
        self._signatures[key] = build, binding
        plans = build.overlap.loops_for(key, binding.extents, device, self.loop_transport)
        self._create_loop_groups(plans)
        rewrites = []
        if plans:
            rewrites.append(functools.partial(
                _group_loops, plans, binding=binding, rank=self.rank,
                group_of=self._group, ring_all=self.ring_order,
                transport=self.loop_transport, device=device))
        layered = fsdp.layer_schedule(fusion, [fusion, self._source()],
                                      build.compiled.__getitem__)
        if layered is not None:
            rewrites.append(functools.partial(layered.regroup, rank=self.rank,
                                              layouts=binding.layouts, group_of=self._group))
        return build_program(fusion, binding, local, self.rank, self._lower_reshard,
                             lower_op=self._lower_op,
                             group_loops=functools.partial(_rewritten, rewrites),
                             order=layered.order if layered is not None else None)

    def _create_loop_groups(self, plans) -> None:
        """Creates, on every rank, the groups the loops' communications may ask for (each
        mesh axis of the meshes on either side of each): a rank lowers only the loops it
        runs, and creating a group is collective over the world. (Created lazily there, a
        loop on a mesh without this rank left the ranks' group counts apart, and the next
        group any of them created hung.)"""
        if self.communicator is None or self.communicator.size == 1:
            return
        for plan in plans:
            for expr in plan.exprs:
                if not isinstance(expr, Reshard):
                    continue
                for mesh in dict.fromkeys(tv.mesh for tv in (*expr.args[:1], *expr.outputs)
                                          if tv.mesh is not None):
                    for axis in range(mesh.ndim):
                        self.communicator.group_if_member(mesh, axis)

    def bound_extents(self, inputs: Sequence[Any]) -> dict:
        """The global extent of every ID of the fusion's build on ``inputs`` (checked):
        what a fusion with symbolic extents is made static with to differentiate it
        (``meshfuse.autodiff``). Kept per signature; on a new one, every rank calls it (an
        uneven split's extents are learnt from every rank's shard)."""
        key, known = self._key(inputs, False)
        if key not in self._bound:
            inputs = list(inputs)
            comm = self.communicator
            device = None if comm is None else required_device(comm.backend, comm.device,
                                                               comm.size)
            check_inputs(self.fusion, inputs, self.rank, device)
            self._bound[key] = bind(self.fusion, self.allocations, inputs, self.rank,
                                    known).extents
        return self._bound[key]

    def layout_key(self, inputs: Sequence[Any]) -> tuple | None:
        """The key of ``inputs``' program (see :meth:`execute`'s ``key``) where their
        layouts alone decide it; None where a call learns more from the other ranks (the
        global extents of symbolic axes split over devices)."""
        if self._shared_axes and self.communicator is not None and self.communicator.size > 1:
            return None
        return self._key(inputs, False)[0]

    def _key(self, inputs: Sequence[Any], in_call: bool) -> tuple[tuple, dict]:
        """The key of ``inputs``' program: their signature, and for a fusion whose symbolic
        input axes are split over devices the global extents of those, learnt from every
        rank's shard on every call (``_learnt_extents``): a rank's shard of an uneven split
        may stay the same while the others' change. Returns the key and those extents."""
        key = _signature(inputs)
        known = self._learnt_extents(list(inputs), in_call)
        if known:
            inputs_of = self.fusion.inputs()
            key = (key, tuple(known.get(inputs_of[pos].materialized()[axis])
                              for pos, axis in self._shared_axes))
        key = _Key(key)
        return self._keys.setdefault(key, key), known

    def _learnt_extents(self, inputs: list, in_call: bool) -> dict:
        """The global extents of the symbolic input axes split over devices, from every
        rank's shard (an uneven split's shards differ: no rank can tell the extent from its
        own); one small collective per call, on every rank alike (whether it runs depends
        on the fusion only)."""
        axes = self._shared_axes
        if not axes or self.communicator is None or self.communicator.size == 1:
            return {}
        mine = local_extents(self.fusion, inputs, self.rank, axes)
        ranks = agreement_ranks(self.fusion, self.communicator.size)
        return shard_extents(self.fusion, axes,
                             exchanged(self.communicator, mine, in_call, ranks))

    def _shape_known(self, tv: TensorView) -> bool:
        """Whether this rank's input for ``tv`` tells its global shape, to agree on: a shard
        it holds, or the stand-in of a symbolic input off its mesh (see ``bind``)."""
        return held_here(tv, self.rank) or has_symbolic_extents(tv)

    def _out_of_step(self, error: OutOfStep, inputs: Sequence[Any]) -> Exception:
        """The error of this rank, running a cached program, when another rank checks a new
        signature in the same call: the difference of their inputs."""
        binding = bind(self.fusion, self.allocations, list(inputs), self.rank)
        facts = input_facts(self.fusion, inputs, lambda tv: _extents_of(binding, tv),
                            self._shape_known)
        return out_of_step(error.notice, self.rank, facts)

    @staticmethod
    def _fuse(program: Program, backend: str) -> tuple[Program, CompileStats]:
        stats = CompileStats()
        return fuse_program(program, backend, stats), stats

    def _fusion_lines(self, key: tuple, device: torch.device) -> list[str]:
        """explain's lines on fused segments (once ``execute`` compiled them for ``key``): how
        many, and their first-call compile time; then on the automatic replay."""
        lines = []
        for (k, backend), (program, stats) in self._fused.items():
            if k != key:
                continue
            segments = [s for s in program.steps if s.op == FUSED]
            lines.append(f"fused segments ({backend}): {len(segments)} of {len(program.steps)} "
                         f"steps; {stats.describe()}")
        replays = [replay for (k, _), replay in self._replays.items() if k == key]
        lines += replay_lines(self._programs[key], device, replays, self.cuda_graph)
        for (k, _), host in self._host.items():
            if k == key:
                lines += host.lines()
        return lines

    def call_lines(self) -> list[str]:
        """explain's lines on each signature called so far (fused segments, replay, host
        time), binding nothing: what is said of a program whose inputs the caller does not
        hold (a derived backward's)."""
        lines = []
        for n, (key, device) in enumerate(self._devices.items()):
            if key in self._programs:
                lines += [f"signature {n}:",
                          *(f"  {line}" for line in self._fusion_lines(key, device))]
        return lines

    def _bind(self, inputs: list, known: dict) -> tuple[Build, Binding]:
        """This rank's checks of ``inputs``, the build of their extents (``known``: see
        ``_learnt_extents``) and their binding to it; communicates nothing."""
        comm = self.communicator
        device = None if comm is None else required_device(comm.backend, comm.device, comm.size)
        check_inputs(self.fusion, inputs, self.rank, device)
        build = self.builds.base
        if self.builds.symbolic:
            extents = bind(self.fusion, self.allocations, inputs, self.rank, known).extents
            build = self.builds.for_extents(extents)
        fusion = build.fusion  # (whose extents are static: the symbolic ones are bound)
        binding = bind(fusion, build.allocations, inputs, self.rank)
        for v, x in zip(fusion.inputs(), inputs):
            if isinstance(v, TensorView) and held_here(v, self.rank):
                check_strides(v, x, binding.layouts[v])
        check_no_resharding(fusion, binding.extents)
        return build, binding

    def _loop_lines(self, key: tuple | None) -> list[str]:
        """explain's lines on stream-parallel loops (for ``key``'s signature, when given)."""
        program = self._programs.get(key) if key is not None else None
        build = self._signatures[key][0] if key in self._signatures else self.builds.base
        return build.overlap.explain_lines(key, self.ring_order, program)

    def _group(self, mesh, mesh_axis: int) -> Group | None:
        """This rank's Group along ``mesh_axis`` of ``mesh`` (every rank takes part in
        creating it); None outside the mesh."""
        return group_along(self.communicator, mesh, mesh_axis)

    def _lower_op(self, expr):
        """An op a strategy runs itself, bound to this rank's group (a context-parallel
        attention, expert-parallel experts), or None for any other op."""
        return context.lower_attention(expr, self._group) or \
            experts.lower_experts(expr, self._group)

    def _lower_reshard(self, expr: Reshard, binding: Binding, donated: bool):
        """A communication's plan bound to this rank (see :func:`lower_reshard`)."""
        return lower_reshard(expr, binding.extents, donated, self.communicator)


def _extents_of(binding: Binding, tv: TensorView) -> tuple:
    """The global extents of ``tv``'s logical axes, as bound."""
    return tuple(binding.extents.get(i) for i in tv.logical)


def _checked_options(timeout: object, compile: object) -> None:
    """Checks ``execute``'s options that have a value to check (on a new signature, inside
    the cross-rank agreement, so that one rank's bad option is an error on every rank)."""
    if timeout is not None:
        checked_timeout(timeout)
    if compile is not None:
        compile_setting(compile)


def _rewritten(rewrites, exprs, steps, calls, slot_of, keep):
    """The program's steps after each strategy's rewrite (stream loops, FSDP's buckets)."""
    for rewrite in rewrites:
        steps, calls = rewrite(exprs, steps, calls, slot_of, keep)
    return steps, calls


def _group_loops(plans, exprs, steps, calls, slot_of, keep, **options):
    return group_stream_loops(plans, exprs, steps, calls, slot_of, keep, **options)


def _random_streams(program: Program) -> list[str]:
    """The explain lines naming the random stream of each step that draws (dropout, RNG)."""
    notes = []
    for step in program.steps:
        if draws_random(step):
            outputs, _, call = step.label.partition(" = ")
            notes.append(f"  {call.partition('(')[0]} -> {outputs}: {step.note}")
    return [f"random streams on rank {program.rank}:", *notes] if notes else []


def _device_of(inputs: Sequence[Any], communicator) -> torch.device:
    """The device of the tensor inputs (all on one, 0-d CPU tensors aside: see
    ``check_inputs``), else the communicator's, else the CPU."""
    located = [x for x in inputs
               if isinstance(x, torch.Tensor) and x.device.type != "meta"]  # meta: a shape only
    for x in located:
        if not is_cpu_scalar(x):
            return x.device
    if located:
        return located[0].device
    return communicator.device if communicator is not None else torch.device("cpu")


def _check_graphable(fusion: Fusion, inputs: Sequence[Any]) -> None:
    """``cuda_graph=True`` needs every tensor input on a CUDA device (checked on every rank,
    before any capture)."""
    for v, x in zip(fusion.inputs(), inputs):
        if isinstance(x, torch.Tensor) and not x.is_cuda:
            raise InputError(
                f"execute(cuda_graph=True): input {v.name} is on {x.device}; CUDA graphs "
                "capture GPU work only: pass CUDA tensors, or run without cuda_graph"
            )
    if not torch.cuda.is_available():
        raise InputError("execute(cuda_graph=True) needs CUDA, which this process lacks")


class _Key(tuple):
    """A program signature (a tuple of the inputs' dtypes, shapes, strides and devices)
    whose hash is computed once: a call looks its signature up in several tables, and a
    tuple is hashed again, all its items, at each lookup. A runner keeps one object per
    signature (``_keys``), so that later lookups also find it by identity."""

    def __new__(cls, items: tuple) -> Self:
        key = super().__new__(cls, items)
        key.hash = tuple.__hash__(key)
        return key

    def __hash__(self) -> int:
        return self.hash


def _signature(inputs: list) -> tuple:
    # a list built first: tuple() of a generator costs a frame switch per input
    return tuple([(x.dtype, x.shape, x.stride(), x.device) if isinstance(x, torch.Tensor)
                  else type(x) for x in inputs])
