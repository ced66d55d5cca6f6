"""The collectives module: asynchronous launches give the synchronous results.

The executor launches every collective of a resharding plan with ``async_op=True`` and waits
where the result is first read; these tests pin the contract of :class:`Pending` and check
each collective, launched both ways, against the same reference on every rank.
"""

from __future__ import annotations

import pytest
import torch

from meshfuse.ir.mesh import DeviceMesh
from meshfuse.runtime.comm import collectives
from meshfuse.runtime.comm.collectives import Group
from meshfuse.runtime.comm.pending import Pending, resolved
from meshfuse.testing.utils import current_device


class _Work:
    """A stand-in for ``torch.distributed.Work``: counts ``wait`` calls."""

    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1
        return True


def test_pending_applies_its_local_steps_once_when_waited_for():
    work = _Work()
    pending = Pending(work, torch.arange(4.0), lambda x: x * 2).then(lambda x: x + 1)
    assert work.waits == 0
    assert torch.equal(pending.wait(), torch.tensor([1.0, 3.0, 5.0, 7.0]))
    assert torch.equal(resolved(pending), torch.tensor([1.0, 3.0, 5.0, 7.0]))
    assert work.waits == 1
    # a step chained after the result arrived applies at once
    assert torch.equal(pending.then(lambda x: -x).wait(), torch.tensor([-1.0, -3.0, -5.0, -7.0]))


def test_resolved_passes_a_tensor_through():
    x = torch.ones(2)
    assert resolved(x) is x


def _group(multidevice_test) -> Group:
    mesh = DeviceMesh(range(multidevice_test.size))
    process_group = multidevice_test.communicator.group(mesh, 0)
    return Group(process_group, tuple(mesh.device_ids), multidevice_test.rank, 0)


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_each_collective_matches_its_reference(multidevice_test, async_op):
    rank, size = multidevice_test.rank, multidevice_test.size
    group = _group(multidevice_test)
    # every rank's x, known to all: rank r holds r * 10 + [0..size*6)
    xs = [torch.arange(size * 6, dtype=torch.float32).reshape(size * 2, 3) + 10 * r
          for r in range(size)]
    x = xs[rank].to(current_device())

    def run(out):
        assert isinstance(out, Pending) == async_op
        return resolved(out).cpu()

    torch.testing.assert_close(run(collectives.allreduce(x, group, "sum", async_op=async_op)),
                               sum(xs))
    torch.testing.assert_close(run(collectives.allgather(x, 1, group, async_op=async_op)),
                               torch.cat(xs, dim=1))
    torch.testing.assert_close(
        run(collectives.reduce_scatter(x, 0, group, "max", async_op=async_op)),
        torch.stack(xs).amax(0).chunk(size, dim=0)[rank])
    torch.testing.assert_close(
        run(collectives.all_to_all(x, 0, 1, group, async_op=async_op)),
        torch.cat([xr.chunk(size, dim=0)[rank] for xr in xs], dim=1))
    assert torch.equal(x.cpu(), xs[rank]), "a collective that does not own x changed it"
