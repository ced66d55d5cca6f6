"""``meshfuse.capture_step``: a whole training step (forward, backward, optimizer) replayed
from one CUDA graph per signature.

On the CPU, with a stand-in whose capture runs the step and whose replay runs it again on
the graph's argument buffers, copying its results into the captured ones (as a graph
rewrites its outputs): the warm-up calls, the capture, the replays and the signatures are
checked against plain eager training of the same model, the arguments copied in, the
results copied out, and meshfuse's automatic replay paused inside."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from test_autograd_replay import fake_cuda  # noqa: F401 - a fixture
from torch.utils._pytree import tree_flatten

import meshfuse
from meshfuse import DataType, FusionDefinition, FusionModule, InputError
from meshfuse.runtime.replay.automatic import paused
from meshfuse.runtime.replay.step import capture_step

T, H, FFN = 6, 4, 8


class _FakeStep:
    def __init__(self, fn, result):
        self.fn, self.outputs = fn, tree_flatten(result)[0]
        self.replays = 0

    def replay(self):
        self.replays += 1
        with paused():  # a graph's replay runs its kernels, no Python of the programs
            results = tree_flatten(self.fn())[0]
        for out, new in zip(self.outputs, results):
            if isinstance(out, torch.Tensor):
                out.copy_(new)


class FakeStepGraphs:
    capture_runs = True
    captured: ClassVar[list] = []

    @staticmethod
    def warm_up(fn):
        return fn()

    @classmethod
    def capture(cls, fn):
        result = fn()
        graph = _FakeStep(fn, result)
        cls.captured.append(graph)
        return graph, result


def _mlp():
    with FusionDefinition() as fd:
        x = fd.define_tensor([T, H], dtype=DataType.Double)
        w1 = fd.define_tensor([FFN, H], dtype=DataType.Double)
        w2 = fd.define_tensor([H, FFN], dtype=DataType.Double)
        fd.add_output(fd.ops.linear(fd.ops.tanh(fd.ops.linear(x, w1)), w2))
    return fd, (w1, w2)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _trainer(layer_or_params, forward):
    opt = torch.optim.AdamW(layer_or_params, lr=0.05)

    def train_step(x, target):
        opt.zero_grad()
        loss = F.mse_loss(forward(x), target)
        loss.backward()
        opt.step()
        return {"loss": loss.detach(), "first": x[0].clone()}

    return train_step


def test_a_captured_training_step_trains_as_eager(fake_cuda):  # noqa: F811
    fd, (w1, w2) = _mlp()
    init = {"w1": _randn(FFN, H, seed=2), "w2": _randn(H, FFN, seed=3)}
    layer = FusionModule(fd, {"w1": (w1, init["w1"]), "w2": (w2, init["w2"])})
    ref = {k: v.clone().requires_grad_() for k, v in init.items()}
    step = capture_step(_trainer(layer.parameters(), layer), warmup=2, cuda=FakeStepGraphs)
    eager = _trainer(ref.values(),
                     lambda x: F.linear(torch.tanh(F.linear(x, ref["w1"])), ref["w2"]))
    FakeStepGraphs.captured.clear()
    held = []
    for i in range(7):
        x, target = _randn(T, H, seed=10 + i), _randn(T, H, seed=20 + i)  # new tensors
        got, want = step(x, target), eager(x, target)
        torch.testing.assert_close(got["loss"], want["loss"])
        torch.testing.assert_close(got["first"], x[0])  # the arguments were copied in
        held.append((got["loss"], want["loss"]))
        assert step.graphs == (1 if i >= 2 else 0)
    for got, want in held:  # results copied out: never rewritten by later steps
        torch.testing.assert_close(got, want)
    (graph,) = FakeStepGraphs.captured
    assert graph.replays == 4  # calls 4 to 7; call 3 captured (and, here, ran)
    for name in init:
        torch.testing.assert_close(getattr(layer, name).detach(), ref[name].detach())
    # meshfuse's own programs ran the interpreter throughout: no graphs of theirs
    (compiled,) = layer._function._derivations.values()
    for runner in (compiled.derivation.forward_runner, compiled._backward):
        assert all(r.graphs == 0 for r in runner._replays.values())


def test_each_signature_gets_its_own_graph_up_to_the_limit():
    calls = []

    def step_fn(x, scale):
        calls.append(x.shape)
        return x * scale

    step = capture_step(step_fn, warmup=1, max_graphs=2, cuda=FakeStepGraphs)
    for rows in (2, 3, 4):
        for _ in range(3):
            x = torch.randn(rows, 2)
            torch.testing.assert_close(step(x, 2.0), x * 2.0)
    assert step.graphs == 2  # the third shape runs the step as it is
    x = torch.randn(2, 2)
    torch.testing.assert_close(step(x, 3.0), x * 3.0)  # a new value: a new signature
    assert step.graphs == 2


def test_results_can_be_the_graphs_own():
    step = capture_step(lambda x: x + 1, warmup=1, copy_outputs=False, cuda=FakeStepGraphs)
    step(torch.zeros(2))
    first = step(torch.zeros(2))  # captured
    second = step(torch.ones(2))  # replayed: the graph's tensor, rewritten
    assert first.data_ptr() == second.data_ptr()
    torch.testing.assert_close(first, torch.full((2,), 2.0))


def test_errors_say_what_to_do():
    with pytest.raises(InputError, match="warmup >= 1"):
        capture_step(lambda x: x, warmup=0)
    step = meshfuse.capture_step(lambda x: x)
    with pytest.raises(InputError, match="argument 0 is on cpu.*CUDA tensors"):
        step(torch.zeros(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_captured_step_trains_as_eager():
    fd, (w1, w2) = _mlp()
    init = {"w1": _randn(FFN, H, seed=2).cuda(), "w2": _randn(H, FFN, seed=3).cuda()}
    layer = FusionModule(fd, {"w1": (w1, init["w1"]), "w2": (w2, init["w2"])})
    ref = {k: v.clone().requires_grad_() for k, v in init.items()}
    opt = torch.optim.AdamW(layer.parameters(), lr=0.05, capturable=True)
    ref_opt = torch.optim.AdamW(ref.values(), lr=0.05)

    def train_step(x, target):
        opt.zero_grad()
        loss = F.mse_loss(layer(x), target)
        loss.backward()
        opt.step()
        return loss.detach()

    def eager(x, target):
        ref_opt.zero_grad()
        loss = F.mse_loss(F.linear(torch.tanh(F.linear(x, ref["w1"])), ref["w2"]), target)
        loss.backward()
        ref_opt.step()
        return loss.detach()

    step = meshfuse.capture_step(train_step, warmup=2)
    for i in range(6):
        x, target = _randn(T, H, seed=10 + i).cuda(), _randn(T, H, seed=20 + i).cuda()
        # Inductor's fused segments (on by default on CUDA) and capturable AdamW round float32
        # in another order than the eager reference: the project's float32 bound, not 1e-7.
        torch.testing.assert_close(step(x, target), eager(x, target), rtol=1e-5, atol=1e-5)
    assert step.graphs == 1
    for name in init:
        torch.testing.assert_close(
            getattr(layer, name).detach(), ref[name].detach(), rtol=1e-5, atol=1e-5
        )
