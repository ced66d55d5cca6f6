"""The transport of stream loops' decomposed communications: the process group (NCCL,
gloo) or the GPUs' copy engines through symmetric memory (:mod:`meshfuse.runtime.comm.copy_engine`).

On CPU ranks the copy engines cannot run: the tests check the choice (``CommunicatorBackend``,
``MemoryType.symmetric``, ``MESHFUSE_OVERLAP_TRANSPORT``), its fallback and what ``explain``
says, the block order of a copy-engine loop, and the values against the unsharded layer.
On CUDA (the tests marked ``cuda_only`` skip elsewhere) the copy-engine loops are compared
with the unsharded layer and with the NCCL loops, their transfers recorded.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard
from test_overlap import _ints, _kinds, column_parallel, row_sp_linear

from meshfuse import DataType, FusionDefinition
from meshfuse.errors import InputError
from meshfuse.multidevice import (
    CommunicatorBackend,
    MultiDeviceExecutor,
    MultiDeviceExecutorParams,
)
from meshfuse.parallel.overlap.stream_loop import (
    COPY_ENGINE,
    PROCESS_GROUP,
    ChunkReduce,
    StreamLoop,
)
from meshfuse.parallel.overlap.stream_loop_lowering import choose_transport
from meshfuse.runtime.comm.collectives import Group, record_communications
from meshfuse.runtime.comm.copy_engine import Gathering, Reducing, closing_barrier, hosts

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="copy engines: CUDA only")


def _group(coordinate: int = 0, size: int = 2, axis: int = 0) -> Group:
    return Group(None, tuple(range(size)), coordinate, axis)


def test_transport_choice_on_a_cpu():
    """Asked for or not, the copy engines fall back to the process group on a CPU, saying
    why; the process group asked for is kept; a bad MESHFUSE_OVERLAP_TRANSPORT is refused."""
    cpu = torch.device("cpu")
    for requested in ("auto", "copy_engine"):
        transport, why = choose_transport(requested, cpu, [_group()], symmetric=True)
        assert transport == PROCESS_GROUP and "copy engines are CUDA's" in why
    assert choose_transport("process_group", cpu, [_group()], False) == \
        (PROCESS_GROUP, "asked for the process group")
    transport, why = choose_transport("auto", cpu, [_group()], symmetric=False)
    assert transport == PROCESS_GROUP and "copy engines unavailable" in why
    two_axes = [_group(axis=0), _group(axis=1)]
    assert "several mesh axes" in choose_transport("copy_engine", cpu, two_axes, False)[1]


def test_scheduled_stream_axis_keeps_the_process_group(monkeypatch):
    """A loop the engine chose takes the copy engines by default where they can run; the
    user's own stream axis runs over the process group as nvFuser runs it (its tests count
    NCCL's kernels), unless the copy engines are asked for."""
    monkeypatch.delenv("MESHFUSE_OVERLAP_TRANSPORT", raising=False)
    gpu = torch.device("cuda", 0)  # a device object only: nothing runs on it
    transport, why = choose_transport("auto", gpu, [_group()], False, scheduled=True)
    assert transport == PROCESS_GROUP and "scheduled stream axis" in why
    transport, why = choose_transport("auto", gpu, [_group()], False)
    assert transport == PROCESS_GROUP and why.startswith("copy engines unavailable")
    for asked in ({"requested": "copy_engine", "symmetric": False},
                  {"requested": "auto", "symmetric": True}):
        why = choose_transport(asked["requested"], gpu, [_group()], asked["symmetric"],
                               scheduled=True)[1]
        assert "scheduled" not in why
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "copy_engine")
    assert "scheduled" not in choose_transport("auto", gpu, [_group()], False, scheduled=True)[1]


def test_ranks_on_several_hosts_are_told_apart(monkeypatch):
    """The copy engines reach one host's GPUs: the launcher's local size in consecutive
    ranks share a host (torchrun's LOCAL_WORLD_SIZE, mpirun's OMPI_COMM_WORLD_LOCAL_SIZE),
    so a group across that boundary takes the process group."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "16")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    assert hosts((2, 6)) == {0}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert hosts((0, 1, 2, 3)) == {0}
    assert hosts((2, 6)) == {0, 1}


def test_transport_environment(monkeypatch):
    """MESHFUSE_OVERLAP_TRANSPORT=nccl means the process group; a typo is an InputError
    naming the variable and the choices."""
    cpu = torch.device("cpu")
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "nccl")
    assert choose_transport("auto", cpu, [_group()], symmetric=True)[0] == PROCESS_GROUP
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "copy-engines")
    with pytest.raises(InputError, match="MESHFUSE_OVERLAP_TRANSPORT.*'copy_engine'"):
        choose_transport("auto", cpu, [_group()], symmetric=False)


@pytest.mark.parametrize("coordinate", [0, 1, 2])
def test_copy_engine_reduce_visits_its_own_block_last(coordinate):
    """A copy-engine loop that reduces visits the other ranks' blocks first, in ring order
    from the next one, and its own last (the pulls of its partials run under the GEMMs of
    the other blocks); every block once."""
    reduce = ChunkReduce(_group(coordinate, 3), "sum", (9, 2), 0, torch.float32)
    loop = StreamLoop(3, (), {}, {}, (), (), 1, (coordinate, 3), reduces={0: reduce},
                      transport=COPY_ENGINE)
    order = [loop.block(i) for i in range(3)]
    assert order == Reducing.order(coordinate, 3) == \
        [(coordinate + 1) % 3, (coordinate + 2) % 3, coordinate]
    gathering = StreamLoop(3, (), {}, {}, (), (), 1, (coordinate, 3), transport=COPY_ENGINE)
    assert gathering.block(0) == coordinate  # own block first


@pytest.mark.mpi
@pytest.mark.parametrize("tokens", [8, 10], ids=["even", "uneven"])
def test_cuda_backend_falls_back_on_cpu_ranks(multidevice_test, tokens):
    """CommunicatorBackend.cuda and MemoryType.symmetric on CPU ranks: the loop runs over
    the process group (its collective permutes), the values are the unsharded layer's, and
    explain(inputs) says which transport carried the loop and why. (On CUDA ranks the copy
    engines run: the CUDA tests below.)"""
    if multidevice_test.device.type == "cuda":
        pytest.skip("CPU ranks only: on CUDA the copy engines carry the loop")
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    x, w = _ints(tokens, 2), _ints(8, 2, seed=1)
    for symmetric, backend in ((False, CommunicatorBackend.cuda),
                               (True, CommunicatorBackend.nccl)):
        fd = column_parallel(tokens, 2, mesh, ring=True, symmetric=symmetric)
        params = MultiDeviceExecutorParams()
        params.backend_type = backend
        executor = MultiDeviceExecutor(fd.fusion, params)
        inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((x, w), fd.fusion.inputs())]
        with record_communications() as comms:
            out, = executor.run(inputs)
        torch.testing.assert_close(out.cpu(), F.linear(x, inputs[1].cpu()))
        assert _kinds(comms) == (Counter(collective_permute=d - 1) if d > 1 else Counter())
        text = executor.explain(inputs)
        if d > 1 and backend is CommunicatorBackend.cuda:
            assert "stream loop transports on this rank:" in text
            assert "transfers by the process group: copy engines unavailable: copy engines " \
                "are CUDA's" in text
        elif d > 1:  # the nccl backend asks for the process group, whatever the memory
            assert "transfers by the process group: asked for the process group" in text


@pytest.mark.mpi
@pytest.mark.parametrize("tokens", [8, 10], ids=["even", "uneven"])
def test_sequence_parallel_loops_on_a_2x2_mesh(multidevice_test, tokens):
    """Data x tensor parallel with the sequence-parallel loops: x's tokens over mesh_y (data)
    and, within, over mesh_x (sequence); the allgather of the tokens over mesh_x before the
    first linear and the reduce-scatter onto them after the second, both forced into
    loops (set_overlap): d - 1 collective permutes and d reduces, all over mesh_x."""
    mesh = mesh_2x2(multidevice_test)
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, tokens, 4], dtype=DataType.Float)
        w1 = fd.define_tensor([8, 4], dtype=DataType.Float)
        w2 = fd.define_tensor([4, 8], dtype=DataType.Float)
        hidden = fd.ops.linear(x, w1)
        out = fd.ops.linear(fd.ops.relu(hidden), w2)
        fd.add_output(out)
    for tv, axis in ((x, 1), (w1, 0), (w2, 1), (out, 1), (hidden, 2)):
        shard(tv, axis, mesh, MX)
    for tv in (x, out, hidden):
        shard(tv, 0, mesh, MY)
    x.set_overlap(True)
    out.set_overlap(True)
    gx, g1, g2 = _ints(2, tokens, 4), _ints(8, 4, seed=1), _ints(4, 8, seed=2)
    inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((gx, g1, g2), (x, w1, w2))]
    with record_communications() as comms:
        result, = fd.execute(inputs)
    expected = F.linear(F.linear(gx, g1).relu(), g2)
    torch.testing.assert_close(result, multidevice_test.shard_tensor(expected, out))
    assert _kinds(comms) == Counter(collective_permute=1, reduce=2)
    assert {c.mesh_axis for c in comms} == {mesh.axis_of(MX)}
    assert fd.explain(inputs).count("stream loop: ") == 2


@cuda_only
@pytest.mark.mpi
@pytest.mark.parametrize("tokens", [8, 10], ids=["even", "uneven"])
def test_copy_engine_column_loop_equals_nccl_loop(multidevice_test, monkeypatch, tokens):
    """On CUDA: the ring-order allgather -> GEMM loop with its blocks pulled by the copy
    engines gives the NCCL loop's result and the unsharded layer's, at three calls in a row
    (the workspace reused), with d - 1 pulls recorded per call."""
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    x, w = _ints(tokens, 2), _ints(8, 2, seed=1)
    results = {}
    for transport in ("process_group", "copy_engine"):
        monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", transport)
        fd = column_parallel(tokens, 2, mesh, ring=True)
        inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((x, w), fd.fusion.inputs())]
        for _ in range(3):
            with record_communications() as comms:
                out, = fd.execute(inputs)
            torch.testing.assert_close(out.cpu(), F.linear(x, inputs[1].cpu()))
        results[transport] = out.cpu()
        pulls = Counter(copy_engine_pull=d - 1) if transport == "copy_engine" else \
            Counter(collective_permute=d - 1)
        assert _kinds(comms) == (pulls if d > 1 else Counter())
        if d > 1:
            assert ("by copy engines" in fd.explain(inputs)) == (transport == "copy_engine")
    assert torch.equal(results["process_group"], results["copy_engine"])


@cuda_only
@pytest.mark.mpi
@pytest.mark.parametrize("tokens", [8, 10], ids=["even", "uneven"])
def test_copy_engine_reduce_scatter_loop_equals_nccl_loop(multidevice_test, monkeypatch,
                                                          tokens):
    """On CUDA: the GEMM -> reduce-scatter loop with each partial block pulled by its owner
    through the copy engines equals the unsharded layer (and the NCCL loop), three calls in
    a row, d - 1 pulls recorded per call."""
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    gx, gw = _ints(tokens, 8), _ints(3, 8, seed=1)
    for transport in ("process_group", "copy_engine"):
        monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", transport)
        fd = row_sp_linear(tokens, mesh)
        x, w, out_tv = *fd.fusion.inputs(), fd.fusion.outputs()[0]
        inputs = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((gx, gw), (x, w))]
        for _ in range(3):
            with record_communications() as comms:
                result, = fd.execute(inputs)
            torch.testing.assert_close(
                result, multidevice_test.shard_tensor(F.linear(gx, gw), out_tv))
        expected = Counter(copy_engine_pull=d - 1) if transport == "copy_engine" else \
            Counter(reduce=d)
        assert _kinds(comms) == (expected if d > 1 else Counter())


def _sequence_parallel_mlp(t: int, h: int, dtype: DataType, mesh):
    """``linear(relu(linear(x, w1)), w2)`` with x's and the output's tokens sharded and both
    communications forced into the engine's loops (``set_overlap(True)``): the fusion and its
    tensors x, w1, w2, out."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([t, h], dtype=dtype)
        w1 = fd.define_tensor([4 * h, h], dtype=dtype)
        w2 = fd.define_tensor([h, 4 * h], dtype=dtype)
        out = fd.ops.linear(fd.ops.relu(fd.ops.linear(x, w1)), w2)
        fd.add_output(out)
    for tv, axis in ((x, 0), (w1, 0), (w2, 1), (out, 0)):
        shard(tv, axis, mesh)
    x.set_overlap(True)
    out.set_overlap(True)
    return fd, (x, w1, w2, out)


@cuda_only
@pytest.mark.mpi
def test_copy_engine_mlp_loops_back_to_back(multidevice_test, monkeypatch):
    """On CUDA: a sequence-parallel MLP with both loops on the copy engines, bf16 at a size
    where the GEMMs take a while, five calls back to back with the host never waiting, each
    close to the unsharded MLP."""
    monkeypatch.setenv("MESHFUSE_OVERLAP_TRANSPORT", "copy_engine")
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    t, h = 1024, 512
    fd, (x, w1, w2, out) = _sequence_parallel_mlp(t, h, DataType.BFloat16, mesh)
    gen = torch.Generator().manual_seed(0)
    gx, g1, g2 = (torch.randn(*s, generator=gen).bfloat16() * s[-1] ** -0.5
                  for s in ((t, h), (4 * h, h), (h, 4 * h)))
    inputs = [multidevice_test.shard_tensor(a, tv) for a, tv in zip((gx, g1, g2), (x, w1, w2))]
    outs = [fd.execute(inputs)[0] for _ in range(5)]
    expected = multidevice_test.shard_tensor(F.linear(F.linear(gx, g1).relu(), g2), out)
    for result in outs:
        torch.testing.assert_close(result.float(), expected.float(), atol=3e-2, rtol=3e-2)
    if d > 1:
        loops = [line for line in fd.explain(inputs).splitlines()
                 if "decomposed): transfers by" in line]
        assert loops and all("copy engines" in line for line in loops), loops
        assert any("(allgather decomposed)" in line for line in loops), loops
        assert any("(reduce-scatter decomposed)" in line for line in loops), loops


@cuda_only
@pytest.mark.mpi
def test_copy_engine_loops_replayed_from_a_cuda_graph(multidevice_test, monkeypatch):
    """On CUDA, with the default transport: the sequence-parallel MLP's loops (the engine's,
    forced by set_overlap) captured into a CUDA graph and replayed ten times, on new values
    each time; a replay reuses the workspaces it captured, so each loop ends with a barrier
    there, and every replay matches the unsharded MLP."""
    monkeypatch.delenv("MESHFUSE_OVERLAP_TRANSPORT", raising=False)
    mesh = mesh_1d(multidevice_test)
    t, h = 512, 256
    fd, (x, w1, w2, out) = _sequence_parallel_mlp(t, h, DataType.Float, mesh)
    g1, g2 = _ints(4 * h, h, seed=1), _ints(h, 4 * h, seed=2)
    weights = [multidevice_test.shard_tensor(a, tv) for a, tv in ((g1, w1), (g2, w2))]
    for call in range(10):
        gx = _ints(t, h, seed=10 + call) / 4
        shard_x = multidevice_test.shard_tensor(gx, x)
        result, = fd.execute([shard_x, *weights], cuda_graph=True)
        expected = multidevice_test.shard_tensor(F.linear(F.linear(gx, g1).relu(), g2), out)
        torch.testing.assert_close(result, expected)
    if multidevice_test.size > 1:
        assert "by copy engines" in fd.explain([shard_x, *weights])


def test_closing_barrier_only_under_capture(monkeypatch):
    """A loop run ends with a barrier only while a CUDA graph is being captured."""
    calls = []
    space = SimpleNamespace(barrier=lambda: calls.append("barrier"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    closing_barrier(space)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    closing_barrier(space)
    assert calls == ["barrier"]


@cuda_only
@pytest.mark.mpi
@pytest.mark.parametrize("barrier_aside", [False, True], ids=["barrier_inline", "barrier_aside"])
def test_copy_engine_gathering_pulls_after_the_own_block(multidevice_test, barrier_aside):
    """On CUDA: a Gathering of uneven shards (the last one short) issues no pull until a
    block of another rank is asked for, then gives every other rank's shard, its own being
    the shard itself; three runs back to back reuse the workspace; d - 1 pulls recorded per
    run, with the staging barrier on the current stream or on the copy stream; successive
    runs take the two workspaces of their place in turn."""
    d, me = multidevice_test.size, multidevice_test.rank
    if d == 1:
        pytest.skip("the copy engines move blocks between ranks")
    group = Group(dist.group.WORLD, tuple(range(d)), me, 0)
    shapes = [(5, 4)] * (d - 1) + [(3, 4)]
    workspaces = []
    for run in range(3):
        shard = torch.arange(20, device=multidevice_test.device, dtype=torch.float32)
        shard = (shard[:shapes[me][0] * 4].view(shapes[me]) + 100 * me + run).contiguous()
        with record_communications() as comms:
            gathering = Gathering(shard, group, shapes, place=0, barrier_aside=barrier_aside)
            workspaces.append(gathering.workspace)
            assert gathering.block(me) is gathering.x and not gathering.blocks
            blocks = {b: gathering.block(b).clone() for b in Reducing.order(me, d)}
            gathering.finish()
        for b, got in blocks.items():
            expected = torch.arange(shapes[b][0] * 4, dtype=torch.float32).view(shapes[b])
            torch.testing.assert_close(got.cpu(), expected + 100 * b + run)
        assert _kinds(comms) == Counter(copy_engine_pull=d - 1)
    # two workspaces taken in turn: no barrier needed at a run's end
    assert workspaces[0] is workspaces[2] and workspaces[0] is not workspaces[1]
