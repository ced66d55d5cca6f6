"""Automatic CUDA-graph replay (``meshfuse.runtime.replay.automatic``): ``execute``'s default on
CUDA.

The policy runs on CPU with a stand-in for the CUDA graph that re-runs the program into the
captured outputs, reading the inputs where they were at capture (as a graph does): the first
call of a signature runs the interpreter, later calls with inputs at the same addresses
replay, new addresses are captured up to a limit, a caller still holding an earlier result
(or a view of it) gets a second graph and then the interpreter, and programs that draw
random numbers on the host, communicate or run on the CPU are never replayed. On a CUDA
device the real graphs are checked against the interpreter: plain ``execute`` of the seed attention, a
dropout attention (replayed, each call with a new mask), an autograd function, new
shapes and scalar values, and the opt-outs.
"""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch
from test_cuda_graph import _RowParallelLinear

from meshfuse import (
    DataType,
    DeviceMesh,
    FusionDefinition,
    InputError,
    ParallelType,
    shard_tensor,
)
from meshfuse.engine.settings import cuda_graph_setting
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention, random_inputs
from meshfuse.runtime.interpreter.executor import RESHARD, Step
from meshfuse.runtime.replay import automatic, graphs, pools
from meshfuse.runtime.replay.automatic import (
    BUFFERS,
    MAX_GRAPHS,
    AutoReplay,
    GraphBudget,
    _local,
    replay_lines,
    replay_wanted,
    why_not_replayed,
)
from meshfuse.testing.utils import current_device

CUDA = torch.device("cuda")  # what the decision is told; the stand-in graph runs on the CPU


class FakeGraph:
    """Replays ``program`` on the captured input tensors into the captured outputs."""

    replays = 0

    def __init__(self, program, inputs, outputs):
        self.program, self.inputs, self.outputs = program, list(inputs), outputs

    def replay(self):
        FakeGraph.replays += 1
        for out, new in zip(self.outputs, self.program.run(self.inputs)):
            if out.data_ptr() != new.data_ptr():  # an output that is an input stays itself
                out.copy_(new)


def fake_capture(program, inputs, generators=(), pool=None):
    outputs = program.run(inputs)
    return FakeGraph(program, inputs, outputs), outputs, 1024, ()


class FakeCuda:
    """CUDA graphs on the CPU: the stand-in graph above; ``capturing``: set by a test."""

    capture = staticmethod(fake_capture)
    capturing_now = False

    @classmethod
    def capturing(cls):
        return cls.capturing_now


def _program(fd, inputs):
    fd.execute(inputs, cuda_graph=False)
    runner = fd._get_runner()
    (program,) = runner._programs.values()
    return program


def _replay(fd, inputs, budget=None):
    return AutoReplay(_program(fd, inputs), CUDA, budget, FakeCuda)


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
    replay = _replay(_chain(), [x, y])
    assert replay.run([x, y]) is None  # the signature's first call: the interpreter
    before = FakeGraph.replays
    _assert_outputs(replay.run([x, y]), x, y)  # captured, replayed
    x.mul_(2)  # new values at the same address: the graph reads them
    _assert_outputs(replay.run([x, y]), x, y)
    assert FakeGraph.replays == before + 2 and replay.graphs == 1
    assert "1 graphs captured for 1 sets of input addresses" in replay.describe()
    assert "holding 0.0 MiB" in replay.describe()


def test_an_earlier_result_still_held_is_never_overwritten():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    replay = _replay(_chain(), [x, y])
    replay.run([x, y])
    first = replay.run([x, y])
    kept = first[0].clone()
    x.add_(1)
    second = replay.run([x, y])  # `first` is alive: a second graph, its own memory
    assert second is not None and replay.graphs == BUFFERS
    assert second[0].data_ptr() != first[0].data_ptr()
    _assert_outputs(second, x, y)
    assert replay.run([x, y]) is None  # both held: the interpreter
    assert torch.equal(first[0], kept)
    view = first[1][:2]
    del first
    assert replay.run([x, y]) is None  # a view of it is alive too
    del view
    _assert_outputs(replay.run([x, y]), x, y)
    assert replay.graphs == BUFFERS


def test_a_loop_holding_the_previous_result_replays_every_call():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    replay = _replay(_chain(), [x, y])
    out = replay.run([x, y])  # the first call (the interpreter's)
    for step in range(6):
        x.add_(step)
        previous = out
        out = replay.run([x, y])  # while `out` still holds the previous result
        assert out is not None
        _assert_outputs(out, x, y)
        if previous is not None:
            assert out[0].data_ptr() != previous[0].data_ptr()
    assert replay.graphs == BUFFERS


def test_a_graph_waits_for_later_graphs_whose_outputs_lie_in_its_memory(monkeypatch):
    """Graphs share a memory pool: a graph captured later may put its outputs where an
    earlier one keeps its intermediates. The earlier graph then replays only while nothing
    holds those outputs (else a second graph, then the interpreter)."""
    monkeypatch.setattr(pools, "_POOLS", {})
    monkeypatch.setenv("MESHFUSE_SHARED_GRAPH_POOLS", "1")  # the default

    def everywhere(program, inputs, generators=(), pool=None):  # writes all memory
        return (*fake_capture(program, inputs)[:3], [(0, 2**63)])

    class Overlapping(FakeCuda):
        capture = staticmethod(everywhere)

    x, y = torch.randn(8, 8), torch.randn(8, 8)
    first = AutoReplay(_program(_chain(), [x, y]), CUDA, cuda=Overlapping)
    second = AutoReplay(_program(_chain(), [x, y]), CUDA, cuda=Overlapping)
    first.run([x, y])
    del first.run([x, y])[:]  # captured: graph A
    second.run([x, y])
    held = second.run([x, y])  # graph B, captured after A, its outputs in A's memory
    ((a,),) = first._graphs.values()
    assert not a.free() and a.unheld()
    x.add_(1)
    _assert_outputs(first.run([x, y]), x, y)  # A waits: a second graph of its own
    assert first.graphs == 2
    del held
    assert a.free()
    before = FakeGraph.replays
    _assert_outputs(first.run([x, y]), x, y)  # A again
    assert FakeGraph.replays == before + 1 and first.graphs == 2


def test_a_loop_holding_the_previous_result_replays_every_call_in_shared_pools(monkeypatch):
    """The two graphs of a loop that holds the previous result (``out = f(x)``) alternate,
    where each capture writes all of its pool's memory: the second graph lies in a pool of
    its own kind's second graphs. In the first graph's pool its outputs blocked the first
    graph while the loop held them, and every third call ran the interpreter (on an H200,
    the forward of a GPT layer; its backward then captured a graph for each new set of
    residual addresses)."""
    monkeypatch.setattr(pools, "_POOLS", {})
    monkeypatch.setenv("MESHFUSE_SHARED_GRAPH_POOLS", "1")  # the default

    def everywhere(program, inputs, generators=(), pool=None):
        return (*fake_capture(program, inputs)[:3], [(0, 2**63)])

    class Overlapping(FakeCuda):
        capture = staticmethod(everywhere)

    x, y = torch.randn(8, 8), torch.randn(8, 8)
    replay = AutoReplay(_program(_chain(), [x, y]), CUDA, cuda=Overlapping)
    out = replay.run([x, y])  # the first call: the interpreter's
    assert out is None
    before = FakeGraph.replays
    for step in range(9):
        x.add_(step)
        out = replay.run([x, y])  # `out` holds the previous result during the call
        assert out is not None, f"call {step + 2} ran the interpreter"
        _assert_outputs(out, x, y)
    assert replay.graphs == BUFFERS and FakeGraph.replays == before + 9
    assert len({id(p) for p in pools._POOLS.values()}) == BUFFERS


def test_copy_into_copies_large_tensors_alone_and_small_ones_together():
    sources = [torch.randn(2**19), torch.arange(5), torch.randn(3, 4).t(), torch.randn(2**18 + 1)]
    destinations = [torch.empty_like(x) for x in sources]
    graphs.copy_into(destinations, sources)
    for got, want in zip(destinations, sources):
        assert torch.equal(got, want)
    assert [d.nbytes >= graphs.LARGE_COPY for d in destinations] == [True, False, False, True]


def test_written_memory_is_the_pool_less_what_was_held_before():
    assert pools.written([(0, 100), (200, 300)], [(10, 20), (90, 110), (250, 300)]) == \
        [(0, 10), (20, 90), (200, 250)]
    assert pools.overlaps([(0, 10)], [(9, 12)]) and not pools.overlaps([(0, 10)], [(10, 12)])


def test_inside_the_callers_own_capture_the_interpreter_runs(monkeypatch):
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    replay = _replay(_chain(), [x, y])
    replay.run([x, y])
    monkeypatch.setattr(FakeCuda, "capturing_now", True)
    assert replay.run([x, y]) is None and replay.graphs == 0  # neither captured nor replayed
    monkeypatch.setattr(FakeCuda, "capturing_now", False)
    _assert_outputs(replay.run([x, y]), x, y)
    monkeypatch.setattr(FakeCuda, "capturing_now", True)
    assert replay.run([x, y]) is None and replay.graphs == 1


def test_new_addresses_are_captured_at_their_second_call_up_to_the_limit():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    replay = _replay(_chain(), [x, y])
    replay.run([x, y])
    pairs = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(MAX_GRAPHS + 1)]
    for i, (a, b) in enumerate(pairs):
        assert replay.run([a, b]) is None  # their first call: the interpreter
        got = replay.run([a, b])
        if i < MAX_GRAPHS:
            _assert_outputs(got, a, b)
        else:
            assert got is None  # beyond the limit: the interpreter
    assert replay.graphs == MAX_GRAPHS
    a, b = pairs[0]
    _assert_outputs(replay.run([a, b]), a, b)  # captured addresses still replay
    assert replay.run([x, y]) is None  # seen once, and the limit is reached


def test_captures_stop_where_the_graphs_pools_hold_their_memory_limit():
    """The pools of every automatic graph of the process count against one limit (the
    stand-in's pools are 1024 bytes each): once they reach it, a new set of addresses runs
    the interpreter, and graphs already captured go on replaying."""
    held = automatic.held_bytes()

    class Limited(FakeCuda):
        @staticmethod
        def memory_limit(device):
            assert device == CUDA
            return held + 2 * 1024

    fd = _chain()
    pairs = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(3)]
    replay = AutoReplay(_program(fd, list(pairs[0])), CUDA, cuda=Limited)
    for a, b in pairs[:2]:
        assert replay.run([a, b]) is None  # first call: the interpreter
        _assert_outputs(replay.run([a, b]), a, b)  # captured
    assert replay.run(list(pairs[2])) is None
    assert replay.run(list(pairs[2])) is None  # not captured: over the limit
    assert replay.graphs == 2
    assert automatic.held_bytes() == held + 2 * 1024
    assert "no more captures: the process's graphs hold 25% of the device's memory" in \
        replay.describe()
    _assert_outputs(replay.run(list(pairs[0])), *pairs[0])
    del replay  # a dropped runner's graphs free their pools
    assert automatic.held_bytes() == held


def test_settled_inputs_are_captured_at_their_first_call():
    """A set of addresses met for the first time is captured at once where a tensor lies
    in a live graph's output memory (the previous layer's replayed output) and each other
    where an earlier call had its position's (the layer's parameters); else at its second
    call: a new address, or known addresses in a new combination without a graph's output
    (what the allocator hands out between programs)."""
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    first = _replay(_chain(), [x, y])
    first.run([x, y])
    out = first.run([x, y])[0]  # captured: out is a graph's output memory
    second = _replay(_chain(), [x, y])
    x2, y2 = torch.randn(8, 8), torch.randn(8, 8)
    for pair in ((x, y), (x2, y2)):
        assert second.run(list(pair)) is None  # first calls: the interpreter
    assert second.run([x, y2]) is None  # addresses met, no graph's output: second call
    _assert_outputs(second.run([out, y]), out, y)  # a graph's output, y met there: at once
    assert second.run([out, x]) is None  # x never came at position 1
    assert second.run([y, out]) is None  # nor y at position 0
    _assert_outputs(second.run([x, y2]), x, y2)  # the second call of a combination
    assert second.graphs == 2


def test_inputs_that_move_every_call_are_never_captured():
    x = torch.randn(8, 8)
    replay = _replay(_chain(), [x, x])
    held = []  # kept alive: a freed tensor's address may be handed to the next one
    for _ in range(10):
        held.append((torch.randn(8, 8), torch.randn(8, 8)))
        assert replay.run(list(held[-1])) is None
    assert replay.graphs == 0


def test_the_signatures_of_a_fusion_share_a_graph_budget():
    budget = GraphBudget(3)
    replays = [_replay(_chain(), [torch.randn(8, 8)] * 2, budget) for _ in range(2)]
    for replay in replays:
        for a, b in [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(2)]:
            replay.run([a, b])
            replay.run([a, b])
    assert [r.graphs for r in replays] == [2, 1] and budget.left == 0
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    replays[1].run([a, b])
    assert replays[1].run([a, b]) is None  # its own limit is not reached; the fusion's is
    assert "graph budget is spent" in replays[1].describe()


def test_scalar_values_are_part_of_the_key():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 4], dtype=DataType.Float)
        a = fd.define_scalar(None, dtype=DataType.Double)
        fd.add_output(fd.ops.mul(x, a))
    x = torch.randn(4, 4)
    replay = _replay(fd, [x, 2.0])
    replay.run([x, 2.0])
    assert replay.run([x, 3.0]) is None  # a new value: a new key, seen once
    for value in (2.0, 3.0, 2.0, 3.0):
        torch.testing.assert_close(replay.run([x, value])[0], x * value)
    assert replay.graphs == 2


def test_an_output_that_is_an_input_does_not_block_replay():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 4], dtype=DataType.Float)
        fd.add_output(x)
        fd.add_output(fd.ops.neg(x))
    x = torch.randn(4, 4)
    replay = _replay(fd, [x])
    replay.run([x])
    held, neg = replay.run([x])
    assert held.data_ptr() == x.data_ptr()
    del neg  # the caller keeps the input (and the output that is it): the graph is free
    same, neg = replay.run([x])
    assert same.data_ptr() == x.data_ptr()
    torch.testing.assert_close(neg, -x)
    assert replay.graphs == 1


class WeakFakeGraph(FakeGraph):
    """A stand-in that, as a CUDA graph, holds neither its inputs nor an output that is
    one (it reads the inputs through weak references)."""

    def __init__(self, program, inputs, outputs):
        given = {x.untyped_storage()._cdata for x in inputs if isinstance(x, torch.Tensor)}
        super().__init__(program, [], [None if o.untyped_storage()._cdata in given else o
                                       for o in outputs])
        self.weak = [weakref.ref(x) for x in inputs]

    def replay(self):
        FakeGraph.replays += 1
        results = self.program.run([ref() for ref in self.weak])
        for out, new in zip(self.outputs, results):
            if out is not None:
                out.copy_(new)


def test_a_graph_does_not_keep_an_input_it_returns():
    """An output that is a view of an input (an op working in place, as the fused cross
    entropy's backward scaling its residual gradient) comes back from each replay as that
    view of the call's input, and the graph keeps no reference to it: the input dies with
    its last holder. Before, the graph held it: every step's residual gradient of a
    cross entropy through autograd stayed allocated (512 MiB a step on an H200 at 32k
    classes), and the forward graph it lay in stayed busy."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 4], dtype=DataType.Float)
        fd.add_output(fd.ops.neg(x))
        fd.add_output(x)

    class WeakCuda(FakeCuda):
        @staticmethod
        def capture(program, inputs, generators=(), pool=None):
            outputs = program.run(inputs)
            return WeakFakeGraph(program, inputs, outputs), outputs, 1024, ()

    x = torch.randn(4, 4)
    replay = AutoReplay(_program(fd, [x]), CUDA, None, WeakCuda)
    replay.run([x])
    replay.run([x])  # captured and replayed
    neg, same = replay.run([x])
    assert replay.graphs == 1 and same.data_ptr() == x.data_ptr()
    torch.testing.assert_close(neg, -x)
    torch.testing.assert_close(same, x)
    alive = weakref.ref(x)
    del x, same, neg
    assert alive() is None  # the graph kept no reference to its input


def test_a_failed_capture_leaves_the_program_to_the_interpreter():
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def failing(program, inputs, generators=(), pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    class Failing(FakeCuda):
        capture = staticmethod(failing)

    replay = AutoReplay(_program(_chain(), [x, y]), CUDA, cuda=Failing)
    assert replay.run([x, y]) is None and replay.run([x, y]) is None
    assert "no capture: RuntimeError" in replay.describe()


def test_programs_that_draw_random_numbers_are_not_replayed():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 8], dtype=DataType.Float)
        fd.add_output(fd.ops.add(x, fd.ops.rand_like(x)))
    reason = why_not_replayed(_program(fd, [torch.randn(8, 8)]), CUDA)
    assert reason is not None and "random" in reason


def test_lookups_on_a_sharded_vocabulary_replay():
    """Regression (the Llama example under CUDA-graph replay on an H200: ``ValueError:
    'rng_seed' is not in list``): a lookup on a vocabulary split over a mesh of one device
    notes the positions it holds, and the replay took any note for a random stream and read
    the op's seed. An embedding and a pick of the target logit replay, and explain lists no
    random stream for them."""
    mesh = DeviceMesh(range(1))
    with FusionDefinition() as fd:
        ids = fd.define_tensor([2, 5], dtype=DataType.Int)
        w = fd.define_tensor([11, 6], dtype=DataType.Float)
        logits = fd.define_tensor([2, 11], dtype=DataType.Float)
        fd.add_output(fd.ops.embedding_fwd(ids, w))
        fd.add_output(fd.ops.take_along_axis(logits, fd.ops.slice(ids, [0, 0], [2, 1]), 1))
    for tv in (ids, w, logits):
        tv.set_device_mesh(mesh)
    for tv, axis in ((w, 0), (logits, 1)):
        tv.split(axis, 1, inner_split=False)
        tv.parallelize(axis, ParallelType.mesh_x)
    inputs = [torch.randint(0, 11, (2, 5)), torch.randn(11, 6), torch.randn(2, 11)]
    program = _program(fd, inputs)
    assert any(step.op == "embedding_fwd" and step.note for step in program.steps)
    assert why_not_replayed(program, CUDA) is None
    replay = AutoReplay(program, CUDA, cuda=FakeCuda)
    assert replay.run(inputs) is None  # the first call: the interpreter
    before = FakeGraph.replays
    emb, picked = replay.run(inputs)
    assert FakeGraph.replays == before + 1
    torch.testing.assert_close(emb, torch.nn.functional.embedding(inputs[0], inputs[1]))
    torch.testing.assert_close(picked, inputs[2].gather(1, inputs[0][:, :1]))
    assert "random streams" not in fd.explain(inputs)


def test_a_new_batch_of_token_ids_at_each_call_replays():
    """A training loop hands each step new token ids wherever the allocator puts them: the
    integer input is copied into the graph's buffer at each replay, not part of its key, so
    the program replays from its second call (the weight at its address) with each call's
    ids; a float input at a new address still is a new key (the interpreter, then a
    capture)."""
    with FusionDefinition() as fd:
        ids = fd.define_tensor([2, 5], dtype=DataType.Int)
        w = fd.define_tensor([11, 6], dtype=DataType.Float)
        fd.add_output(fd.ops.embedding_fwd(ids, w))
    w_value = torch.randn(11, 6)
    held = []  # every batch stays alive: each lies at a new address
    replay = AutoReplay(_program(fd, [torch.randint(0, 11, (2, 5)), w_value]), CUDA,
                        cuda=FakeCuda)
    results = []
    for step in range(5):
        batch = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(step))
        held.append(batch)
        out = replay.run([batch, w_value])
        results.append(None if out is None else out[0].clone())
        if out is not None:
            torch.testing.assert_close(out[0], torch.nn.functional.embedding(batch, w_value))
        del out  # a result still held would make the graph busy (a second graph)
    assert results[0] is None and all(r is not None for r in results[1:])
    assert replay.graphs == 1
    assert replay.run([held[0], w_value.clone()]) is None  # the weight moved: a new key


def test_only_small_integer_inputs_on_the_floating_inputs_device_are_staged():
    """Token ids, targets and masks are copied into a graph's buffers; a large index, one on
    another device than the program's floating-point tensors (a kernel's random state kept
    on the host), and floating-point inputs are keyed on their addresses."""
    ids = torch.zeros(2, 5, dtype=torch.int64)
    mask = torch.ones(2, 5, dtype=torch.bool)
    x = torch.randn(2, 5)
    elsewhere = torch.zeros(2, dtype=torch.int64, device="meta")
    big = torch.zeros(automatic.DATA_BYTES // 8 + 1, dtype=torch.int64)
    assert automatic.data_inputs([ids, x, mask, 3, elsewhere, big]) == {0, 2}
    assert automatic.data_inputs([ids]) == frozenset()  # no floating-point input: no device


def test_attention_with_dropout_replays_only_with_a_fused_kernel():
    """Dropout replays where a fused kernel draws it (tests/test_dropout_replay.py); the CPU
    binds the math kernel, so the capture is refused and the interpreter runs."""
    b, h, s, e = 1, 2, 8, 16
    model = SeedAttention(QkvFormat.BHSE, DeviceMesh(range(1)), b, h, s, e, dropout_p=0.1)
    inputs = model.inputs_for(*random_inputs(b, h, s, e), 0)
    assert why_not_replayed(_program(model, inputs), CUDA) is None
    replay = _replay(model, inputs)
    assert replay.run(inputs) is None and replay.run(inputs) is None
    assert "math kernel draws the dropout mask" in replay.describe()


@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
def test_the_seed_attention_on_one_device_is_replayable(qkv_format):
    b, h, s, e = 1, 2, 8, 16  # on a mesh of one device its reshards are local copies
    model = SeedAttention(qkv_format, DeviceMesh(range(1)), b, h, s, e)
    inputs = model.inputs_for(*random_inputs(b, h, s, e), 0)
    assert why_not_replayed(_program(model, inputs), CUDA) is None


def test_a_set_inside_the_program_is_replayable():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 4], dtype=DataType.Float)
        fd.add_output(fd.ops.exp(fd.ops.set(x)))  # the set runs as a view of x
    assert why_not_replayed(_program(fd, [torch.randn(4, 4)]), CUDA) is None


def test_only_registry_implementations_and_segments_count_as_local():
    step = Step("exp", (), {}, (0,), (), "T1 = exp(T0)")
    assert _local(step, torch.exp) is False  # not the registry's implementation
    from meshfuse.ops.registry import lookup
    assert _local(step, lookup("exp").impl)
    assert _local(Step(RESHARD, (), {}, (0,), (), "a local copy"), torch.clone)
    assert not _local(Step(RESHARD, (), {}, (0,), (), "allgather"), lambda x: x)
    assert not _local(Step(RESHARD, (), {}, (0,), (), "allgather", plan=("step",)), torch.clone)


def test_cpu_programs_are_interpreted_and_explain_is_silent_on_replay():
    fd = _chain()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    before = fd.explain([x, y])
    for _ in range(3):
        _assert_outputs(fd.execute([x, y]), x, y)
    (replay,) = fd._get_runner()._replays.values()
    assert replay.reason == "its inputs are on cpu, not on a CUDA device"
    after = fd.explain([x, y])  # adds the host time of the cached calls, nothing on replay
    assert "CUDA graph replay" not in before and "CUDA graph replay" not in after
    assert after.startswith(before) and "host time per cached call" in after


def test_explain_states_the_decision_before_the_first_call():
    program = _program(_chain(), [torch.randn(8, 8)] * 2)
    assert replay_lines(program, torch.device("cpu"), [], True) == []
    assert replay_lines(program, CUDA, [], False) == []
    (line,) = replay_lines(program, CUDA, [], True)
    assert line.startswith("CUDA graph replay: on (nothing captured yet")
    replay = AutoReplay(program, CUDA, cuda=FakeCuda)
    assert replay_lines(program, CUDA, [replay], True) == [line]  # after one call: the same


def test_which_calls_may_replay():
    assert replay_wanted(None, True) and not replay_wanted(None, False)
    assert replay_wanted("auto", False) and not replay_wanted(False, True)
    with pytest.raises(InputError, match="cuda_graph='always'"):
        replay_wanted("always", True)
    assert cuda_graph_setting(None) is True and cuda_graph_setting("auto") is True
    assert cuda_graph_setting("0") is False and cuda_graph_setting("off") is False
    with pytest.raises(InputError, match="MESHFUSE_CUDA_GRAPH='yes'"):
        cuda_graph_setting("yes")


def test_bad_options_are_named():
    fd = _chain()
    x = torch.randn(8, 8)
    with pytest.raises(InputError, match="cuda_graph='always'"):
        fd.execute([x, x], cuda_graph="always")


@pytest.mark.mpi
def test_programs_that_communicate_are_not_replayed(multidevice_test):
    rank, mesh = multidevice_test.rank, DeviceMesh(range(multidevice_test.size))
    fd = _RowParallelLinear(mesh)
    fd.define()
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    inputs = [shard_tensor(x, fd.x, rank).to(multidevice_test.device),
              shard_tensor(w, fd.w, rank).to(multidevice_test.device)]  # NCCL needs CUDA
    reason = why_not_replayed(_program(fd, inputs), CUDA)
    if multidevice_test.size == 1:
        assert reason is None
    else:
        assert reason is not None and reason.startswith("it communicates")


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _replay_line(fd, inputs) -> str:
    return next(s for s in fd.explain(inputs).splitlines() if "CUDA graph replay" in s)


@cuda_only
@pytest.mark.parametrize("compile", [False, "inductor"])
@pytest.mark.parametrize("option", [{}, {"cuda_graph": "auto"}])
def test_cuda_replay_equals_the_interpreter(compile, option):
    fd = _chain()
    x, y = (torch.randn(8, 8, device="cuda") for _ in range(2))
    results = []
    for step in range(4):
        x.add_(step)
        got = fd.execute([x, y], compile=compile, **option)
        _assert_outputs(got, x, y)
        results.append((got, [t.clone() for t in got]))
    for got, copy in results:  # held results were never overwritten
        assert all(torch.equal(a, b) for a, b in zip(got, copy))
    del results, got
    for _ in range(2):
        _assert_outputs(fd.execute([x, y], compile=compile, **option), x, y)
    assert "2 graphs captured for 1 sets of input addresses" in _replay_line(fd, [x, y])


@cuda_only
@pytest.mark.mpi
@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
def test_cuda_plain_execute_of_the_seed_attention_replays(multidevice_test, qkv_format):
    d, rank = multidevice_test.size, multidevice_test.rank
    b, h, s, e = 2, 4 * d, 128, 64 * 4 * d  # heads split over the ranks: no communication
    model = SeedAttention(qkv_format, DeviceMesh(range(d)), b, h, s, e)
    sets = [model.inputs_for(*random_inputs(b, h, s, e, device=current_device(), seed=seed),
                             rank) for seed in (0, 1)]
    expected = [model.execute(inputs, cuda_graph=False) for inputs in sets]
    out = None
    for step in range(6):  # out = execute(...): the previous result is held during a call
        inputs = sets[step % 2]
        out = model.execute(inputs)
        for got, want in zip(out, expected[step % 2]):
            assert got.stride() == want.stride()
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    line = _replay_line(model, sets[0])
    assert "graphs captured for 2 sets of input addresses" in line, line
    for inputs, want in zip(sets, expected):  # results held across calls stay as they were
        first = model.execute(inputs)
        model.execute(inputs)
        torch.testing.assert_close(first[0], want[0], rtol=1e-2, atol=1e-2)


@cuda_only
def test_cuda_captures_keep_no_workspace_each():
    """Every capture's warm-up runs on one side stream: cuBLAS keeps a workspace per stream
    it ran on for the life of the process (32 MiB on a Hopper GPU), so a stream per warm-up
    left one allocated per captured graph (1 GiB for a 1B Llama step's 33 graphs)."""
    with FusionDefinition() as fd:
        a = fd.define_tensor([64, 64], dtype=DataType.Float)
        b = fd.define_tensor([64, 64], dtype=DataType.Float)
        fd.add_output(fd.ops.matmul(a, b))
    pairs = [(torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda"))
             for _ in range(6)]
    allocated = []
    for a, b in pairs:  # new addresses: captured at their second call
        for _ in range(2):
            torch.testing.assert_close(fd.execute([a, b])[0], a @ b)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert "6 graphs captured for 6 sets" in _replay_line(fd, list(pairs[0]))
    # the later captures add their outputs (16 KiB each) and no workspace
    assert allocated[-1] - allocated[1] < 2**20


@cuda_only
def test_cuda_new_shapes_and_scalars_get_their_own_graphs():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8], dtype=DataType.Float)
        a = fd.define_scalar(None, dtype=DataType.Double)
        fd.add_output(fd.ops.mul(fd.ops.exp(x), a))
    for rows in (4, 16):
        x = torch.randn(rows, 8, device="cuda")
        for value in (2.0, 3.0, 2.0, 3.0, 2.0):
            torch.testing.assert_close(fd.execute([x, value])[0], torch.exp(x) * value)
        assert "2 graphs captured for 2 sets" in _replay_line(fd, [x, 2.0])


@cuda_only
def test_cuda_dropout_draws_a_new_mask_each_call():
    b, h, s, e = 2, 4, 128, 256
    model = SeedAttention(QkvFormat.BHSE, DeviceMesh(range(1)), b, h, s, e, dropout_p=0.2)
    inputs = model.inputs_for(*random_inputs(b, h, s, e, device="cuda"), 0)
    attns = [model.execute(inputs)[0].clone() for _ in range(4)]
    for earlier, later in itertools.pairwise(attns):
        assert not torch.equal(earlier, later)
    assert "seeds the dropout streams" in _replay_line(model, inputs)


@cuda_only
def test_cuda_autograd_through_a_replayed_forward():
    fd = _chain()
    function = fd.as_autograd_function()
    x0, y0 = (torch.randn(8, 8, device="cuda") for _ in range(2))
    x, y = (t.clone().requires_grad_() for t in (x0, y0))
    for step in range(4):
        prod, total = function([x, y])
        (prod.sum() + total.sum()).backward()
        ref_x, ref_y = (t.clone().requires_grad_() for t in (x0, y0))
        ((torch.exp(ref_x) * ref_y).sum() + ref_x.sum(1).sum()).backward()
        torch.testing.assert_close(x.grad, ref_x.grad * (step + 1))
        torch.testing.assert_close(y.grad, ref_y.grad * (step + 1))


@cuda_only
def test_cuda_execute_inside_the_callers_own_graph():
    fd = _chain()
    x, y = (torch.randn(8, 8, device="cuda") for _ in range(2))
    for _ in range(3):
        fd.execute([x, y])  # captured at the second call, replayed at the third
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the caller's own warm-up, as CUDA asks
        fd.execute([x, y])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the interpreter's kernels go into the caller's graph
        out = fd.execute([x, y])
    x.add_(1)
    graph.replay()
    _assert_outputs(out, x, y)
    assert "1 graphs captured" in _replay_line(fd, [x, y])


@cuda_only
@pytest.mark.parametrize("how", ["env", "option"])
def test_cuda_replay_can_be_turned_off(how, monkeypatch):
    if how == "env":
        monkeypatch.setenv("MESHFUSE_CUDA_GRAPH", "0")
    option = {"cuda_graph": False} if how == "option" else {}
    fd = _chain()
    x, y = (torch.randn(8, 8, device="cuda") for _ in range(2))
    for _ in range(3):
        _assert_outputs(fd.execute([x, y], **option), x, y)
    assert not fd._get_runner()._replays
