"""Host time of cached calls in ``explain(inputs)`` (``runtime/interpreter/host_time.py``):
counted by path (interpreted, replayed), the first call of a signature not counted, the
interpreted path timed step by step on its first cached calls."""

from __future__ import annotations

import pytest
import torch
from test_autograd_replay import fake_cuda  # noqa: F401 - a fixture

from meshfuse import DataType, FusionDefinition, FusionModule
from meshfuse.runtime.interpreter.host_time import TIMED_CALLS, _breakdown


def _chain():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 8], dtype=DataType.Float)
        fd.add_output(fd.ops.mul(fd.ops.exp(x), fd.ops.neg(x)))
    return fd


def _host(fd):
    (log,) = fd._get_runner()._host.values()
    return log


def test_interpreted_calls_are_counted_and_timed_step_by_step():
    fd = _chain()
    x = torch.randn(8, 8)
    assert "host time" not in fd.explain([x])
    fd.execute([x])  # the first call: building, not counted
    assert _host(fd).interpreted.calls == 0 and "host time" not in fd.explain([x])
    for _ in range(TIMED_CALLS + 2):
        torch.testing.assert_close(fd.execute([x])[0], torch.exp(x) * -x)
    log = _host(fd)
    assert log.interpreted.calls == TIMED_CALLS + 2 and log.timed_left == 0
    assert log.breakdown.launches == 3 and log.breakdown.total > 0
    assert 0 < log.interpreted.least <= log.interpreted.last
    text = fd.explain([x])
    assert "host time per cached call (this rank, measured):" in text
    assert "interpreted, step by step:" in text and "between its 3 launches" in text
    assert "replayed" not in text.split("host time")[1]


def test_replayed_calls_are_counted_apart(fake_cuda):  # noqa: F811
    fd = _chain()
    x = torch.randn(8, 8)
    for _ in range(5):  # built and its addresses seen; captured (not counted); replayed
        fd.execute([x])
    log = _host(fd)
    assert log.replayed.calls == 3 and log.interpreted.calls == 0
    held = [fd.execute([x])]  # replayed: the graph is busy while the caller holds it
    held.append(fd.execute([x]))  # the second graph captured
    fd.execute([x])  # both busy: the interpreter, counted as such
    assert log.replayed.calls == 4 and log.interpreted.calls == 1
    assert log.breakdown is not None  # and timed step by step
    assert "replayed: " in fd.explain([x]) and "(one graph launch)" in fd.explain([x])


def test_the_breakdown_splits_a_call():
    # entry 0; launches [10, 15] and [18, 30]; return 34
    found = _breakdown(0, [10, 15, 18, 30], 34)
    assert (found.before_first, found.between, found.in_launches, found.after_last,
            found.launches) == (10, 3, 17, 4, 2)
    assert found.total == 34


def _layer():
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 4], dtype=DataType.Float)
        w = fd.define_tensor([4, 4], dtype=DataType.Float)
        fd.add_output(fd.ops.tanh(fd.ops.linear(x, w)))
    return fd, w


@pytest.mark.parametrize("replayed", [False, True])
def test_the_autograd_path_explains_both_programs_and_the_node(request, replayed):
    """``FusionModule.explain(x)`` (``FusionFunction.explain``): the forward's explain, the
    derived backward's per signature it ran, and the autograd node's host time."""
    if replayed:
        request.getfixturevalue("fake_cuda")
    fd, w = _layer()
    layer = FusionModule(fd, {"w": (w, torch.randn(4, 4))})
    x = torch.randn(6, 4)
    text = layer.explain(x)
    saved = "derived backward:\n  saved for the backward (remat='recompute_fused'): "
    assert saved in text and "\n  not run yet" in text and "autograd node" not in text
    for _ in range(5):
        layer(x).sum().backward()
    w_ref = layer.w.detach().clone().requires_grad_()
    torch.tanh(x @ w_ref.T).sum().backward()
    torch.testing.assert_close(layer.w.grad, 5 * w_ref.grad)
    text = layer.explain(x)
    forward, backward = text.split("derived backward:\n")
    path = "replayed: " if replayed else "interpreted: "
    for part in (forward, backward):
        assert "host time per cached call (this rank, measured):" in part and path in part
    assert backward.split("\n", 1)[1].startswith("  signature 0:\n")
    node = text.split("host time per autograd node call (this rank, measured, its program "
                      "included):\n")[1].splitlines()
    assert node[0].startswith("  forward: ") and node[0].endswith("(over 5 calls)")
    assert node[1].startswith("  backward: ") and node[1].endswith("(over 5 calls)")
