"""Stream-parallel loops (``ParallelType.stream``, ``swizzle1d``): values against the
unsharded computation and the communications each chunk runs, at every world size.

Each test defines a layer with global shapes, parallelizes one axis on stream, runs it on
this rank's shards and compares with plain PyTorch on the global tensors (sliced to this
rank's shard); it then asserts the communications that ran: one per chunk for a collective
on another axis (allreduce, allgather), ``d`` broadcasts or ``d - 1`` collective permutes for
an allgather of the stream axis itself.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard

from meshfuse import DataType, FusionDefinition, MemoryType, ParallelType
from meshfuse.errors import ScheduleError
from meshfuse.multidevice import (
    CommunicatorBackend,
    MultiDeviceExecutor,
    MultiDeviceExecutorParams,
)
from meshfuse.runtime.comm.collectives import record_communications

STREAM = ParallelType.stream


def _ints(*shape: int, seed: int = 0) -> torch.Tensor:
    """Small integers as floats: sums of products are exact in any order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).float()


def _kinds(comms) -> Counter:
    return Counter(c.kind for c in comms)


def _row_parallel(tokens: int, hidden: int, chunks: int, mesh) -> FusionDefinition:
    """linear(x, w) with the contracted axis sharded and the tokens of x on stream."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4 * hidden], dtype=DataType.Float)
        w = fd.define_tensor([hidden, 4 * hidden], dtype=DataType.Float)
        fd.add_output(fd.ops.linear(x, w))
    x.set_device_mesh(mesh)
    x.outer_split(0, chunks)
    x.axis(0).parallelize(STREAM)
    x.outer_split(2, mesh.size)
    x.axis(2).parallelize(MX)
    shard(w, 1, mesh)
    return fd


@pytest.mark.mpi
@pytest.mark.parametrize("tokens, chunks", [(6, 3), (7, 3), (2, 4)],
                         ids=["even", "uneven", "empty_chunks"])
def test_row_parallel_linear_allreduce_per_chunk(multidevice_test, tokens, chunks):
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    fd = _row_parallel(tokens, 3, chunks, mesh)
    x, w = _ints(tokens, 12), _ints(3, 12, seed=1)
    inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((x, w), fd.fusion.inputs())]
    with record_communications() as comms, torch.profiler.profile(record_shapes=True) as prof:
        out, = fd.execute(inputs)
    torch.testing.assert_close(out.cpu(), F.linear(x, w))
    assert _kinds(comms) == (Counter(allreduce=chunks) if d > 1 else Counter())
    # one GEMM per chunk, written into its block of the output (out=: three operands)
    gemms = [e.input_shapes for e in prof.events() if e.name == "aten::mm"]
    k, rows = 12 // d, -(-tokens // chunks)
    blocks = [max(0, min(rows, tokens - c * rows)) for c in range(chunks)]
    assert gemms == [[[m, k], [k, 3], [m, 3]] for m in blocks]
    if d > 1:  # each chunk reduces its own rows only
        assert sum(c.bytes for c in comms) == tokens * 3 * 4


@pytest.mark.mpi
def test_a_bias_moved_for_the_loop_moves_once_before_it(multidevice_test):
    """Fuzz overlap seed 24 at 2 ranks, by hand: x's tokens on stream, the contracted axis
    sharded, and a bias held by the last rank alone, which the GEMM needs everywhere. Its
    move is the same for every chunk: it runs once, before the loop (the loop took it in
    and refused the schedule: the bias has no axis the stream axis maps to)."""
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    chunks, tokens = 2, 5
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, 4 * d], dtype=DataType.Float)
        w = fd.define_tensor([3, 4 * d], dtype=DataType.Float)
        b = fd.define_tensor([3], dtype=DataType.Float)
        fd.add_output(fd.ops.linear(x, w, b))
    x.set_device_mesh(mesh)
    x.outer_split(0, chunks)
    x.axis(0).parallelize(STREAM)
    x.outer_split(2, d)
    x.axis(2).parallelize(MX)
    shard(w, 1, mesh)
    b.set_device_mesh(type(mesh)([d - 1]))
    gx, gw, gb = _ints(tokens, 4 * d), _ints(3, 4 * d, seed=1), _ints(3, seed=2)
    inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((gx, gw), (x, w))]
    inputs.append(gb.to(multidevice_test.device) if multidevice_test.rank == d - 1 else None)
    with record_communications() as comms:
        out, = fd.execute(inputs)
    torch.testing.assert_close(out.cpu(), F.linear(gx, gw, gb))
    moves = _kinds(comms)
    assert moves.pop("allreduce", 0) == (chunks if d > 1 else 0)
    assert sum(moves.values()) == (1 if d > 1 else 0), comms  # the bias, once
    assert "stream loop: 2 chunks" in fd.explain(inputs)


def column_parallel(tokens: int, hidden: int, mesh, ring: bool,
                    symmetric: bool = False) -> FusionDefinition:
    """linear(allgather(x), w) with x and w sharded on their rows; the gathered x on stream
    with one chunk per device (the allgather decomposed per block), in symmetric memory if
    ``symmetric``. Static extents: an uneven symbolic extent cannot be inferred from the
    last, short shard."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, hidden], dtype=DataType.Float)
        w = fd.define_tensor([4 * hidden, hidden], dtype=DataType.Float)
        gathered = fd.ops.set(x)
        fd.add_output(fd.ops.linear(gathered, w))
    shard(x, 0, mesh)
    shard(w, 0, mesh)
    gathered.set_device_mesh(mesh)
    gathered.outer_split(0, mesh.size)
    if ring:
        gathered.swizzle1d(0, MX)
    gathered.axis(0).parallelize(STREAM)
    if symmetric:
        gathered.set_memory_type(MemoryType.symmetric)
    return fd


@pytest.mark.mpi
@pytest.mark.parametrize("ring", [True, False], ids=["collective_permute", "broadcast"])
@pytest.mark.parametrize("tokens", [8, 10], ids=["even", "uneven"])
def test_column_parallel_linear_gathers_per_chunk(multidevice_test, ring, tokens):
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    fd = column_parallel(tokens, 2, mesh, ring)
    x, w = _ints(tokens, 2), _ints(8, 2, seed=1)
    inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((x, w), fd.fusion.inputs())]
    with record_communications() as comms:
        out, = fd.execute(inputs)
    torch.testing.assert_close(out.cpu(), F.linear(x, inputs[1].cpu()))
    expected = Counter(collective_permute=d - 1) if ring else Counter(broadcast=d)
    assert _kinds(comms) == (expected if d > 1 else Counter())


@pytest.mark.mpi
@pytest.mark.parametrize("chunks", [1, 2])
def test_allgather_matmul_stream_outermost(multidevice_test, chunks):
    """x [s, d, m, k] with its device axis logical; the output's stream axis 0: an allgather
    and a linear per chunk."""
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        x = fd.define_tensor([chunks, d, 3, 4], dtype=DataType.Float)
        w = fd.define_tensor([5, 4], dtype=DataType.Float)
        b = fd.define_tensor([5], dtype=DataType.Float)
        out = fd.ops.linear(x, w, b)
        fd.add_output(out)
    for tv in (x, w, b, out):
        tv.set_device_mesh(mesh)
    x.axis(1).parallelize(MX)
    out.axis(0).parallelize(STREAM)
    gx, gw, gb = _ints(chunks, d, 3, 4), _ints(5, 4, seed=1), _ints(5, seed=2)
    device = multidevice_test.device
    inputs = [multidevice_test.shard_tensor(gx, x), gw.to(device), gb.to(device)]
    with record_communications() as comms:
        result, = MultiDeviceExecutor(fd.fusion).run(inputs)
    torch.testing.assert_close(result.cpu(), F.linear(gx, gw, gb))
    assert _kinds(comms) == (Counter(allgather=chunks) if d > 1 else Counter())


@pytest.mark.mpi
@pytest.mark.parametrize("ring", [False, True], ids=["broadcast", "offset_by_rank"])
@pytest.mark.parametrize("backend", [CommunicatorBackend.nccl, CommunicatorBackend.cuda])
def test_allgather_matmul_shard_outermost(multidevice_test, ring, backend):
    """x [d, m, k] sharded on its device axis 0, the output's stream axis 0 the same axis:
    the allgather decomposed into one block per chunk."""
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        x = fd.define_tensor([d, 3, 4], dtype=DataType.Float)
        w = fd.define_tensor([5, 4], dtype=DataType.Float)
        out = fd.ops.linear(x, w)
        fd.add_output(out)
    for tv in (x, w, out):
        tv.set_device_mesh(mesh)
    x.axis(0).parallelize(MX)
    out.axis(0).parallelize(STREAM)
    gx, gw = _ints(d, 3, 4), _ints(5, 4, seed=1)
    params = MultiDeviceExecutorParams()
    params.backend_type = backend
    params.offset_stream_indexing_by_rank = ring
    executor = MultiDeviceExecutor(fd.fusion, params)
    with record_communications() as comms:
        result, = executor.run([multidevice_test.shard_tensor(gx, x),
                                gw.to(multidevice_test.device)])
    torch.testing.assert_close(result.cpu(), F.linear(gx, gw))
    expected = Counter(collective_permute=d - 1) if ring else Counter(broadcast=d)
    assert _kinds(comms) == (expected if d > 1 else Counter())
    assert "stream loop: " in executor.explain()


@pytest.mark.mpi
def test_explain_shows_the_loop(multidevice_test):
    mesh = mesh_1d(multidevice_test)
    fd = _row_parallel(6, 3, 3, mesh)
    x, w = _ints(6, 12), _ints(3, 12, seed=1)
    inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((x, w), fd.fusion.inputs())]
    text = fd.explain(inputs, verbose=True)
    assert "stream loop: 3 chunks of axis 0 of T0: T3 = linear(T0, T1, None); " \
        "T2 = reshard(T3, [P] -> [R])" in text
    assert "= stream_loop(" not in text  # explain lists the steps by label
    assert "chunk: T3 = linear(T0, T1, None)" in text


def test_stream_axis_reduced_is_refused():
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 4], dtype=DataType.Float)
        fd.add_output(fd.ops.sum(x, [0]))
    x.outer_split(0, 3)
    x.axis(0).parallelize(STREAM)
    with pytest.raises(ScheduleError, match="cannot run per chunk"):
        fd.execute([torch.ones(6, 4)])


def test_stream_on_an_inner_split_is_refused():
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 4], dtype=DataType.Float)
        fd.add_output(fd.ops.neg(x))
    x.split(0, 3)
    x.axis(1).parallelize(STREAM)
    with pytest.raises(ScheduleError, match="outer part"):
        fd.execute([torch.ones(6, 4)])


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_single_device_loop_matches(compile):
    """Without a mesh, a stream loop is a chunked local computation (also beside fused
    segments: the loop step is not fused)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4], dtype=DataType.Float)
        w = fd.define_tensor([3, 4], dtype=DataType.Float)
        y = fd.ops.relu(fd.ops.linear(x, w))
        fd.add_output(y)
    y.outer_split(0, 4)
    y.axis(0).parallelize(STREAM)
    x_, w_ = _ints(9, 4), _ints(3, 4, seed=1)
    out, = fd.execute([x_, w_], compile=compile)
    torch.testing.assert_close(out, F.linear(x_, w_).relu())


@pytest.mark.mpi
def test_gather_needs_one_chunk_per_device(multidevice_test):
    d = multidevice_test.size
    if d == 1:
        pytest.skip("one device: nothing is gathered")
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        x = fd.define_tensor([4 * d, 2], dtype=DataType.Float)
        gathered = fd.ops.set(x)
        fd.add_output(fd.ops.neg(gathered))
    shard(x, 0, mesh)
    gathered.set_device_mesh(mesh)
    gathered.outer_split(0, 2 * d)
    gathered.axis(0).parallelize(STREAM)
    with pytest.raises(ScheduleError, match="one chunk per device"):
        fd.execute([multidevice_test.shard_tensor(torch.ones(4 * d, 2), x)])


def row_sp_linear(tokens: int, mesh, contracted: int = 8, features: int = 3,
                  matmul: bool = False) -> FusionDefinition:
    """The sequence-parallel row linear: x's tokens on stream (one chunk per device), its
    contracted axis sharded, the output reduce-scattered onto the tokens. ``matmul``:
    ``x @ w``, w ``[contracted, features]`` (else ``linear``: w ``[features, contracted]``)."""
    d = mesh.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, contracted], dtype=DataType.Float)
        w = fd.define_tensor([contracted, features] if matmul else [features, contracted],
                             dtype=DataType.Float)
        out = fd.ops.matmul(x, w) if matmul else fd.ops.linear(x, w)
        fd.add_output(out)
    x.set_device_mesh(mesh)
    x.outer_split(0, d)
    x.axis(0).parallelize(STREAM)
    x.outer_split(2, d)
    x.axis(2).parallelize(MX)
    shard(w, 0 if matmul else 1, mesh)
    shard(out, 0, mesh)
    return fd


def _reduced_per_block(multidevice_test, fd: FusionDefinition, gx: torch.Tensor,
                       gw: torch.Tensor, gemm) -> None:
    """Runs ``fd`` (:func:`row_sp_linear`) on the shards of ``gx``, ``gw``: this rank's block
    of ``gemm(gx, gw)``, by one reduce per block onto its owner."""
    x, w, out = *fd.fusion.inputs(), fd.fusion.outputs()[0]
    inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((gx, gw), (x, w))]
    with record_communications() as comms:
        result, = fd.execute(inputs)
    torch.testing.assert_close(result, multidevice_test.shard_tensor(gemm(gx, gw), out))
    d = multidevice_test.size
    assert _kinds(comms) == (Counter(reduce=d) if d > 1 else Counter())


@pytest.mark.mpi
@pytest.mark.parametrize("tokens", [8, 10], ids=["even", "uneven"])
def test_gemm_reduce_scatter_per_chunk(multidevice_test, tokens):
    """Sequence-parallel row linear: the partial product reduce-scattered onto the tokens,
    decomposed into one reduce per block onto its owner."""
    fd = row_sp_linear(tokens, mesh_1d(multidevice_test))
    _reduced_per_block(multidevice_test, fd, _ints(tokens, 8), _ints(3, 8, seed=1), F.linear)
    assert "(per chunk: a reduce onto the block's owner)" in fd.explain()


@pytest.mark.mpi
def test_a_streamed_operand_is_not_moved_instead_of_the_result(multidevice_test):
    """Overlap fuzzer seed 226 at 2 ranks, by hand: a sequence-parallel matmul with x's
    tokens on stream, where x (d contracted columns) is smaller than the result (8
    columns). Moving x onto the tokens (and w whole) would move fewer bytes than
    reduce-scattering the partial result, but x's tokens are the loop's chunks: the engine
    keeps the loop's reduce per block (it moved x, and refused the schedule)."""
    d = multidevice_test.size
    fd = row_sp_linear(10, mesh_1d(multidevice_test), contracted=d, features=8, matmul=True)
    _reduced_per_block(multidevice_test, fd, _ints(10, d), _ints(d, 8, seed=1),
                       torch.matmul)


def _sequence_parallel_mlp(mesh, tokens: int, overlap: bool | None) -> FusionDefinition:
    """A sequence-parallel MLP: tokens sharded in and out, an allgather before the first
    linear and a reduce-scatter after the second."""
    d = mesh.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, 4], dtype=DataType.Float)
        w1 = fd.define_tensor([4 * d, 4], dtype=DataType.Float)
        w2 = fd.define_tensor([4, 4 * d], dtype=DataType.Float)
        h = fd.ops.relu(fd.ops.linear(x, w1))
        out = fd.ops.linear(h, w2)
        fd.add_output(out)
    shard(x, 0, mesh)
    shard(w1, 0, mesh)
    shard(w2, 1, mesh)
    shard(out, 0, mesh)
    if overlap is not None:
        x.set_overlap(overlap)
        out.set_overlap(overlap)
    return fd


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False, None], ids=["forced", "forbidden", "auto"])
@pytest.mark.parametrize("tokens", [8, 10], ids=["even", "uneven"])
def test_sequence_parallel_overlap_choice(multidevice_test, overlap, tokens):
    """set_overlap forces or forbids the decomposition of the allgather -> GEMM and the
    GEMM -> reduce-scatter; left to the cost estimate, tiny CPU GEMMs run as a whole."""
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    fd = _sequence_parallel_mlp(mesh, tokens, overlap)
    gx, g1, g2 = _ints(tokens, 4), _ints(4 * d, 4, seed=1), _ints(4, 4 * d, seed=2)
    tvs = fd.fusion.inputs()
    inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((gx, g1, g2), tvs)]
    with record_communications() as comms:
        result, = fd.execute(inputs)
    expected = F.linear(F.linear(gx, g1).relu(), g2)
    torch.testing.assert_close(result, multidevice_test.shard_tensor(expected,
                                                                       fd.fusion.outputs()[0]))
    text = fd.explain(inputs)
    if d == 1:
        assert _kinds(comms) == Counter()
    elif overlap:
        assert _kinds(comms) == Counter(collective_permute=d - 1, reduce=d)
        assert "allgather -> GEMM: est." not in text and "set_overlap(True)" in text
        assert text.count("stream loop: ") == 2
    else:
        assert _kinds(comms) == Counter(allgather=1, reduce_scatter=1)
        assert "as a whole" in text and "stream loop: " not in text


@pytest.mark.mpi
def test_row_parallel_loop_on_a_2x2_mesh(multidevice_test):
    """Data x tensor parallel: tokens over mesh_y, the contracted axis over mesh_x; the
    loop runs over chunks of this rank's tokens, one allreduce over mesh_x per chunk."""
    mesh = mesh_2x2(multidevice_test)
    tokens, chunks = 10, 2
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, 8], dtype=DataType.Float)
        w = fd.define_tensor([3, 8], dtype=DataType.Float)
        fd.add_output(fd.ops.linear(x, w))
    x.set_device_mesh(mesh)
    x.outer_split(0, 2)
    x.axis(0).parallelize(MY)
    x.outer_split(1, chunks)
    x.axis(1).parallelize(STREAM)
    x.outer_split(3, 2)
    x.axis(3).parallelize(MX)
    shard(w, 1, mesh)
    gx, gw = _ints(tokens, 8), _ints(3, 8, seed=1)
    inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((gx, gw), (x, w))]
    with record_communications() as comms:
        out, = fd.execute(inputs)
    out_tv = fd.fusion.outputs()[0]
    torch.testing.assert_close(out, multidevice_test.shard_tensor(F.linear(gx, gw), out_tv))
    assert _kinds(comms) == Counter(allreduce=chunks)
    assert {c.mesh_axis for c in comms} == {mesh.axis_of(MX)}


@pytest.mark.mpi
def test_a_gather_that_also_relays_a_strided_shard_is_no_loop(multidevice_test):
    """Regression (fuzz seed 20132): ``x``'s last axis lies on mesh_x in strided blocks (a
    split of a piece of it), the GEMM's operand in blocks, both placed ``S(2)``; the reshard
    gathers mesh_y's axis and re-lays mesh_x's. A stream loop of the gather alone left the
    re-layout out (55 of 60 values wrong here): the engine forms none, even forced (the GEMM's
    allreduce may still run in a loop: it carries the whole reshard per chunk)."""
    mesh = mesh_2x2(multidevice_test)
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 6, 8], dtype=DataType.Float)
        w = fd.define_tensor([5, 8], dtype=DataType.Float)
        t = fd.ops.neg(x)
        fd.add_output(fd.ops.linear(t, w))
    x.set_device_mesh(mesh)
    x.outer_split(1, 2)
    x.axis(1).parallelize(MY)
    x.split(3, 2, False)  # the last axis: [2 pieces, 4], each piece split over mesh_x
    x.outer_split(4, 2)
    x.axis(4).parallelize(MX)
    t.set_device_mesh(mesh)
    t.outer_split(2, 2)
    t.axis(2).parallelize(MX)
    t.set_overlap(True)
    shard(w, 1, mesh)
    gx, gw = _ints(2, 6, 8), _ints(5, 8, seed=1)
    inputs = [multidevice_test.shard_tensor(g, tv) for g, tv in zip((gx, gw), (x, w))]
    assert "allgather decomposed" not in fd.explain(inputs)
    out, = fd.execute(inputs)
    torch.testing.assert_close(out, multidevice_test.shard_tensor(F.linear(-gx, gw),
                                                                  fd.fusion.outputs()[0]))
