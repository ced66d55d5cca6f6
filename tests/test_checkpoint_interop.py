"""meshfuse checkpoints and torchtitan-style DTensor models of the same architecture: the MLP
stack trained by meshfuse (tests/checkpoint_layouts.py) saved under PyTorch's names
(``layers.0.fc1.weight``, through ``checkpoint_names``), loaded by ``dcp.load`` into
``TorchStack`` laid out as torchtitan lays out a model (``fully_shard`` per block and at the
root; ``parallelize_module`` with column/row parallel linears; at 4 ranks both, FSDP over
``dp`` and TP over ``tp``); the values equal the saved ones and the loss of the next batch
equals meshfuse's (but at 3 ranks under TP: DTensor's matmul refuses the uneven split of
the 10 hidden units). The other way round: the torch model trained a step, ``dcp.save``'d and
loaded by ``meshfuse.checkpoint.load`` into a meshfuse model of other values: every shard
equals the torch model's weights."""

from __future__ import annotations

import tempfile

import pytest
import torch
from checkpoint_layouts import FFN, LR, TorchNamed, TorchStack, batch, build, torch_name
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshfuse import checkpoint
from meshfuse.sharding import shard_tensor

pytestmark = pytest.mark.mpi

FIRST = {1: "one", 2: "tp", 3: "fsdp", 4: "dp2tp2"}  # the meshfuse layout that saves


def _shared_dir(test) -> str:
    path = tempfile.mkdtemp(prefix="meshfuse-ckpt-") if test.rank == 0 else None
    return test.communicator.allgather_object(path)[0]


def _torch_model(layout: str, world: int) -> TorchStack:
    """``TorchStack`` of values other than the checkpoint's, laid out as torchtitan does."""
    torch.manual_seed(7)
    model = TorchStack()
    if layout == "fsdp+tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
    else:
        dp = tp = init_device_mesh("cpu", (world,))
    for block in model.layers:
        if layout in ("tp", "fsdp+tp"):
            parallelize_module(block, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if layout in ("fsdp", "fsdp+tp"):
            fully_shard(block, mesh=dp)
    if layout in ("fsdp", "fsdp+tp"):
        fully_shard(model, mesh=dp)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _meshfuse_weights(model) -> dict[str, torch.Tensor]:
    """The global weights of a meshfuse model, by torch name (read back through a checkpoint
    into the one-device layout)."""
    return {torch_name(n): p.detach() for n, p in model.inner.named_parameters()}


@pytest.mark.parametrize("layout", ["fsdp", "tp", "fsdp+tp"])
def test_meshfuse_and_torchtitan_style_modules_load_each_others_checkpoints(
        multidevice_test, layout):
    world = multidevice_test.size
    if world == 1 or (layout == "fsdp+tp") != (world == 4):
        pytest.skip("fsdp and tp at 2 and 3 ranks (uneven at 3), fsdp+tp (2-D) at 4")
    model, opt, step = build(FIRST[world], world)
    model = TorchNamed(model)
    step(0)
    path = _shared_dir(multidevice_test)
    checkpoint.save(path, model, opt, extra={"step": 1})
    whole = TorchNamed(build("one", world)[0])
    checkpoint.load(path, whole)
    saved = _meshfuse_weights(whole)
    expected_loss = step(1)  # the loss at the saved weights (then a step)

    tmodel = _torch_model(layout, world)
    dcp_load(tmodel.state_dict(), checkpoint_id=path)
    assert {n for n, _ in tmodel.named_parameters()} == set(saved)
    for name, p in tmodel.named_parameters():
        assert torch.equal(_full(p), saved[name]), name
    if layout == "tp" and FFN % world:  # DTensor's matmul refuses uneven column shards
        with torch.no_grad():
            for p in tmodel.parameters():
                p.mul_(2.0)  # weights the checkpoint never held
    else:
        topt = torch.optim.AdamW(tmodel.parameters(), lr=LR)
        loss = tmodel(*batch(1))
        torch.testing.assert_close(loss.item(), expected_loss, rtol=1e-6, atol=0)
        loss.backward()
        topt.step()  # weights the checkpoint never held

    back = _shared_dir(multidevice_test)
    dcp_save(tmodel.state_dict(), checkpoint_id=back)
    trained = {n: _full(p).clone() for n, p in tmodel.named_parameters()}
    for kind in {FIRST[world], "fsdp"}:
        other = TorchNamed(build(kind, world)[0])
        checkpoint.load(path, other)  # not the torch model's values
        checkpoint.load(back, other)
        for name, tv in other.inner.parameter_tensors().items():
            expected = shard_tensor(trained[torch_name(name)], tv)
            assert torch.equal(getattr(other.inner, name).detach(), expected), (kind, name)
