"""``fd.as_autograd_function()`` on DTensors: DTensors in, DTensors out, and gradients that are
the gradients DTensor's own autograd gives (values and placements), for a Megatron MLP whose
weights ``parallelize_module`` laid out (Colwise/Rowwise), on 1-D and 2-D meshes."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshfuse import FusionDefinition, InputError
from meshfuse.runtime.comm.collectives import record_communications

E = 8


@pytest.fixture(autouse=True)
def same_random_tensors_on_every_rank():
    torch.manual_seed(0)


def _mesh(multidevice_test, two_d: bool):
    """A torch mesh of every rank on the fixture's device type (CUDA under NCCL), so that
    distribute_tensor puts the shards where the ranks compute."""
    size, device_type = multidevice_test.size, multidevice_test.device.type
    if not two_d:
        return init_device_mesh(device_type, (size,), mesh_dim_names=("tp",))
    if size % 2:
        pytest.skip("a 2-D mesh needs an even number of ranks")
    return init_device_mesh(device_type, (size // 2, 2), mesh_dim_names=("dp", "tp"))


def _mlp_fusion(tokens: int, hidden: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, E])
        w1 = fd.define_tensor([hidden, E])
        w2 = fd.define_tensor([E, hidden])
        h = fd.ops.gelu(fd.ops.linear(x, w1), approximate="tanh")
        fd.add_output(fd.ops.linear(h, w2))
    return fd


def _megatron_weights(mesh, tp, hidden: int):
    """w1 column parallel and w2 row parallel over tp, as parallelize_module lays them out
    (replicated over dp on a 2-D mesh); leaves that require grad."""
    mlp = torch.nn.Sequential(torch.nn.Linear(E, hidden, bias=False), torch.nn.GELU("tanh"),
                              torch.nn.Linear(hidden, E, bias=False))
    parallelize_module(mlp, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    weights = [mlp[0].weight, mlp[2].weight]
    if mesh is not tp:
        weights = [distribute_tensor(w.full_tensor().detach(), mesh, [Replicate(), *w.placements])
                   for w in weights]
    return [w.detach().requires_grad_() for w in weights]


def _leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.mpi
@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("hidden", [4 * E, 4 * E + 1], ids=["even", "uneven"])
def test_megatron_mlp_gradients_on_dtensors_match_dtensor(multidevice_test, two_d, hidden):
    """Weights Colwise/Rowwise (the uneven hidden size 4E + 1 shards them unevenly); tokens
    replicated (1-D) or sharded over dp (2-D), uneven there. The output and the gradients of
    the tokens and both weights are DTensors with the placements and values DTensor's
    autograd gives; the tensor-parallel backward runs one allreduce (the replicated tokens'
    gradient) on a 1-D mesh, as DTensor's does."""
    mesh = _mesh(multidevice_test, two_d)
    tp = mesh["tp"] if two_d else mesh
    tokens = 2 * (mesh.size() // tp.size()) + 1
    x = torch.randn(tokens, E)
    dy = torch.randn(tokens, E)
    placements = [Shard(0), Replicate()] if two_d else [Replicate()]
    w1, w2 = _megatron_weights(mesh, tp, hidden)
    x_dt = distribute_tensor(x, mesh, placements).requires_grad_()
    dy_dt = distribute_tensor(dy, mesh, placements)

    ref_x, ref_w1, ref_w2 = _leaves([x_dt, w1, w2])
    expected = F.linear(F.gelu(F.linear(ref_x, ref_w1), approximate="tanh"), ref_w2)
    expected.backward(dy_dt)

    function = _mlp_fusion(tokens, hidden).as_autograd_function()
    out, = function([x_dt, w1, w2])
    assert isinstance(out, DTensor) and out.device_mesh is x_dt.device_mesh
    assert out.placements == tuple(placements)  # resolved (DTensor's F.linear leaves Partial)
    with record_communications() as comms:
        out.backward(dy_dt)
    torch.testing.assert_close(out.full_tensor(), expected.full_tensor(), rtol=1e-5, atol=1e-5)
    for got, ref in ((x_dt, ref_x), (w1, ref_w1), (w2, ref_w2)):
        assert isinstance(got.grad, DTensor)
        assert got.grad.placements == got.placements
        torch.testing.assert_close(got.grad.full_tensor(), ref.grad.full_tensor(),
                                   rtol=1e-5, atol=1e-5)
    # 1-D: DTensor's one allreduce. (On the 2-D mesh meshfuse gathers the dp-sharded
    # activations for the weight gradients, where DTensor leaves them Partial over dp.)
    if not two_d:
        assert [c.kind for c in comms] == (["allreduce"] if tp.size() > 1 else [])


@pytest.mark.mpi
def test_sequence_parallel_tokens_get_sharded_gradients(multidevice_test):
    """Tokens sharded on the sequence (SP): the output equals DTensor's, and the tokens'
    gradient comes back sequence sharded, equal to DTensor's; the backward reduce-scatters it
    (the transpose of the forward's allgather of the tokens)."""
    size = multidevice_test.size
    mesh = _mesh(multidevice_test, False)
    tokens = 2 * size
    w1, w2 = _megatron_weights(mesh, mesh, 4 * E)
    x_dt = distribute_tensor(torch.randn(tokens, E), mesh, [Shard(0)]).requires_grad_()
    dy = torch.randn(tokens, E)
    fd = _mlp_fusion(tokens, 4 * E)
    out, = fd.as_autograd_function()([x_dt, w1, w2])
    with record_communications() as comms:
        out.backward(distribute_tensor(dy, mesh, out.placements))
    ref_x, ref_w1, ref_w2 = _leaves([x_dt, w1, w2])
    expected = F.linear(F.gelu(F.linear(ref_x, ref_w1), approximate="tanh"), ref_w2)
    expected.backward(distribute_tensor(dy, mesh, [Replicate()]))  # its output is Partial
    torch.testing.assert_close(out.full_tensor(), expected.full_tensor(), rtol=1e-5, atol=1e-5)
    assert x_dt.grad.placements == (Shard(0),)
    for got, ref in ((x_dt, ref_x), (w1, ref_w1), (w2, ref_w2)):
        torch.testing.assert_close(got.grad.full_tensor(), ref.grad.full_tensor(),
                                   rtol=1e-5, atol=1e-5)
    if size > 1:
        assert "reduce_scatter" in [c.kind for c in comms]


@pytest.mark.mpi
def test_dtensors_laid_out_otherwise_than_the_first_are_an_input_error(multidevice_test):
    mesh = _mesh(multidevice_test, False)
    w1, w2 = _megatron_weights(mesh, mesh, 4 * E)
    function = _mlp_fusion(4, 4 * E).as_autograd_function()
    x = torch.randn(4, E)
    function([distribute_tensor(x, mesh, [Replicate()]), w1, w2])
    other = distribute_tensor(w1.full_tensor().detach(), mesh, [Replicate()]).requires_grad_()
    if multidevice_test.size > 1:
        with pytest.raises(InputError, match="T1"):
            function([distribute_tensor(x, mesh, [Replicate()]), other, w2])
