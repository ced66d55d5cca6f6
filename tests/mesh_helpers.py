"""Meshes and hand-written shards shared by the multi-device tests."""

import pytest
import torch

from meshfuse import DeviceMesh, ParallelType

MX, MY = ParallelType.mesh_x, ParallelType.mesh_y


def mesh_1d(multidevice_test) -> DeviceMesh:
    """Every rank of the test, in rank order."""
    return DeviceMesh(range(multidevice_test.size))


def mesh_2x2(multidevice_test) -> DeviceMesh:
    """``[[0, 1], [2, 3]]``; skips the test unless it runs on 4 ranks."""
    if multidevice_test.size != 4:
        pytest.skip("a 2x2 mesh needs 4 ranks")
    return DeviceMesh(torch.arange(4).reshape(2, 2))


def meshes_of_kind(multidevice_test, kind: str) -> tuple[DeviceMesh, ...]:
    """The meshes of a hand-written case: ``"1d"`` (every rank), ``"2x2"`` (4 ranks only:
    skips otherwise) or ``"two"`` (the first and the second half of the ranks, from 2 ranks:
    skips at 1)."""
    if kind == "2x2":
        return (mesh_2x2(multidevice_test),)
    d = multidevice_test.size
    if kind == "two":
        if d == 1:
            pytest.skip("two meshes of different devices need 2 ranks")
        return DeviceMesh(range(d // 2)), DeviceMesh(range(d // 2, d))
    return (mesh_1d(multidevice_test),)


def shard(tv, axis: int, mesh: DeviceMesh, pt: ParallelType = MX, inner: bool = False) -> None:
    """Shards materialized axis ``axis`` of ``tv`` over the mesh axis of ``pt``: a block
    shard (outer split), or a cyclic one (inner split)."""
    tv.set_device_mesh(mesh)
    pos = tv.loop.index(tv.materialized()[axis])
    tv.split(pos, mesh.axis_size(pt), inner_split=inner)
    tv.parallelize(pos + 1 if inner else pos, pt)


TYPES = {1: (MX,), 2: (MY, MX), 3: (ParallelType.mesh_z, MY, MX)}


def schedule_placements(tv, mesh: DeviceMesh, sharding: tuple, offset: int = 0) -> None:
    """Schedules ``tv`` by ``sharding``, one entry per mesh axis (outermost first): ``("R",)``,
    ``("S", axis)`` a block shard, ``("Sc", axis)`` a cyclic one (axes counted from
    ``offset``); a later mesh axis sharding the same axis splits what the earlier left."""
    tv.set_device_mesh(mesh)
    rest = {}  # logical axis -> the loop ID holding what earlier splits left of it
    for pt, placement in zip(TYPES[mesh.ndim], sharding):
        if placement[0] not in ("S", "Sc"):
            continue
        axis = placement[1] + offset
        pos = tv.loop.index(rest.get(axis, tv.logical[axis]))
        inner = placement[0] == "Sc"
        tv.split(pos, mesh.axis_size(pt), inner_split=inner)
        tv.parallelize(pos + 1 if inner else pos, pt)
        rest[axis] = tv.loop[pos if inner else pos + 1]
