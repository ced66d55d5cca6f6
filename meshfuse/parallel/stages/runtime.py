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
The first activation between two stages is preceded by a small header giving its shape and
dtype (every microbatch has the same); after that, only data moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from meshfuse.errors import InputError, ScheduleError
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
from meshfuse.parallel.stages.schedules import Schedule
from meshfuse.parallel.stages.simulate import Costs
from meshfuse.parallel.stages.table import explain
from meshfuse.runtime.comm import collectives
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.comm.pending import Pending

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32]
_HEADER = 8  # ndim, dtype, up to six extents
_KINDS = {SEND_FORWARD: 0, RECV_FORWARD: 0, SEND_BACKWARD: 1, RECV_BACKWARD: 1}


class PipelineRunner:
    """Runs ``schedule`` on this rank's stages.

    Args:
        schedule: the schedule (:func:`~meshfuse.parallel.stages.schedules.schedule`).
        modules: this rank's stage modules by global stage index (``schedule.stages_of``
            this rank's pipeline rank); each maps the stage's input tensor to its output.
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
        every = tuple(r for ranks in self.stage_ranks for r in ranks)
        self.group = collectives.Group(None, every, every.index(self.rank), 0)
        self.shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # stage -> output
        self.announced: set[int] = set()  # stages whose output header was sent
        self.times: dict[tuple[str, int], float] = {}  # last step's mean host seconds

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
            inputs: the whole batch (first dimension split into microbatches); read on the
                ranks of the first stage only (others may pass None).
            targets: the batch's targets, read on the ranks of the last stage only.

        Returns:
            The mean loss over the microbatches on the last stage's ranks, else None.
        """
        m, last, dp = self.schedule.n_microbatches, self.schedule.n_stages - 1, \
            self.data_parallel
        run = _Step(self, _chunks(inputs, m, "inputs", dp) if 0 in self.modules else None,
                    _chunks(targets, m, "targets", dp) if last in self.modules else None)
        run.walk()
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


def _chunks(x: torch.Tensor | None, m: int, what: str,
            data_parallel: tuple[int, int] | None) -> list[torch.Tensor]:
    """The ``m`` microbatches of ``x`` (this rank's block of each one's rows)."""
    index, count = data_parallel or (0, 1)
    if x is None or x.shape[0] % (m * count):
        raise InputError(f"pipeline {what} must be a tensor whose first dimension divides "
                         f"into {m} microbatches of {count} equal blocks of rows, got "
                         f"{None if x is None else tuple(x.shape)}")
    return [c.chunk(count)[index] for c in x.chunk(m)]


class _Step:
    """One step's walk over the rank's actions: the values in flight and saved."""

    def __init__(self, runner: PipelineRunner, inputs, targets) -> None:
        self.r, self.inputs, self.targets = runner, inputs, targets
        self.received: dict[Action, Pending | torch.Tensor] = {}
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}  # same-rank handoffs
        self.saved: dict[tuple[int, int], backward.Saved] = {}
        self.results: dict[tuple[str, int, int], torch.Tensor] = {}  # what sends send
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

    def _receive(self, a: Action) -> None:
        source = a.stage - 1 if a.kind == RECV_FORWARD else a.stage
        peer = self.r.peer(a.stage - 1 if a.kind == RECV_FORWARD else a.stage + 1)
        if source not in self.r.shapes:
            if a.kind == RECV_FORWARD and a.microbatch == 0 and source not in self.received:
                header = collectives.recv([_HEADER], torch.int64, torch.device("cpu"), peer,
                                          self.r.group, _tag(self.r, a, header=True))
                self.received[source] = header  # read when the activation is
            self.received[a] = (peer, None)  # launched once the shape is known
            return
        shape, dtype = self.r.shapes[source]
        self.received[a] = collectives.recv(shape, dtype, _device(self), peer,
                                            self.r.group, _tag(self.r, a))

    def incoming(self, a: Action) -> torch.Tensor:
        """The tensor receive action ``a`` brings (launched now if it could not be)."""
        got = self.received.pop(a)
        if isinstance(got, tuple):
            source = a.stage - 1 if a.kind == RECV_FORWARD else a.stage
            if source not in self.r.shapes:
                self.r.shapes[source] = _read_header(self.received.pop(source).wait())
            shape, dtype = self.r.shapes[source]
            got = collectives.recv(shape, dtype, _device(self), got[0], self.r.group,
                                   _tag(self.r, a))
        return got.wait()

    def _send(self, a: Action) -> None:
        value = self.results.pop((a.kind, a.stage, a.microbatch))
        to = self.r.peer(a.stage + 1 if a.kind == SEND_FORWARD else a.stage - 1)
        if a.kind == SEND_FORWARD and a.stage not in self.r.announced:
            self.r.announced.add(a.stage)
            self.sends.append(collectives.send(_header(value), to, self.r.group,
                                               _tag(self.r, Action(RECV_FORWARD, a.stage + 1,
                                                                   a.microbatch),
                                                    header=True)))
        receive = Action(RECV_FORWARD if a.kind == SEND_FORWARD else RECV_BACKWARD,
                         a.stage + 1 if a.kind == SEND_FORWARD else a.stage - 1, a.microbatch)
        self.sends.append(collectives.send(value, to, self.r.group, _tag(self.r, receive)))

    def stage_input(self, a: Action) -> torch.Tensor:
        if a.stage == 0:
            return self.inputs[a.microbatch]
        key = (FORWARD, a.stage - 1, a.microbatch)
        if key in self.local:
            return self.local.pop(key)
        return self.incoming(Action(RECV_FORWARD, a.stage, a.microbatch))

    def output_grad(self, a: Action) -> torch.Tensor | None:
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


def _tag(runner: PipelineRunner, receive: Action, header: bool = False) -> int:
    """One tag per message of a step: the receiving action, and whether it is a header."""
    m = runner.schedule.n_microbatches
    index = (receive.stage * m + receive.microbatch) * 2 + _KINDS[receive.kind]
    return 2 * index + int(header) + 1


def _header(x: torch.Tensor) -> torch.Tensor:
    if x.dim() > _HEADER - 2 or x.dtype not in _DTYPES:
        raise ScheduleError(f"a pipeline stage's output of shape {tuple(x.shape)} and dtype "
                            f"{x.dtype} cannot cross stages; use at most {_HEADER - 2} "
                            f"dimensions and one of {_DTYPES}")
    values = [x.dim(), _DTYPES.index(x.dtype), *x.shape]
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64)


def _read_header(h: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    ndim, dtype = int(h[0]), _DTYPES[int(h[1])]
    return tuple(int(e) for e in h[2:2 + ndim]), dtype


def _forward(step: _Step, a: Action) -> None:
    r, last = step.r, step.r.schedule.n_stages - 1
    x = step.stage_input(a)
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    notes = r.notes.get(a.stage)
    linears: list = []
    if notes is not None:
        notes.active = linears
    try:
        y = r.modules[a.stage](x)
    finally:
        if notes is not None:
            notes.active = None
    if a.stage == last:
        loss = r.loss_fn(y, step.targets[a.microbatch])
        step.losses.append(loss.detach())
        y = loss / r.schedule.n_microbatches
    else:
        r.shapes.setdefault(a.stage, (tuple(y.shape), y.dtype))
        _hand_on(step, (FORWARD, a.stage, a.microbatch), y.detach(), a.stage + 1,
                 SEND_FORWARD)
    step.saved[(a.stage, a.microbatch)] = backward.Saved(
        x if x.requires_grad else None, y, linears)


def _hand_on(step: _Step, key: tuple[str, int, int], value: torch.Tensor, to_stage: int,
             send_kind: str) -> None:
    """Keeps ``value`` for a stage of this rank, or for the send that follows."""
    if step.r.schedule.placement[to_stage] == step.r.pp_rank:
        step.local[key] = value
    else:
        step.results[(send_kind, key[1], key[2])] = value


def _backward(step: _Step, a: Action) -> None:
    grad = step.output_grad(a)
    key = (a.stage, a.microbatch)
    if a.kind == BACKWARD:
        dx = backward.full(step.saved.pop(key), grad)
    else:
        notes = step.r.notes[a.stage]
        dx = backward.input_half(step.saved[key], grad, step.r.modules[a.stage],
                                 notes.deferred_parameters())
    if a.stage > 0:
        if dx is None:
            raise ScheduleError(f"pipeline stage {a.stage}'s input got no gradient on "
                                f"microbatch {a.microbatch}: its output does not depend on it")
        _hand_on(step, ("grad", a.stage, a.microbatch), dx, a.stage - 1, SEND_BACKWARD)


def _weight(step: _Step, a: Action) -> None:
    backward.weight_half(step.saved.pop((a.stage, a.microbatch)))


_COMPUTE = {FORWARD: _forward, BACKWARD: _backward, BACKWARD_INPUT: _backward,
            BACKWARD_WEIGHT: _weight}
