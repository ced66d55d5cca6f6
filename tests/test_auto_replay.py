"""Automatic CUDA-graph replay (``meshfuse.runtime.replay``, ``execute(cuda_graph="auto")``).

The policy runs on CPU with a stand-in for the CUDA graph that re-runs the program into the
captured outputs, reading the inputs where they were at capture (as a graph does): the first
call of a signature runs the interpreter, later calls with inputs at the same addresses
replay, new addresses are captured up to a limit, a caller still holding an earlier result
(or a view of it) gets the interpreter, and programs that draw random numbers or
communicate are never replayed. On a CUDA device the real graphs are checked against the
interpreter.
"""

from __future__ import annotations

import pytest
import torch

from meshfuse import DataType, FusionDefinition, InputError
from meshfuse.runtime.executor import RESHARD, Step
from meshfuse.runtime.replay import MAX_GRAPHS, AutoReplay, _local, why_not_replayed
from meshfuse.runtime.runner import cuda_graph_setting


class FakeGraph:
    """Replays ``program`` on the captured input tensors into the captured outputs."""

    replays = 0

    def __init__(self, program, inputs, outputs):
        self.program, self.inputs, self.outputs = program, list(inputs), outputs

    def replay(self):
        FakeGraph.replays += 1
        for out, new in zip(self.outputs, self.program.run(self.inputs)):
            out.copy_(new)


def fake_capture(program, inputs):
    outputs = [t.clone() for t in program.run(inputs)]
    return FakeGraph(program, inputs, outputs), outputs, []


def _program(fd, inputs):
    fd.execute(inputs, cuda_graph=False)
    runner = fd._get_runner()
    (program,) = runner._programs.values()
    return program


def _chain():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 8], dtype=DataType.Float)
        y = fd.define_tensor([8, 8], dtype=DataType.Float)
        fd.add_output(fd.ops.mul(fd.ops.exp(x), y))
        fd.add_output(fd.ops.sum(x, [1]))
    return fd


def _expected(x, y):
    return [torch.exp(x) * y, x.sum(1)]


def _assert_outputs(got, x, y):
    for g, e in zip(got, _expected(x, y)):
        torch.testing.assert_close(g, e)


def test_first_call_interprets_then_replays_at_the_same_addresses():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    fd = _chain()
    replay = AutoReplay(_program(fd, [x, y]), fake_capture)
    assert replay.run([x, y]) is None  # the signature's first call: the interpreter
    before = FakeGraph.replays
    _assert_outputs(replay.run([x, y]), x, y)  # captured, replayed
    x.mul_(2)  # new values at the same address: the graph reads them
    _assert_outputs(replay.run([x, y]), x, y)
    assert FakeGraph.replays == before + 2 and replay.graphs == 1
    assert "1 graphs captured" in replay.describe()


def test_an_earlier_result_still_held_is_never_overwritten():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    replay = AutoReplay(_program(_chain(), [x, y]), fake_capture)
    replay.run([x, y])
    first = replay.run([x, y])
    kept = first[0].clone()
    x.add_(1)
    assert replay.run([x, y]) is None  # `first` is alive: the interpreter runs
    assert torch.equal(first[0], kept)
    view = first[1][:2]
    del first
    assert replay.run([x, y]) is None  # a view of it is alive too
    del view
    _assert_outputs(replay.run([x, y]), x, y)


def test_new_addresses_are_captured_up_to_the_limit():
    fd = _chain()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    replay = AutoReplay(_program(fd, [x, y]), fake_capture)
    replay.run([x, y])
    pairs = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(MAX_GRAPHS + 1)]
    for i, (a, b) in enumerate(pairs):
        got = replay.run([a, b])
        if i < MAX_GRAPHS:
            _assert_outputs(got, a, b)
        else:
            assert got is None  # beyond the limit: the interpreter
    assert replay.graphs == MAX_GRAPHS


def test_a_failed_capture_leaves_the_program_to_the_interpreter():
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def failing(program, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    replay = AutoReplay(_program(_chain(), [x, y]), failing)
    assert replay.run([x, y]) is None and replay.run([x, y]) is None
    assert "no capture: RuntimeError" in replay.describe()


def test_programs_that_draw_random_numbers_are_not_replayed():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 8], dtype=DataType.Float)
        fd.add_output(fd.ops.add(x, fd.ops.rand_like(x)))
    x = torch.randn(8, 8)
    reason = why_not_replayed(_program(fd, [x]))
    assert reason is not None and "random" in reason


def test_only_registry_implementations_and_segments_count_as_local():
    step = Step("exp", (), {}, (0,), (), "T1 = exp(T0)")
    assert _local(step, torch.exp) is False  # not the registry's implementation
    from meshfuse.ops.registry import lookup
    assert _local(step, lookup("exp").impl)
    assert not _local(Step(RESHARD, (), {}, (0,), (), "allgather"), torch.clone)


def test_cpu_programs_are_interpreted_and_explain_says_why():
    fd = _chain()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for _ in range(3):
        _assert_outputs(fd.execute([x, y], cuda_graph="auto"), x, y)
    assert "CUDA graph replay: off (no capture: ValueError: an input is not a CUDA tensor)" \
        in fd.explain([x, y])


def test_bad_options_are_named():
    fd = _chain()
    x = torch.randn(8, 8)
    with pytest.raises(InputError, match="cuda_graph='always'"):
        fd.execute([x, x], cuda_graph="always")
    assert cuda_graph_setting(None) is None and cuda_graph_setting("auto") == "auto"
    assert cuda_graph_setting("0") is False
    with pytest.raises(InputError, match="MESHFUSE_CUDA_GRAPH='yes'"):
        cuda_graph_setting("yes")


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("compile", [False, "inductor"])
def test_cuda_replay_equals_the_interpreter(compile):
    fd = _chain()
    x, y = (torch.randn(8, 8, device="cuda") for _ in range(2))
    results = []
    for step in range(4):
        x.add_(step)
        got = fd.execute([x, y], cuda_graph="auto", compile=compile)
        _assert_outputs(got, x, y)
        results.append((got, [t.clone() for t in got]))
    for got, copy in results:  # held results were never overwritten
        assert all(torch.equal(a, b) for a, b in zip(got, copy))
    del results
    for _ in range(2):
        _assert_outputs(fd.execute([x, y], cuda_graph="auto", compile=compile), x, y)
    line = next(s for s in fd.explain([x, y]).splitlines() if "CUDA graph replay" in s)
    assert "1 graphs captured" in line, line

