"""``execute(inputs, cuda_graph=True)``: the captured program gives the eager program's results.

Checked: the seed's head-parallel attention and a row-parallel linear whose partial sums are
allreduced (a collective inside the graph), at every world size the suite runs, against the
eager run and the unsharded reference; new input values after the capture; results of an
earlier call left intact; the communications of each replay reported. On a machine without
CUDA only the input check runs.
"""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import shard

from meshfuse import DataType, DeviceMesh, FusionDefinition, InputError, shard_tensor
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention, random_inputs
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device, is_pre_ampere

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or is_pre_ampere(),
                                reason="CUDA graphs of attention need an Ampere or newer GPU")


def test_cuda_graph_refuses_cpu_inputs_and_names_them():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 4], dtype=DataType.Float)
        fd.add_output(fd.ops.exp(x))
    with pytest.raises(InputError, match=r"cuda_graph=True.*input T0 is on cpu"):
        fd.execute([torch.ones(4, 4)], cuda_graph=True)


@needs_cuda
@pytest.mark.mpi
@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
def test_cuda_graph_of_the_seed_attention_matches_eager(multidevice_test, qkv_format):
    d, rank = multidevice_test.size, multidevice_test.rank
    b, h, s, e = 2, 4 * d, 128, 64 * d
    model = SeedAttention(qkv_format, DeviceMesh(range(d)), b, h, s, e)
    first, second = (model.inputs_for(*random_inputs(b, h, s, e, device=current_device(),
                                                     seed=seed), rank) for seed in (0, 1))
    eager_first, eager_second = model.execute(first), model.execute(second)
    graphed_first = model.execute(first, cuda_graph=True)  # captures
    graphed_second = model.execute(second, cuda_graph=True)  # replays with new values
    for got, want in zip(graphed_first + graphed_second, eager_first + eager_second):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    # the second replay did not overwrite what the first call returned
    torch.testing.assert_close(graphed_first[0], eager_first[0], rtol=1e-2, atol=1e-2)


class _RowParallelLinear(FusionDefinition):
    """``y = x @ w.T`` with the reduced axis of ``x`` and ``w`` split over the mesh: each rank
    makes partial sums, and ``y`` replicated needs an allreduce."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh

    def definition(self) -> None:
        self.x = self.define_tensor([8, 16], dtype=DataType.Float)
        self.w = self.define_tensor([4, 16], dtype=DataType.Float)
        self.y = self.ops.linear(self.x, self.w)
        self.add_output(self.y)

    def multidevice_schedule(self) -> None:
        for tv in (self.x, self.w):
            shard(tv, 1, self.mesh)
        self.y.set_device_mesh(self.mesh)


@needs_cuda
@pytest.mark.mpi
def test_cuda_graph_replays_the_allreduce_of_partial_sums(multidevice_test):
    rank, mesh = multidevice_test.rank, DeviceMesh(range(multidevice_test.size))
    fd = _RowParallelLinear(mesh)
    fd.define()
    for seed in (0, 1, 2):  # capture, then two replays with new values
        gen = torch.Generator().manual_seed(seed)
        x, w = (torch.randn(*shape, generator=gen).to(current_device())
                for shape in ((8, 16), (4, 16)))
        inputs = [shard_tensor(x, fd.x, rank), shard_tensor(w, fd.w, rank)]
        with record_communications() as comms:
            y, = fd.execute(inputs, cuda_graph=True)
        torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)
        # one allreduce per run (none on one device); the first call runs the program
        # eagerly once (warm-up) and replays it once
        per_run = int(multidevice_test.size > 1)
        assert [c.kind for c in comms] == ["allreduce"] * per_run * (2 if seed == 0 else 1)
