"""How the ring's blocks travel and how its forward merges them: the options
``MESHFUSE_CP_TRANSPORT`` (NCCL's send/recv, or copies by the GPUs' copy engines into
symmetric memory) and ``MESHFUSE_CP_MERGE`` (torch operations, or one compiled pass).

Neither changes what is computed: on CPU every test checks values against PyTorch's
unsharded attention (the copy engines exist on CUDA only: there they are compared with the
NCCL ring bit for bit, and with the unsharded attention, by the tests that skip on CPU).
"""

from __future__ import annotations

import functools

import pytest
import torch
from mesh_helpers import mesh_1d
from test_context_parallel import (
    Attention,
    _assert_equal,
    _expected_ring,
    _global_inputs,
    _run,
    _sequence_sharded,
)

from meshfuse import DataType, DefinitionError, DeviceMesh, FusionDefinition, ParallelType
from meshfuse.examples.seed_sdpa import QkvFormat
from meshfuse.explain import explain
from meshfuse.parallel.context import blocks as context_blocks
from meshfuse.parallel.context.blocks import Merged, merge_into
from meshfuse.parallel.context.explain import planned_context_parallel
from meshfuse.passes.pipeline import compile as compile_fusion
from meshfuse.runtime.comm import peer_copy
from meshfuse.runtime.comm.collectives import Group, record_communications, ring_shift
from meshfuse.runtime.comm.communicator import Communicator

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="copy engines: CUDA only")


def _blocks(dtype, rows=12, seed=0):
    """Two blocks' results for the same rows: ``(attn, lse)`` each, ``[1, 3, rows, 8]``."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 3, rows, 8, generator=gen).to(dtype),
             torch.randn(1, 3, rows, generator=gen) * 3) for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(0, 12), (4, 12)], ids=["all_rows", "some_rows"])
def test_merge_into_is_the_eager_merge(dtype, rows):
    """merge_into (what the compiled merge compiles), eager and traced by torch.compile
    (aot_eager: the same operations after functionalization), gives bit for bit the eager
    Merged's result, on all rows and on a strided slice of them."""
    (a0, l0), (a1, l1) = _blocks(dtype)
    want = Merged(a0, a0, dtype)
    want.add((0, 12), a0.clone(), l0.clone())  # kept as is, then merged into in place
    want.add(rows, a1[..., rows[0]:rows[1], :], l1[..., rows[0]:rows[1]])
    traced = torch.compile(merge_into, backend="aot_eager", fullgraph=True)
    for merge in (merge_into, traced):
        out, lse = a0.clone(), l0.clone()
        merge(out[..., rows[0]:rows[1], :], lse[..., rows[0]:rows[1]],
              a1[..., rows[0]:rows[1], :], l1[..., rows[0]:rows[1]])
        assert torch.equal(out, want.out) and torch.equal(lse, want.lse)


@functools.cache
def _traced_merge():
    return torch.compile(merge_into, backend="aot_eager", fullgraph=True)


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["block", "zigzag"])
def test_compiled_merge_ring_equals_unsharded(multidevice_test, monkeypatch, causal, layout):
    """MESHFUSE_CP_MERGE=compiled (read when the program is built): the ring's forward
    merges with the compiled merge_into (here traced for the CPU, without a C compiler),
    forward and backward equal the unsharded attention, the transfers are the ring's."""
    monkeypatch.setenv("MESHFUSE_CP_MERGE", "compiled")
    calls = []
    monkeypatch.setattr(context_blocks, "compiled_merge",
                        lambda: calls.append(1) or _traced_merge())
    d = multidevice_test.size
    fd = Attention(2, 16, causal, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), layout)
    outputs, expected, comms = _run(multidevice_test, fd, _global_inputs(2, 16, QkvFormat.BHSE))
    _assert_equal(outputs, expected)
    assert [(c.kind, c.bytes) for c in comms] == _expected_ring(
        16, d, 2, 4, multidevice_test.rank, layout)
    if multidevice_test.rank == d - 1:  # (rank 0 of a causal block split merges nothing)
        assert (len(calls) > 0) == (d > 1)


@pytest.mark.mpi
def test_auto_transport_on_cpu_is_the_ring_over_gloo(multidevice_test, monkeypatch):
    """MESHFUSE_CP_TRANSPORT=auto and MESHFUSE_CP_MERGE=auto on CPU: send/recv and the
    eager merge, the same values and transfers as the defaults."""
    if torch.cuda.is_available():
        pytest.skip("auto on CPU; on CUDA it is the copy engines and the compiled merge")
    monkeypatch.setenv("MESHFUSE_CP_TRANSPORT", "auto")
    monkeypatch.setenv("MESHFUSE_CP_MERGE", "auto")
    monkeypatch.setattr(context_blocks, "compiled_merge", lambda: pytest.fail("compiled"))
    d = multidevice_test.size
    fd = Attention(2, 16, True, dtype=DataType.BFloat16, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    outputs, expected, comms = _run(multidevice_test, fd,
                                    _global_inputs(2, 16, QkvFormat.BHSE, torch.bfloat16))
    _assert_equal(outputs, expected, tol=3e-2)
    assert [(c.kind, c.bytes) for c in comms] == _expected_ring(
        16, d, 2, 2, multidevice_test.rank, "zigzag")


@pytest.mark.mpi
def test_default_merge_is_eager_on_cpu_and_compiled_on_cuda(multidevice_test, monkeypatch):
    """Without MESHFUSE_CP_MERGE the merge is ``auto``: the ring's forward merges with the
    compiled merge on CUDA (where it measured faster) and never compiles on CPU; explain,
    before anything ran, names the merge of the communicator's device, and the records
    planned for the outputs' device name the merge that ran."""
    monkeypatch.delenv("MESHFUSE_CP_MERGE", raising=False)
    cuda = torch.cuda.is_available()
    compiled = context_blocks.compiled_merge
    calls = []
    monkeypatch.setattr(context_blocks, "compiled_merge",
                        lambda: calls.append(1) or compiled() if cuda
                        else pytest.fail("compiled on CPU"))
    fd = Attention(2, 16, True, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    explained = fd.explain()  # before anything runs: the communicator's device decides
    outputs, expected, _ = _run(multidevice_test, fd, _global_inputs(2, 16, QkvFormat.BHSE))
    _assert_equal(outputs, expected)
    ring = multidevice_test.size > 1
    assert (len(calls) > 0) == (cuda and ring)
    merge = "merge: compiled" if cuda else "merge: eager"
    assert (merge in explained) == ring and "device not known" not in explained
    records = [p.record for p in planned_context_parallel(
        fd.compiled().fusion, multidevice_test.rank, device=outputs[0].device)]
    assert {r.merge for r in records} == ({"compiled" if cuda else "eager"} if ring else set())


def _planned_ring(world_size, device):
    """The forward's and the backward's explained lines and records on rank 0 of a ring of
    ``world_size`` (zig-zag, causal), planned in this process for ``device``."""
    fd = Attention(2, 16, True, strategy="ring")
    _sequence_sharded(fd, DeviceMesh(range(world_size)), "zigzag")
    compiled = compile_fusion(fd.fusion, world_size)
    text = explain(compiled.fusion, compiled.allocations, 0, world_size, device=device)
    lines = [line for line in text.splitlines() if "ring over mesh axis" in line]
    records = [p.record for p in planned_context_parallel(compiled.fusion, 0, device=device)]
    return lines, records


@pytest.mark.parametrize("device,transport,merge", [
    (None, "copy engines on CUDA, send/recv elsewhere (device not known yet)",
     "compiled on CUDA, eager elsewhere (device not known yet)"),
    (torch.device("cpu"), "send/recv", "eager (torch operations)"),
    (torch.device("cuda", 1), "copy engines", "compiled (one torch.compile'd pass)"),
], ids=["no_device", "cpu", "cuda"])
def test_explain_names_the_transport_and_merge_the_device_runs(device, transport, merge):
    """explain names how the ring moves its blocks and how its forward merges them: what the
    device runs (auto resolved: the copy engines and the compiled merge on CUDA, send/recv
    and the eager merge elsewhere), or, planned without a device, both choices; only the
    forward merges. (A CUDA device is only named here: nothing runs.)"""
    (forward, backward), records = _planned_ring(2, device)
    assert forward.endswith(f"; transport: {transport}; merge: {merge}")
    assert backward.endswith(f"; transport: {transport}")
    auto = device is None
    assert {(r.transport, r.merge) for r in records} == (
        {("auto", "auto")} if auto else
        {("copy_engine", "compiled")} if device.type == "cuda" else {("nccl", "eager")})


def test_explain_names_forced_options_and_send_recv_for_uneven_blocks(monkeypatch):
    """A forced merge or transport is named as forced, with or without a device; blocks of
    different sizes (10 rows over 4 ranks) travel by send/recv even on CUDA, and the copy
    engines forced there are refused when explained too, with the fix."""
    monkeypatch.setenv("MESHFUSE_CP_MERGE", "eager")
    monkeypatch.setenv("MESHFUSE_CP_TRANSPORT", "copy_engine")
    (forward, _), _ = _planned_ring(2, None)
    assert forward.endswith("; transport: copy engines; merge: eager (torch operations)")
    monkeypatch.setenv("MESHFUSE_CP_TRANSPORT", "auto")
    fd = Attention(2, 10, True, strategy="ring")
    _sequence_sharded(fd, DeviceMesh(range(4)), "block")
    compiled = compile_fusion(fd.fusion, 4)
    for device in (None, torch.device("cuda", 0)):
        text = explain(compiled.fusion, compiled.allocations, 0, 4, device=device)
        assert text.count("; transport: send/recv") == 2
    monkeypatch.setenv("MESHFUSE_CP_TRANSPORT", "copy_engine")
    with pytest.raises(DefinitionError, match="blocks of one size.*zig-zag split"):
        explain(compiled.fusion, compiled.allocations, 0, 4)


@pytest.mark.mpi
def test_copy_engines_refused_where_they_cannot_run(multidevice_test, monkeypatch):
    """The copy engines asked for a ring over tensors on the CPU, or for blocks of different
    sizes (10 rows over 4 ranks: 3, 3, 3, 1), are DefinitionErrors naming the variable, on
    every rank, when the rank's program is built (on one rank nothing moves: it runs); a value that
    is no transport or merge, too."""
    if torch.cuda.is_available():
        pytest.skip("the CPU refusal; on CUDA the copy engines run")
    monkeypatch.setenv("MESHFUSE_CP_TRANSPORT", "copy_engine")
    s, d = 10, multidevice_test.size
    fd = Attention(2, s, True, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "block")
    if d == 1:
        _assert_equal(*_run(multidevice_test, fd, _global_inputs(2, s, QkvFormat.BHSE))[:2])
        return
    unequal = len({len(c) for c in torch.arange(s).chunk(d)}) > 1
    why = "moves blocks of one size" if unequal else "copies blocks between CUDA devices"
    with pytest.raises(DefinitionError, match=f"MESHFUSE_CP_TRANSPORT=copy_engine {why}"):
        _run(multidevice_test, fd, _global_inputs(2, s, QkvFormat.BHSE))
    for variable in ("MESHFUSE_CP_TRANSPORT", "MESHFUSE_CP_MERGE"):
        monkeypatch.setenv("MESHFUSE_CP_TRANSPORT", "nccl")
        monkeypatch.setenv(variable, "pigeon")
        fd = Attention(2, 16, True, strategy="ring")
        _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
        with pytest.raises(DefinitionError, match=f"{variable}='pigeon': use one of"):
            _run(multidevice_test, fd, _global_inputs(2, 16, QkvFormat.BHSE))


CUDA_CASES = [(True, "zigzag", QkvFormat.BHSE), (True, "block", QkvFormat.BSHE),
              (False, "zigzag", QkvFormat.BHSE)]


@cuda_only
@pytest.mark.mpi
@pytest.mark.parametrize("causal,layout,qkv_format", CUDA_CASES,
                         ids=["causal_zigzag", "causal_block_bshe", "full"])
def test_copy_engine_ring_equals_nccl_ring(multidevice_test, monkeypatch, causal, layout,
                                           qkv_format):
    """On CUDA: the ring with the copy engines gives the NCCL ring's outputs bit for bit, at
    two calls in a row (the symmetric buffers are reused), with the same transfers recorded;
    with the compiled merge (and with both options on auto) too, close to the unsharded
    attention (bf16). The math kernel runs every block (cuDNN's and flash's backward add
    with atomics: not bit for bit from one call to the next)."""
    monkeypatch.setenv("MESHFUSE_SDPA_BACKEND", "math")
    runs = {}
    for transport, merge in (("nccl", "eager"), ("copy_engine", "eager"),
                             ("copy_engine", "compiled"), ("auto", "auto")):
        monkeypatch.setenv("MESHFUSE_CP_TRANSPORT", transport)
        monkeypatch.setenv("MESHFUSE_CP_MERGE", merge)
        fd = Attention(4, 64, causal, qkv_format, strategy="ring", dtype=DataType.BFloat16)
        _sequence_sharded(fd, mesh_1d(multidevice_test), layout)
        inputs = _global_inputs(4, 64, qkv_format, torch.bfloat16)
        outputs, expected, comms = _run(multidevice_test, fd, inputs)
        _assert_equal(outputs, expected, tol=3e-2)
        local = [multidevice_test.shard_tensor(t, tv)
                 for t, tv in zip(inputs, (fd.q, fd.k, fd.v, fd.g))]
        with record_communications() as again:
            second = fd.execute(local)
        for a, b in zip(outputs, second):
            assert torch.equal(a, b)
        runs[transport, merge] = outputs
        runs[transport, merge, "comms"] = [(c.kind, c.bytes, c.peer) for c in comms]
        assert [(c.kind, c.bytes, c.peer) for c in again] == runs[transport, merge, "comms"]
    for a, b in zip(runs["nccl", "eager"], runs["copy_engine", "eager"]):
        assert torch.equal(a, b)
    assert runs["nccl", "eager", "comms"] == runs["copy_engine", "eager", "comms"]
    for a, b in zip(runs["copy_engine", "compiled"], runs["auto", "auto"]):
        assert torch.equal(a, b)


@cuda_only
@pytest.mark.mpi
def test_copy_engine_slot_made_while_a_peer_is_busy(multidevice_test, monkeypatch):
    """A copy-engine slot made while one rank's device is still busy (rank 1 queues a sleep
    kernel of about 0.3 s first): torch zeroes the new buffer's signal pad behind that work,
    so the slot must not reach the peers before the zeroing has run (else the peer's barrier
    signal is erased, and the barrier waits out its limit, here 10 s: a device error). One
    shift moves each rank's tensor to the next rank."""
    d, rank = multidevice_test.size, multidevice_test.rank
    if d < 2:
        pytest.skip("moves nothing on one rank")
    monkeypatch.setattr(peer_copy, "BARRIER_TIMEOUT_MS", 10_000)
    mesh = mesh_1d(multidevice_test)
    group = Group(Communicator.instance().group(mesh, 0), tuple(mesh.device_ids), rank, 0)
    device = multidevice_test.device
    sent = torch.full((3, 1000), float(rank), device=device)
    if rank == 1:
        torch.cuda._sleep(600_000_000)  # cycles: about 0.3 s
    shifted = ring_shift([sent], [sent.shape], group, transport="copy_engine",
                         slot=f"busy_peer_{d}")
    received, = shifted.wait()
    assert torch.equal(received.cpu(), torch.full((3, 1000), float((rank - 1) % d)))


@cuda_only
@pytest.mark.mpi
def test_copy_engine_ring_back_to_back_at_size(multidevice_test, monkeypatch):
    """On CUDA, at a size where the kernels take milliseconds (bf16, 8 heads of 64, 4096
    rows, cuDNN or flash): five calls with the copy engines back to back, the host never
    waiting, each close to one call of the NCCL ring. (The benchmark's first run with the
    copy engines, at 32768 rows, stopped in a barrier that timed out: this test asks
    whether size and back-to-back calls are what it takes.)"""
    if multidevice_test.size < 2:
        pytest.skip("moves nothing on one rank")

    class Big(FusionDefinition):
        def definition(self):
            shape = [1, 8, 4096, 64]
            self.ins = [self.define_tensor(shape, dtype=DataType.BFloat16) for _ in range(4)]
            q, k, v, g = self.ins
            attn, lse, seed, offset = self.ops.sdpfa_fwd(q, k, v, 0.0, True, None,
                                                         context_parallel="ring")
            grads = self.ops.sdpfa_bwd(g, q, k, v, attn, lse, 0.0, True, seed, offset, None,
                                       context_parallel="ring")
            self.all = [*self.ins, attn, lse, *grads]
            for t in (attn, *grads):
                self.add_output(t)

        def multidevice_schedule(self):
            mesh = mesh_1d(multidevice_test)
            for tv in self.all:
                tv.set_device_mesh(mesh)
                tv.zigzag_split(2, mesh.size)
                tv.parallelize(2, ParallelType.mesh_x)

    torch.manual_seed(0)
    inputs = [torch.randn(1, 8, 4096, 64, dtype=torch.bfloat16) for _ in range(4)]
    results = {}
    for transport in ("nccl", "copy_engine"):
        monkeypatch.setenv("MESHFUSE_CP_TRANSPORT", transport)
        fd = Big()
        fd.define()
        local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(inputs, fd.ins)]
        results[transport] = [fd.execute(local) for _ in range(1 if transport == "nccl"
                                                                else 5)]
    torch.cuda.synchronize()
    for outputs in results["copy_engine"]:
        for got, want in zip(outputs, results["nccl"][0]):
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, err
