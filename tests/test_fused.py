"""Fused segments (``execute(..., compile=...)``): the compiled program gives the interpreter's
results and runs the same communications.

Checked: which records a program's runs of fusible steps become (a matrix product and a
communication stay outside, a segment ends before a step reading a communication's result);
values against the interpreter and against plain PyTorch, on one process and sharded at every
world size the suite runs (a row-parallel linear whose partial sums are allreduced, then a
softmax-like chain; the fusion benchmark's programs); the communications recorded; no
recompilation on cached calls (meshfuse's compile counter and torch's); a scalar input
compiled once per value; explain's line. The suite compiles with ``aot_eager`` (the same lowering,
through torch.compile's tracing, without generating kernels: Inductor's C++ compiler takes
tens of seconds on a loaded CPU); ``MESHFUSE_TEST_INDUCTOR=1`` adds the Inductor run.
"""

from __future__ import annotations

import os

import pytest
import torch
from mesh_helpers import mesh_1d, shard
from torch._dynamo.utils import counters

from benchmarks.cases.fusion import NormFwdBwd, SoftmaxRows
from benchmarks.fusions import Pointwise10
from meshfuse import DataType, FusionDefinition, InputError, shard_tensor
from meshfuse.engine.settings import compile_setting
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.runtime.interpreter import fused as fused_module
from meshfuse.runtime.interpreter import persistent_rows
from meshfuse.runtime.interpreter.fused import (
    FUSED,
    INDUCTOR,
    INDUCTOR_ALONG_ROWS_ON_CUDA,
    INDUCTOR_ON_CUDA,
    inductor_patches,
)

BACKEND = "aot_eager"


class _LinearThenSoftmax(FusionDefinition):
    """``softmax(x @ w.T * 0.5, dim=1)`` written with ops; ``x`` and ``w`` optionally split on
    the reduced axis (partial sums, allreduced before the chain)."""

    def __init__(self, mesh=None):
        super().__init__()
        self.mesh = mesh

    def definition(self) -> None:
        self.x = self.define_tensor([6, 12], dtype=DataType.Float)
        self.w = self.define_tensor([5, 12], dtype=DataType.Float)
        x = self.ops.mul(self.ops.exp(self.x), 0.5)  # a segment before the matmul
        y = self.ops.mul(self.ops.linear(x, self.w), 0.5)
        m = self.ops.broadcast_in_dim(self.ops.max(y, [1]), [6, 5], [0])
        e = self.ops.exp(self.ops.sub(y, m))
        s = self.ops.broadcast_in_dim(self.ops.sum(e, [1]), [6, 5], [0])
        self.y = self.ops.div(e, s)
        self.add_output(self.y)

    def multidevice_schedule(self) -> None:
        if self.mesh is not None:
            for tv in (self.x, self.w):
                shard(tv, 1, self.mesh)
            self.y.set_device_mesh(self.mesh)


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.softmax(torch.nn.functional.linear(x.exp() * 0.5, w) * 0.5, dim=1)


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(6, 12, generator=gen), torch.randn(5, 12, generator=gen)


def test_runs_of_fusible_steps_become_segments_and_match_the_interpreter():
    fd = _LinearThenSoftmax()
    x, w = _inputs()
    want, = fd.execute([x, w], compile=False)
    got, = fd.execute([x, w], compile=BACKEND)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, _reference(x, w))
    runner = fd._get_runner()
    (program, stats), = runner._fused.values()
    assert [s.op for s in program.steps] == [FUSED, "linear", FUSED]
    assert "fused segment of 2 steps" in program.steps[0].label
    assert stats.compiles == 2
    for seed in (1, 2):  # cached calls, new values: no recompilation
        x, w = _inputs(seed)
        got, = fd.execute([x, w], compile=BACKEND)
        torch.testing.assert_close(got, _reference(x, w))
    assert stats.compiles == 2
    assert f"fused segments ({BACKEND}): 2 of 3 steps; 2 segment compilations" in \
        fd.explain([x, w])


class _ProductsBetweenPointwise(FusionDefinition):
    """Pointwise work interleaved with matrix products as a derived backward interleaves it:
    ``a = exp(x)``; ``p = a @ w1.T``; ``b = x * 2`` and ``c = tanh(w2)`` need no product (they
    may join ``a``'s segment); ``q = (p + 1) @ w2.T`` reads ``p`` (its ``p + 1`` may not move
    above the product it reads); ``d = b + c`` may join ``p + 1``'s segment."""

    def definition(self) -> None:
        o = self.ops
        self.x = self.define_tensor([6, 8], dtype=DataType.Float)
        self.w1 = self.define_tensor([8, 8], dtype=DataType.Float)
        self.w2 = self.define_tensor([8, 8], dtype=DataType.Float)
        a = o.exp(self.x)
        p = o.linear(a, self.w1)
        b = o.mul(self.x, 2.0)
        c = o.tanh(self.w2)
        q = o.linear(o.add(p, 1.0), self.w2)
        d = o.add(o.mul(b, 3.0), o.sum(c, [1]))
        for t in (q, d):
            self.add_output(t)


def test_pointwise_steps_that_need_no_product_join_the_segment_before_it(monkeypatch):
    """A fusible step moves up past matrix products it does not read, to the previous
    segment: the program above runs as 2 segments and 2 products, not 4 and 2, with the
    interpreter's values. (Recomputation across segments is off here: it would then move
    ``x * 2`` and ``tanh(w2)`` into the second segment, which reads ``x`` and ``w2``
    instead of their results: tests/test_recompute_segments.py.)"""
    from meshfuse.runtime.interpreter import fused

    original = fused.recomputed_in_readers
    monkeypatch.setattr(fused, "recomputed_in_readers",
                        lambda *args: original(*args[:4], {}, *args[5:]))
    fd = _ProductsBetweenPointwise()
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(6, 8, generator=gen), torch.randn(8, 8, generator=gen),
              torch.randn(8, 8, generator=gen)]
    want = fd.execute(inputs, compile=False)
    got = fd.execute(inputs, compile=BACKEND)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    x, w1, w2 = inputs
    torch.testing.assert_close(got[0], (x.exp() @ w1.T + 1) @ w2.T)
    (program, _), = fd._get_runner()._fused.values()
    assert [s.op for s in program.steps] == [FUSED, "linear", FUSED, "linear"]
    assert "tanh" in program.steps[0].label and "exp" in program.steps[0].label


def test_clustering_keeps_reads_frees_and_communications_in_order():
    """``clustered`` moves a fusible step over a product only when it reads none of the
    product's results nor of its inputs (which an op may write in place, and whose last use
    the step may be), and no communication lies between; a program that defines a slot
    twice keeps its order."""
    from meshfuse.runtime.interpreter.executor import RESHARD, Slot, Step
    from meshfuse.runtime.interpreter.fused import clustered

    def step(op, reads, outputs, free=()):
        return Step(op, tuple(Slot(r) for r in reads), {}, tuple(outputs), tuple(free), op)

    exp, mm = step("exp", [0], [1]), step("linear", [1, 9], [2])
    assert clustered([exp, mm, step("neg", [0], [3])], set()) == [0, 2, 1]
    assert clustered([exp, mm, step("neg", [2], [3])], set()) == [0, 1, 2]  # reads the product
    assert clustered([exp, mm, step("neg", [9], [3], free=[9])], set()) == [0, 1, 2]  # frees
    assert clustered([exp, mm, step("neg", [9], [3])], set()) == [0, 1, 2]  # reads its input
    reshard = step(RESHARD, [1], [4])
    assert clustered([exp, reshard, step("neg", [0], [3])], {4}) == [0, 1, 2]
    assert clustered([exp, mm, step("neg", [0], [1])], set()) == [0, 1, 2]  # %1 defined twice


def test_a_lone_pointwise_step_moves_down_to_the_next_segment():
    """A fusible step between two products (a Llama MLP's ``silu(x @ w1) * (x @ w3)``) moves
    past the product it does not touch into the next fusible run: one kernel; not when the
    product reads its result or its input, when it frees a slot (its inputs would live
    longer), or when a communication lies between."""
    from meshfuse.runtime.interpreter.executor import RESHARD, Slot, Step
    from meshfuse.runtime.interpreter.fused import clustered

    def step(op, reads, outputs, free=()):
        return Step(op, tuple(Slot(r) for r in reads), {}, tuple(outputs), tuple(free), op)

    gate, silu = step("linear", [0, 1], [2]), step("silu", [2], [3])
    up, mul = step("linear", [0, 4], [5]), step("mul", [3, 5], [6])
    assert clustered([gate, silu, up, mul], set()) == [0, 2, 1, 3]
    assert clustered([gate, silu, step("linear", [3, 4], [5]), mul], set()) == [0, 1, 2, 3]
    assert clustered([gate, silu, step("linear", [2, 4], [5]), mul], set()) == [0, 1, 2, 3]
    assert clustered([gate, step("silu", [2], [3], free=[2]), up, mul], set()) == [0, 1, 2, 3]
    assert clustered([gate, silu, step(RESHARD, [0], [5]), mul], {5}) == [0, 1, 2, 3]
    assert clustered([gate, silu, step("linear", [7, 4], [5]), mul], {7}) == [0, 1, 2, 3]
    # a fusible step that nothing fusible follows stays where it is
    assert clustered([gate, silu, up], set()) == [0, 1, 2]


def test_environment_and_option_select_the_compiler(monkeypatch):
    assert compile_setting("0") is None and compile_setting(False) is None
    assert compile_setting("1") == "inductor" and compile_setting(True) == "inductor"
    assert compile_setting("aot_eager") == "aot_eager"
    assert compile_setting("auto") == "auto"
    with pytest.raises(InputError, match=r"compile=3.*backend name"):
        compile_setting(3)
    with pytest.raises(InputError, match=r"compile='inductr'.*no torch.compile backend"):
        compile_setting("inductr")
    monkeypatch.setenv("MESHFUSE_COMPILE", BACKEND)
    fd = _LinearThenSoftmax()
    x, w = _inputs()
    got, = fd.execute([x, w])
    torch.testing.assert_close(got, _reference(x, w))
    assert len(fd._get_runner()._fused) == 1
    fd.execute([x, w], compile=False)  # the option wins over the environment
    assert len(fd._get_runner()._fused) == 1


@pytest.mark.mpi
def test_sharded_compiled_program_matches_interpreter_and_communicates_alike(multidevice_test):
    rank, mesh = multidevice_test.rank, mesh_1d(multidevice_test)
    fd = _LinearThenSoftmax(mesh)
    fd.define()
    x, w = _inputs()
    inputs = [shard_tensor(t, tv, rank).to(multidevice_test.device)
              for t, tv in ((x, fd.x), (w, fd.w))]
    with record_communications() as eager_comms:
        want, = fd.execute(inputs, compile=False)
    with record_communications() as fused_comms:
        got, = fd.execute(inputs, compile=BACKEND)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got.cpu(), _reference(x, w), rtol=1e-5, atol=1e-6)
    assert [c.kind for c in fused_comms] == [c.kind for c in eager_comms] == \
        ["allreduce"] * int(multidevice_test.size > 1)
    (program, stats), = fd._get_runner()._fused.values()
    ops = [s.op for s in program.steps]
    if multidevice_test.size > 1:  # the chain after the allreduce starts its own segment
        assert ops == [FUSED, "linear", "reshard", FUSED]
    fd.execute(inputs, compile=BACKEND)
    assert stats.compiles == ops.count(FUSED)


@pytest.mark.skipif(os.environ.get("MESHFUSE_TEST_INDUCTOR", "0") == "0",
                    reason="Inductor's C++ compile takes tens of seconds on a loaded CPU; "
                           "MESHFUSE_TEST_INDUCTOR=1 runs it")
def test_inductor_compiles_the_segments():
    torch._inductor.config.compile_threads = 1
    fd = _LinearThenSoftmax()
    x, w = _inputs()
    got, = fd.execute([x, w], compile=True)
    torch.testing.assert_close(got, _reference(x, w))
    fd.execute([x, w], compile=True)
    (_, stats), = fd._get_runner()._fused.values()
    assert stats.compiles == 2 and stats.seconds > 0


def _compile_counters() -> dict:
    """torch's compile counters (Dynamo frames and graphs, AOTAutograd compilations)."""
    return {name: dict(counter) for name, counter in counters.items()}


def test_cached_calls_never_recompile():
    fd = _LinearThenSoftmax()
    fd.execute(list(_inputs()), compile=BACKEND)
    first = _compile_counters()
    assert first["aot_autograd"]["total"] >= 2  # the counter counts segment compilations
    for seed in (1, 2, 3):
        x, w = _inputs(seed)
        got, = fd.execute([x, w], compile=BACKEND)
        torch.testing.assert_close(got, _reference(x, w))
    assert _compile_counters() == first
    (_, stats), = fd._get_runner()._fused.values()
    assert stats.compiles == 2


class _ScaledChain(FusionDefinition):
    """``exp(x * a) + a`` with ``a`` a Double scalar input: a segment reading a Python number."""

    def definition(self) -> None:
        self.x = self.define_tensor([3, 4], dtype=DataType.Float)
        self.a = self.define_scalar(dtype=DataType.Double)
        self.add_output(self.ops.add(self.ops.exp(self.ops.mul(self.x, self.a)), self.a))


def test_a_scalar_input_compiles_once_per_value():
    fd = _ScaledChain()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    for a, compiles in ((0.5, 1), (2.0, 2), (0.5, 2), (2.0, 2)):
        got, = fd.execute([x, a], compile=BACKEND)
        want, = fd.execute([x, a], compile=False)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got, torch.exp(x * a) + a)
        (program, stats), = fd._get_runner()._fused.values()
        assert [s.op for s in program.steps] == [FUSED]
        assert stats.compiles == compiles


def _benchmark_programs():
    """The fusion benchmark's programs at small sizes: (fusion, inputs)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    bf16 = torch.bfloat16
    return {
        "pointwise10": (Pointwise10(8, None), [randn(8, 8), randn(8, 8)]),
        "softmax": (SoftmaxRows(8, 16, None), [randn(8, 16, dtype=bf16)]),
        "layer_norm": (NormFwdBwd(8, 16, None, rms=False),
                       [randn(8, 16, dtype=bf16), randn(16, dtype=bf16), randn(8, 16, dtype=bf16)]),
        "rms_norm": (NormFwdBwd(8, 16, None, rms=True),
                     [randn(8, 16, dtype=bf16), randn(16, dtype=bf16), randn(8, 16, dtype=bf16)]),
    }


@pytest.mark.parametrize("name", ["pointwise10", "softmax", "layer_norm", "rms_norm"])
def test_benchmark_programs_compiled_match_the_interpreter(name):
    fd, inputs = _benchmark_programs()[name]
    want = fd.execute(inputs, compile=False)
    got = fd.execute(inputs, compile=BACKEND)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.stride() == w.stride()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    (program, _), = fd._get_runner()._fused.values()
    assert [s.op for s in program.steps] == [FUSED]  # the whole program is one segment


def test_auto_compiles_on_cuda_only():
    fd = _LinearThenSoftmax()
    x, w = _inputs()
    fd.execute([x, w], compile="auto")  # CPU tensors: the interpreter
    assert not fd._get_runner()._fused
    if torch.cuda.is_available():
        got, = fd.execute([x.cuda(), w.cuda()], compile="auto")
        torch.testing.assert_close(got.cpu(), _reference(x, w))
        (_, backend), = fd._get_runner()._fused
        assert backend == "inductor"


class _Like:
    """A stand-in for a tensor of a device (only ``is_cuda`` is read)."""

    def __init__(self, is_cuda: bool):
        self.is_cuda = is_cuda


def test_inductor_segments_on_gpus_get_persistent_kernels_for_rows(monkeypatch):
    """Inductor on CUDA tensors recomputes pointwise values of up to 40 operations in each
    reader (realize_opcount_threshold) and, where the segment reduces along rows, compiles
    its reductions with meshfuse's heuristics (persistent kernels for rows of up to 16384:
    ``persistent_rows``, named by its own setting); a segment whose reductions all run
    across rows keeps Inductor's own heuristics; Inductor everywhere rounds at casts to
    half precision; other backends get no settings."""
    on_cuda = {**INDUCTOR, **INDUCTOR_ON_CUDA}
    along_rows_on_cuda = {**on_cuda, **INDUCTOR_ALONG_ROWS_ON_CUDA}
    assert inductor_patches("inductor", [_Like(False), _Like(True)]) == along_rows_on_cuda
    assert INDUCTOR_ON_CUDA["realize_opcount_threshold"] == 40
    assert INDUCTOR_ALONG_ROWS_ON_CUDA == {persistent_rows.SETTING: 16384}
    assert inductor_patches("inductor", [_Like(False)]) == INDUCTOR == \
        {"emulate_precision_casts": True}
    assert inductor_patches("aot_eager", [_Like(True)]) == {}
    for along_rows, patches in ((True, along_rows_on_cuda), (False, on_cuda)):
        monkeypatch.setattr(fused_module, "reduces_along_rows", lambda g, t, a=along_rows: a)
        assert inductor_patches("inductor", [_Like(True)], object()) == patches
