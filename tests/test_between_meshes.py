"""Tensors moving between meshes: pipeline-style send/recv, broadcast from one device,
sharding onto a larger mesh, gathering onto one device. Ranks outside a tensor's mesh pass
None for its inputs and get empty tensors for its outputs."""

import pytest
import torch

from meshfuse import DataType, DeviceMesh, FusionDefinition, InputError, ParallelType
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.sharding import shard_tensor
from meshfuse.testing.utils import current_device


def _need(multidevice_test, size: int) -> None:
    if multidevice_test.size < size:
        pytest.skip(f"needs {size} ranks")


def _global(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(current_device())


def _run(fd, x_tv, gx, rank):
    local = shard_tensor(gx, x_tv, rank) if rank in x_tv.mesh else None
    with record_communications() as comms:
        out, = fd.execute([local])
    return out, [c.kind for c in comms]


@pytest.mark.mpi
def test_pipeline_stage_to_stage_is_a_send_recv(multidevice_test):
    _need(multidevice_test, 2)
    rank = multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8], dtype=DataType.Float)
        h = fd.ops.relu(x)           # stage 0
        y = fd.ops.mul(h, 2.0)       # stage 1
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0]))
    h.set_device_mesh(DeviceMesh([0]))
    y.set_device_mesh(DeviceMesh([1]))
    gx = _global(4, 8)
    out, kinds = _run(fd, x, gx, rank)
    if rank == 1:
        torch.testing.assert_close(out, gx.relu() * 2)
    else:
        assert out.numel() == 0
    assert kinds == (["send_recv"] if rank in (0, 1) else [])


@pytest.mark.mpi
def test_one_device_to_all_is_sent_then_sliced_locally(multidevice_test):
    _need(multidevice_test, 2)
    d, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([4 * d, 3], dtype=DataType.Float)
        y = fd.ops.exp(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0]))
    y.set_device_mesh(DeviceMesh(range(d)))
    y.outer_split(0, d)
    y.axis(0).parallelize(ParallelType.mesh_x)
    gx = _global(4 * d, 3)
    out, kinds = _run(fd, x, gx, rank)
    torch.testing.assert_close(out, shard_tensor(gx.exp(), y, rank))
    # one receiver: a send/recv; more: a broadcast from device 0
    assert kinds == (["send_recv"] if d == 2 else ["broadcast"])


@pytest.mark.mpi
def test_shards_to_one_device_gather_there(multidevice_test):
    _need(multidevice_test, 2)
    d, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([2 * d, 3], dtype=DataType.Float)
        y = fd.ops.neg(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(d)))
    x.outer_split(0, d)
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.set_device_mesh(DeviceMesh([d - 1]))
    gx = _global(2 * d, 3)
    out, kinds = _run(fd, x, gx, rank)
    if rank == d - 1:
        torch.testing.assert_close(out, -gx)
    else:
        assert out.numel() == 0
    assert kinds == ["allgather"]  # the last device is in the source mesh: no broadcast


@pytest.mark.mpi
def test_symbolic_input_on_part_of_the_world_needs_its_shape_off_its_mesh(multidevice_test):
    """Ranks outside x's mesh need its symbolic extents too (they receive from it): passing
    None there is an InputError, on every rank, that says what to pass."""
    _need(multidevice_test, 2)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 3], dtype=DataType.Float)
        y = fd.ops.neg(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0]))
    y.set_device_mesh(DeviceMesh([1]))
    with pytest.raises(InputError, match="pass a tensor of its global shape there"):
        fd.execute([torch.ones(2, 3, device=multidevice_test.device)
                    if multidevice_test.rank == 0 else None])


@pytest.mark.mpi
def test_symbolic_input_on_a_sub_mesh_learns_its_extents_from_a_shape_off_its_mesh(
        multidevice_test):
    """x (symbolic extents [d, 3]) sharded on rows over the first half of the ranks, y =
    exp(x) on its 3 columns over the second half (uneven at 4 ranks): the ranks outside x's
    mesh pass a meta tensor of x's global shape; every rank gets torch's values. (A symbolic
    extent is learnt from local shards as if even: x's rows divide its mesh.)"""
    _need(multidevice_test, 2)
    d, rank = multidevice_test.size, multidevice_test.rank
    first, second = DeviceMesh(range(d // 2)), DeviceMesh(range(d // 2, d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        y = fd.ops.exp(x)
        fd.add_output(y)
    for tv, mesh, axis in ((x, first, 0), (y, second, 1)):
        tv.set_device_mesh(mesh)
        tv.outer_split(axis, mesh.size)
        tv.axis(axis).parallelize(ParallelType.mesh_x)
    gx = _global(d, 3)
    local = shard_tensor(gx, x, rank) if rank in first else \
        torch.empty(gx.shape, dtype=gx.dtype, device="meta")
    with record_communications() as comms:
        out, = fd.execute([local])
    if rank in second:
        torch.testing.assert_close(out, shard_tensor(gx.exp(), y, rank))
    else:
        assert out.numel() == 0
    assert [c.kind for c in comms] != [] and all(c.ranks for c in comms)
