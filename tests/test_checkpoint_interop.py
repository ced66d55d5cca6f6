"""meshfuse checkpoints and torchtitan-style DTensor models of the same architecture: the MLP
stack trained by meshfuse (tests/checkpoint_layouts.py) saved under PyTorch's names
(``layers.0.fc1.weight``, through ``checkpoint_names``), loaded by ``dcp.load`` into
``TorchStack`` laid out as torchtitan lays out a model (``fully_shard`` per block and at the
root; ``parallelize_module`` with column/row parallel linears; at 4 ranks both, FSDP over
``dp`` and TP over ``tp``); the values equal the saved ones and the loss of the next batch
equals meshfuse's (but at 3 ranks under TP: DTensor's matmul refuses the uneven split of
the 10 hidden units). The other way round: the torch model trained a step, ``dcp.save``'d and
loaded by ``meshfuse.checkpoint.load`` into a meshfuse model of other values: every shard
equals the torch model's weights.

The AdamW state moves too: meshfuse names it as ``get_optimizer_state_dict`` does under the
key ``optimizer`` (``optimizer.state.NAME.exp_avg``, ``optimizer.param_groups`` with the
parameters' names), so the torch model continues meshfuse's training (the next two losses
equal, the learning rate read from the file) and meshfuse loads the torch optimizer's."""

from __future__ import annotations

import tempfile

import pytest
import torch
from checkpoint_layouts import FFN, LR, TorchNamed, TorchStack, batch, build, torch_name
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
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


def _weights(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's global weight and AdamW state, by torch name."""
    inner = getattr(model, "inner", None)
    named = {torch_name(n): p for n, p in inner.named_parameters()} if inner is not None \
        else dict(model.named_parameters())
    return {n: {"weight": _full(p).clone(),
                **{k: _full(v).clone() for k, v in opt.state[p].items()}}
            for n, p in named.items()}


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
    whole, whole_opt, _ = build("one", world)
    whole = TorchNamed(whole)
    checkpoint.load(path, whole, whole_opt)
    saved = _weights(whole, whole_opt)
    expected = [step(1), step(2)]  # the losses at the saved weights and one step later

    tmodel = _torch_model(layout, world)
    topt = torch.optim.AdamW(tmodel.parameters(), lr=2 * LR)  # the lr comes from the file
    state = {"optimizer": get_optimizer_state_dict(tmodel, topt), **tmodel.state_dict()}
    dcp_load(state, checkpoint_id=path)
    set_optimizer_state_dict(tmodel, topt, state["optimizer"])
    loaded = _weights(tmodel, topt)
    assert loaded.keys() == saved.keys()
    for name, values in loaded.items():
        assert values.keys() == saved[name].keys(), name
        assert all(torch.equal(v, saved[name][k]) for k, v in values.items()), name
    if layout == "tp" and FFN % world:  # DTensor's matmul refuses uneven column shards
        with torch.no_grad():
            for p in tmodel.parameters():
                p.mul_(2.0)  # weights the checkpoint never held
    else:  # the same steps as meshfuse's: the optimizer state and lr came along
        losses = []
        for i in (1, 2):
            topt.zero_grad()
            loss = tmodel(*batch(i))
            loss.backward()
            topt.step()
            losses.append(loss.item())
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)

    back = _shared_dir(multidevice_test)
    dcp_save({"optimizer": get_optimizer_state_dict(tmodel, topt), **tmodel.state_dict()},
             checkpoint_id=back)
    trained = _weights(tmodel, topt)
    for kind in {FIRST[world], "fsdp"}:
        other, other_opt, other_step = build(kind, world)
        other = TorchNamed(other)
        other_step(0)
        checkpoint.load(path, other, other_opt)  # not the torch model's values
        checkpoint.load(back, other, other_opt)
        for name, tv in other.inner.parameter_tensors().items():
            p, values = getattr(other.inner, name), trained[torch_name(name)]
            assert torch.equal(p.detach(), shard_tensor(values["weight"], tv)), (kind, name)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(other_opt.state[p][key], shard_tensor(values[key], tv))
            assert torch.equal(other_opt.state[p]["step"], values["step"])
