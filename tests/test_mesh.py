"""DeviceMesh: construction, coordinates, mesh axes of parallel types, slices and shards."""

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfuse.errors import ScheduleError, ShardingError
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType

X, Y, Z = ParallelType.mesh_x, ParallelType.mesh_y, ParallelType.mesh_z


@pytest.mark.parametrize(
    ("devices", "shape", "ids", "text"),
    [
        (range(4), (4,), (0, 1, 2, 3), "DeviceMesh([0, 1, 2, 3])"),
        ([3, 1, 2], (3,), (3, 1, 2), "DeviceMesh([3, 1, 2])"),
        ((0, 1), (2,), (0, 1), "DeviceMesh([0, 1])"),
        ([[0, 1], [2, 3]], (2, 2), (0, 1, 2, 3), "DeviceMesh([[0, 1], [2, 3]])"),
        (
            torch.arange(6).reshape(2, 3),
            (2, 3),
            (0, 1, 2, 3, 4, 5),
            "DeviceMesh([[0, 1, 2], [3, 4, 5]])",
        ),
        (
            torch.arange(8, dtype=torch.int32).reshape(2, 2, 2).flip(0),
            (2, 2, 2),
            (4, 5, 6, 7, 0, 1, 2, 3),
            "DeviceMesh([[[4, 5], [6, 7]], [[0, 1], [2, 3]]])",
        ),
    ],
)
def test_construct(devices, shape, ids, text):
    mesh = DeviceMesh(devices)
    assert mesh.shape == shape
    assert mesh.ndim == len(shape)
    assert mesh.size == len(ids)
    assert mesh.device_ids == ids
    assert repr(mesh) == text
    assert mesh.devices.dtype == torch.int64
    assert mesh.devices.flatten().tolist() == list(ids)
    assert tuple(mesh.devices.shape) == shape


def test_value_semantics():
    mesh = DeviceMesh([[0, 1], [2, 3]])
    assert mesh == DeviceMesh(torch.arange(4).reshape(2, 2))
    assert hash(mesh) == hash(DeviceMesh(torch.arange(4).reshape(2, 2)))
    assert mesh != DeviceMesh(range(4))  # same ids, other shape
    assert mesh != DeviceMesh([[0, 2], [1, 3]])
    assert {mesh: "a"}[DeviceMesh([[0, 1], [2, 3]])] == "a"
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    mesh.devices[0, 0] = 7  # a new tensor each time
    assert mesh.device_ids[0] == 0
    with pytest.raises(AttributeError):
        mesh.shape = (4,)
    assert 3 in mesh and 4 not in mesh and "0" not in mesh


def test_coordinates_round_trip():
    mesh = DeviceMesh(
        torch.randperm(24, generator=torch.Generator().manual_seed(0)).reshape(2, 3, 4)
    )
    for rank in mesh.device_ids:
        coord = mesh.coordinate(rank)
        assert mesh.rank_at(coord) == rank
        assert mesh.devices[coord].item() == rank
    assert mesh.coordinate(mesh.device_ids[5]) == (0, 1, 1)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((4,), {X: 0}),
        ((2, 3), {X: 1, Y: 0}),
        ((2, 3, 4), {X: 2, Y: 1, Z: 0}),
    ],
)
def test_axis_of(shape, expected):
    mesh = DeviceMesh(torch.arange(int(torch.tensor(shape).prod())).reshape(shape))
    for pt, axis in expected.items():
        assert mesh.axis_of(pt) == axis
        assert mesh.axis_size(pt) == shape[axis]
    assert mesh.axis_of(ParallelType.DIDx) == expected[X]  # nvFuser's name


@pytest.mark.parametrize(
    ("devices", "pt", "words"),
    [
        ([0, 1], Y, ["mesh_y", "at least 2 axes", "DeviceMesh([0, 1]) has 1", "use mesh_x"]),
        ([0, 1], Z, ["mesh_z", "at least 3 axes", "3-D mesh"]),
        ([[0, 1]], Z, ["mesh_z", "has 2", "mesh_x or mesh_y"]),
        ([0, 1], ParallelType.Serial, ["not a device parallel type", "mesh_x"]),
        ([0, 1], "DIDx", ["not a device parallel type"]),
    ],
)
def test_axis_of_errors(devices, pt, words):
    with pytest.raises(ScheduleError) as info:
        DeviceMesh(devices).axis_of(pt)
    for word in words:
        assert word in str(info.value)


def test_group_ranks_and_all_groups():
    mesh = DeviceMesh(torch.arange(6).reshape(2, 3))
    assert mesh.group_ranks(4, 1) == (3, 4, 5)
    assert mesh.group_ranks(4, 0) == (1, 4)
    assert mesh.group_ranks(4, -1) == (3, 4, 5)
    assert mesh.all_groups(1) == [(0, 1, 2), (3, 4, 5)]
    assert mesh.all_groups(0) == [(0, 3), (1, 4), (2, 5)]
    assert DeviceMesh([2, 0, 1]).all_groups(0) == [(2, 0, 1)]  # mesh order, not rank order

    cube = DeviceMesh(torch.arange(8).reshape(2, 2, 2))
    assert cube.all_groups(0) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert cube.all_groups(1) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    # Every rank is in exactly one group of each axis, and its group is the one all_groups lists.
    for axis in range(cube.ndim):
        groups = cube.all_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(8))
        for rank in range(8):
            assert cube.group_ranks(rank, axis) in groups


@pytest.mark.parametrize(
    ("devices", "words"),
    [
        ([], ["no devices"]),
        ([[0, 1], [2]], ["rectangular", "row 1"]),
        ([[0], 1], ["all be lists or all be ints"]),
        ([0, 1, 1], ["unique", "[1]"]),
        ([0, -1], ["non-negative", "-1"]),
        ([0, 1.0], ["must be ints", "float"]),
        ([True], ["must be ints", "bool"]),
        (torch.tensor(3), ["0-D", "DeviceMesh([3])"]),
        (torch.tensor([0.0, 1.0]), ["integer tensor", "float32", ".long()"]),
        ("0123", ["takes a range", "str"]),
    ],
)
def test_construct_errors(devices, words):
    with pytest.raises(ScheduleError) as info:
        DeviceMesh(devices)
    for word in words:
        assert word in str(info.value)


def test_lookup_errors():
    mesh = DeviceMesh([[0, 1], [2, 3]])
    with pytest.raises(
        ScheduleError, match=r"device 7 is not in DeviceMesh\(\[\[0, 1\], \[2, 3\]\]\)"
    ):
        mesh.coordinate(7)
    with pytest.raises(ScheduleError, match="coordinate"):
        mesh.rank_at((2, 0))
    with pytest.raises(ScheduleError, match="coordinate"):
        mesh.rank_at((0,))
    with pytest.raises(ScheduleError, match="mesh axis 2 is out of range"):
        mesh.group_ranks(0, 2)
    with pytest.raises(ScheduleError, match="must be an int"):
        mesh.all_groups(X)


def test_shard_tensor():
    t = torch.arange(24).reshape(4, 6)
    mesh = DeviceMesh([[0, 1, 2], [3, 4, 5]])
    assert torch.equal(mesh.shard_tensor(t, 1, X, rank=4), t[:, 2:4])
    assert torch.equal(mesh.shard_tensor(t, 0, Y, rank=4), t[2:])
    assert torch.equal(mesh.shard_tensor(t, -1, X, rank=2), t[:, 4:])
    shard = mesh.shard_tensor(t, 1, X, rank=0)
    shard[0, 0] = -1  # a copy, not a view
    assert t[0, 0] == 0


def test_shard_tensor_keeps_memory_order():
    # A "BSHE" tensor: logical [b, h, s, e], memory b, s, h, e.
    t = torch.randn(2, 4, 3, 5).transpose(1, 2).contiguous().transpose(1, 2)
    shard = DeviceMesh(range(2)).shard_tensor(t, 1, rank=1)
    assert torch.equal(shard, t[:, 2:])
    assert shard.is_contiguous(memory_format=torch.contiguous_format) is False
    assert shard.transpose(1, 2).is_contiguous()


def test_shard_tensor_default_rank_is_zero_without_distributed():
    # Under a multi-process run this process has its own rank; only check the single process.
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        pytest.skip("this process is not rank 0")
    t = torch.arange(4)
    assert torch.equal(DeviceMesh(range(2)).shard_tensor(t, 0), t[:2])


def test_shard_tensor_of_an_uneven_extent_is_a_chunk():
    t = torch.arange(5)
    mesh = DeviceMesh(range(4))
    assert [mesh.shard_tensor(t, 0, rank=r).tolist() for r in range(4)] == [
        [0, 1], [2, 3], [4], []]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"axis": 1, "rank": 9}, ["device 9", "not in DeviceMesh"]),
        ({"axis": 2}, ["axis 2 is out of range", "(5, 4)"]),
    ],
)
def test_shard_tensor_errors(kwargs, words):
    with pytest.raises(ShardingError) as info:
        DeviceMesh(range(2)).shard_tensor(torch.zeros(5, 4), **{"rank": 0, **kwargs})
    for word in words:
        assert word in str(info.value)


@st.composite
def meshes_and_tensors(draw):
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    n = int(torch.tensor(shape).prod())
    ids = draw(st.permutations(range(n)))
    mesh = DeviceMesh(torch.tensor(ids).reshape(shape))
    pt = draw(st.sampled_from([X, Y, Z][: mesh.ndim]))
    d = mesh.axis_size(pt)
    t_shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    axis = draw(st.integers(-len(t_shape), len(t_shape) - 1))
    t_shape[axis] *= d
    return mesh, pt, torch.arange(int(torch.tensor(t_shape).prod())).reshape(t_shape), axis


@settings(max_examples=60, deadline=None)
@given(meshes_and_tensors())
def test_shards_cover_the_tensor(case):
    mesh, pt, t, axis = case
    mesh_axis = mesh.axis_of(pt)
    for rank in mesh.device_ids:
        group = mesh.group_ranks(rank, mesh_axis)
        shards = [mesh.shard_tensor(t, axis, pt, rank=r) for r in group]
        assert torch.equal(torch.cat(shards, dim=axis), t)
        # Ranks that differ only on other mesh axes hold the same block (a replica).
        coord = mesh.coordinate(rank)[mesh_axis]
        assert torch.equal(shards[coord], mesh.shard_tensor(t, axis, pt, rank=rank))
