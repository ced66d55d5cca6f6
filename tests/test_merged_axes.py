"""Device axes split from merged axes (nvFuser's ``merge`` then ``split`` then
``parallelize``): run as the equivalent split of one logical axis, against plain torch, at
world sizes 1, 2 and 4, with extents the split does not divide; merges whose devices' parts
are no blocks of the tensor are ScheduleErrors that say how to shard instead."""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import MX, mesh_1d, shard

from meshfuse import DataType, DeviceMesh, FusionDefinition, ScheduleError, shard_tensor
from meshfuse.passes.pipeline import compile as compile_fusion
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device


def _merged_outer(tv, mesh) -> None:
    """``merge(0); outer_split(0, d)``, the outer part on the devices."""
    tv.set_device_mesh(mesh)
    tv.merge(0)
    tv.outer_split(0, mesh.size)
    tv.parallelize(0, MX)


def _merged_rows(tv, mesh) -> None:
    """``merge(0); inner_split(0, 4)``, the outer part (blocks of 4 elements: 2 rows of 2)
    on the devices."""
    tv.set_device_mesh(mesh)
    tv.merge(0)
    tv.inner_split(0, 4)
    tv.parallelize(0, MX)


def _merged_cyclic(tv, mesh) -> None:
    """``merge(0); inner_split(0, d)``, the inner part (every d-th element) on the devices."""
    tv.set_device_mesh(mesh)
    tv.merge(0)
    tv.inner_split(0, mesh.size)
    tv.parallelize(1, MX)


# name -> (global shape for d ranks, the merged schedule, the same sharding written as a
# split of one logical axis: (axis, inner))
CASES = {
    "outer_split_of_the_merge_is_a_block_of_rows": (
        lambda d: [2 * d, 3], _merged_outer, (0, False)),
    "blocks_of_whole_rows_uneven": (lambda d: [2 * d - 1, 2], _merged_rows, (0, False)),
    "inner_split_of_the_merge_is_cyclic_on_the_inner_axis": (
        lambda d: [3, 2 * d], _merged_cyclic, (1, True)),
    "outer_axis_of_extent_1_uneven": (lambda d: [1, 2 * d + 1], _merged_outer, (1, False)),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(CASES))
def test_merged_device_axis_runs_as_a_split_of_one_axis(multidevice_test, name):
    """``y = exp(x) + z`` with x and y scheduled through a merge and z as the equivalent split
    of one axis: the same shards, so no communication; each rank's values are torch's."""
    shape, merged, (axis, inner) = CASES[name]
    d, rank = multidevice_test.size, multidevice_test.rank
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        x, z = (fd.define_tensor(shape(d), dtype=DataType.Float) for _ in range(2))
        y = fd.ops.add(fd.ops.exp(x), z)
        fd.add_output(y)
    merged(x, mesh)
    merged(y, mesh)
    shard(z, axis, mesh, inner=inner)
    gen = torch.Generator().manual_seed(0)
    gx, gz = (torch.randn(shape(d), generator=gen) for _ in range(2))
    local = [shard_tensor(t, tv, rank).to(current_device()) for t, tv in ((gx, x), (gz, z))]
    with record_communications() as comms:
        out, = fd.execute(local)
    assert [c for c in comms if len(c.ranks) > 1] == []
    expected = shard_tensor(gx.exp() + gz, z, rank)
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(out.cpu(), shard_tensor(gx.exp() + gz, y, rank))


@pytest.mark.mpi
def test_merged_input_resharded_for_a_consumer(multidevice_test):
    """A merged block shard of rows summed over the rows: a partial sum, one allreduce."""
    d, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([2 * d - 1, 2], dtype=DataType.Float)
        fd.add_output(fd.ops.sum(x, [0]))
    _merged_rows(x, mesh_1d(multidevice_test))
    gx = torch.randn(2 * d - 1, 2, generator=torch.Generator().manual_seed(1))
    with record_communications() as comms:
        out, = fd.execute([shard_tensor(gx, x, rank).to(current_device())])
    torch.testing.assert_close(out.cpu(), gx.sum(0))
    assert [c.kind for c in comms if len(c.ranks) > 1] == ([] if d == 1 else ["allreduce"])


@pytest.mark.parametrize("schedule, shape, message", [
    (_merged_outer, [3, 3], "blocks of 5 elements of the merged 3 x 3 do not hold whole rows"),
    (_merged_cyclic, [3, 3], "merged 3 x 3 elements cyclically by 2"),
])
def test_merged_device_axis_that_is_no_block_is_a_schedule_error(schedule, shape, message):
    """At 2 ranks, 9 elements in blocks of 5 (or every other one) cut rows of 3 apart: no
    local tensor holds such a part; the error says how to shard instead."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape, dtype=DataType.Float)
        fd.add_output(fd.ops.exp(x))
    schedule(x, DeviceMesh(range(2)))
    with pytest.raises(ScheduleError, match=message) as error:
        compile_fusion(fd.fusion, 2)
    assert "split one logical axis itself and parallelize a part of it" in str(error.value)


def test_merged_device_axis_with_symbolic_extents_is_a_schedule_error():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4], dtype=DataType.Float)
        fd.add_output(fd.ops.exp(x))
    _merged_outer(x, DeviceMesh(range(2)))
    with pytest.raises(ScheduleError, match="symbolic .declare them static"):
        compile_fusion(fd.fusion, 2)
