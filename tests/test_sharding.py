"""Local shards from schedules: shapes, strides, ownership (single process, no communication)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfuse import (
    DataType,
    DeviceMesh,
    FusionDefinition,
    ParallelType,
    ScheduleError,
    shard_tensor,
    unshard_tensor,
)
from meshfuse.ir.layout import derived_extents, local_layout
from meshfuse.ir.tensor_view import Allocation

MESH_TYPES = (ParallelType.mesh_x, ParallelType.mesh_y, ParallelType.mesh_z)


def _tensor(shape, stride_order=None):
    fd = FusionDefinition()
    return fd.define_tensor(shape, dtype=DataType.Float, stride_order=stride_order)


def _layout(tv, shape):
    extents = derived_extents(tv, dict(zip(tv.logical, shape)))
    return local_layout(tv, tv.allocation, extents)


def test_block_shard_is_contiguous_slice():
    tv = _tensor([2, 12, 8])
    tv.set_device_mesh(DeviceMesh(range(4)))
    tv.outer_split(1, 4)
    tv.axis(1).parallelize(ParallelType.mesh_x)
    t = torch.arange(2 * 12 * 8.0).reshape(2, 12, 8)
    for rank in range(4):
        assert torch.equal(shard_tensor(t, tv, rank), t[:, rank * 3:(rank + 1) * 3])


def test_cyclic_shard_from_inner_split():
    tv = _tensor([12])
    tv.set_device_mesh(DeviceMesh(range(3)))
    tv.inner_split(0, 3)
    tv.axis(1).parallelize(ParallelType.mesh_x)
    t = torch.arange(12.0)
    for rank in range(3):
        assert torch.equal(shard_tensor(t, tv, rank), t[rank::3])


def test_logical_device_axis_has_local_extent_one():
    tv = _tensor([2, 3, 5])
    tv.set_device_mesh(DeviceMesh(range(2)))
    tv.axis(0).parallelize(ParallelType.mesh_x)
    t = torch.randn(2, 3, 5)
    assert torch.equal(shard_tensor(t, tv, 1), t[1:2])
    assert _layout(tv, [2, 3, 5]).shape == (1, 3, 5)


def test_seed_bshe_allocation_gives_bshe_strides():
    b, h, s, e, d = 2, 12, 16, 4, 2
    tv = _tensor([b, h, s, e], stride_order=[3, 1, 2, 0])
    tv.set_device_mesh(DeviceMesh(range(d)))
    tv.split(1, d, False)
    tv.parallelize(1, ParallelType.mesh_x)
    tv.reorder({2: 3, 3: 2})
    tv.set_allocation_as_loop()
    layout = _layout(tv, [b, h, s, e])
    assert layout.shape == (b, h // d, s, e)
    expected = torch.empty(b, s, h // d, e).transpose(1, 2)
    assert layout.strides == expected.stride()
    shard = shard_tensor(torch.randn(b, h, s, e), tv, 1)
    assert shard.stride() == expected.stride()


def test_two_mesh_axes_shard_two_logical_axes():
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    tv = _tensor([4, 6])
    tv.set_device_mesh(mesh)
    tv.outer_split(0, 2)
    tv.axis(0).parallelize(ParallelType.mesh_y)
    tv.outer_split(2, 2)
    tv.axis(2).parallelize(ParallelType.mesh_x)
    t = torch.arange(24.0).reshape(4, 6)
    # rank 3 has coordinate (1, 1): rows 2..3 (mesh_y), columns 3..5 (mesh_x)
    assert torch.equal(shard_tensor(t, tv, 3), t[2:4, 3:6])
    assert torch.equal(shard_tensor(t, tv, 1), t[0:2, 3:6])


@pytest.mark.parametrize("inner", [False, True], ids=["block", "cyclic"])
def test_uneven_split_gives_chunk_sizes(inner):
    """12 over 5 devices: blocks as torch.chunk (3, 3, 3, 3, 0), cyclic every 5th index
    (3, 3, 2, 2, 2); local layouts follow each device's shard, and the shards unshard."""
    tv = _tensor([2, 12])
    mesh = DeviceMesh(range(5))
    tv.set_device_mesh(mesh)
    tv.split(1, 5, inner_split=inner)
    tv.parallelize(2 if inner else 1, ParallelType.mesh_x)
    t = torch.arange(24.0).reshape(2, 12)
    shards = [shard_tensor(t, tv, rank) for rank in range(5)]
    expected = [t[:, r::5] for r in range(5)] if inner else list(t.chunk(5, dim=1)) + [t[:, :0]]
    for shard, want in zip(shards, expected):
        assert torch.equal(shard, want)
    extents = derived_extents(tv, dict(zip(tv.logical, [2, 12])))
    sizes = [local_layout(tv, tv.allocation or _row_major(tv), extents,
                          {ParallelType.mesh_x: c}).shape[1] for c in range(5)]
    assert sizes == ([3, 3, 2, 2, 2] if inner else [3, 3, 3, 3, 0])
    assert torch.equal(unshard_tensor(shards, tv), t)


def _row_major(tv):
    return Allocation(tuple(tv.logical), (True,) * len(tv.logical))


def test_parallel_type_used_twice_is_rejected():
    tv = _tensor([4, 4])
    tv.set_device_mesh(DeviceMesh(range(2)))
    tv.outer_split(0, 2).outer_split(2, 2)
    tv.axis(0).parallelize(ParallelType.mesh_x)
    with pytest.raises(ScheduleError, match="DIDx is used twice"):
        tv.axis(2).parallelize(ParallelType.mesh_x)


def test_broadcast_axis_cannot_be_sharded():
    tv = _tensor([1, 4])
    tv.set_device_mesh(DeviceMesh(range(2)))
    with pytest.raises(ScheduleError, match="broadcast axis"):
        tv.axis(0).parallelize(ParallelType.mesh_x)


def test_reorder_fills_unnamed_positions_in_order():
    tv = _tensor([2, 3, 5, 7])
    ids = list(tv.loop)
    tv.reorder({0: 3})
    assert tv.loop == [ids[1], ids[2], ids[3], ids[0]]


def test_allocation_must_cover_every_axis():
    tv = _tensor([2, 12])
    tv.outer_split(1, 2)
    with pytest.raises(ScheduleError, match="cover each logical axis exactly once"):
        tv.set_allocation_domain([tv.axis(0), tv.axis(1)])


# ----- property tests: shards of all ranks cover the tensor once per replica ---------------

@st.composite
def schedules(draw):
    """A random tensor shape, mesh and schedule of DID splits (outer or inner, nested)."""
    mesh_shape = draw(st.sampled_from([(2,), (3,), (4,), (2, 2), (2, 3), (2, 1, 2)]))
    ndim = draw(st.integers(1, 3))
    used = draw(st.permutations(range(len(mesh_shape))))[: draw(st.integers(0, len(mesh_shape)))]
    plan = []  # (logical axis, mesh axis, inner_split)
    for mesh_axis in used:
        plan.append((draw(st.integers(0, ndim - 1)), mesh_axis, draw(st.booleans())))
    shape = []
    for axis in range(ndim):
        factor = 1
        for a, m, _ in plan:
            if a == axis:
                factor *= mesh_shape[m]
        shape.append(max(2, factor * draw(st.integers(1, 3))))  # 1 would be a broadcast axis
    return mesh_shape, shape, plan


def _schedule(mesh_shape, shape, plan):
    tv = _tensor(shape)
    mesh = DeviceMesh(torch.arange(int(torch.tensor(mesh_shape).prod())).reshape(mesh_shape))
    tv.set_device_mesh(mesh)
    for axis, mesh_axis, inner in plan:
        pt = MESH_TYPES[len(mesh_shape) - 1 - mesh_axis]
        # the loop position of the (last serial piece of the) logical axis
        pos = _serial_position(tv, axis)
        factor = mesh_shape[mesh_axis]
        tv.split(pos, factor, inner_split=inner)
        tv.parallelize(pos + 1 if inner else pos, pt)
    return tv, mesh


def _serial_position(tv, axis):
    from meshfuse.ir.layout import logical_root

    root = tv.logical[axis]
    candidates = [p for p, i in enumerate(tv.loop)
                  if logical_root(tv, i) is root and not tv.parallel_type(i).is_device]
    return candidates[-1]


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_shards_gather_back_and_each_element_is_owned_once_per_replica(case):
    mesh_shape, shape, plan = case
    tv, mesh = _schedule(mesh_shape, shape, plan)
    t = torch.arange(float(torch.tensor(shape).prod())).reshape(shape)
    shards = [shard_tensor(t, tv, rank) for rank in mesh.device_ids]
    assert torch.equal(unshard_tensor(shards, tv), t)
    owners = torch.zeros(shape, dtype=torch.long)
    for shard in shards:
        owners.view(-1)[shard.flatten().long()] += 1
    sharded_mesh_axes = {m for _, m, _ in plan}
    replicas = 1
    for m, n in enumerate(mesh_shape):
        if m not in sharded_mesh_axes:
            replicas *= n
    assert torch.all(owners == replicas)


def test_every_rank_shard_has_the_layout_shape():
    for mesh_shape, shape, plan in [((2,), [4, 6], [(1, 0, False)]),
                                    ((2, 2), [4, 4], [(0, 0, True), (0, 1, False)])]:
        tv, mesh = _schedule(mesh_shape, shape, plan)
        layout = _layout(tv, shape)
        for rank, t in itertools.product(mesh.device_ids, [torch.randn(shape)]):
            assert tuple(shard_tensor(t, tv, rank).shape) == layout.shape


def test_domain_accessors_and_from_pytorch():
    fd = FusionDefinition()
    t = torch.randn(2, 3, 4).transpose(1, 2)  # memory order 0, 2, 1
    tv = fd.from_pytorch(t)
    assert [a.extent for a in tv.get_logical_domain()] == [None, None, None]
    assert tv.get_allocation_domain()[1].id is tv.logical[2]
    tv.set_device_mesh(DeviceMesh(range(2)))
    tv.outer_split(0, 2)
    tv.axis(0).parallelize(ParallelType.mesh_x)
    loop = tv.get_loop_domain()
    assert [a.extent for a in loop] == [2, None, None, None]
    assert loop[0].parallel_type is ParallelType.mesh_x and repr(loop[0]) == "iDIDx{2}"
