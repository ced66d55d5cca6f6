"""Inputs on the wrong device under NCCL: a typed error naming the input and this rank's GPU
(``binding.check_input_device``), instead of a raw error inside a collective. The checks are
pure, so they run on CPU with NCCL's facts given as arguments."""

from __future__ import annotations

import pytest
import torch

from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType
from meshfuse.errors import InputError
from meshfuse.runtime.binding import check_input_device

GPU1 = torch.device("cuda", 1)


def _fusion():
    """x [4, 8] row-sharded over ranks 0 and 1, b [8] on no mesh, s a host scalar:
    (x + b) * s."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8], dtype=DataType.Float)
        b = fd.define_tensor([8], dtype=DataType.Float)
        s = fd.define_tensor([], dtype=DataType.Float, is_cpu=True)
        fd.add_output(fd.ops.mul(fd.ops.add(x, fd.ops.broadcast_in_dim(b, [4, 8], [1])), s))
    x.set_device_mesh(DeviceMesh([0, 1]))
    x.outer_split(0, 2)
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd.fusion


def _inputs(x=None, b=None):
    x = torch.zeros(2, 8) if x is None else x
    return [x, torch.zeros(8) if b is None else b, torch.tensor(2.0)]


def test_a_cpu_input_under_nccl_names_the_input_and_the_gpu():
    with pytest.raises(InputError, match=r"input T0 is on cpu, but rank 1 runs NCCL on "
                       r"cuda:1: put the inputs on this rank's GPU"):
        check_input_device(_fusion(), _inputs(), 1, "nccl", GPU1, 2)


@pytest.mark.parametrize("backend, world_size", [("gloo", 2), ("nccl", 1)])
def test_gloo_or_one_rank_takes_inputs_where_they_are(backend, world_size):
    check_input_device(_fusion(), _inputs(), 1, backend, GPU1, world_size)


def test_host_scalars_and_shape_stand_ins_are_not_checked():
    meta = torch.empty(4, 8, device="meta")
    with pytest.raises(InputError, match="input T1 is on cpu"):  # x and s pass; b does not
        check_input_device(_fusion(), _inputs(x=meta), 1, "nccl", GPU1, 2)


def test_an_input_off_this_ranks_mesh_is_not_checked():
    # Rank 5 of 6 is outside x's mesh (whatever it passes for x is ignored), but b, on no
    # mesh, is every rank's.
    with pytest.raises(InputError, match="input T1 is on cpu"):
        check_input_device(_fusion(), _inputs(), 5, "nccl", GPU1, 6)
