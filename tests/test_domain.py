"""The cached domain object: split-chain answers against direct walks of the transforms."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType
from meshfuse.errors import ScheduleError
from meshfuse.ir.domain import domain
from meshfuse.ir.iter_domain import Split
from meshfuse.ir.layout import (
    block_factor,
    derived_extents,
    local_extents,
    local_indices,
    split_indices,
)


def _walk_root(tv, id_):
    """The logical ID above ``id_`` by a plain walk over the transforms (None: a merge)."""
    for t in tv.transforms:
        if id_ in t.outputs:
            return _walk_root(tv, t.in_id) if isinstance(t, Split) else None
    return id_


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([1, 2, 3]), st.booleans()),
                max_size=5))
def test_roots_subtrees_and_indices_match_a_direct_walk(splits):
    with FusionDefinition() as fd:
        tv = fd.define_tensor([12, 6], dtype=DataType.Float)
    for pos, factor, inner in splits:
        pos = pos % len(tv.loop)
        if tv.loop[pos].extent % factor == 0:
            tv.split(pos, factor, inner_split=inner)
    d = domain(tv)
    every = set(tv.logical) | {o for t in tv.transforms for o in t.outputs}
    for id_ in every:
        assert d.logical_root(id_) is _walk_root(tv, id_)
    for logical in tv.logical:
        below = {i for i in every if _walk_root(tv, i) is logical}
        assert set(d.subtree(logical)) == below
        extents = {i: i.extent for i in every}
        index = d.split_indices(logical, extents)
        for id_ in below:
            assert index[id_].max() < id_.extent
        leaves = [i for i in tv.loop if i in below]  # each global index, rebuilt from them
        rebuilt = torch.zeros_like(index[logical])
        for leaf in leaves:
            stride = 1
            for later in leaves[leaves.index(leaf) + 1:]:
                stride *= later.extent
            rebuilt += index[leaf] * stride
        assert torch.equal(rebuilt, index[logical])


def test_the_cache_follows_the_schedule():
    with FusionDefinition() as fd:
        tv = fd.define_tensor([8, 6], dtype=DataType.Float)
    first = domain(tv)
    assert domain(tv) is first
    tv.set_device_mesh(DeviceMesh(range(2)))
    tv.outer_split(0, 2)
    second = domain(tv)
    assert second is not first and second.device_ids == {}
    tv.parallelize(0, ParallelType.mesh_x)
    third = domain(tv)
    assert third.device_ids == {tv.logical[0]: [(tv.loop[0], ParallelType.mesh_x)]}
    assert domain(tv) is third


def test_block_factor_counts_the_even_blocks_of_nested_outer_device_splits():
    """The batch split over ``replicate`` then ``dp`` (2 x 3 blocks, in order): 6; a cyclic
    split, a split of the inner part on no device, or an axis left whole: no block count."""
    mesh = DeviceMesh(torch.arange(6).reshape(2, 3))

    def tensor():
        with FusionDefinition() as fd:
            tv = fd.define_tensor([12, 6], dtype=DataType.Float)
        tv.set_device_mesh(mesh)
        return tv

    nested = tensor()
    nested.outer_split(0, 2)
    nested.parallelize(0, ParallelType.mesh_y)
    nested.outer_split(1, 3)
    nested.parallelize(1, ParallelType.mesh_x)
    assert block_factor(nested, nested.logical[0]) == 6
    assert block_factor(nested, nested.logical[1]) is None
    cyclic = tensor()
    cyclic.split(0, 3, inner_split=True)
    cyclic.parallelize(1, ParallelType.mesh_x)
    assert block_factor(cyclic, cyclic.logical[0]) is None
    local = tensor()
    local.outer_split(0, 2)
    local.parallelize(0, ParallelType.mesh_y)
    local.outer_split(1, 3)  # the inner part split again, on no device
    assert block_factor(local, local.logical[0]) is None


def test_a_device_axis_from_a_merge_is_a_schedule_error():
    with FusionDefinition() as fd:
        tv = fd.define_tensor([2, 6], dtype=DataType.Float)
    tv.set_device_mesh(DeviceMesh(range(2)))
    tv.merge(0)
    tv.split(0, 2, inner_split=False)
    tv.parallelize(0, ParallelType.mesh_x)
    with pytest.raises(ScheduleError, match="derived from a merge"):
        domain(tv).check_device_ids()


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 40), st.integers(1, 6), st.booleans(), st.booleans(), st.data())
def test_local_extents_of_one_split_match_the_index_walk(n, factor, inner_split, outer_part,
                                                         data):
    """local_extents counts a block or cyclic shard of one split without index tensors: the
    same counts as the held indices give."""
    with FusionDefinition() as fd:
        tv = fd.define_tensor([n, 3], dtype=DataType.Float)
    tv.split(0, factor, inner_split=inner_split)
    part = tv.loop[0] if outer_part else tv.loop[1]
    tv.set_device_mesh(DeviceMesh(range(part.extent)))
    tv.parallelize(tv.loop.index(part), ParallelType.mesh_x)
    coords = {ParallelType.mesh_x: data.draw(st.integers(0, part.extent - 1))}
    extents = derived_extents(tv, {i: i.extent for i in tv.logical})
    ids = [tv.logical[0], *tv.loop[:2], tv.logical[1]]
    held = local_indices(tv, tv.logical[0], extents, coords)
    index = split_indices(tv, tv.logical[0], extents)
    expected = [held.numel(), *(index[i][held].unique().numel() for i in tv.loop[:2]), 3]
    assert local_extents(tv, ids, extents, coords) == expected
