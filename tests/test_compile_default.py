"""Fusion by default on CUDA (``MESHFUSE_COMPILE`` unset: ``auto``), and compile time
amortized: identical segments of different programs share one compiled artifact
(``meshfuse.runtime.interpreter.segment_cache``), and cached training steps compile nothing.

Compiled with ``aot_eager`` (the same lowering as Inductor, without its C++ build)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from meshfuse import DataType, FusionDefinition, FusionModule
from meshfuse.engine.runner import FusionRunner
from meshfuse.engine.settings import AUTO, backend_for, compile_setting
from meshfuse.runtime.interpreter.segment_cache import SHARED, _value_key

BACKEND = "aot_eager"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test counts its own compilations (other tests compile the same segments)."""
    SHARED.clear()


def _block(rows=6, width=8):
    """A norm-like chain, a linear, a tanh: two segments around a matmul."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([rows, width], dtype=DataType.Float)
        w = fd.define_tensor([width, width], dtype=DataType.Float)
        h = fd.ops.mul(fd.ops.exp(fd.ops.mul(x, 0.5)), 2.0)
        fd.add_output(fd.ops.add(fd.ops.tanh(fd.ops.linear(h, w)), x))
    return fd


def _reference(x, w):
    return torch.tanh(torch.nn.functional.linear(torch.exp(x * 0.5) * 2.0, w)) + x


def _stats(fd):
    return [stats for _, stats in fd._get_runner()._fused.values()]


def test_the_default_fuses_on_cuda_and_interprets_on_the_cpu(monkeypatch):
    monkeypatch.delenv("MESHFUSE_COMPILE", raising=False)
    fd = _block()
    fd.define()
    assert FusionRunner(fd.fusion).compile == AUTO
    assert backend_for(AUTO, CUDA) == "inductor" and backend_for(AUTO, CPU) is None
    assert backend_for(None, CUDA) is None and backend_for(BACKEND, CPU) == BACKEND
    monkeypatch.setenv("MESHFUSE_COMPILE", "0")
    assert FusionRunner(fd.fusion).compile is None and compile_setting("auto") == AUTO
    monkeypatch.delenv("MESHFUSE_COMPILE")
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    torch.testing.assert_close(fd.execute([x, w])[0], _reference(x, w))
    assert not fd._get_runner()._fused  # CPU: the interpreter, unless asked


def test_identical_segments_of_two_fusions_share_one_compilation():
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    first, second, other = _block(), _block(), _block(rows=4)
    for fd, rows in ((first, 6), (second, 6), (other, 4)):
        got = fd.execute([x[:rows].contiguous(), w], compile=BACKEND)[0]
        torch.testing.assert_close(got, _reference(x[:rows], w))
    (a,), (b,), (c,) = _stats(first), _stats(second), _stats(other)
    assert a.compiles == b.compiles == c.compiles == 2
    assert b.reused == 2  # the same graphs on the same shapes: compiled once
    assert c.reused == 0  # other shapes: their own code
    assert "2 reused from identical segments" in second.explain([x, w])


def test_the_cache_key_tells_values_apart():
    assert len({_value_key(v, {}) for v in (1, 1.0, True, -0.0, 0.0, "1")}) == 6
    assert _value_key([1, 2], {}) != _value_key((1, 2), {})
    assert SHARED.key(_Opaque.graph(), [], BACKEND, {}) is None


class _Opaque:
    """A graph holding an object with no faithful key: never shared."""

    @staticmethod
    def graph():
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_function(torch.add, (x, object())))
        return SimpleNamespace(graph=graph)  # what the key reads of a GraphModule


def _compile_counters() -> dict:
    return {name: dict(counter) for name, counter in counters.items()}


@pytest.mark.parametrize("layers", [2])
def test_cached_training_steps_never_recompile(monkeypatch, layers):
    """Two identical layers (FusionModules, compile forced on): the second layer's segments
    reuse the first's, and from the second step on nothing compiles (meshfuse's counts and
    torch's counters alike)."""
    monkeypatch.setenv("MESHFUSE_COMPILE", BACKEND)
    stack = []
    for seed in range(layers):
        fd = _block()
        fd.define()
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)) / 3
        stack.append(FusionModule(fd, {"w": (fd.fusion.inputs()[1], w)}))
    reference = [layer.w.detach().clone().requires_grad_() for layer in stack]
    x = torch.randn(6, 8).requires_grad_()  # so that both layers derive the same backward
    before = after_first = None
    for step in range(4):
        y, want = x, x
        for layer, w in zip(stack, reference):
            y, want = layer(y), _reference(want, w)
        torch.testing.assert_close(y, want)
        y.pow(2).sum().backward()
        want.pow(2).sum().backward()
        if step == 0:
            before = _compile_counters()
        if step == 1:
            after_first = (_compile_counters(), _all_stats(stack))
    assert after_first == (_compile_counters(), _all_stats(stack))
    assert before == after_first[0]  # the second step compiled nothing either
    for layer, w in zip(stack, reference):
        torch.testing.assert_close(layer.w.grad, w.grad)
    # each program's segments compiled by the layer that ran it first (the second
    # layer's backward runs before the first's), reused by the other
    first, second = (_all_stats([layer]) for layer in stack)
    assert len(first) == len(second) == 2  # a forward and a backward each
    for (c1, r1), (c2, r2) in zip(first, second):
        assert c1 == c2 > 0 and sorted([r1, r2]) == [0, c1]


def _all_stats(layers) -> list[tuple[int, int]]:
    """(compiles, reused) of every fused program of the layers' forward and backward."""
    found = []
    for layer in layers:
        for compiled in layer._function._derivations.values():
            runners = [compiled.derivation.forward_runner, compiled._backward]
            for runner in runners:
                found += [(s.compiles, s.reused) for _, s in runner._fused.values()]
    return found
