"""GEMM -> allreduce loops (tensor parallelism without sequence parallelism): a row-parallel
GEMM and the allreduce of its partial result cut into row chunks, chosen by the engine.
The tests of the process group's loops ask for it (on CUDA ranks the copy engines are the
default); those of the copy engines run on CUDA only.

Values against the unsharded computation at every world size (rows that do not divide by
the chunk count, rows of a 3-D operand, a ``matmul``, the Megatron MLP's forward and
backward), the communications that ran (one allreduce per non-empty chunk, the result's
bytes in all), the user's ``set_overlap`` choice, the estimate, and explain's lines.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from mesh_helpers import mesh_1d, mesh_2x2, shard

from benchmarks.fusions import MegatronMlp, megatron_mlp_torch
from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType
from meshfuse.errors import InputError
from meshfuse.parallel.overlap import allreduce_loop_cost
from meshfuse.parallel.overlap.allreduce_loop import COPY_ENGINE, PROCESS_GROUP
from meshfuse.parallel.overlap.allreduce_pattern import GEMM_ALLREDUCE
from meshfuse.parallel.overlap.candidates import overlap_candidates
from meshfuse.parallel.overlap.cost import DEFAULT_COSTS, _largest_shard
from meshfuse.parallel.overlap.stream_loop_lowering import choose_transport
from meshfuse.passes.pipeline import compile as compile_fusion
from meshfuse.runtime.comm.collectives import Group, record_communications

FREE = "100,1,0,0"  # GB/s, TFLOP/s, us per chunk, contention: a loop always pays
MX = ParallelType.mesh_x


def _ints(*shape: int, seed: int = 0) -> torch.Tensor:
    """Small integers as floats: sums of products are exact in any order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).float()


def _kinds(comms) -> Counter:
    return Counter(c.kind for c in comms)


def _row_linear(mesh, x_shape: list[int], hidden: int, overlap: bool | None,
                op: str = "linear") -> FusionDefinition:
    """``linear(x, w)`` (or ``matmul(x, w.T)``), the contracted (last) axis of x and of w
    split over the mesh: a partial result, allreduced into the replicated output."""
    k = x_shape[-1]
    with FusionDefinition() as fd:
        x = fd.define_tensor(x_shape, dtype=DataType.Float)
        w = fd.define_tensor([hidden, k] if op == "linear" else [k, hidden],
                             dtype=DataType.Float)
        out = fd.ops.linear(x, w) if op == "linear" else fd.ops.matmul(x, w)
        fd.add_output(out)
    shard(x, len(x_shape) - 1, mesh)
    shard(w, 1 if op == "linear" else 0, mesh)
    if overlap is not None:
        out.set_overlap(overlap)
    return fd


def _run(multidevice_test, fd, globals_):
    inputs = [multidevice_test.shard_tensor(t, tv)
              for t, tv in zip(globals_, fd.fusion.inputs())]
    with record_communications() as comms:
        out, = fd.execute(inputs)
    return out, comms, fd.explain(inputs)


def _linear_on_every_rank(multidevice_test, x_shape: list[int], overlap: bool | None):
    """``_row_linear`` on every rank, x of ``x_shape`` and w of [3, 8] (small integers), run
    once; its output must be ``F.linear`` of the global tensors.

    Returns:
        The fusion, the communications that ran and explain's text for the inputs.
    """
    fd = _row_linear(mesh_1d(multidevice_test), x_shape, 3, overlap=overlap)
    x, w = _ints(*x_shape), _ints(3, 8, seed=1)
    out, comms, text = _run(multidevice_test, fd, (x, w))
    torch.testing.assert_close(out.cpu(), F.linear(x, w))
    return fd, comms, text


@pytest.mark.mpi
@pytest.mark.parametrize("x_shape, chunks", [([8, 8], 2), ([7, 8], 4), ([2, 3, 8], 4),
                                             ([3, 8], 8), ([9, 8], 8)],
                         ids=["even", "uneven", "rows_of_3d", "more_chunks_than_rows", "empty_chunks"])
def test_forced_loop_values_and_allreduces(multidevice_test, monkeypatch, x_shape, chunks):
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "process_group")
    monkeypatch.setenv("MESHFUSE_OVERLAP_CHUNKS", str(chunks))
    d = multidevice_test.size
    _, comms, text = _linear_on_every_rank(multidevice_test, x_shape, overlap=True)
    rows = math.prod(x_shape[:-1])
    if d == 1:
        assert _kinds(comms) == Counter()
        return
    chunks = min(chunks, rows)
    q = -(-rows // chunks)
    assert _kinds(comms) == Counter(allreduce=-(-rows // q))  # the non-empty chunks
    assert sum(c.bytes for c in comms) == rows * 3 * 4  # each row reduced once
    assert f"stream loop: {chunks} chunks of the rows of" in text
    assert "set_overlap(True); GEMM -> allreduce: est." in text
    assert f"stream loop of {chunks} row chunks (allreduce decomposed): transfers by the " \
        "process group" in text


@pytest.mark.mpi
def test_matmul_by_a_sharded_matrix(multidevice_test, monkeypatch):
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "process_group")
    monkeypatch.setenv("MESHFUSE_OVERLAP_COST", FREE)
    monkeypatch.delenv("MESHFUSE_OVERLAP_CHUNKS", raising=False)
    d = multidevice_test.size
    fd = _row_linear(mesh_1d(multidevice_test), [9, 8], 4, overlap=None, op="matmul")
    x, w = _ints(9, 8), _ints(8, 4, seed=2)
    out, comms, text = _run(multidevice_test, fd, (x, w))
    torch.testing.assert_close(out.cpu(), x @ w)
    if d > 1:
        chunks = int(text.split("stream loop: ")[1].split()[0])
        assert chunks in (2, 4, 8)
        assert _kinds(comms) == Counter(allreduce=-(-9 // -(-9 // chunks)))


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [False, None], ids=["forbidden", "estimated"])
def test_whole_allreduce_unless_it_pays(multidevice_test, monkeypatch, overlap):
    """Forbidden, or estimated on the device's own figures (tiny CPU GEMMs, a contention of
    1): one allreduce of the whole result."""
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "process_group")
    if overlap is False:
        monkeypatch.setenv("MESHFUSE_OVERLAP_COST", FREE)  # would pay, but forbidden
    else:
        monkeypatch.delenv("MESHFUSE_OVERLAP_COST", raising=False)
    d = multidevice_test.size
    fd, comms, text = _linear_on_every_rank(multidevice_test, [6, 8], overlap=overlap)
    assert _kinds(comms) == (Counter(allreduce=1) if d > 1 else Counter())
    if d > 1:
        why = "set_overlap(False)" if overlap is False else "GEMM -> allreduce: est."
        line = next(s for s in text.splitlines() if "next to linear -> " in s)
        assert f": as a whole ({why}" in line
        before = "set_overlap(False)" if overlap is False else \
            "decided per input signature by a cost estimate"
        assert any(s.startswith("  GEMM -> allreduce: ") and s.endswith(before)
                   for s in fd.explain().splitlines())  # without inputs: the candidate
        assert "stream loop" not in text


@pytest.mark.mpi
def test_overlap_off_keeps_the_allreduce_whole(multidevice_test, monkeypatch):
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "process_group")
    monkeypatch.setenv("MESHFUSE_OVERLAP_COST", FREE)
    monkeypatch.setenv("MESHFUSE_OVERLAP", "off")
    _, comms, text = _linear_on_every_rank(multidevice_test, [6, 8], overlap=None)
    if multidevice_test.size > 1:
        assert _kinds(comms) == Counter(allreduce=1)
        assert "as a whole (MESHFUSE_OVERLAP=off)" in text


@pytest.mark.mpi
def test_loop_on_a_2x2_mesh(multidevice_test, monkeypatch):
    """Tokens over mesh_y, the contracted axis over mesh_x: each rank chunks its own
    tokens (5 rows, 2 chunks), one allreduce over mesh_x per chunk."""
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "process_group")
    monkeypatch.setenv("MESHFUSE_OVERLAP_CHUNKS", "2")
    mesh = mesh_2x2(multidevice_test)
    with FusionDefinition() as fd:
        x = fd.define_tensor([10, 8], dtype=DataType.Float)
        w = fd.define_tensor([3, 8], dtype=DataType.Float)
        out = fd.ops.linear(x, w)
        fd.add_output(out)
    shard(x, 0, mesh, ParallelType.mesh_y)
    shard(x, 1, mesh)
    shard(w, 1, mesh)
    shard(out, 0, mesh, ParallelType.mesh_y)
    out.set_overlap(True)
    gx, gw = _ints(10, 8), _ints(3, 8, seed=1)
    got, comms, _ = _run(multidevice_test, fd, (gx, gw))
    expected = multidevice_test.shard_tensor(F.linear(gx, gw), fd.fusion.outputs()[0])
    torch.testing.assert_close(got, expected)
    assert [(c.kind, c.mesh_axis) for c in comms] == [("allreduce", 1)] * 2


def _mlp_inputs(multidevice_test, tokens: int) -> list[torch.Tensor]:
    """x, this rank's w1 rows and w2 columns (8 of the ffn axis each), dz: MegatronMlp's
    inputs (hidden 8), on the rank's device."""
    d, r = multidevice_test.size, multidevice_test.rank
    x, dz = _ints(tokens, 8), _ints(tokens, 8, seed=1)
    w1, w2 = _ints(8 * d, 8, seed=2), _ints(8, 8 * d, seed=3)
    part = slice(r * 8, (r + 1) * 8)
    local = [x, w1[part].contiguous(), w2[:, part].contiguous(), dz]
    return [t.to(multidevice_test.device) for t in local]


@pytest.mark.mpi
@pytest.mark.parametrize("tokens", [16, 13], ids=["even", "uneven"])
def test_megatron_mlp_loops_keep_the_backward_overlap(multidevice_test, monkeypatch, tokens):
    """The MLP's two allreduces (z forward, dx backward) as loops of 4 chunks: values as
    the Megatron calls; the forward loop runs before the backward's GEMMs, and z is read
    only after them (the loop's result is waited for where read, not at the loop's end);
    the backward's loop runs before the weight gradients' GEMMs, as its allreduce did."""
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "process_group")
    monkeypatch.setenv("MESHFUSE_OVERLAP_CHUNKS", "4")
    d = multidevice_test.size
    mesh = DeviceMesh(range(d)) if d > 1 else None
    model = MegatronMlp(tokens, 8, 8 * d, mesh, dtype=DataType.Float, overlap=True)
    inputs = _mlp_inputs(multidevice_test, tokens)
    with record_communications() as comms:
        got = model.execute(inputs)
    group = torch.distributed.group.WORLD if d > 1 else None
    for a, b in zip(got, megatron_mlp_torch(*inputs, group)):
        torch.testing.assert_close(a, b)
    if d == 1:
        return
    assert _kinds(comms) == Counter(allreduce=8)
    program = model.explain(inputs, verbose=True).split("program on rank")[1].splitlines()
    loops = [k for k, line in enumerate(program) if "stream loop: 4 row chunks" in line]
    first_backward_gemm = next(k for k, line in enumerate(program) if "= matmul(T3, T2)" in line)
    z_read = next(k for k, line in enumerate(program) if "T7 = set(T16)" in line)
    weight_gradients = [k for k, line in enumerate(program)
                        if "= matmul(T10, T5)" in line or "= matmul(T12, T0)" in line]
    assert len(loops) == 2 and loops[0] < first_backward_gemm < z_read
    assert loops[1] < min(weight_gradients)  # dx's chunks move under dw1's and dw2's GEMMs


MLP = (2.0 * 8192 * 8192 * 16384, 8192 * 8192 * 2)  # the MLP's GEMM per device, its result
NCCL, CE = DEFAULT_COSTS["cuda"], DEFAULT_COSTS["cuda_copy_engine"]


def test_estimate_with_nccl_never_pays():
    """With NCCL's measured contention (1) a loop is never estimated faster, whatever work
    runs beside it."""
    for k in (2, 4, 8):
        for beside in (0.0, 4 * MLP[0]):
            whole, looped = allreduce_loop_cost.estimate_ms(NCCL, NCCL, *MLP, 2, k,
                                                            beside_flops=beside)
            assert looped > whole


def test_estimate_with_copy_engines_chunks_only_what_nothing_hides():
    """By the copy engines: with GEMMs beside the allreduce (the MLP's backward) one chunk
    is best, the transfer then costing no SM; with none (a forward alone) several are."""
    def best(beside):
        times = {k: allreduce_loop_cost.estimate_ms(NCCL, CE, *MLP, 2, k, COPY_ENGINE, beside)
                 for k in (1, 2, 4, 8)}
        k = min(times, key=lambda k: times[k][1])
        return k, times[k]

    k, (whole, looped) = best(4 * MLP[0])
    assert k == 1 and looped < 0.85 * whole
    k, (whole, looped) = best(0.0)
    assert k > 1 and looped < 0.95 * whole


@pytest.mark.parametrize("d", [2, 4])
def test_megatron_mlp_choice_reads_the_gemms_beside(d, monkeypatch):
    """The compiled MLP at the benchmark's sizes: both allreduces are candidates; z's has
    the four backward GEMMs beside it, dx's the two weight gradients'; with the NCCL figures
    both run whole, with the copy engines' each as one chunk."""
    for name in ("MESHFUSE_OVERLAP", "MESHFUSE_OVERLAP_COST", "MESHFUSE_OVERLAP_CHUNKS"):
        monkeypatch.delenv(name, raising=False)
    model = MegatronMlp(8192, 8192, 32768, DeviceMesh(range(d))).define()
    fusion = compile_fusion(model.fusion, d).fusion
    extents = {i: i.extent for tv in fusion.tensors() for i in tv.logical}
    candidates = overlap_candidates(fusion, [])
    assert [c.kind for c in candidates] == [GEMM_ALLREDUCE] * 2
    per_gemm = 2.0 * 8192 * 8192 * 32768 / d
    for c, beside in zip(candidates, (4, 2)):
        plan, why = allreduce_loop_cost.choose(c, extents, _largest_shard, NCCL, NCCL,
                                               PROCESS_GROUP, True)
        beside_ms = beside * per_gemm / (NCCL.gemm_tflops * 1e12) * 1e3
        assert plan is None and f"{beside_ms:.3f} ms of GEMMs beside" in why
        plan, why = allreduce_loop_cost.choose(c, extents, _largest_shard, NCCL, CE,
                                               COPY_ENGINE, True)
        assert plan is not None and plan.chunks == 1 and "in 1 chunks by copy engines" in why


def test_chunk_count_from_the_environment(monkeypatch):
    monkeypatch.setenv("MESHFUSE_OVERLAP_CHUNKS", "3")
    assert allreduce_loop_cost.fixed_chunks() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("MESHFUSE_OVERLAP_CHUNKS", bad)
        with pytest.raises(InputError, match="MESHFUSE_OVERLAP_CHUNKS.*positive number"):
            allreduce_loop_cost.fixed_chunks()


@pytest.mark.mpi
def test_copy_engines_asked_for_on_a_cpu_fall_back(multidevice_test, monkeypatch):
    """MESHFUSE_OVERLAP_TRANSPORT=copy_engine on CPU ranks: the process group carries the
    chunks' allreduces, and explain says why."""
    if torch.cuda.is_available():
        pytest.skip("CPU ranks only (on CUDA the copy engines run)")
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "copy_engine")
    monkeypatch.setenv("MESHFUSE_OVERLAP_CHUNKS", "2")
    _, comms, text = _linear_on_every_rank(multidevice_test, [5, 8], overlap=True)
    if multidevice_test.size > 1:
        assert _kinds(comms) == Counter(allreduce=2)
        assert "transfers by the process group" in text and "copy engines are CUDA's" in text


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="copy engines: CUDA only")


@cuda_only
@pytest.mark.mpi
@pytest.mark.parametrize("rows, chunks", [(8, 1), (8, 2), (7, 4)],
                         ids=["whole", "even", "uneven"])
def test_copy_engine_loop_equals_the_unsharded_gemm(multidevice_test, monkeypatch, rows,
                                                    chunks):
    """On CUDA: the peers' rows pulled by the copy engines and summed where the result is
    read, three calls in a row (the workspace reused), d - 1 pulls per chunk recorded."""
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "copy_engine")
    monkeypatch.setenv("MESHFUSE_OVERLAP_CHUNKS", str(chunks))
    d = multidevice_test.size
    fd = _row_linear(mesh_1d(multidevice_test), [rows, 8], 3, overlap=True)
    x, w = _ints(rows, 8), _ints(3, 8, seed=1)
    for _ in range(3):
        out, comms, text = _run(multidevice_test, fd, (x, w))
        torch.testing.assert_close(out.cpu(), F.linear(x, w))
    if d > 1:
        nonempty = -(-rows // -(-rows // chunks))
        assert _kinds(comms) == Counter(copy_engine_pull=nonempty * (d - 1))
        assert sum(c.bytes for c in comms) == rows * 3 * 4 * (d - 1)
        assert "transfers by copy engines" in text


@cuda_only
@pytest.mark.mpi
def test_megatron_mlp_with_copy_engine_loops(multidevice_test, monkeypatch):
    """On CUDA: the MLP's two allreduces by the copy engines (one chunk each) give the
    Megatron calls' values, twice in a row."""
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "copy_engine")
    monkeypatch.setenv("MESHFUSE_OVERLAP_CHUNKS", "1")
    d = multidevice_test.size
    mesh = DeviceMesh(range(d)) if d > 1 else None
    model = MegatronMlp(12, 8, 8 * d, mesh, dtype=DataType.Float, overlap=True)
    inputs = _mlp_inputs(multidevice_test, 12)
    group = torch.distributed.group.WORLD if d > 1 else None
    for _ in range(2):
        with record_communications() as comms:
            got = model.execute(inputs)
        for a, b in zip(got, megatron_mlp_torch(*inputs, group)):
            torch.testing.assert_close(a, b)
    if d > 1:
        assert _kinds(comms) == Counter(copy_engine_pull=2 * (d - 1))


@pytest.mark.mpi
@pytest.mark.parametrize("forced", [False, True], ids=["whole", "loop"])
def test_output_set_of_an_allreduce_is_not_copied(multidevice_test, monkeypatch, forced):
    """``out = set(partial)``: the allreduce's (or the loop's) result becomes the output
    without a copy (on one device the communication is a local copy, and the set none);
    a second output reading the same result keeps its own buffer."""
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "process_group")
    monkeypatch.setenv("MESHFUSE_OVERLAP_CHUNKS", "2")
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 8], dtype=DataType.Float)
        w = fd.define_tensor([3, 8], dtype=DataType.Float)
        partial = fd.ops.linear(x, w)
        z = fd.ops.set(partial)
        fd.add_output(z)
    shard(x, 1, mesh)
    shard(w, 1, mesh)
    partial.set_overlap(forced)
    gx, gw = _ints(6, 8), _ints(3, 8, seed=1)
    inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((gx, gw), (x, w))]
    # The program's own copies: on CUDA a plain execute may replay a graph, which copies
    # its outputs out of the graph's memory.
    fd.execute(inputs, cuda_graph=False)  # the first call also agrees on the inputs
    with torch.profiler.profile() as prof:
        out, = fd.execute(inputs, cuda_graph=False)
    torch.testing.assert_close(out.cpu(), F.linear(gx, gw))
    copies = [e.name for e in prof.events() if e.name in ("aten::clone", "aten::copy_")]
    assert copies == ([] if multidevice_test.size > 1 else ["aten::clone", "aten::copy_"])

    with FusionDefinition() as twice:
        x = twice.define_tensor([6, 8], dtype=DataType.Float)
        w = twice.define_tensor([3, 8], dtype=DataType.Float)
        reduced = twice.ops.set(twice.ops.linear(x, w))
        twice.add_output(reduced)
        twice.add_output(twice.ops.set(reduced))
    shard(x, 1, mesh)
    shard(w, 1, mesh)
    a, b = twice.execute(inputs)
    torch.testing.assert_close(a, b)
    assert a.data_ptr() != b.data_ptr()


def test_transport_default_of_allreduce_loops(monkeypatch):
    """``auto`` means the copy engines where they can run (not on a CPU, which says why);
    the process group asked for is kept."""
    monkeypatch.delenv("MESHFUSE_OVERLAP_TRANSPORT", raising=False)
    cpu, group = torch.device("cpu"), [Group(None, (0, 1), 0, 0)]
    transport, why = choose_transport("auto", cpu, group, False)
    assert transport == PROCESS_GROUP
    assert why.startswith("copy engines unavailable: copy engines are CUDA")
    assert choose_transport("process_group", cpu, group, False) == \
        (PROCESS_GROUP, "asked for the process group")
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "nccl")
    assert choose_transport("auto", cpu, group, False)[0] == PROCESS_GROUP