"""The GEMM calls of a program (``benchmarks.gemm_record``): recorded with their operands'
layouts, scaled to other sizes; and meshfuse's GPT-3 layer (TP + SP, derived backward)
making the same calls as DTensor's, rank by rank, the row-parallel bias's ``addmm``
included on ranks whose partial result leaves the bias out.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import meshfuse
from benchmarks.context import Context
from benchmarks.gemm_calls import differences, extents, layer_steps, pairs
from benchmarks.gemm_record import GemmRecorder, TensorSpec, gemms, replay, scaled
from meshfuse import DataType, FusionDefinition
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.testing.utils import current_device

SMALL = {"b": 1, "s": 48, "h": 4, "e": 80}  # gemm_calls' record sizes: distinct extents


def _linear_calls():
    x = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    with GemmRecorder() as recorder:
        y = F.linear(x, w, b)
        y.backward(torch.ones_like(y))
    return recorder.events


def test_a_linear_records_its_addmm_and_both_gradient_mms_with_layouts():
    events = _linear_calls()
    assert [e.describe() for e in gemms(events)] == [
        "addmm.default(float32[5], float32[6, 8], float32[8, 5] T) -> float32[6, 5]",
        "mm.default(float32[6, 5], float32[5, 8]) -> float32[6, 8]",
        "mm.default(float32[5, 6] T, float32[6, 8]) -> float32[5, 8]",
    ]
    addmm = gemms(events)[0]
    assert addmm.args[2] == TensorSpec((8, 5), (1, 8), "float32")
    assert addmm.problem() == ((6, 5), 8)
    assert gemms(events)[1].problem() == ((6, 8), 5)


def test_an_inductor_graph_s_extern_gemm_is_recorded():
    """Inductor leaves matrix products to aten (extern kernels) and its generated code calls
    them through the dispatcher, so a compiled graph's GEMMs are in the list too."""
    compiled = torch.compile(lambda a, b: (a @ b).relu() + 1, backend="inductor")
    a, b = torch.randn(32, 16), torch.randn(16, 8)
    compiled(a, b)
    with GemmRecorder() as recorder:
        compiled(a, b)
    assert [e.describe() for e in gemms(recorder.events)] == [
        "mm.default(float32[32, 16], float32[16, 8]) -> float32[32, 8]"]


def test_scaled_maps_each_extent_and_keeps_the_dimension_order():
    event = gemms(_linear_calls())[2]  # mm(g^T, x): a transposed first operand
    big = scaled(event, {5: 50, 6: 60, 8: 80})
    assert big.args[0] == TensorSpec((50, 60), (1, 50), "float32")
    assert big.args[1] == TensorSpec((60, 80), (80, 1), "float32")
    assert big.out == TensorSpec((50, 80), (80, 1), "float32")
    out = replay(big, "cpu", torch.Generator().manual_seed(0))()
    assert out.shape == (50, 80)


def test_scaled_refuses_an_unknown_extent_and_a_slice():
    event = gemms(_linear_calls())[0]
    with pytest.raises(ValueError, match="extent 6 of float32\\[6, 8\\] has no counterpart"):
        scaled(event, {5: 50, 8: 80})
    with GemmRecorder() as recorder:
        torch.mm(torch.randn(4, 6)[:, :3], torch.randn(3, 2))
    with pytest.raises(ValueError, match="not a dense tensor"):
        scaled(gemms(recorder.events)[0], {4: 8, 3: 6, 2: 4})


def test_record_sizes_must_keep_extents_apart():
    assert extents(SMALL, {"b": 1, "s": 2048, "h": 96, "e": 12288})[160] == 24576
    with pytest.raises(ValueError, match="coincide"):
        extents({"b": 1, "s": 64, "h": 4, "e": 64}, {"b": 1, "s": 2048, "h": 96, "e": 12288})


def test_pairs_match_an_addmm_with_the_mm_of_the_same_problem():
    x, w, b = torch.randn(6, 8), torch.randn(5, 8), torch.randn(5)
    with GemmRecorder() as base:
        F.linear(x, w, b)
        torch.mm(x, w.t())
    with GemmRecorder() as other:
        torch.mm(x, w.t())
        torch.mm(x, w.t())
    assert pairs(gemms(base.events), gemms(other.events)) == [(0, 0), (1, 1)]
    with GemmRecorder() as third:
        torch.mm(x.t(), x)
    assert pairs(gemms(base.events), gemms(third.events)) == [(None, 0), (0, None),
                                                              (1, None)]


@pytest.mark.mpi
def test_row_parallel_linear_runs_addmm_on_every_rank(multidevice_test):
    """A partial result's bias is added on coordinate 0 only; the other ranks add a zero
    bias: one ``addmm`` everywhere (cuBLAS's bias epilogue), the values unchanged."""
    d, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 4 * d], dtype=DataType.Float)
        w = fd.define_tensor([5, 4 * d], dtype=DataType.Float)
        b = fd.define_tensor([5], dtype=DataType.Float)
        fd.add_output(fd.ops.linear(x, w, b))
    mesh = meshfuse.DeviceMesh(range(d))
    for tv in (x, w, b):
        tv.set_device_mesh(mesh)
    for tv in (x, w):
        tv.outer_split(1, d)
        tv.axis(1).parallelize(ParallelType.mesh_x)
    gen = torch.Generator().manual_seed(0)
    gx, gw, gb = (torch.randn(*s, generator=gen) for s in ((6, 4 * d), (5, 4 * d), (5,)))
    inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in ((gx, x), (gw, w), (gb, b))]
    with GemmRecorder() as recorder:
        out, = fd.execute(inputs)
    assert [e.op for e in gemms(recorder.events)] == ["addmm.default"], rank
    torch.testing.assert_close(out.cpu(), F.linear(gx, gw, gb))


@pytest.mark.mpi
def test_gpt3_layer_makes_dtensors_gemm_calls_on_every_rank(multidevice_test):
    """The GPT-3 layer's forward + derived backward (TP + SP) calls the GEMMs DTensor's
    ``parallelize_module`` layer calls, with the same operand shapes, strides and dtypes,
    on every rank (the order differs: meshfuse launches its collectives early)."""
    if str(current_device()) != "cpu":
        pytest.skip("the lists are recorded on CPU ranks (gloo)")
    d, rank = multidevice_test.size, multidevice_test.rank
    ctx = Context(rank, d, rank, torch.device("cpu"), "gloo", quick=True)
    sizes = dict(SMALL, h=4 * d)  # the heads split over any world size
    lists = {}
    for name, step in layer_steps(ctx, sizes, compile=False).items():
        step()
        with GemmRecorder() as recorder:
            step()
        lists[name] = recorder.events
    dtensor, mine = (Counter(e.describe() for e in gemms(lists[n]))
                     for n in ("dtensor", "meshfuse"))
    assert sum(dtensor.values()) == 18
    assert mine == dtensor, differences(lists)
