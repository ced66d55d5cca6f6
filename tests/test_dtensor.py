"""DTensor interop: placements <-> schedules, and fusions run on DTensors give the DTensors
that plain DTensor computation gives (a Megatron MLP with Colwise/Rowwise weights)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import meshfuse
from meshfuse import DataType, DeviceMesh, FusionDefinition, InputError, ParallelType
from meshfuse.runtime.comm.collectives import record_communications


@pytest.fixture(autouse=True)
def same_random_tensors_on_every_rank():
    torch.manual_seed(0)


# ----- conversions (one process) ----------------------------------------------------------
@pytest.mark.parametrize("mesh_shape, placements", [
    ((4,), [Shard(1)]),
    ((4,), [Replicate()]),
    ((2, 2), [Shard(0), Shard(1)]),
    ((2, 2), [Replicate(), Shard(0)]),
    ((2, 2), [Shard(0), Shard(0)]),
])
def test_schedule_from_placements_round_trips(mesh_shape, placements):
    mesh = DeviceMesh(torch.arange(4).reshape(mesh_shape))
    with FusionDefinition() as fd:
        tv = fd.define_tensor([8, 12])
    meshfuse.schedule_from_placements(tv, mesh, placements)
    assert meshfuse.to_placements(tv) == tuple(placements)
    # Each rank's shard is the one DTensor gives it (torch.chunk along each mesh axis).
    t = torch.arange(96).reshape(8, 12)
    for rank in range(4):
        expected = t
        coord = mesh.coordinate(rank)
        for mesh_axis, p in enumerate(placements):
            if isinstance(p, Shard):
                expected = expected.chunk(mesh_shape[mesh_axis], p.dim)[coord[mesh_axis]]
        assert torch.equal(meshfuse.shard_tensor(t, tv, rank), expected)


def test_partial_output_placement_names_its_reduction():
    mesh = DeviceMesh(range(2))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        out = fd.ops.max(x, [1])
        fd.add_output(out)
    x.set_device_mesh(mesh)
    x.outer_split(1, 2)
    x.axis(1).parallelize(ParallelType.mesh_x)
    out.set_device_mesh(mesh)
    out.outer_split(1, 2)
    out.axis(1).parallelize(ParallelType.mesh_x)
    assert meshfuse.to_placements(out) == (Partial("max"),)


def test_cyclic_shard_has_no_placement():
    with FusionDefinition() as fd:
        tv = fd.define_tensor([8])
    tv.set_device_mesh(DeviceMesh(range(2)))
    tv.inner_split(0, 2)
    tv.axis(1).parallelize(ParallelType.mesh_x)
    with pytest.raises(meshfuse.ShardingError, match="cyclic"):
        meshfuse.to_placements(tv)


# ----- DTensors in, DTensors out (ranks) ------------------------------------------------------
def _mesh(multidevice_test, two_d: bool):
    """A torch mesh of every rank on the fixture's device type (CUDA under NCCL), so that
    distribute_tensor puts the shards where the ranks compute."""
    d, device_type = multidevice_test.size, multidevice_test.device.type
    if not two_d:
        return init_device_mesh(device_type, (d,), mesh_dim_names=("tp",))
    if d % 2:
        pytest.skip("a 2-D mesh needs an even number of ranks")
    return init_device_mesh(device_type, (d // 2, 2), mesh_dim_names=("dp", "tp"))


def _mlp_fusion(e: int, hidden: int | None = None, tokens: int | None = None) -> FusionDefinition:
    """x [-1, -1, e], or [tokens, e] (a static extent: uneven shards need one)."""
    hidden = hidden or 4 * e
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, e] if tokens is None else [tokens, e])
        w1 = fd.define_tensor([hidden, e])
        w2 = fd.define_tensor([e, hidden])
        h = fd.ops.gelu(fd.ops.linear(x, w1), approximate="tanh")
        fd.add_output(fd.ops.linear(h, w2))
    return fd


@pytest.mark.mpi
@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
def test_megatron_mlp_on_dtensors_matches_dtensor(multidevice_test, two_d):
    """Weights laid out by parallelize_module(Colwise, Rowwise); tokens replicated (1-D) or
    sharded over dp (2-D). meshfuse's output DTensor equals DTensor's own computation."""
    mesh = _mesh(multidevice_test, two_d)
    tp = mesh["tp"] if two_d else mesh
    e, b, s = 8, 2 * (mesh.size() // tp.size()), 3
    mlp = torch.nn.Sequential(torch.nn.Linear(e, 4 * e, bias=False),
                              torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(4 * e, e, bias=False))
    parallelize_module(mlp, tp, {"0": ColwiseParallel(use_local_output=False),
                                 "2": RowwiseParallel(use_local_output=False)})
    w1, w2 = mlp[0].weight, mlp[2].weight
    x = torch.randn(b, s, e)
    if two_d:  # the weights on the 2-D mesh: replicated over dp, sharded over tp as above
        w1, w2 = (distribute_tensor(w.full_tensor().detach(), mesh, [Replicate(), w.placements[0]])
                  for w in (w1, w2))
        x_dt = distribute_tensor(x, mesh, [Shard(0), Replicate()])
        expected = F.linear(F.gelu(F.linear(x_dt, w1), approximate="tanh"), w2)
    else:
        x_dt = distribute_tensor(x, mesh, [Replicate()])
        expected = mlp(x_dt)

    fd = _mlp_fusion(e)
    with record_communications() as comms:
        (out,) = fd.execute([x_dt, w1, w2])
    assert isinstance(out, DTensor)
    assert out.device_mesh is x_dt.device_mesh
    assert out.device_mesh.mesh_dim_names == mesh.mesh_dim_names
    assert tuple(out.placements) == (Shard(0), Replicate()) if two_d else (Replicate(),)
    torch.testing.assert_close(out.full_tensor(), expected.full_tensor())
    assert [c.kind for c in comms] == (["allreduce"] if tp.size() > 1 else [])
    # A second call reuses the schedules the first one derived.
    (again,) = meshfuse.execute_with_dtensors(fd, [x_dt, w1, w2])
    torch.testing.assert_close(again.to_local(), out.to_local())


@pytest.mark.mpi
@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("tokens", ["uneven", "partial"])
def test_megatron_mlp_with_uneven_weights_and_partial_tokens(multidevice_test, two_d, tokens):
    """The MLP's hidden size (4e + 1) does not divide over tp, so parallelize_module shards
    its weights unevenly; the tokens are unevenly sharded over dp (2-D) or a Partial sum over
    tp. meshfuse's output equals DTensor's own computation of the same DTensors (tokens as
    rows: DTensor cannot flatten an uneven [b, s, e])."""
    mesh = _mesh(multidevice_test, two_d)
    tp = mesh["tp"] if two_d else mesh
    e = 8
    b = 2 * (mesh.size() // tp.size()) + 1  # token rows, uneven over dp
    mlp = torch.nn.Sequential(torch.nn.Linear(e, 4 * e + 1, bias=False),
                              torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(4 * e + 1, e, bias=False))
    parallelize_module(mlp, tp, {"0": ColwiseParallel(use_local_output=False),
                                 "2": RowwiseParallel(use_local_output=False)})
    w1, w2 = mlp[0].weight, mlp[2].weight
    if two_d:
        w1, w2 = (distribute_tensor(w.full_tensor().detach(), mesh, [Replicate(), w.placements[0]])
                  for w in (w1, w2))
    x = torch.randn(b, e)
    dp = [Shard(0)] if two_d else []
    if tokens == "uneven":
        x_dt = distribute_tensor(x, mesh, [*dp, Replicate()])
    else:  # each tp rank holds a share; their sum is x
        whole = distribute_tensor(x, mesh, [*dp, Replicate()]).to_local()
        share = whole * (tp.get_local_rank() + 1) * 2 / (tp.size() * (tp.size() + 1))
        x_dt = DTensor.from_local(share, mesh, [*dp, Partial()], shape=x.shape, stride=x.stride())
    expected = F.linear(F.gelu(F.linear(x_dt, w1), approximate="tanh"), w2)
    (out,) = _mlp_fusion(e, 4 * e + 1, tokens=b).execute([x_dt, w1, w2])
    assert isinstance(out, DTensor) and out.device_mesh is x_dt.device_mesh
    torch.testing.assert_close(out.full_tensor(), expected.full_tensor(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.full_tensor(), mlp(distribute_tensor(x, tp)).full_tensor(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
def test_sharded_output_keeps_input_mesh_and_names(multidevice_test):
    mesh = _mesh(multidevice_test, two_d=False)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.add(x, fd.define_scalar(1.0, dtype=DataType.Float)))
    x_dt = distribute_tensor(torch.randn(2 * multidevice_test.size, 4), mesh, [Shard(0)])
    (out,) = fd.execute([x_dt])
    assert out.device_mesh == x_dt.device_mesh and out.placements == x_dt.placements
    torch.testing.assert_close(out.to_local(), x_dt.to_local() + 1)


@pytest.mark.mpi
def test_uneven_shard_of_a_symbolic_axis_is_an_input_error(multidevice_test):
    d = multidevice_test.size
    if d == 1:
        pytest.skip("one rank holds everything")
    x_dt = distribute_tensor(torch.randn(2 * d + 1, 4), _mesh(multidevice_test, False), [Shard(0)])
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.relu(fd.define_tensor([-1, 4])))
    with pytest.raises(InputError, match=f"T0 axis 0 .* its extent {2 * d + 1}"):
        fd.execute([x_dt])


@pytest.mark.mpi
def test_partial_input_is_reduced_first(multidevice_test):
    mesh = _mesh(multidevice_test, two_d=False)
    local = torch.full((2, 3), float(multidevice_test.rank + 1), device=multidevice_test.device)
    x_dt = DTensor.from_local(local, mesh, [Partial()])
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.mul(fd.define_tensor([2, 3]), 2.0))
    (out,) = fd.execute([x_dt])
    d = multidevice_test.size
    torch.testing.assert_close(out.full_tensor().cpu(), torch.full((2, 3), d * (d + 1.0)))


@pytest.mark.mpi
def test_a_dtensor_laid_out_otherwise_is_an_input_error(multidevice_test):
    mesh = _mesh(multidevice_test, two_d=False)
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.relu(fd.define_tensor([-1, 4])))
    t = torch.randn(2 * multidevice_test.size, 4)
    fd.execute([distribute_tensor(t, mesh, [Shard(0)])])
    with pytest.raises(InputError, match="T0"):
        fd.execute([distribute_tensor(t, mesh, [Replicate()])])


@pytest.mark.mpi
def test_device_meshes_convert_both_ways(multidevice_test):
    mesh = _mesh(multidevice_test, two_d=False)
    ours = meshfuse.mesh_from_torch(mesh)
    assert ours == DeviceMesh(range(multidevice_test.size))
    back = meshfuse.mesh_to_torch(ours, multidevice_test.device.type, ("tp",))
    assert back.mesh.tolist() == mesh.mesh.tolist() and back.mesh_dim_names == ("tp",)
