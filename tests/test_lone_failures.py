"""An error raised on one rank only, after the cross-rank agreement, reaches every rank promptly.

Each test runs at 2 and 4 ranks (the harness's 1-rank run is skipped: nothing to tell). The
*culprit* (the last rank) fails while the others are inside, or on their way to, the program's
allreduce: every rank must raise the culprit's error type, the others with a message naming
the culprit, well before the collective timeout (the harness's is 120 s; a test that waits for
it fails by the clock of the harness, not by an assert here). Afterwards the ranks are out of
step: every rank calls ``Communicator.recover()`` and runs the fusion again, with good inputs.
"""

from __future__ import annotations

import pytest
import torch

from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType
from meshfuse.errors import CommunicationError, ExecutionError, InputError
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.comm.pending import in_flight

ROWS, COLS = 4, 6  # the local shard of a [ROWS, COLS * d] input sharded on axis 1


def _columns(tvs, d: int) -> None:
    mesh = DeviceMesh(range(d))
    for tv in tvs:
        tv.set_device_mesh(mesh)
        tv.outer_split(1, d)
        tv.axis(1).parallelize(ParallelType.mesh_x)


def row_sums(d: int, rows: int = ROWS) -> FusionDefinition:
    """``T1 = sum(T0, dims=[1])``, T0 ``[rows, COLS * d]`` (``rows`` -1: symbolic) sharded
    on its columns: one allreduce."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([rows, COLS * d])
        fd.add_output(fd.ops.sum(x, dims=[1]))
    _columns([x], d)
    return fd


def remainder_sums(d: int) -> FusionDefinition:
    """``T3 = sum(fmod(T0, T1), dims=[1])`` on Int tensors sharded on their columns: the
    fmod of a rank whose T1 shard holds a zero fails (a kernel error on that rank only),
    before the allreduce."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([ROWS, COLS * d], dtype=DataType.Int)
        y = fd.define_tensor([ROWS, COLS * d], dtype=DataType.Int)
        fd.add_output(fd.ops.sum(fd.ops.fmod(x, y), dims=[1]))
    _columns([x, y], d)
    return fd


def _ranks(multidevice_test) -> tuple[int, int, bool]:
    d = multidevice_test.size
    if d < 2:
        pytest.skip("one rank has no one to tell")
    return d, d - 1, multidevice_test.rank == d - 1


def _fmod_by_zero_raises(multidevice_test) -> None:
    """Skips a test whose kernel error is an integer fmod by zero, which raises on the CPU
    only (CUDA returns a value), when NCCL needs the inputs on the GPU."""
    if multidevice_test.device.type == "cuda":
        pytest.skip("an integer fmod by zero raises on the CPU only, and NCCL needs the "
                    "inputs on the GPU")


def _start_over(fd: FusionDefinition, inputs: list, expected: list[float]) -> None:
    """Every rank recovers, and the fusion runs again with good inputs."""
    assert in_flight() == 0
    Communicator.instance().recover()
    with record_communications() as comms:
        (out,) = fd.execute(inputs)
    assert out.tolist() == expected
    assert [c.kind for c in comms] == ["allreduce"]


def test_kernel_error_on_one_rank(multidevice_test):
    """The culprit's fmod divides by zero (its own data) on the first call, after the
    agreement passed: every rank raises ExecutionError naming the culprit, its step and
    torch's error."""
    _fmod_by_zero_raises(multidevice_test)
    d, culprit, guilty = _ranks(multidevice_test)
    fd = remainder_sums(d)
    x = torch.full((ROWS, COLS), 7, dtype=torch.int64)
    y = torch.full((ROWS, COLS), 2, dtype=torch.int64)
    with pytest.raises(ExecutionError) as info:
        fd.execute([x, y.clone().fill_(0) if guilty else y])
    message = str(info.value)
    assert f"rank {culprit}" in message and "fmod" in message, message
    assert "ZeroDivisionError" in message, message
    if not guilty:
        assert message.startswith(f"rank {culprit}: step "), message
        assert info.value.failed_rank == culprit
    _start_over(fd, [x, y], [float(COLS * d)] * ROWS)


def test_bad_option_on_one_rank_on_a_cached_call(multidevice_test):
    """The signature is cached (no agreement runs): the culprit's ``timeout=-1`` is refused
    before its program starts, while the others wait in the allreduce: every rank raises the
    same InputError."""
    d, culprit, guilty = _ranks(multidevice_test)
    fd = row_sums(d)
    x = torch.ones(ROWS, COLS, device=multidevice_test.device)
    fd.execute([x])
    with pytest.raises(InputError) as info:
        fd.execute([x], timeout=-1 if guilty else 60)
    message = str(info.value)
    assert "execute(timeout=-1)" in message and "positive number" in message, message
    if not guilty:
        assert message.startswith(f"rank {culprit}: "), message
    # out of step: a later call raises at once, on every rank, until recover()
    with pytest.raises(CommunicationError, match="out of step"):
        fd.execute([x])
    _start_over(fd, [x], [float(COLS * d)] * ROWS)


def test_bad_option_on_one_rank_on_a_first_call(multidevice_test):
    """On a new signature the options are checked inside the agreement: every rank raises
    the culprit's InputError and the ranks stay in step (no recover needed)."""
    d, culprit, guilty = _ranks(multidevice_test)
    fd = row_sums(d)
    x = torch.ones(ROWS, COLS, device=multidevice_test.device)
    with pytest.raises(InputError) as info:
        fd.execute([x], compile="no-such-backend" if guilty else False)
    assert f"rank {culprit}: execute(compile='no-such-backend')" in str(info.value)
    (out,) = fd.execute([x])
    assert out.tolist() == [float(COLS * d)] * ROWS


def test_symbolic_extent_out_of_step(multidevice_test):
    """Every rank ran ``[ROWS, ...]``; now the culprit passes one row more for the symbolic
    extent (a new signature: it checks it with the others) while the others run their cached
    program: every rank raises InputError naming input T0, axis 0 and both shapes."""
    d, culprit, guilty = _ranks(multidevice_test)
    fd = row_sums(d, rows=-1)
    x = torch.ones(ROWS, COLS, device=multidevice_test.device)
    fd.execute([x])
    with pytest.raises(InputError) as info:
        fd.execute([torch.ones(ROWS + 1, COLS, device=x.device) if guilty else x])
    message = str(info.value)
    for words in ("ranks disagree on input T0 (on axis 0)", f"rank {culprit} has",
                  f"local shape [{ROWS + 1}, {COLS}]", f"local shape [{ROWS}, {COLS}]"):
        assert words in message, message
    _start_over(fd, [x], [float(COLS * d)] * ROWS)


def test_every_rank_failing_alike_stays_in_step(multidevice_test):
    """Every rank's fmod divides by zero on a cached call: each raises its own error (no rank
    was left waiting), and the ranks are still in step: the next call runs, no recover."""
    _fmod_by_zero_raises(multidevice_test)
    d, _, _ = _ranks(multidevice_test)
    fd = remainder_sums(d)
    x = torch.full((ROWS, COLS), 7, dtype=torch.int64)
    y = torch.full((ROWS, COLS), 2, dtype=torch.int64)
    fd.execute([x, y])
    with pytest.raises(ExecutionError, match=f"rank {multidevice_test.rank}, step"):
        fd.execute([x, torch.zeros_like(y)])
    (out,) = fd.execute([x, y])
    assert out.tolist() == [float(COLS * d)] * ROWS


def test_error_after_the_last_collective(multidevice_test):
    """The culprit fails after the allreduce (its output's layout check), the others return:
    the culprit's next call raises at once, the others' next call raises the culprit's error
    when they wait for it: no rank waits for the timeout."""
    _fmod_by_zero_raises(multidevice_test)
    d, culprit, guilty = _ranks(multidevice_test)
    with FusionDefinition() as fd:
        x = fd.define_tensor([ROWS, COLS * d], dtype=DataType.Int)
        y = fd.define_tensor([ROWS], dtype=DataType.Int)
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(fd.ops.fmod(s, y))
    _columns([x], d)
    for tv in (y,):
        tv.set_device_mesh(DeviceMesh(range(d)))
    x_local = torch.ones(ROWS, COLS, dtype=torch.int64)
    y_good = torch.full((ROWS,), 5, dtype=torch.int64)
    fd.execute([x_local, y_good])
    if guilty:
        with pytest.raises(ExecutionError, match="fmod"):
            fd.execute([x_local, torch.zeros_like(y_good)])
        with pytest.raises(CommunicationError, match="out of step since its own error"):
            fd.execute([x_local, y_good])
    else:
        fd.execute([x_local, y_good])  # returns: this rank did not wait for the culprit
        with pytest.raises(ExecutionError) as info:
            fd.execute([x_local, y_good])
        assert str(info.value).startswith(f"rank {culprit}: step"), str(info.value)
    _start_over(fd, [x_local, y_good], [float(COLS * d % 5)] * ROWS)


def test_recover_aligns_the_ranks_process_group_names(multidevice_test):
    """torch names a new process group by how many its process created: a group one rank
    created alone (here by hand; a loop lowered on some ranks once did it) makes every later
    creation pair wrongly, and hang. ``recover()`` aligns the ranks' counts: the next
    program creates its groups and runs."""
    d, culprit, guilty = _ranks(multidevice_test)
    if guilty:
        torch.distributed.new_group([culprit])
    _start_over(row_sums(d), [torch.ones(ROWS, COLS, device=multidevice_test.device)],
                [float(COLS * d)] * ROWS)
    counts = Communicator.instance().allgather_object(
        torch.distributed.distributed_c10d._world.group_count)
    assert len(set(counts)) == 1, counts


def test_ranks_that_ran_different_numbers_of_calls_stay_in_step(multidevice_test):
    """Rank 0 runs a program of its own first (a fusion on its sub-mesh, as a pipeline stage
    does), so it has counted one ``execute`` call more than the others. Then every rank checks
    a new signature while rank 0 waits (it posts its claim for ranks running a cached
    program), and runs its cached program while the others wait (they read the board): the
    claim is of an earlier call, not of theirs, and every call returns. A count of calls per
    process once matched that claim to the cached call and raised a false OutOfStep."""
    import time

    from meshfuse.runtime.faults.board import POLL_S

    d, _, _ = _ranks(multidevice_test)
    rank = multidevice_test.rank
    if rank == 0:  # a program of rank 0 alone
        with FusionDefinition() as own:
            a = own.define_tensor([ROWS, COLS])
            own.add_output(own.ops.neg(a))
        a.set_device_mesh(DeviceMesh([0]))
        own.execute([torch.ones(ROWS, COLS)])
    fd = row_sums(d, rows=-1)
    x, y = torch.ones(ROWS, COLS), torch.ones(ROWS + 1, COLS)
    fd.execute([x])
    late = 4 * POLL_S
    if rank != 0:  # rank 0's agreement waits: it posts its claim
        time.sleep(late)
    assert fd.execute([y])[0].tolist() == [float(COLS * d)] * (ROWS + 1)
    if rank == 0:  # the others' cached program waits: they read the board
        time.sleep(late)
    assert fd.execute([x])[0].tolist() == [float(COLS * d)] * ROWS
    assert Communicator.instance().lone.out_of_step is None
