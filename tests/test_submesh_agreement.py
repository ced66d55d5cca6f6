"""Fusions on sub-meshes agree among their own ranks only: the world is cut in two halves
(pipeline stages), each half runs a fusion of its own on its mesh, and the ranks of the
other half never call it. The cross-rank agreement (on the fusion when built, on the
inputs on a new signature) is held among the ranks of the fusion's meshes, so neither half
waits for the other, and one half's bad input is an error on every rank of that half."""

from __future__ import annotations

import pytest
import torch

from meshfuse import DataType, DeviceMesh, FusionDefinition, InputError, ParallelType
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.sharding import shard_tensor

ROWS, COLS = 2, 6


def _halves(size: int) -> list[list[int]]:
    return [list(range(size // 2)), list(range(size // 2, size))]


def _column_sums(ranks: list[int]):
    """``sum(relu(x), 0)`` of an ``[ROWS * n, COLS]`` input sharded by rows over ``ranks``."""
    mesh = DeviceMesh(ranks)
    with FusionDefinition() as fd:
        x = fd.define_tensor([ROWS * len(ranks), COLS], dtype=DataType.Float)
        y = fd.ops.sum(fd.ops.relu(x), [0])
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(mesh)
    x.outer_split(0, mesh.size)
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def _half_of(multidevice_test) -> list[int]:
    if multidevice_test.size < 2:
        pytest.skip("needs two ranks to make two stages")
    halves = _halves(multidevice_test.size)
    comm = Communicator.instance()
    for half in halves:  # creating a slice's group is collective: every rank, in one order
        comm.group_if_member(DeviceMesh(half), 0)
    return next(h for h in halves if multidevice_test.rank in h)


@pytest.mark.mpi
def test_each_half_runs_its_own_fusion(multidevice_test):
    half, rank = _half_of(multidevice_test), multidevice_test.rank
    fd, x = _column_sums(half)
    gx = torch.randn(ROWS * len(half), COLS, generator=torch.Generator().manual_seed(len(half)))
    for _ in range(2):  # the new signature's agreement, then the cached program
        with record_communications() as comms:
            out, = fd.execute([shard_tensor(gx, x, rank)])
        torch.testing.assert_close(out, gx.relu().sum(0))
        assert all(set(c.ranks) <= set(half) for c in comms)
        assert [c.kind for c in comms] == (["allreduce"] if len(half) > 1 else [])
    # the halves are in step again: a fusion of the whole world runs after
    world, wx = _column_sums(list(range(multidevice_test.size)))
    gw = torch.randn(ROWS * multidevice_test.size, COLS)
    gw = Communicator.instance().allgather(gw, DeviceMesh(range(multidevice_test.size)), 0)[0]
    out, = world.execute([shard_tensor(gw, wx, rank)])
    torch.testing.assert_close(out, gw.relu().sum(0))


@pytest.mark.mpi
def test_a_bad_input_is_an_error_on_every_rank_of_its_half(multidevice_test):
    half, rank = _half_of(multidevice_test), multidevice_test.rank
    fd, _ = _column_sums(half)
    culprit = multidevice_test.size - 1
    good = torch.randn(ROWS, COLS)
    if culprit in half and len(half) > 1:
        mine = good if rank != culprit else torch.randn(ROWS + 1, COLS)
        with pytest.raises(InputError) as info:
            fd.execute([mine])
        assert f"rank {culprit}" in str(info.value)
    else:  # as many calls on every rank: lone-failure notices are keyed by a call count
        fd.execute([good])
    out, = fd.execute([good])  # both halves still run
    assert out.shape == (COLS,)
