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


def shard(tv, axis: int, mesh: DeviceMesh, pt: ParallelType = MX, inner: bool = False) -> None:
    """Shards materialized axis ``axis`` of ``tv`` over the mesh axis of ``pt``: a block
    shard (outer split), or a cyclic one (inner split)."""
    tv.set_device_mesh(mesh)
    pos = tv.loop.index(tv.materialized()[axis])
    tv.split(pos, mesh.axis_size(pt), inner_split=inner)
    tv.parallelize(pos + 1 if inner else pos, pt)
