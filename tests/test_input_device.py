"""Inputs on the wrong device under NCCL: a typed error naming the input and this rank's GPU
(``binding.check_inputs`` with ``binding.required_device``), instead of a raw error inside a
collective. The checks are pure, so they run on CPU with NCCL's facts given as arguments."""

from __future__ import annotations

import pytest
import torch

from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType
from meshfuse.errors import InputError
from meshfuse.runtime.interpreter.binding import check_inputs, required_device

GPU1 = torch.device("cuda", 1)


def check_input_device(fusion, inputs, rank, backend, device, world_size):
    check_inputs(fusion, inputs, rank, required_device(backend, device, world_size))


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


def test_a_0d_cpu_tensor_goes_beside_tensors_on_another_device():
    """A 0-d CPU tensor (as the RNG seed and offset that sdpa's forward returns on the CPU)
    is taken beside tensors on the GPU, as torch's ops take it, with NCCL or without. (A meta
    tensor stands for the GPU one here: the one device other than the CPU that this host has,
    and exempt from NCCL's check as a shape only.)"""
    with FusionDefinition() as fd:
        t = fd.define_tensor([8], dtype=DataType.Float)
        s = fd.define_tensor([], dtype=DataType.Float)  # not is_cpu: on any device
        fd.add_output(fd.ops.mul(t, s))
    inputs = [torch.empty(8, device="meta"), torch.tensor(2.0)]
    check_inputs(fd.fusion, inputs, 1, GPU1)
    check_inputs(fd.fusion, inputs, 0)


def test_inputs_on_two_devices_name_both_and_the_rank():
    with pytest.raises(InputError, match=r"input T1 is on cpu but input T0 is on meta \(rank "
                       r"0\): put all inputs on one device"):
        check_inputs(_fusion(), _inputs(x=torch.empty(2, 8, device="meta")), 0)
