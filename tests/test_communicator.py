"""Communicator: launcher variables, backend choice, and (on several ranks) its process groups."""

import pytest
import torch
import torch.distributed as dist

from meshfuse.errors import CommunicationError
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.runtime.comm.launch_env import LaunchInfo, choose_backend, launch_info_from_env

# ----- launcher variables and backend (one process, no torch.distributed) ---------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, LaunchInfo(0, 1, 0, 1, "none")),
        (
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            LaunchInfo(3, 4, 1, 2, "torchrun"),
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, LaunchInfo(1, 2, 1, 2, "torchrun")),
        (
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            },
            LaunchInfo(5, 8, 1, 4, "mpirun"),
        ),
        (  # torchrun's variables win
            {
                "RANK": "0",
                "WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
            },
            LaunchInfo(0, 2, 0, 2, "torchrun"),
        ),
    ],
)
def test_launch_info_from_env(env, expected):
    assert launch_info_from_env(env) == expected


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"WORLD_SIZE": "2"}, ["RANK is not", "torchrun"]),
        ({"OMPI_COMM_WORLD_RANK": "0"}, ["OMPI_COMM_WORLD_SIZE is not", "mpirun"]),
        ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x' is not an integer"]),
        ({"RANK": "2", "WORLD_SIZE": "2"}, ["inconsistent torchrun", "RANK=2", "WORLD_SIZE=2"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, ["LOCAL_WORLD_SIZE=4"]),
    ],
)
def test_launch_info_errors(env, words):
    with pytest.raises(CommunicationError) as info:
        launch_info_from_env(env)
    for word in words:
        assert word in str(info.value)


def test_choose_backend():
    assert choose_backend({}, cuda_available=False) == "gloo"
    assert choose_backend({}, cuda_available=True) == "nccl"
    assert choose_backend({"MESHFUSE_BACKEND": "gloo"}, cuda_available=True) == "gloo"
    assert choose_backend({"MESHFUSE_BACKEND": " NCCL "}, cuda_available=True) == "nccl"
    with pytest.raises(CommunicationError, match="'tcp' is not a backend"):
        choose_backend({"MESHFUSE_BACKEND": "tcp"}, cuda_available=False)
    with pytest.raises(CommunicationError, match="nccl but CUDA is not available"):
        choose_backend({"MESHFUSE_BACKEND": "nccl"}, cuda_available=False)


# ----- on every rank of a world of 1, 2 and 4 processes ------------------------------------------


def test_rank_and_size(multidevice_test):
    comm = multidevice_test.communicator
    assert (comm.rank, comm.size) == (dist.get_rank(), dist.get_world_size())
    assert 0 <= comm.local_rank < comm.local_size <= comm.size
    assert comm.backend == str(dist.get_backend())
    expected = "cuda" if comm.backend == "nccl" else "cpu"
    assert comm.device.type == expected
    comm.barrier()


def test_allreduce_over_1d_mesh(multidevice_test):
    comm = multidevice_test.communicator
    mesh = DeviceMesh(range(comm.size))
    group = comm.group(mesh, ParallelType.mesh_x)
    assert group is comm.group(mesh, 0)  # cached
    # the whole world in rank order: the default group on NCCL (until recover() starts the
    # groups over), else a group of meshfuse's own, which recover() may destroy
    assert (group is dist.group.WORLD) == (comm.backend == "nccl" and comm.generation == 0)
    t = torch.tensor([comm.rank + 1.0], device=comm.device)
    dist.all_reduce(t, group=group)
    assert t.item() == comm.size * (comm.size + 1) / 2


def test_allreduce_over_2x2_mesh(multidevice_test):
    comm = multidevice_test.communicator
    if comm.size != 4:
        pytest.skip(f"needs 4 ranks, has {comm.size}")
    mesh = DeviceMesh([[0, 1], [2, 3]])
    for axis, pt in ((1, ParallelType.mesh_x), (0, ParallelType.mesh_y)):
        t = torch.tensor([float(comm.rank)], device=comm.device)
        dist.all_reduce(t, group=comm.group(mesh, pt))
        assert t.item() == sum(mesh.group_ranks(comm.rank, axis)), (axis, comm.rank)


def test_allgather_in_mesh_order(multidevice_test):
    comm = multidevice_test.communicator
    mesh = DeviceMesh(list(reversed(range(comm.size))))  # slice order differs from rank order
    gathered = comm.allgather(torch.tensor([comm.rank], device=comm.device), mesh, 0)
    assert [t.item() for t in gathered] == list(mesh.device_ids)


def test_allgather_object(multidevice_test):
    comm = multidevice_test.communicator
    # Objects of different sizes and types on different ranks.
    obj = {"rank": comm.rank, "pad": "x" * 100 * comm.rank} if comm.rank % 2 else [comm.rank]
    gathered = comm.allgather_object(obj)
    assert len(gathered) == comm.size
    for r, got in enumerate(gathered):
        assert got == ({"rank": r, "pad": "x" * 100 * r} if r % 2 else [r])


def test_allgather_object_unpicklable_raises_everywhere(multidevice_test):
    comm = multidevice_test.communicator
    obj = (lambda: 0) if comm.rank == comm.size - 1 else comm.rank
    with pytest.raises(CommunicationError, match=f"ranks \\[{comm.size - 1}\\].*cannot be pickled"):
        comm.allgather_object(obj)
    assert comm.allgather_object(comm.rank) == list(range(comm.size))  # still in step


def test_group_rejects_a_mesh_larger_than_the_world(multidevice_test):
    comm = multidevice_test.communicator
    mesh = DeviceMesh(range(comm.size + 1))
    with pytest.raises(CommunicationError, match=f"has device {comm.size} but the world has"):
        comm.group(mesh, 0)
