"""Context parallelism: attention with q, k and v sharded on the sequence axis.

Every sharded run is checked against PyTorch's unsharded attention (forward and the three
gradients), and the point-to-point transfers that ran are checked against the ring's theory:
a forward sends its k/v block ``n - 1`` times; a backward sends k/v ``n - 1`` times and the dk/dv
accumulators ``n - 1`` times, the last time home (the own block's gradients stay).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard

from meshfuse import DataType, DefinitionError, FusionDefinition, ScheduleError, ShardingError
from meshfuse.examples.seed_sdpa import QkvFormat
from meshfuse.parallel.context.cost import Machine, Problem, choose, estimate, machine
from meshfuse.parallel.context.explain import planned_context_parallel
from meshfuse.parallel.context.planning import problem
from meshfuse.parallel.context.record import ContextParallel, most_terms, runs_of
from meshfuse.runtime.comm.collectives import record_communications

B, E = 1, 8
STRIDES = {QkvFormat.BHSE: [3, 2, 1, 0], QkvFormat.BSHE: [3, 1, 2, 0]}


class Attention(FusionDefinition):
    """Attention forward and backward; outputs attn, q_grad, k_grad, v_grad. ``kv_heads``:
    fewer key/value heads than ``h`` (grouped-query attention); by default ``h``."""

    def __init__(self, h, s, causal, qkv_format=QkvFormat.BHSE, strategy=None,
                 dtype=DataType.Float, batch=B, kv_heads=None):
        super().__init__()
        self.h, self.s, self.causal, self.format, self.strategy = h, s, causal, qkv_format, \
            strategy
        self.dtype, self.batch = dtype, batch
        self.hkv = h if kv_heads is None else kv_heads

    def definition(self):
        self.q, self.k, self.v, self.g = (
            self.define_tensor([self.batch, heads, self.s, E], dtype=self.dtype,
                               stride_order=STRIDES[self.format])
            for heads in (self.h, self.hkv, self.hkv, self.h))
        self.attn, self.lse, seed, offset = self.ops.sdpfa_fwd(
            self.q, self.k, self.v, 0.0, self.causal, None, context_parallel=self.strategy)
        self.grads = self.ops.sdpfa_bwd(self.g, self.q, self.k, self.v, self.attn, self.lse,
                                        0.0, self.causal, seed, offset, None,
                                        context_parallel=self.strategy)
        for t in (self.attn, *self.grads):
            self.add_output(t)

    def tensors(self):
        self.define()
        return (self.q, self.k, self.v, self.g, self.attn, self.lse, *self.grads)


def _global_inputs(h, s, qkv_format, dtype=torch.float32, batch=B):
    torch.manual_seed(7)
    shape = [batch, s, h, E] if qkv_format is QkvFormat.BSHE else [batch, h, s, E]
    tensors = [torch.randn(shape, dtype=dtype) for _ in range(4)]
    return [t.transpose(1, 2) if qkv_format is QkvFormat.BSHE else t for t in tensors]


def _reference(q, k, v, g, causal):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(g.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _run(multidevice_test, fd, inputs):
    """This rank's outputs, the expected ones, and the communications that ran."""
    tensors = fd.tensors()
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(inputs, tensors)]
    with record_communications() as comms:
        outputs = fd.execute(local)
    expected = _reference(*inputs, fd.causal)
    expected = [multidevice_test.shard_tensor(r.to(x.dtype), tv)
                for r, x, tv in zip(expected, outputs, fd.fusion.outputs())]
    return outputs, expected, comms


def _assert_equal(outputs, expected, tol=1e-5):
    for name, out, ref in zip(("attn", "q_grad", "k_grad", "v_grad"), outputs, expected):
        assert out.shape == ref.shape, name
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol, msg=name)


def _sequence_sharded(fd, mesh, layout="block", pt=MX):
    devices = mesh.axis_size(pt)
    if layout == "zigzag" and fd.tensors()[0].logical[2].extent % (2 * devices):
        # Inherently even: a zig-zag split is a ScheduleError unless its 2d chunks are equal.
        pytest.skip(f"a zig-zag layout over {devices} devices needs a sequence that "
                    f"{2 * devices} divides")
    for tv in fd.tensors():
        if layout == "zigzag":
            tv.set_device_mesh(mesh)
            pos = tv.loop.index(tv.logical[2])
            tv.zigzag_split(pos, mesh.axis_size(pt))
            tv.parallelize(pos, pt)
        else:
            shard(tv, 2, mesh, pt)


def _rows(s, d, layout):
    """The global rows each position holds: torch.chunk's blocks, or head-tail pairs."""
    if layout == "zigzag":
        chunks = torch.arange(s).chunk(2 * d)
        return [torch.cat([chunks[r], chunks[2 * d - 1 - r]]) for r in range(d)]
    blocks = list(torch.arange(s).chunk(d))
    return blocks + [torch.arange(0)] * (d - len(blocks))


def _expected_ring(s, d, h_local, itemsize, position, layout="block"):
    """The ring's theory for one rank: (kind, bytes) of each transfer, in launch order: the
    forward sends its k/v block n - 1 times (steps 0 to n - 2); the backward sends k/v at the
    same steps and the dk/dv accumulators of the block it holds at steps 1 to n - 1 (the last
    time to the block's home), float32 but in the inputs' dtype on a ring of two, where each
    sum has two terms."""
    block = [len(r) * h_local * E for r in _rows(s, d, layout)]
    order = [(position - step) % d for step in range(d + 1)]
    forward, backward = [], []
    sums = 4 if d > 2 else itemsize
    for step in range(d):
        sent, received = block[order[step]], block[order[step + 1]]
        if step < d - 1:
            kv = [("send", sent * itemsize), ("recv", received * itemsize)] * 2
            forward += kv
            backward += kv
        if step >= 1:
            backward += [("send", sent * sums), ("recv", received * sums)] * 2
    return (forward + backward) if d > 1 else []


LAYOUTS = [("block", 16), ("uneven", 10), ("zigzag", 16)]


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
@pytest.mark.parametrize("layout,s", LAYOUTS, ids=[lay for lay, _ in LAYOUTS])
def test_ring_equals_unsharded(multidevice_test, causal, qkv_format, layout, s):
    """Ring attention, forward and backward, against PyTorch's unsharded attention; the
    transfers that ran are the ring's theory."""
    d = multidevice_test.size
    fd = Attention(2, s, causal, qkv_format, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag" if layout == "zigzag" else "block")
    outputs, expected, comms = _run(multidevice_test, fd, _global_inputs(2, s, qkv_format))
    _assert_equal(outputs, expected)
    assert "context_parallel='ring'" in fd.explain()
    assert [(c.kind, c.bytes) for c in comms] == _expected_ring(
        s, d, 2, 4, multidevice_test.rank, "zigzag" if layout == "zigzag" else "block")


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allgather", "alltoall"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["block", "zigzag"])
def test_other_strategies_equal_unsharded(multidevice_test, strategy, causal, layout):
    """All-gather of k/v and all-to-all (heads for sequence and back), forced; what ran is
    what explain plans (the query sequence stays sharded: nothing else moves)."""
    d = multidevice_test.size
    if strategy == "alltoall" and 4 % d:
        pytest.skip(f"all-to-all trades the sequence for the 4 heads: {d} ranks must divide "
                    "them (else a ShardingError names the fix)")
    fd = Attention(4, 16, causal, QkvFormat.BSHE, strategy=strategy)
    _sequence_sharded(fd, mesh_1d(multidevice_test), layout)
    outputs, expected, comms = _run(multidevice_test, fd, _global_inputs(4, 16, QkvFormat.BSHE))
    _assert_equal(outputs, expected)
    assert f"context_parallel='{strategy}'" in fd.explain()
    planned = planned_context_parallel(fd.compiled().fusion, multidevice_test.rank)
    assert comms == [c for p in planned for c in p.communications()]
    kinds = {"allgather": {"allgather", "reduce_scatter"}, "alltoall": {"all_to_all"}}
    assert {c.kind for c in comms} == (kinds[strategy] if d > 1 else set())


@pytest.mark.mpi
def test_uneven_allgather(multidevice_test):
    fd = Attention(2, 10, True, strategy="allgather")
    _sequence_sharded(fd, mesh_1d(multidevice_test))
    outputs, expected, _ = _run(multidevice_test, fd, _global_inputs(2, 10, QkvFormat.BHSE))
    _assert_equal(outputs, expected)


@pytest.mark.mpi
def test_ring_peers_and_explain_match_what_ran(multidevice_test):
    """Each send goes to the next rank and each recv comes from the previous; explain's
    planned transfers, without inputs, are the records that ran."""
    d, rank = multidevice_test.size, multidevice_test.rank
    fd = Attention(2, 12, True, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test))
    _, _, comms = _run(multidevice_test, fd, _global_inputs(2, 12, QkvFormat.BHSE))
    assert {c.peer for c in comms if c.kind == "send"} <= {(rank + 1) % d}
    assert {c.peer for c in comms if c.kind == "recv"} <= {(rank - 1) % d}
    planned = planned_context_parallel(fd.compiled().fusion, rank)
    assert [c for p in planned for c in p.communications()] == comms
    assert ("ring over mesh axis 0" in fd.explain()) == (d > 1)


def _own_parts(fd, rank):
    """The own-block parts of the backward's ring record on ``rank``."""
    planned = planned_context_parallel(fd.compiled().fusion, rank)
    return [p.record.own_parts for p in planned if p.record.backward]


@pytest.mark.mpi
def test_odd_heads_compute_the_own_block_whole(multidevice_test):
    """Three heads do not halve: the own block's kernels run whole, the transfers are the
    ring's theory either way."""
    d = multidevice_test.size
    fd = Attention(3, 16, True, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    outputs, expected, comms = _run(multidevice_test, fd, _global_inputs(3, 16, QkvFormat.BHSE))
    _assert_equal(outputs, expected)
    assert [(c.kind, c.bytes) for c in comms] == _expected_ring(
        16, d, 3, 4, multidevice_test.rank, "zigzag")
    planned = planned_context_parallel(fd.compiled().fusion, multidevice_test.rank)
    assert [c for p in planned for c in p.communications()] == comms
    assert _own_parts(fd, multidevice_test.rank) == ([1] if d > 1 else [])


@pytest.mark.mpi
@pytest.mark.parametrize("parts", [1, 4])
def test_own_block_parts_when_asked(multidevice_test, monkeypatch, parts):
    """MESHFUSE_CP_OWN_PARTS (read when the program is built): 1 computes the own block
    whole, 4 in quarters of the 4 heads; the results and the transfers do not change."""
    monkeypatch.setenv("MESHFUSE_CP_OWN_PARTS", str(parts))
    d = multidevice_test.size
    fd = Attention(4, 16, True, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    outputs, expected, comms = _run(multidevice_test, fd, _global_inputs(4, 16, QkvFormat.BHSE))
    _assert_equal(outputs, expected)
    assert [(c.kind, c.bytes) for c in comms] == _expected_ring(
        16, d, 4, 4, multidevice_test.rank, "zigzag")
    assert _own_parts(fd, multidevice_test.rank) == ([parts] if d > 1 else [])


@pytest.mark.mpi
def test_own_parts_must_be_a_count(multidevice_test, monkeypatch):
    """A value of MESHFUSE_CP_OWN_PARTS that is no count of parts is a DefinitionError
    naming the variable, on every rank."""
    if multidevice_test.size == 1:
        pytest.skip("one rank: no ring backward")
    monkeypatch.setenv("MESHFUSE_CP_OWN_PARTS", "half")
    fd = Attention(4, 16, True, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    with pytest.raises(DefinitionError, match="MESHFUSE_CP_OWN_PARTS='half'"):
        _run(multidevice_test, fd, _global_inputs(4, 16, QkvFormat.BHSE))


@pytest.mark.mpi
@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
def test_batch_of_two_computes_the_own_block_per_batch_element(multidevice_test, qkv_format):
    """With a batch of 2 the own block's kernels run per batch element (3 heads and all):
    the values equal the unsharded attention's, the transfers are the ring's theory."""
    d, rank = multidevice_test.size, multidevice_test.rank
    fd = Attention(3, 16, True, qkv_format, strategy="ring", batch=2)
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    inputs = _global_inputs(3, 16, qkv_format, batch=2)
    outputs, expected, comms = _run(multidevice_test, fd, inputs)
    _assert_equal(outputs, expected)
    kinds = [(c.kind, c.bytes) for c in comms]
    whole = _expected_ring(16, d, 3, 4, rank, "zigzag")
    assert kinds == [(kind, 2 * size) for kind, size in whole]  # each block: both elements
    planned = planned_context_parallel(fd.compiled().fusion, rank)
    assert [c for p in planned for c in p.communications()] == comms
    assert _own_parts(fd, rank) == ([2] if d > 1 else [])


@pytest.mark.mpi
def test_zigzag_layout_is_in_the_schedule(multidevice_test):
    """shard_tensor gives each rank chunk r and chunk 2d - 1 - r of the sequence; explain
    prints the placement S(2)z; unshard_tensor puts the rows back."""
    d, rank = multidevice_test.size, multidevice_test.rank
    fd = Attention(2, 16, True)
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    x = torch.arange(B * 2 * 16 * E, dtype=torch.float).reshape(B, 2, 16, E)
    local = multidevice_test.shard_tensor(x, fd.q)
    assert torch.equal(local.cpu(), x[:, :, _rows(16, d, "zigzag")[rank]])
    assert "[S(2)z]" in fd.explain()
    assert torch.equal(multidevice_test.unshard_tensor(local, fd.q).cpu(), x)


@pytest.mark.mpi
def test_bfloat16_ring(multidevice_test):
    fd = Attention(2, 32, True, dtype=DataType.BFloat16, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    inputs = _global_inputs(2, 32, QkvFormat.BHSE, torch.bfloat16)
    outputs, expected, comms = _run(multidevice_test, fd, inputs)
    _assert_equal(outputs, expected, tol=3e-2)
    d = multidevice_test.size
    assert [(c.kind, c.bytes) for c in comms] == _expected_ring(
        32, d, 2, 2, multidevice_test.rank, "zigzag")


@pytest.mark.parametrize("layout,s", LAYOUTS, ids=[lay for lay, _ in LAYOUTS])
@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_sums_in_the_inputs_dtype_only_with_two_terms(layout, s, d):
    """A ring of two adds at most two kernel results into any sum (so the inputs' dtype
    rounds as a float32 sum would); longer rings add more, in float32."""
    rows = tuple(runs_of(r) or ((0, 0),) for r in _rows(s, d, "zigzag" if layout == "zigzag"
                                                          else "block"))
    for position in range(d):
        record = ContextParallel("ring", 0, tuple(range(d)), position, rows, True)
        assert record.sums_in_input_dtype == (d <= 2)
        assert most_terms(record, False) == d


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["ring", "alltoall"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_heads_by_sequence_2x2(multidevice_test, strategy, causal):
    """Heads on one mesh axis, the sequence on the other: a group of 2 per head block."""
    mesh = mesh_2x2(multidevice_test)
    fd = Attention(4, 12, causal, QkvFormat.BSHE, strategy=strategy)
    for tv in fd.tensors():
        shard(tv, 1, mesh, MY)
        shard(tv, 2, mesh, MX)
    outputs, expected, comms = _run(multidevice_test, fd, _global_inputs(4, 12, QkvFormat.BSHE))
    _assert_equal(outputs, expected)
    rank = multidevice_test.rank
    assert all(c.ranks == (rank & 2, (rank & 2) + 1) for c in comms)  # this rank's row
    if strategy == "ring":
        assert {c.peer for c in comms} == {rank ^ 1}
        assert [(c.kind, c.bytes) for c in comms] == _expected_ring(12, 2, 2, 4, rank % 2)


@pytest.mark.mpi
def test_auto_takes_the_estimates_choice(multidevice_test, monkeypatch):
    """Without a request the cost estimate picks, forward and backward alike: with a slow
    kernel and a fast link the ring (its transfers hide under compute); with a slow start of
    every message, on 4 ranks the backward's all-gather (4 messages against the ring's 12),
    on 2 the ring (4 messages as well, and fewer bytes)."""
    d = multidevice_test.size
    if d == 1:
        pytest.skip("one rank: nothing to choose")
    allowed = ("ring", "allgather", "alltoall") if 2 % d == 0 else ("ring", "allgather")
    picks = {}
    for name, kernel, link, latency in (("compute_bound", "0.00001", "1000", "0"),
                                        ("slow_start", "1000", "1000", "1e7")):
        monkeypatch.setenv("MESHFUSE_CP_KERNEL_TFLOPS", kernel)
        monkeypatch.setenv("MESHFUSE_CP_LINK_GBPS", link)
        monkeypatch.setenv("MESHFUSE_CP_LATENCY_US", latency)
        fd = Attention(2, 16, True)
        _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
        outputs, expected, _ = _run(multidevice_test, fd, _global_inputs(2, 16, QkvFormat.BHSE))
        _assert_equal(outputs, expected)
        for expr in fd.compiled().fusion.exprs:
            if getattr(expr.op, "name", None) in ("sdpfa_fwd", "sdpfa_bwd"):
                chosen, estimates = choose(problem(expr), machine("cpu"), allowed)
                assert expr.args[-1] == chosen, estimates
                picks[name, expr.op.name] = chosen
    assert picks["compute_bound", "sdpfa_fwd"] == picks["compute_bound", "sdpfa_bwd"] == "ring"
    assert picks["slow_start", "sdpfa_bwd"] == ("allgather" if d > 2 else "ring")


def test_cost_estimate():
    """The estimate's arithmetic: the ring hides its transfer under compute, the all-gather
    adds it; a zig-zag layout removes the causal skew; all-to-all needs no skew either."""
    m = Machine(kernel_flops=1e12, link_bytes=1e9, latency=0.0)
    p = Problem(1, 8, 4096, 64, 64, 2, 2, causal=True, backward=False, balanced=True)
    compute = 4 * 8 * 4096 ** 2 * 64 / 2 / 2 / 1e12
    block = 8 * 2048 * 128 * 2 / 1e9
    assert estimate("ring", p, m) == pytest.approx(max(compute / 2, block) + compute / 2)
    assert estimate("allgather", p, m) == pytest.approx(compute + block)
    skewed = dataclasses.replace(p, balanced=False)
    assert estimate("allgather", skewed, m) == pytest.approx(compute * 1.5 + block)
    assert estimate("alltoall", skewed, m) == pytest.approx(compute + 4 * block / 2 / 2)


@pytest.mark.mpi
def test_refused_strategies_say_why(multidevice_test):
    """A ring whose k is replicated, an all-to-all whose heads do not divide, a zig-zag split
    of a length it does not fit: typed errors naming the tensor and the fix, on every rank."""
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    if d > 1:
        fd = Attention(2, 8, False, strategy="ring")
        for tv in fd.tensors():
            tv.set_device_mesh(mesh) if tv is fd.k else shard(tv, 2, mesh)
        inputs = _global_inputs(2, 8, QkvFormat.BHSE)
        with pytest.raises(ShardingError, match=r"'ring' cannot run: T1 \(k\) is not sharded"):
            fd.execute([multidevice_test.shard_tensor(t, tv) for t, tv in
                        zip(inputs, fd.tensors())])
        fd = Attention(d + 1, 8, False, strategy="alltoall")
        _sequence_sharded(fd, mesh)
        with pytest.raises(ShardingError, match="local heads of T0 do not divide"):
            fd.compiled()
    fd = Attention(2, 6, True)
    with pytest.raises(ScheduleError, match="not a multiple of 2 \\* 2"):
        fd.tensors()[0].zigzag_split(2, 2)


def test_unknown_strategy_is_a_definition_error():
    with pytest.raises(DefinitionError, match="'spiral' is not a context-parallel strategy"):
        Attention(2, 8, False, strategy="spiral").tensors()


class DropoutAttention(FusionDefinition):
    """Causal attention with dropout, forward and backward, q/k of head dim S and v the
    identity (so ``attn`` is the dropped-out probability matrix: its zeros are the mask)."""

    def __init__(self, mode, strategy, p=0.3):
        super().__init__()
        self.mode, self.strategy, self.p = mode, strategy, p

    def definition(self):
        self.q, self.k, self.v, self.g = (self.define_tensor([B, 2, 16, 16], dtype=DataType.Float)
                                          for _ in range(4))
        self.attn, self.lse, seed, offset = self.ops.sdpfa_fwd(
            self.q, self.k, self.v, self.p, True, None, rng_seed=5, rng_offset=2,
            dropout_mode=self.mode, context_parallel=self.strategy)
        self.grads = self.ops.sdpfa_bwd(self.g, self.q, self.k, self.v, self.attn, self.lse,
                                        self.p, True, seed, offset, None,
                                        context_parallel=self.strategy)
        for t in (self.attn, *self.grads):
            self.add_output(t)

    def tensors(self):
        self.define()
        return (self.q, self.k, self.v, self.g, self.attn, self.lse, *self.grads)


def _dropout_inputs():
    torch.manual_seed(3)
    q, k, g = (torch.randn(B, 2, 16, 16) for _ in range(3))
    return [q, k, torch.eye(16).expand(B, 2, 16, 16).contiguous(), g]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["block", "zigzag"])
def test_dropout_global_mode_equals_unsharded(multidevice_test, strategy, layout):
    """Global-mask dropout: each block's mask is the unsharded run's at its global position,
    so the sharded forward and gradients equal the unsharded run's."""
    inputs = _dropout_inputs()
    expected = DropoutAttention("global", None).execute(
        [t.to(multidevice_test.device) for t in inputs])
    fd = DropoutAttention("global", strategy)
    _sequence_sharded(fd, mesh_1d(multidevice_test), layout)
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(inputs, fd.tensors())]
    outputs = fd.execute(local)
    assert f"context_parallel='{strategy}'" in fd.explain()
    for out, ref, tv in zip(outputs, expected, fd.fusion.outputs()):
        torch.testing.assert_close(out, multidevice_test.shard_tensor(ref, tv), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.mpi
def test_dropout_shard_mode_gradients_use_the_forwards_masks(multidevice_test):
    """Per-block streams: the backward redraws every block's mask from the forward's seed
    and offset. The mask is read off the output (v is the identity) and a reference with
    that mask, differentiated by autograd, gives the same gradients; the same seed gives the
    same bits twice, and the masks are not the global mode's."""
    inputs = _dropout_inputs()
    fd = DropoutAttention("shard", "ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(inputs, fd.tensors())]
    outputs = fd.execute(local)
    assert all(torch.equal(a, b) for a, b in zip(outputs, fd.execute(local)))
    attn = multidevice_test.unshard_tensor(outputs[0], fd.fusion.outputs()[0]).cpu()
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    keep = (attn != 0) | ~causal
    q, k, v = (t.double().requires_grad_() for t in inputs[:3])
    scores = (q @ k.transpose(-2, -1) / 4.0).masked_fill(~causal, float("-inf"))
    out = (scores.softmax(-1) * keep / 0.7) @ v
    out.backward(inputs[3].double())
    for got, ref, tv in zip(outputs, (out.detach(), q.grad, k.grad, v.grad),
                            fd.fusion.outputs()):
        torch.testing.assert_close(got, multidevice_test.shard_tensor(ref.float(), tv),
                                   atol=1e-5, rtol=1e-5)
    dropped = ((~keep & causal).sum() / (causal.sum() * 2 * B)).item()
    assert 0.2 < dropped < 0.4, dropped  # about p = 0.3 of the entries the causal mask keeps
    global_attn = DropoutAttention("global", None).execute(
        [t.to(multidevice_test.device) for t in inputs])[0].cpu()
    if multidevice_test.size > 1:
        assert not torch.equal((global_attn != 0), (attn != 0))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["ring", None], ids=["ring", "estimate"])
@pytest.mark.parametrize("layout,s", [("zigzag", 16), ("uneven", 10)], ids=["zigzag", "uneven"])
def test_backward_of_a_gathered_output_runs_context_parallel(multidevice_test, strategy,
                                                             layout, s):
    """Regression (found by tests/test_fuzz_context_parallel.py): the forward's output
    pinned whole (a gather after it) and a whole output gradient, fed to the backward. The
    backward's query-row inputs (output gradient, output) had to be sharded as q: a forced
    ring was a ShardingError, the estimate fell back to the engine's gather of k and v. They
    are resharded as q now (from whole: a slice, no traffic) and the backward runs
    context-parallel; with the ring, its transfers are the ring's theory and the only other
    communication is the gather of the output."""
    d, rank = multidevice_test.size, multidevice_test.rank
    if layout == "zigzag" and s % (2 * d):
        pytest.skip("a zig-zag split needs 2d to divide the sequence")
    fd = Attention(2, s, True, strategy=strategy)
    mesh = mesh_1d(multidevice_test)
    q, k, v, g, attn = fd.tensors()[:5]
    for tv in (q, k, v):
        tv.set_device_mesh(mesh)
        tv.split(2, d, inner_split=False, zigzag=layout == "zigzag")
        tv.parallelize(2, MX)
    for tv in (g, attn):  # whole, pinned
        tv.set_device_mesh(mesh)
    inputs = _global_inputs(2, s, QkvFormat.BHSE)
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(inputs, (q, k, v, g))]
    with record_communications() as comms:
        outputs = fd.execute(local)
    want = [multidevice_test.shard_tensor(r.float(), tv)
            for r, tv in zip(_reference(*inputs, True), fd.fusion.outputs())]
    _assert_equal(outputs, want)
    assert outputs[0].shape == (B, 2, s, E)  # the output whole on every rank
    records = [p.record for p in planned_context_parallel(fd.compiled().fusion, rank)]
    assert [r.backward for r in records] == ([False, True] if d > 1 else [])
    if strategy == "ring":
        ring = [(c.kind, c.bytes) for c in comms if c.kind in ("send", "recv")]
        assert ring == _expected_ring(s, d, 2, 4, rank, layout)
        others = sorted({c.kind for c in comms if c.kind not in ("send", "recv")})
        assert others == (["allgather"] if d > 1 else []), others
