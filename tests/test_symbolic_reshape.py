"""Reshapes of tensors with symbolic extents (``define_tensor`` with ``-1``), sharded, against
plain torch at world sizes 1, 2 and 4: static groups at either end map as in the static rule,
the axes between as a merge or split when that is what they are, else to no input axis (a
sharded axis there is gathered first); the element count is checked at execute."""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import mesh_1d, shard

from meshfuse import DataType, FusionDefinition, InputError, shard_tensor
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

# name -> (input shape as declared, global shape for d ranks, new shape, sharded input axis,
# whether, at d ranks, the reshape keeps that axis's shards (no communication) or not (one
# allgather: a block shard is carried across a split only where d divides both sides))
CASES = {
    "static_split_after_a_symbolic_axis": ([-1, 6], lambda d: [2 * d, 6], [-1, 2, 3], 0, lambda d: True),
    "static_merge_before_a_symbolic_axis": (
        [2, 3, -1], lambda d: [2, 3, 2 * d], [6, -1], 2, lambda d: True),
    "symbolic_axes_merged_between_static_groups": (
        [4, -1, -1, 6], lambda d: [4, d, 3, 6], [2, 2, -1, 2, 3], 0, lambda d: d <= 2),
    "mixed_axes_map_to_none": ([-1, 6], lambda d: [2 * d, 6], [-1, 4], 0, lambda d: False),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(CASES))
def test_reshape_of_symbolic_extents(multidevice_test, name):
    declared, shape, new, axis, kept = CASES[name]
    d, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor(declared, dtype=DataType.Float)
        y = fd.ops.exp(fd.ops.reshape(x, new))
        fd.add_output(y)
    shard(x, axis, mesh_1d(multidevice_test))
    gx = torch.randn(shape(d), generator=torch.Generator().manual_seed(0))
    with record_communications() as comms:
        out, = fd.execute([shard_tensor(gx, x, rank).to(current_device())])
    torch.testing.assert_close(out.cpu(), shard_tensor(gx.reshape(new).exp(), y, rank))
    kinds = [c.kind for c in comms if len(c.ranks) > 1]
    assert kinds == ([] if kept(d) or d == 1 else ["allgather"]), kinds


def test_reshape_of_symbolic_extents_checks_the_count_at_execute():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 6], dtype=DataType.Float)
        fd.add_output(fd.ops.reshape(x, [-1, 4]))
    with pytest.raises(InputError, match="cannot reshape"):
        fd.execute([torch.randn(3, 6)])
