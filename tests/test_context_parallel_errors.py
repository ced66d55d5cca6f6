"""Bad input to a context-parallel attention on one rank: a typed error on every rank, never a
hang in the ring.

Every rank builds the ring attention of ``test_context_parallel`` (sequence zig-zag split);
the *culprit* (the last rank) makes one mistake while the others are right: a sequence shard
of another length, a k of another dtype, an option of the environment that is no option, a
schedule naming a mesh axis its mesh does not have. Every rank must raise the row's error type
(the culprit's message names the tensor or variable and the fix; the others name the culprit)
before any transfer of the ring starts, and afterwards every rank runs the good inputs: the
ranks are still in step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from mesh_helpers import mesh_1d
from test_context_parallel import Attention, _global_inputs, _sequence_sharded

from meshfuse import DefinitionError, InputError, ParallelType, ScheduleError
from meshfuse.errors import MeshfuseError
from meshfuse.examples.seed_sdpa import QkvFormat
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.runtime.comm.pending import in_flight

H, S = 2, 16
MX = ParallelType.mesh_x


@dataclasses.dataclass(frozen=True)
class Case:
    """One mistake of the culprit: ``inputs(local)`` gives its inputs from the good ones,
    ``env`` is set on it only, ``schedule(fd)`` is applied to its fusion only."""

    error: type[MeshfuseError]
    words: tuple[str, ...]
    inputs: Callable[[list], list] | None = None
    env: dict = dataclasses.field(default_factory=dict)
    schedule: Callable | None = None
    cuda: bool | None = None  # only on CUDA (True), only on CPUs (False), or both (None)


def _replace(i: int, value_of: Callable) -> Callable[[list], list]:
    return lambda good: [value_of(x) if j == i else x for j, x in enumerate(good)]


def _sequence_on_mesh_y(fd):
    """q's sequence on mesh_y, which the 1-D mesh does not have."""
    q = fd.tensors()[0]
    sharded = next(i for i in range(len(q.loop)) if q.axis(i).parallel_type is MX)
    q.parallelize(sharded, ParallelType.Serial)
    q.parallelize(sharded, ParallelType.mesh_y)


CASES = {
    "shorter_query_sequence": Case(InputError, ("T0", "axis 2"), _replace(0, lambda q: q[:, :, 1:])),
    "longer_key_sequence": Case(InputError, ("T1", "axis 2"),
                                _replace(1, lambda k: torch.cat([k, k[:, :, :1]], dim=2))),
    "key_of_another_dtype": Case(InputError, ("T1", "torch.float64"),
                                 _replace(1, lambda k: k.double())),
    "value_of_other_heads": Case(InputError, ("T2", "axis 1"),
                                 _replace(2, lambda v: torch.cat([v, v], dim=1))),
    "other_strategy_variable": Case(InputError, ("context parallelism of sdpfa_fwd",
                                                 "allgather", "ring"),
                                    env={"MESHFUSE_CONTEXT_PARALLEL": "allgather"}),
    # on CUDA the others' auto is the copy engines (blocks of one size)
    "other_transport_variable": Case(InputError, ("context parallelism of sdpfa_fwd",
                                                  "'nccl'", "'copy_engine'"),
                                     env={"MESHFUSE_CP_TRANSPORT": "nccl"}, cuda=True),
    "copy_engines_on_a_cpu_rank": Case(DefinitionError, ("MESHFUSE_CP_TRANSPORT=copy_engine",
                                                         "use nccl or auto"),
                                       env={"MESHFUSE_CP_TRANSPORT": "copy_engine"}, cuda=False),
    "bad_transport_variable": Case(DefinitionError, ("MESHFUSE_CP_TRANSPORT='pigeon'",),
                                   env={"MESHFUSE_CP_TRANSPORT": "pigeon"}),
    "bad_own_parts_variable": Case(DefinitionError, ("MESHFUSE_CP_OWN_PARTS='half'",),
                                   env={"MESHFUSE_CP_OWN_PARTS": "half"}),
    "sequence_on_a_missing_mesh_axis": Case(ScheduleError, ("mesh_y",),
                                            schedule=_sequence_on_mesh_y),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_on_one_rank_is_an_error_on_every_rank(multidevice_test, monkeypatch, name):
    case = CASES[name]
    d, rank = multidevice_test.size, multidevice_test.rank
    culprit = d - 1
    if d < 2:
        pytest.skip("needs two ranks: one wrong, the others right")
    if case.cuda is not None and case.cuda != torch.cuda.is_available():
        pytest.skip(f"a mistake {'only CUDA' if case.cuda else 'only a CPU'} can make")
    monkeypatch.setenv("MESHFUSE_CONTEXT_PARALLEL", "ring")  # the others' strategy
    monkeypatch.delenv("MESHFUSE_CP_TRANSPORT", raising=False)
    if rank == culprit:  # read when the fusion is defined and built
        for variable, value in case.env.items():
            monkeypatch.setenv(variable, value)
    fd = Attention(H, S, False)
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    good = [multidevice_test.shard_tensor(t, tv)
            for t, tv in zip(_global_inputs(H, S, QkvFormat.BHSE), fd.tensors())]
    mine = good
    if rank == culprit:
        if case.schedule is not None:
            case.schedule(fd)
        if case.inputs is not None:
            mine = case.inputs(good)
    with record_communications() as comms, pytest.raises(case.error) as info:
        fd.execute(mine)
    message = str(info.value)
    if rank == culprit:
        missing = [w for w in case.words if w not in message]
        assert not missing, f"{missing} not in: {message}"
    else:
        assert f"rank {culprit}" in message, message
    assert not [c for c in comms if c.kind in ("send", "recv")]  # the ring never started
    assert not in_flight()
    monkeypatch.undo()
    fd = Attention(H, S, False, strategy="ring")  # the ranks are still in step
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    assert len(fd.execute(good)) == 4
