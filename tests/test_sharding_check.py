"""The per-signature sharding check: an op whose tensors are still owned differently is an
error naming both; axes split alike pass without comparing owners index by index."""

import pytest
from mesh_helpers import shard

from meshfuse import DataType, DeviceMesh, FusionDefinition
from meshfuse.errors import ShardingError
from meshfuse.ir.layout import derived_extents
from meshfuse.passes.sharding_check import check_no_resharding, owner_map, same_owners

MESH = DeviceMesh(range(4))


def _neg(extent: int, x_shard: tuple, out_shard: tuple):
    """``out = neg(x)`` over ``[extent, 8]``, each scheduled by hand as ``(axis, inner)``
    (no passes run: the check sees the schedules as written)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([extent, 8], dtype=DataType.Float)
        out = fd.ops.neg(x)
        fd.add_output(out)
    shard(x, x_shard[0], MESH, inner=x_shard[1])
    shard(out, out_shard[0], MESH, inner=out_shard[1])
    extents = {}
    for tv in (x, out):
        extents.update(derived_extents(tv, {i: i.extent for i in tv.logical}))
    return fd.fusion, x, out, extents


@pytest.mark.parametrize("extent", [8, 10, 3])  # even, uneven, fewer rows than devices
@pytest.mark.parametrize("inner", [False, True])
def test_axes_split_alike_pass(extent, inner):
    fusion, x, out, extents = _neg(extent, (0, inner), (0, inner))
    assert same_owners(owner_map(x, x.logical[0], extents),
                       owner_map(out, out.logical[0], extents))
    check_no_resharding(fusion, extents)


@pytest.mark.parametrize("extent", [8, 10])
def test_block_against_cyclic_needs_a_communication(extent):
    fusion, _, _, extents = _neg(extent, (0, False), (0, True))
    with pytest.raises(ShardingError, match=r"T0 axis 0 is DIDx \(owners \[0, 0"
                                            r".*but axis 0 of T1 is DIDx \(owners \[0, 1"):
        check_no_resharding(fusion, extents)


def test_another_axis_needs_a_communication():
    fusion, _, _, extents = _neg(8, (0, False), (1, False))
    with pytest.raises(ShardingError, match="T0 axis 0 is DIDx .* but axis 0 of T1 is "
                                            "replicated; this needs a communication"):
        check_no_resharding(fusion, extents)
