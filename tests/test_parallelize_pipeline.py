"""``meshfuse.parallelize(model, mesh, plan, pipeline=PipelineSpec(...))``: a small model's
layers cut into two stages over the mesh's ``pp`` dimension (alone, or with a ``tp``
dimension over which each stage is tensor parallel by the plan) trains 3 AdamW steps with
the losses of the one-device model; the activations cross by sends to the same coordinate of
the other stage; bad specs are refused."""

from __future__ import annotations

import pytest
import torch

import meshfuse
from meshfuse import DeviceMesh, PipelineSpec
from meshfuse.capture.pipeline import default_pieces
from meshfuse.dtensor import mesh_to_torch
from meshfuse.errors import DefinitionError
from meshfuse.runtime.comm.collectives import record_communications

HIDDEN, FFN, LAYERS, BATCH, STEPS, M = 16, 32, 3, 8, 3, 4
PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, FFN)
        self.down = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(HIDDEN, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 5, HIDDEN, generator=g),
             torch.randn(BATCH, 5, 4, generator=g)) for _ in range(STEPS)]


def _loss(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _reference() -> list[float]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _data():
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _mesh(shape, names):
    return mesh_to_torch(DeviceMesh(torch.arange(torch.tensor(shape).prod()).reshape(shape)),
                         mesh_dim_names=names)


@pytest.mark.mpi
@pytest.mark.parametrize("split", [["layers.1"], [2]])  # by name, by piece index
def test_pipelined_parallelize_trains_like_one_device(multidevice_test, split):
    d, rank = multidevice_test.size, multidevice_test.rank
    if d not in (2, 4):
        pytest.skip("pp2 at 2 ranks, pp2 x tp2 at 4")
    shape, names = ((2,), ("pp",)) if d == 2 else ((2, 2), ("pp", "tp"))
    spec = PipelineSpec(split_points=split, loss_fn=_loss, schedule="1F1B", microbatches=M)
    pipe = meshfuse.parallelize(_model(), _mesh(shape, names), PLAN if d == 4 else {},
                                pipeline=spec)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    with record_communications() as comms:
        for x, y in _data():
            opt.zero_grad()
            losses.append(pipe.step(x, y))
            opt.step()
    width = d // 2
    mine = rank // width
    if mine == 1:
        for got, want in zip(losses, _reference()):
            assert abs(got.item() - want) <= 1e-5 * abs(want)
    else:
        assert losses == [None] * STEPS
    # activations forward, gradients back: to the same coordinate of the other stage only
    other = rank + width if mine == 0 else rank - width
    sends = [c for c in comms if c.kind == "send"]
    assert {c.peer for c in comms if c.kind in ("send", "recv")} == {other}
    activation = (BATCH // M) * 5 * HIDDEN * 4
    assert sum(c.bytes == activation for c in sends) == M * STEPS
    (stage,) = pipe.stages.values()
    if d == 4:  # each stage's blocks are tensor parallel over its row of the mesh
        up = stage.get_submodule(f"layers.{2 if mine else 0}.up").weight
        assert tuple(up.to_local().shape) == (FFN // 2, HIDDEN)
        inside = [c for c in comms if c.kind not in ("send", "recv")]
        assert inside and all(set(c.ranks) <= {mine * 2, mine * 2 + 1} for c in inside)


class Scaled(Net):
    """Parameters and a buffer of the model itself (not of a child): held by stage 0."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(HIDDEN))
        self.register_buffer("shift", torch.full((HIDDEN,), 0.5))

    def forward(self, x):
        return super().forward(x * self.scale + self.shift)


@pytest.mark.mpi
def test_the_models_own_parameters_go_to_the_first_stage(multidevice_test):
    if multidevice_test.size != 2:
        pytest.skip("pp2")
    torch.manual_seed(0)
    reference = Scaled()
    model = Scaled()
    model.load_state_dict(reference.state_dict())
    spec = PipelineSpec(split_points=["layers.1"], loss_fn=_loss, microbatches=M)
    pipe = meshfuse.parallelize(model, _mesh((2,), ("pp",)), {}, pipeline=spec)
    (stage,) = pipe.stages.values()
    names = [n for n, _ in stage.named_parameters()]
    assert ("scale" in names) == (multidevice_test.rank == 0)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pipe, reference)]
    for x, y in _data():
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = pipe.step(x, y)
        expected = _loss(reference(x), y)
        expected.backward()
        for optimizer in optimizers:
            optimizer.step()
        if multidevice_test.rank == 1:
            assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())


@pytest.mark.mpi
def test_pipeline_spec_errors(multidevice_test):
    if multidevice_test.size != 2:
        pytest.skip("two ranks")
    mesh = _mesh((2,), ("pp",))

    def build(split, mesh=mesh, plan=None):
        spec = PipelineSpec(split_points=split, loss_fn=_loss, microbatches=2)
        return meshfuse.parallelize(_model(), mesh, plan or {}, pipeline=spec)

    with pytest.raises(DefinitionError, match="no module named 'layers.9'"):
        build(["layers.9"])
    with pytest.raises(DefinitionError, match="size 2 runs 2"):
        build(["layers.0", "layers.1"])  # three stages on two pipeline ranks
    with pytest.raises(DefinitionError, match="increasing"):
        build([7])  # past the last of the 5 pieces
    with pytest.raises(DefinitionError, match="dimension named 'pp'"):
        build(["layers.1"], mesh=_mesh((2,), ("tp",)))
    with pytest.raises(DefinitionError, match="only 'pp'"):
        build(["layers.1"], plan=PLAN)
    with pytest.raises(DefinitionError, match="match no module"):
        build(["layers.1"], mesh=_mesh((1, 2), ("pp", "tp")), plan={"nothing.*": "colwise"})


def test_default_pieces():
    assert default_pieces(_model()) == ["inp", "layers.0", "layers.1", "layers.2", "head"]
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    assert default_pieces(seq) == ["0", "1"]
