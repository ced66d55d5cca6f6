"""Attention dropout replayed from a CUDA graph (``meshfuse.runtime.replay.streams``).

On CPU: which programs may replay (the decision from the records, then at the capture from the
bound kernels), and the host work of each replay, as data: the seeds it draws (the
interpreter's draws, in its order), the stream keys and the generators it seeds, and the CPU
generator given back after a capture. A fused kernel stands in where the CPU binds the math
kernel. On a CUDA device: the replayed program's outputs are bitwise the interpreter's at every
call index (forward and backward, cuDNN and flash, drawn, constant and input seeds, two
dropout steps in one graph, 1 and 2 ranks, an autograd function whose forward replays), and
the user's CUDA generator is left alone.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch

from meshfuse import DataType, DeviceMesh, FusionDefinition, InputError
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention, random_inputs
from meshfuse.ops.attention.backends import ENV_VAR as BACKEND_ENV
from meshfuse.ops.attention.backends import AttentionBackend
from meshfuse.ops.attention.dropout import FusedDropout
from meshfuse.ops.random import rng
from meshfuse.runtime.replay.automatic import AutoReplay, _Graph, why_not_replayed
from meshfuse.runtime.replay.streams import Source, plan_streams, seed_inputs
from meshfuse.testing.utils import current_device

CUDA = torch.device("cuda")  # what the decision is told; the programs run on the CPU
B, H, S, E = 1, 2, 8, 16  # the seed attention's sizes here (E: all heads together)


class TwoAttentions(FusionDefinition):
    """Two attention forwards with dropout on the same q, k, v, then one backward each:
    ``seeds`` None (each draws a seed per call), "constant" or "input" (Int scalar inputs)."""

    def __init__(self, shape, p=0.2, seeds=None):
        super().__init__()
        self.shape, self.p, self.seeds = shape, p, seeds

    def definition(self):
        q, k, v, g = (self.define_tensor(self.shape, dtype=DataType.BFloat16) for _ in range(4))
        for step in range(2):
            kwargs = {}
            if self.seeds == "constant":
                kwargs = {"rng_seed": 40 + step, "rng_offset": step}
            elif self.seeds == "input":
                kwargs = {"rng_seed": self.define_scalar(dtype=DataType.Int),
                          "rng_offset": self.define_scalar(dtype=DataType.Int)}
            attn, lse, seed, offset = self.ops.sdpfa_fwd(q, k, v, self.p, True, None, **kwargs)
            grads = self.ops.sdpfa_bwd(g, q, k, v, attn, lse, self.p, True, seed, offset, None)
            for t in (attn, *grads):
                self.add_output(t)


def _tensors(shape, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16).to(device) for _ in range(4)]


def _program(fd, inputs):
    fd.execute(inputs, cuda_graph=False)
    (program,) = fd._get_runner()._programs.values()
    return program


def _planned(fd, inputs):
    """The fused stand-ins of ``fd``'s program for ``inputs`` and its replay plan."""
    program = _program(fd, inputs)
    fused = _fused_stand_ins(program)
    return fused, plan_streams(program, inputs)


def _fused_stand_ins(program):
    """Binds a cuDNN-like fused kernel to every attention step of a CPU ``program`` (the CPU
    binds the math kernel, and its generator stands for a CUDA one): its forwards'
    FusedDropout, in step order."""
    fused = []
    for step, call in zip(program.steps, program.calls):
        backend, kernel, _ = call.bound[True]
        assert backend is AttentionBackend.MATH
        dropout = None
        if step.op == "sdpfa_fwd":
            dropout = FusedDropout(step.attrs["site"], AttentionBackend.CUDNN, torch.device("cpu"))
            dropout.swap.exchanges_states = True  # as a CUDA generator does
            fused.append(dropout)
        call.bound[True] = (AttentionBackend.CUDNN, kernel, dropout)
    return fused


# ----------------------------------------------------------------------------------------------
# Which programs replay


def test_dropout_with_a_fused_kernel_may_replay_from_its_records():
    model = SeedAttention(QkvFormat.BHSE, DeviceMesh(range(1)), B, H, S, E, dropout_p=0.1)
    inputs = model.inputs_for(*random_inputs(B, H, S, E), 0)
    assert why_not_replayed(_program(model, inputs), CUDA) is None


def test_the_global_mask_is_never_replayed():
    model = SeedAttention(QkvFormat.BHSE, DeviceMesh(range(1)), B, H, S, E, dropout_p=0.1,
                          dropout_mode="global")
    inputs = model.inputs_for(*random_inputs(B, H, S, E), 0)
    reason = why_not_replayed(_program(model, inputs), CUDA)
    assert reason is not None and "global dropout mask" in reason and "sdpfa_fwd" in reason


class _Noisy(FusionDefinition):
    """x + rand_like(x): the seed drawn at each call, constant, or an input."""

    def __init__(self, seeds=None):
        super().__init__()
        self.seeds = seeds

    def definition(self):
        x = self.define_tensor([8, 8], dtype=DataType.Float)
        kwargs = {}
        if self.seeds == "constant":
            kwargs = {"rng_seed": 1, "rng_offset": 0}
        elif self.seeds == "input":
            kwargs = {"rng_seed": self.define_scalar(dtype=DataType.Int),
                      "rng_offset": self.define_scalar(dtype=DataType.Int)}
        self.add_output(self.ops.add(x, self.ops.rand_like(x, **kwargs)))


@pytest.mark.parametrize("seeds", [None, "constant", "input"])
def test_random_ops_replay_only_with_their_seed_given(seeds):
    """A random op computes its values from the seed on the host: a graph replays them only
    where the seed is fixed for it (a constant, or an input: a graph per value)."""
    inputs = [torch.randn(8, 8)] + ([5, 2] if seeds == "input" else [])
    program = _program(_Noisy(seeds), inputs)
    reason = why_not_replayed(program, CUDA)
    if seeds is None:
        assert reason is not None and "draws random numbers" in reason and "rand_like" in reason
        return
    assert reason is None and plan_streams(program, inputs).streams == ()
    if seeds == "input":
        assert seed_inputs(program) == frozenset()  # keyed: a graph per seed value
        assert "seed is a tensor" in plan_streams(program, [inputs[0], torch.tensor(5), 2])


class _FakeCuda:
    """A capture that must not happen (the decision refuses before it)."""

    @staticmethod
    def capture(program, inputs, generators=(), pool=None):
        raise AssertionError("captured a program the plan refuses")

    @staticmethod
    def capturing():
        return False


def test_the_math_kernel_is_refused_at_the_capture():
    """The CPU binds the math kernel, which draws its mask from the seed on the host: the
    second call (the capture) refuses, naming the step, and the interpreter keeps running."""
    model = SeedAttention(QkvFormat.BHSE, DeviceMesh(range(1)), B, H, S, E, dropout_p=0.1)
    inputs = model.inputs_for(*random_inputs(B, H, S, E), 0)
    replay = AutoReplay(_program(model, inputs), CUDA, cuda=_FakeCuda)
    assert replay.run(inputs) is None and replay.run(inputs) is None
    assert "math kernel draws the dropout mask on the host" in replay.describe()
    assert "sdpfa_fwd" in replay.describe()


@pytest.mark.parametrize("backend", [AttentionBackend.EFFICIENT])
def test_a_kernel_whose_rng_state_is_on_the_host_is_refused(backend):
    fd = TwoAttentions([B, H, S, S])
    inputs = _tensors([B, H, S, S])
    program = _program(fd, inputs)
    for step, call in zip(program.steps, program.calls):
        dropout = FusedDropout(step.attrs["site"], backend, torch.device("cpu"))
        call.bound[True] = (backend, None, dropout if step.op == "sdpfa_fwd" else None)
    reason = plan_streams(program, inputs)
    assert isinstance(reason, str) and "efficient" in reason and "not graph-safe" in reason


# ----------------------------------------------------------------------------------------------
# What each replay does on the host


@pytest.mark.parametrize("seeds", [None, "constant", "input"])
def test_the_plan_lists_each_forward_in_step_order(seeds):
    fd = TwoAttentions([B, H, S, S], seeds=seeds)
    inputs = _tensors([B, H, S, S]) + ([5, 0, 6, 1] if seeds == "input" else [])
    fused, plan = _planned(fd, inputs)
    assert [s.dropout for s in plan.streams] == fused
    assert [s.step for s in plan.streams] == sorted(s.step for s in plan.streams)
    expected = {None: [(Source(), Source())] * 2,
                "constant": [(Source(40), Source(0)), (Source(41), Source(1))],
                "input": [(Source(position=4), Source(position=5)),
                          (Source(position=6), Source(position=7))]}[seeds]
    assert [(s.seed, s.offset) for s in plan.streams] == expected
    assert plan.generators == [d.swap.generator for d in fused]


def test_a_replay_draws_the_interpreters_seeds_in_its_order():
    """Seeds drawn from torch's CPU generator: a replay draws what the interpreter's call
    draws (one seed per forward, in step order), keys them with each step's shard position
    and seeds each step's generator; the calls after it draw what they would have drawn."""
    fd = TwoAttentions([B, H, S, S])
    inputs = _tensors([B, H, S, S])
    fused, plan = _planned(fd, inputs)
    torch.manual_seed(21)
    drawn = [[rng.draw_seed() for _ in fused] for _ in range(3)]
    after = torch.rand(4)
    torch.manual_seed(21)
    for call in range(3):
        keys = plan.prepare(inputs)
        assert keys == [d.key(seed, 0) for d, seed in zip(fused, drawn[call])]
        assert [d.swap.generator.initial_seed() for d in fused] == \
            [key & (2**63 - 1) for key in keys]
    assert torch.equal(torch.rand(4), after)
    assert len({k for call in range(3) for k in plan.prepare(inputs)}) == 6  # all distinct


def test_constant_and_input_seeds_are_read_at_each_replay():
    fd = TwoAttentions([B, H, S, S], seeds="input")
    tensors = _tensors([B, H, S, S])
    fused, plan = _planned(fd, tensors + [5, 0, 6, 1])
    state = torch.get_rng_state()
    for seeds in ([5, 0, 6, 1], [7, 2, 6, 1], [5, 0, 6, 1]):
        keys = plan.prepare(tensors + seeds)
        assert keys == [fused[0].key(*seeds[:2]), fused[1].key(*seeds[2:])]
    assert torch.equal(torch.get_rng_state(), state)  # given seeds: nothing drawn
    const = TwoAttentions([B, H, S, S], seeds="constant")
    fused, plan = _planned(const, tensors)
    assert plan.prepare(tensors) == plan.prepare(tensors) == [fused[0].key(40, 0),
                                                                fused[1].key(41, 1)]


def test_a_capture_gives_its_draws_back_and_allows_only_its_generators():
    fd = TwoAttentions([B, H, S, S])
    inputs = _tensors([B, H, S, S])
    fused, plan = _planned(fd, inputs)
    torch.manual_seed(8)
    expected = rng.draw_seed()
    torch.manual_seed(8)
    with plan.capturing():
        assert all(d.swap._registered for d in fused)
        rng.draw_seed()  # the warm-up's and the capture's draws
    assert not any(d.swap._registered for d in fused)
    assert rng.draw_seed() == expected


def test_inputs_read_only_as_dropout_seeds_are_not_part_of_a_graphs_key():
    """A replay reads such inputs itself: a new seed at every call still replays."""
    tensors = _tensors([B, H, S, S])
    program = _program(TwoAttentions([B, H, S, S], seeds="input"), tensors + [5, 0, 6, 1])
    assert seed_inputs(program) == {4, 5, 6, 7}
    with FusionDefinition() as fd:  # an offset also read by a kernel is keyed
        q, k, v = (fd.define_tensor([B, H, S, S], dtype=DataType.BFloat16) for _ in range(3))
        seed, offset = (fd.define_scalar(dtype=DataType.Int) for _ in range(2))
        fd.add_output(fd.ops.sdpfa_fwd(q, k, v, 0.2, True, None, rng_seed=seed,
                                       rng_offset=offset)[0])
        fd.add_output(fd.ops.mul(q, offset))
    assert seed_inputs(_program(fd, tensors[:3] + [5, 0])) == {3}


class _RerunCuda:
    """A stand-in capture whose graph re-runs the program on the captured inputs."""

    class Graph:
        def __init__(self, program, inputs, outputs):
            self.program, self.inputs, self.outputs = program, list(inputs), outputs

        def replay(self):
            for out, new in zip(self.outputs, self.program.run(self.inputs)):
                out.copy_(new)

    @classmethod
    def capture(cls, program, inputs, generators=(), pool=None):
        outputs = program.run(inputs)
        return cls.Graph(program, inputs, outputs), outputs, 0, ()

    @staticmethod
    def capturing():
        return False


def test_a_graph_is_kept_per_deterministic_mode():
    """A graph keeps the kernels it captured, and ``torch.use_deterministic_algorithms``
    picks some of them at each call (flash's backward): a call in the other mode runs the
    interpreter, then gets a graph of its own."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4], dtype=DataType.Float)
        fd.add_output(fd.ops.exp(x))
    x = torch.randn(4)
    replay = AutoReplay(_program(fd, [x]), CUDA, cuda=_RerunCuda)
    assert replay.run([x]) is None and replay.run([x]) is not None
    with _deterministic():
        assert replay.run([x]) is None and replay.run([x]) is not None
    assert replay.graphs == 2 and replay.run([x]) is not None


def test_dropout_p_zero_at_this_call_draws_nothing():
    """``dropout_p`` as an input: a graph captured for ``dropout_p = 0`` has no stream (the
    interpreter draws no seed then either)."""
    with FusionDefinition() as fd:
        q, k, v = (fd.define_tensor([B, H, S, S], dtype=DataType.BFloat16) for _ in range(3))
        p = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.sdpfa_fwd(q, k, v, p, True, None)[0])
    tensors = _tensors([B, H, S, S])[:3]
    program = _program(fd, tensors + [0.0])
    assert plan_streams(program, tensors + [0.0]).streams == ()
    fd.execute(tensors + [0.3], cuda_graph=False)
    _fused_stand_ins(program)
    assert len(plan_streams(program, tensors + [0.3]).streams) == 1


# ----------------------------------------------------------------------------------------------
# On a CUDA device: the replay is the interpreter, bit for bit

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _backend(name):
    """``MESHFUSE_SDPA_BACKEND=name`` for the first call (where the kernels are bound)."""
    return mock.patch.dict(os.environ, {BACKEND_ENV: name})


@contextlib.contextmanager
def _deterministic():
    """Bitwise gradients: flash's default backward adds q_grad with atomics."""
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved)


def _calls(make, inputs_of, backend, calls=5, replay=True):
    """Outputs (cloned) of ``calls`` calls of a fresh ``make()`` after ``torch.manual_seed``;
    its explain line on the replay. Flash runs under deterministic algorithms (its default
    backward adds q_grad with atomics); cuDNN's backward is bitwise reproducible as it is
    (and torch refuses cuDNN attention under deterministic algorithms)."""
    fd = make()
    torch.manual_seed(1234)
    results = []
    with _deterministic() if backend == "flash" else contextlib.nullcontext():
        for call in range(calls):
            inputs = inputs_of(call)
            with _backend(backend) if call == 0 else contextlib.nullcontext():
                out = fd.execute(inputs, cuda_graph=None if replay else False)
            results.append([t.clone() for t in out])
            del out  # the graph's memory is free again: the next call replays
    line = next((s for s in fd.explain(inputs_of(0)).splitlines() if "CUDA graph replay" in s),
                "")
    return results, line


def _assert_bitwise(replayed, interpreted):
    for call, (got, want) in enumerate(zip(replayed, interpreted)):
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"call {call}, output {i} differs from the interpreter's"


@cuda_only
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_cuda_replayed_seed_attention_is_the_interpreter(multidevice_test, backend):
    """The seed program with dropout 0.1, heads split over the ranks (no communication):
    replayed calls (from the third on; the second captures) give the interpreter's outputs
    bitwise, forward and backward, at every call index; each call draws a new mask."""
    d, rank = multidevice_test.size, multidevice_test.rank
    b, h, s, e = 2, 4 * d, 256, 64 * 4 * d

    def make():
        return SeedAttention(QkvFormat.BHSE, DeviceMesh(range(d)), b, h, s, e, dropout_p=0.1)

    model = make()
    inputs = model.inputs_for(*random_inputs(b, h, s, e, device=current_device()), rank)
    replayed, line = _calls(make, lambda call: inputs, backend)
    interpreted, _ = _calls(make, lambda call: inputs, backend, replay=False)
    assert "graphs captured" in line and "seeds the dropout streams" in line, line
    _assert_bitwise(replayed, interpreted)
    assert not torch.equal(replayed[3][0], replayed[4][0])  # a new mask at each call


@cuda_only
@pytest.mark.mpi
@pytest.mark.parametrize("seeds", [None, "constant", "input"])
def test_cuda_two_dropout_steps_in_one_graph(multidevice_test, seeds):
    """Each attention step keeps its own generator: two dropout forwards in one graph draw
    their own streams, as in the interpreter; constant seeds give one mask at every call,
    input seeds the mask of the call's seeds (new ones at every call: a replay reads them)."""
    shape = [2, 4, 128, 64]
    tensors = _tensors(shape, current_device())

    def inputs_of(call):
        return tensors + ([5 + call, call, 6 + call, 1 + call] if seeds == "input" else [])

    def make():
        return TwoAttentions(shape, seeds=seeds)

    replayed, line = _calls(make, inputs_of, "cudnn", calls=6)
    interpreted, _ = _calls(make, inputs_of, "cudnn", calls=6, replay=False)
    assert "graphs captured for 1 sets" in line and "seeds the dropout streams" in line, line
    _assert_bitwise(replayed, interpreted)
    last = replayed[5]
    assert not torch.equal(last[0], last[4])  # the two steps' masks differ
    if seeds == "constant":
        assert torch.equal(replayed[2][0], replayed[5][0])
    else:
        assert not torch.equal(replayed[4][0], replayed[5][0])


@cuda_only
def test_cuda_replays_leave_the_users_generator_alone():
    model = SeedAttention(QkvFormat.BHSE, DeviceMesh(range(1)), 2, 4, 128, 256, dropout_p=0.1)
    inputs = model.inputs_for(*random_inputs(2, 4, 128, 256, device="cuda"), 0)
    torch.cuda.manual_seed(4)
    expected = torch.rand(8, device="cuda")
    torch.cuda.manual_seed(4)
    for _ in range(4):
        model.execute(inputs)
    assert torch.equal(torch.rand(8, device="cuda"), expected)
    line = next(s for s in model.explain(inputs).splitlines() if "CUDA graph replay" in s)
    assert "graphs captured" in line, line


class _AttentionOnly(FusionDefinition):
    """An attention forward with dropout 0.1 (its backward derived by autodiff)."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape

    def definition(self):
        q, k, v = (self.define_tensor(self.shape, dtype=DataType.BFloat16) for _ in range(3))
        self.add_output(self.ops.sdpfa_fwd(q, k, v, 0.1, True, None)[0])


@cuda_only
def test_cuda_autograd_through_a_replayed_dropout_forward(monkeypatch):
    """``as_autograd_function``: the forward replays (the backward donates its inputs, so
    the interpreter runs it, replaying the RNG state the replayed forward wrote); outputs and
    gradients are an interpreted run's, call for call."""
    shape = [2, 4, 128, 64]
    base = _tensors(shape, "cuda")
    replays = []
    original = _Graph.replay

    def counted(graph, inputs):
        replays.append(1)
        return original(graph, inputs)

    monkeypatch.setattr(_Graph, "replay", counted)

    def run(replayed: bool):
        if replayed:
            monkeypatch.delenv("MESHFUSE_CUDA_GRAPH", raising=False)
        else:  # read when a fusion is first built
            monkeypatch.setenv("MESHFUSE_CUDA_GRAPH", "0")
        function = _AttentionOnly(shape).as_autograd_function()
        leaves = [t.clone().requires_grad_() for t in base[:3]]
        torch.manual_seed(77)
        results = []
        for call in range(4):
            with _backend("cudnn") if call == 0 else contextlib.nullcontext():
                (attn,) = function(leaves)
                attn.backward(base[3])
            results.append([attn.detach().clone(), *(t.grad.clone() for t in leaves)])
            for t in leaves:
                t.grad = None
            del attn
        return results

    replayed = run(True)
    assert len(replays) >= 2, "the forward was not replayed"
    count = len(replays)
    interpreted = run(False)
    assert len(replays) == count
    _assert_bitwise(replayed, interpreted)
    assert not torch.equal(replayed[2][0], replayed[3][0])


@cuda_only
def test_cuda_graph_true_draws_the_interpreters_masks():
    """``execute(cuda_graph=True)`` (captured at the first call, inputs and outputs copied)
    seeds the dropout streams before each replay as the automatic replay does."""
    b, h, s, e = 2, 4, 128, 256

    def make():
        return SeedAttention(QkvFormat.BHSE, DeviceMesh(range(1)), b, h, s, e, dropout_p=0.1)

    inputs = make().inputs_for(*random_inputs(b, h, s, e, device="cuda"), 0)
    results = {}
    for option in (True, False):
        model = make()
        torch.manual_seed(3)
        with _backend("cudnn"):
            results[option] = [model.execute(inputs, cuda_graph=option) for _ in range(4)]
    _assert_bitwise(results[True], results[False])
    assert not torch.equal(results[True][2][0], results[True][3][0])


@cuda_only
def test_cuda_graph_true_refuses_random_values_drawn_on_the_host():
    x = torch.randn(8, 8, device="cuda")
    with pytest.raises(InputError, match=r"cuda_graph=True.*draws random numbers.*rand_like"):
        _Noisy().execute([x], cuda_graph=True)
    for seeds, extra in (("constant", []), ("input", [5, 2])):
        fd = _Noisy(seeds)
        first = fd.execute([x] + extra, cuda_graph=True)[0]
        assert torch.equal(fd.execute([x] + extra, cuda_graph=False)[0], first)


@cuda_only
def test_cuda_random_ops_with_their_seed_given_replay():
    """Their values come from the seed on the host, with no read back from the device: the
    automatic replay captures them (a graph per seed value) and gives the interpreter's."""
    x = torch.randn(8, 8, device="cuda")
    for seeds, extra in (("constant", []), ("input", [5, 2])):
        fd = _Noisy(seeds)
        got = [fd.execute([x] + extra)[0].clone() for _ in range(3)]
        want = fd.execute([x] + extra, cuda_graph=False)[0]
        assert all(torch.equal(g, want) for g in got)
        line = next(s for s in fd.explain([x] + extra).splitlines() if "CUDA graph replay" in s)
        assert "graphs captured" in line, line
