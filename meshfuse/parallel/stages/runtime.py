"""Running a schedule: one rank's actions over its stage modules, with point-to-point
sends of activations forward and of gradients back.

A :class:`PipelineRunner` holds the stage modules of one pipeline rank (each may itself be
parallel over the rank's sub-mesh: stage ``r``'s devices are ``stage_ranks[r]``, and the
device at coordinate ``c`` of one stage talks to coordinate ``c`` of the next). Its
:meth:`~PipelineRunner.step` splits the batch into microbatches and walks the rank's
actions (:meth:`Schedule.with_communication`): a forward feeds the stage the microbatch (the
first stage) or the received activation, the last stage's output goes to the loss (scaled by
``1/m``, so that gradients accumulated over the microbatches are those of the mean); the
backward is whole (``B``) or split (``I`` then ``W``, :mod:`.backward`).

Receives are launched early, before the compute action ahead of the one that reads them,
and sends at once, waited for at the end of the step, so that transfers overlap compute.
A stage takes and returns one tensor or a tuple of them (a *bundle*, :mod:`.messages`):
every value crosses, and a gradient comes back for each floating value that required one.
The first bundle between two stages is preceded by its layout (the values' shapes, dtypes
and which carry gradients; every microbatch has the same); after that, only data moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from meshfuse.errors import InputError, ScheduleError
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.parallel.stages import backward
from meshfuse.parallel.stages.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Action,
)
from meshfuse.parallel.stages.messages import Layout, as_bundle, entries_size, pack, unpack
from meshfuse.parallel.stages.schedules import Schedule
from meshfuse.parallel.stages.simulate import Costs
from meshfuse.parallel.stages.table import explain
from meshfuse.runtime.comm import collectives
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.comm.pending import Pending

Bundle = tuple[torch.Tensor, ...]
_KINDS = {SEND_FORWARD: 0, RECV_FORWARD: 0, SEND_BACKWARD: 1, RECV_BACKWARD: 1}


class PipelineRunner:
    """Runs ``schedule`` on this rank's stages.

    Args:
        schedule: the schedule (:func:`~meshfuse.parallel.stages.schedules.schedule`).
        modules: this rank's stage modules by global stage index (``schedule.stages_of``
            this rank's pipeline rank); each maps the stage's inputs (one tensor or several,
            as positional arguments: the previous stage's output bundle) to its output
            (one tensor, or a tuple of tensors to pass on).
        loss_fn: ``loss_fn(output, target)`` of the last stage, a mean over the microbatch.
        stage_ranks: the devices of each pipeline rank (by default, rank ``r`` alone).
        rank: this process's rank (default: the communicator's).
        data_parallel: ``(index, count)``: this rank takes the ``index``-th of ``count``
            equal blocks of rows of every microbatch (the stage's devices form a ``dp x
            ...`` grid, each ``dp`` row running its copy of the stage on its rows, e.g.
            :class:`~meshfuse.parallel.stages.sharded.ShardedStage`); the loss returned is
            that of this rank's rows.

    A stage module may define ``begin_step()``, called when a step starts, and
    ``end_step()``, called after the stage's last compute action of the step, which may
    return something to ``wait()`` for before the step returns (ShardedStage gathers its
    parameters and reduces its gradients there, once per step).
    """

    def __init__(self, schedule: Schedule, modules: Mapping[int, torch.nn.Module],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 stage_ranks: Sequence[Sequence[int]] | None = None,
                 rank: int | None = None,
                 data_parallel: tuple[int, int] | None = None) -> None:
        self.schedule, self.loss_fn = schedule, loss_fn
        self.stage_ranks = [tuple(r) for r in (stage_ranks or
                                              [[r] for r in range(schedule.n_ranks)])]
        self.rank = Communicator.instance().rank if rank is None else rank
        self.pp_rank, self.coordinate = locate(self.stage_ranks, self.rank)
        mine = schedule.stages_of(self.pp_rank)
        if sorted(modules) != list(mine):
            raise InputError(f"pipeline rank {self.pp_rank} (rank {self.rank}) runs stages "
                             f"{list(mine)} of schedule {schedule.name}, but was given "
                             f"modules for stages {sorted(modules)}")
        self.modules = dict(modules)
        self.actions = schedule.with_communication().actions[self.pp_rank]
        self.data_parallel = data_parallel
        # after which action each stage is done for the step: its gradients are complete
        self.last_action = {a.stage: i for i, a in enumerate(self.actions) if a.is_compute}
        self.notes = {s: backward.LinearNotes(m) for s, m in self.modules.items()} \
            if schedule.split_backward else {}
        self.every = tuple(r for ranks in self.stage_ranks for r in ranks)
        self.group, self.header_group = self._transport()
        self.layouts: dict[int, Layout] = {}  # stage -> what its output bundle holds
        self.announced: set[int] = set()  # stages whose output layout was sent
        self.times: dict[tuple[str, int], float] = {}  # last step's mean host seconds

    def _transport(self) -> tuple[collectives.Group, collectives.Group]:
        """The groups the stages' messages travel in: meshfuse's world group (made again by
        ``Communicator.recover()``, so that no receive left in flight by a failed step takes
        a later step's message), and for the layout headers, which live on the host, its
        gloo group of the world (gloo even beside NCCL)."""
        groups = Communicator.instance().process_groups
        coordinate = self.every.index(self.rank)
        self.generation = groups.generation
        return (collectives.Group(groups.world(), self.every, coordinate, 0),
                collectives.Group(groups.agreement(), self.every, coordinate, 0))

    def peer(self, stage: int) -> int:
        """The rank at this rank's coordinate of the device group running ``stage``."""
        return self.stage_ranks[self.schedule.placement[stage]][self.coordinate]

    def explain(self, costs: Costs | None = None) -> str:
        names = {s: getattr(m, "extra_repr", lambda: "")() or type(m).__name__
                 for s, m in self.modules.items()}
        return explain(self.schedule, costs, self.stage_ranks,
                       [names.get(s, "(another rank)") for s in range(self.schedule.n_stages)])

    def measured_costs(self) -> Costs:
        """Every stage's forward and backward times of the last step (host seconds per
        microbatch; on a GPU, what the host waited, not the kernels), gathered from all
        ranks (collective: every rank calls it): the costs to simulate the schedule with. A
        whole backward counts as the input half."""
        every: dict[tuple[str, int], float] = {}
        for times in Communicator.instance().allgather_object(self.times):
            every.update(times)
        per_stage = {s: (every.get((FORWARD, s), 0.0),
                         every.get((BACKWARD, s), every.get((BACKWARD_INPUT, s), 0.0)),
                         every.get((BACKWARD_WEIGHT, s), 0.0))
                     for s in range(self.schedule.n_stages)}
        return Costs(per_stage=per_stage)

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None
             ) -> torch.Tensor | None:
        """One pass of every microbatch forward and backward; gradients accumulate into the
        parameters' ``.grad`` (zero them before, step the optimizer after).

        Args:
            inputs: the whole batch (first dimension split into microbatches), a tensor or a
                tuple of tensors (the first stage's positional arguments); read on the
                ranks of the first stage only (others may pass None).
            targets: the batch's targets, read on the ranks of the last stage only.

        Returns:
            The mean loss over the microbatches on the last stage's ranks, else None.
        """
        m, last, dp = self.schedule.n_microbatches, self.schedule.n_stages - 1, \
            self.data_parallel
        run = _Step(self, _chunks(inputs, m, "inputs", dp) if 0 in self.modules else None,
                    _targets(targets, m, dp) if last in self.modules else None)
        comm = Communicator.instance()
        if self.generation != comm.process_groups.generation:
            # recover() made new groups: the boundaries' layouts are sent again (a failed
            # step may have sent one that its receiver never read)
            self.group, self.header_group = self._transport()
            self.layouts.clear()
            self.announced.clear()
        lone = comm.lone
        scope = tuple(sorted(self.every))
        call = lone.begin_call(scope)  # (raises at once when the ranks are out of step)
        try:
            run.walk()
        except Exception as error:
            # told to the others (a stage's own error, a collective of its devices): the
            # ranks waiting for this one's messages raise it too, not at their timeout
            lone.left_in_flight(error, call, "a pipeline step", scope)
            raise
        return torch.stack(run.losses).mean() if run.losses else None


def locate(stage_ranks: Sequence[Sequence[int]], rank: int | None = None) -> tuple[int, int]:
    """The pipeline rank whose devices ``stage_ranks[r]`` hold ``rank`` (default: this
    process's), and ``rank``'s coordinate among them."""
    rank = Communicator.instance().rank if rank is None else rank
    for r, ranks in enumerate(stage_ranks):
        ranks = tuple(ranks)
        if rank in ranks:
            return r, ranks.index(rank)
    raise InputError(f"rank {rank} is in no pipeline stage's devices {stage_ranks}; give "
                     f"every rank of the job a stage")


def create_stage_groups(meshes: Sequence[DeviceMesh]) -> None:
    """Creates, on every rank and in one order, the process groups of every stage's mesh
    (each axis): a stage's fusions then find them, rather than create them lazily on that
    stage's ranks alone, which would leave the ranks' group counts apart and hang the next
    group created."""
    comm = Communicator.instance()
    for mesh in meshes:
        for axis in range(mesh.ndim):
            comm.group_if_member(mesh, axis)


def _chunks(x: torch.Tensor | Sequence[torch.Tensor] | None, m: int, what: str,
            data_parallel: tuple[int, int] | None) -> list[Bundle]:
    """The ``m`` microbatches of ``x`` (this rank's block of each one's rows), each a
    bundle of its tensors' rows."""
    index, count = data_parallel or (0, 1)
    bundle = (x,) if isinstance(x, torch.Tensor) else tuple(x) if x is not None else ()
    bad = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
           for t in bundle if not isinstance(t, torch.Tensor) or t.dim() == 0
           or t.shape[0] % (m * count)]
    if not bundle or bad:
        raise InputError(f"pipeline {what} must be a tensor (or a tuple of tensors) whose "
                         f"first dimension divides into {m} microbatches of {count} equal "
                         f"blocks of rows, got {bad[0] if bad else None}; give a batch of a "
                         f"multiple of {m * count} rows or change the microbatches")
    pieces = [[c.chunk(count)[index] for c in t.chunk(m)] for t in bundle]
    return [tuple(p[i] for p in pieces) for i in range(m)]


def _targets(x, m: int, data_parallel: tuple[int, int] | None) -> list:
    """The microbatches of the targets: tensors if ``x`` is one, else bundles."""
    chunks = _chunks(x, m, "targets", data_parallel)
    return [c[0] for c in chunks] if isinstance(x, torch.Tensor) else chunks


class _Step:
    """One step's walk over the rank's actions: the values in flight and saved."""

    def __init__(self, runner: PipelineRunner, inputs, targets) -> None:
        self.r, self.inputs, self.targets = runner, inputs, targets
        self.received: dict = {}  # receive action (or ("header", stage)) -> in flight
        self.local: dict[tuple[str, int, int], Bundle] = {}  # same-rank handoffs
        self.saved: dict[tuple[int, int], backward.Saved] = {}
        self.results: dict[tuple[str, int, int], Bundle] = {}  # what sends send
        self.sends: list[Pending] = []
        self.losses: list[torch.Tensor] = []
        self.posted = 0

    def walk(self) -> None:
        actions, spent = self.r.actions, {}
        for module in self.r.modules.values():
            if hasattr(module, "begin_step"):
                module.begin_step()
        for i, a in enumerate(actions):
            if a.is_compute:
                self._post_receives(actions, i)
                start = time.perf_counter()
                _COMPUTE[a.kind](self, a)
                key = (a.kind, a.stage)
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - start
                if self.r.last_action[a.stage] == i:
                    self._end_stage(a.stage)
            elif a.kind in (SEND_FORWARD, SEND_BACKWARD):
                self._send(a)
        for pending in self.sends:
            pending.wait()
        m = self.r.schedule.n_microbatches
        self.r.times = {key: t / m for key, t in spent.items()}

    def _end_stage(self, stage: int) -> None:
        end = getattr(self.r.modules[stage], "end_step", None)
        pending = end() if end is not None else None
        if pending is not None:
            self.sends.append(pending)

    def _post_receives(self, actions, i: int) -> None:
        """Launches the receives up to the compute action after ``actions[i]``."""
        computes = 0
        while self.posted < len(actions):
            a = actions[self.posted]
            if a.is_compute and self.posted > i:
                computes += 1
                if computes == 2:
                    return
            if a.kind in (RECV_FORWARD, RECV_BACKWARD):
                self._receive(a)
            self.posted += 1

    def _layout(self, a: Action) -> Layout | None:
        """The layout of what receive action ``a`` brings, when known."""
        if a.kind == RECV_FORWARD:
            return self.r.layouts.get(a.stage - 1)
        layout = self.r.layouts.get(a.stage)
        return layout.gradients() if layout is not None else None

    def _receive(self, a: Action) -> None:
        peer = self.r.peer(a.stage - 1 if a.kind == RECV_FORWARD else a.stage + 1)
        layout = self._layout(a)
        if layout is None:
            header = ("header", a.stage - 1)
            if a.kind == RECV_FORWARD and a.microbatch == 0 and header not in self.received:
                self.received[header] = collectives.recv(
                    [1], torch.int64, torch.device("cpu"), peer, self.r.header_group,
                    _tag(self.r, a, part=1))  # read when the values are
            self.received[a] = (peer, None)  # launched once the layout is known
            return
        shape, dtype = layout.buffer_spec()
        self.received[a] = collectives.recv(shape, dtype, _device(self), peer,
                                            self.r.group, _tag(self.r, a))

    def incoming(self, a: Action) -> Bundle:
        """The values receive action ``a`` brings (launched now if it could not be)."""
        got = self.received.pop(a)
        if isinstance(got, tuple):
            peer = got[0]
            if self._layout(a) is None:  # the boundary's first message: read its layout
                count = self.received.pop(("header", a.stage - 1)).wait()
                entries = collectives.recv(entries_size(count), torch.int64,
                                           torch.device("cpu"), peer, self.r.header_group,
                                           _tag(self.r, a, part=2)).wait()
                self.r.layouts[a.stage - 1] = Layout.read(entries)
            shape, dtype = self._layout(a).buffer_spec()
            got = collectives.recv(shape, dtype, _device(self), peer, self.r.group,
                                   _tag(self.r, a))
        return unpack(got.wait(), self._layout(a))

    def _send(self, a: Action) -> None:
        bundle = self.results.pop((a.kind, a.stage, a.microbatch))
        to = self.r.peer(a.stage + 1 if a.kind == SEND_FORWARD else a.stage - 1)
        receive = Action(RECV_FORWARD if a.kind == SEND_FORWARD else RECV_BACKWARD,
                         a.stage + 1 if a.kind == SEND_FORWARD else a.stage - 1, a.microbatch)
        if a.kind == SEND_FORWARD and a.stage not in self.r.announced:
            self.r.announced.add(a.stage)
            for part, header in enumerate(self.r.layouts[a.stage].header(), start=1):
                self.sends.append(collectives.send(header, to, self.r.header_group,
                                                   _tag(self.r, receive, part=part)))
        self.sends.append(collectives.send(pack(bundle), to, self.r.group,
                                           _tag(self.r, receive)))

    def stage_input(self, a: Action) -> Bundle:
        """The stage's inputs for ``a``'s microbatch, those that carry a gradient back
        marked as needing one."""
        if a.stage == 0:  # a floating input needs a gradient (a model without parameters
            # still has a backward to run)
            return tuple(x.detach().requires_grad_(x.is_floating_point())
                         for x in self.inputs[a.microbatch])
        key = (FORWARD, a.stage - 1, a.microbatch)
        if key in self.local:
            values = self.local.pop(key)
        else:
            values = self.incoming(Action(RECV_FORWARD, a.stage, a.microbatch))
        layout = self.r.layouts[a.stage - 1]
        return tuple(x.detach().requires_grad_(v.grad) for x, v in zip(values, layout.values))

    def output_grad(self, a: Action) -> Bundle | None:
        if a.stage == self.r.schedule.n_stages - 1:
            return None
        key = ("grad", a.stage + 1, a.microbatch)
        if key in self.local:
            return self.local.pop(key)
        return self.incoming(Action(RECV_BACKWARD, a.stage, a.microbatch))


def _device(step: _Step) -> torch.device:
    for module in step.r.modules.values():
        for p in module.parameters():
            return p.device
    return torch.device("cpu")


def _tag(runner: PipelineRunner, receive: Action, part: int = 0) -> int:
    """One tag per message of a step: the receiving action, and which part (0: the values,
    1 and 2: the layout's headers)."""
    m = runner.schedule.n_microbatches
    index = (receive.stage * m + receive.microbatch) * 2 + _KINDS[receive.kind]
    return 3 * index + part + 1


def _forward(step: _Step, a: Action) -> None:
    r, last = step.r, step.r.schedule.n_stages - 1
    xs = step.stage_input(a)
    notes = r.notes.get(a.stage)
    linears: list = []
    if notes is not None:
        notes.active = linears
    try:
        y = r.modules[a.stage](*xs)
    finally:
        if notes is not None:
            notes.active = None
    if a.stage == last:
        loss = r.loss_fn(y, step.targets[a.microbatch])
        step.losses.append(loss.detach())
        outputs: Bundle = (loss / r.schedule.n_microbatches,)
    else:
        bundle = as_bundle(y)
        layout = Layout.of(bundle)
        if r.layouts.setdefault(a.stage, layout) != layout:
            raise ScheduleError(f"pipeline stage {a.stage} returned {layout} on microbatch "
                                f"{a.microbatch}, but {r.layouts[a.stage]} before; every "
                                f"microbatch must cross stages with the same shapes")
        outputs = tuple(y for y, v in zip(bundle, layout.values) if v.grad)
        _hand_on(step, (FORWARD, a.stage, a.microbatch),
                 tuple(y.detach() for y in bundle), a.stage + 1, SEND_FORWARD)
    step.saved[(a.stage, a.microbatch)] = backward.Saved(
        tuple(x for x in xs if x.requires_grad), outputs, linears)


def _hand_on(step: _Step, key: tuple[str, int, int], values: Bundle, to_stage: int,
             send_kind: str) -> None:
    """Keeps ``values`` for a stage of this rank, or for the send that follows."""
    if step.r.schedule.placement[to_stage] == step.r.pp_rank:
        step.local[key] = values
    else:
        step.results[(send_kind, key[1], key[2])] = values


def _backward(step: _Step, a: Action) -> None:
    grads = step.output_grad(a)
    key = (a.stage, a.microbatch)
    if a.kind == BACKWARD:
        dxs = backward.full(step.saved.pop(key), grads)
    else:
        dxs = backward.input_half(step.saved[key], grads, step.r.modules[a.stage])
    if a.stage > 0:
        _hand_on(step, ("grad", a.stage, a.microbatch), dxs, a.stage - 1, SEND_BACKWARD)


def _weight(step: _Step, a: Action) -> None:
    backward.weight_half(step.saved.pop((a.stage, a.microbatch)))


_COMPUTE = {FORWARD: _forward, BACKWARD: _backward, BACKWARD_INPUT: _backward,
            BACKWARD_WEIGHT: _weight}
