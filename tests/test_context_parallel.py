"""Context parallelism: attention with q, k and v sharded on the sequence axis.

Every sharded run is checked against PyTorch's unsharded attention (forward and the three
gradients), and the point-to-point transfers that ran are checked against the ring's theory:
a forward sends its k/v block ``n - 1`` times; a backward sends k/v ``n - 1`` times and the
float32 dk/dv accumulators ``n`` times (the last transfer brings them home).
"""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard

from meshfuse import DataType, DefinitionError, FusionDefinition, ShardingError
from meshfuse.examples.seed_sdpa import QkvFormat
from meshfuse.explain import planned_rings
from meshfuse.runtime.collectives import record_communications
from meshfuse.sharding import shard_tensor

B, E = 1, 8
STRIDES = {QkvFormat.BHSE: [3, 2, 1, 0], QkvFormat.BSHE: [3, 1, 2, 0]}


class Attention(FusionDefinition):
    """Attention forward and backward; outputs attn, q_grad, k_grad, v_grad."""

    def __init__(self, h, s, causal, qkv_format=QkvFormat.BHSE, strategy=None,
                 dtype=DataType.Float):
        super().__init__()
        self.h, self.s, self.causal, self.format, self.strategy = h, s, causal, qkv_format, \
            strategy
        self.dtype = dtype

    def definition(self):
        self.q, self.k, self.v, self.g = (
            self.define_tensor([B, self.h, self.s, E], dtype=self.dtype,
                               stride_order=STRIDES[self.format]) for _ in range(4))
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


def _global_inputs(h, s, qkv_format, dtype=torch.float32):
    torch.manual_seed(7)
    shape = [B, s, h, E] if qkv_format is QkvFormat.BSHE else [B, h, s, E]
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


def _sequence_sharded(fd, mesh, pt=MX):
    for tv in fd.tensors():
        shard(tv, 2, mesh, pt)


def _rows(s, d):
    """torch.chunk's rows per position (uneven shards follow it)."""
    return [len(c) for c in torch.arange(s).chunk(d)] + [0] * (d - len(torch.arange(s).chunk(d)))


def _expected_transfers(s, d, h_local, itemsize, position):
    """The ring's theory for one rank: (kind, bytes) of each transfer, in launch order."""
    rows = _rows(s, d)
    block = [r * h_local * E for r in rows]
    order = [(position - step) % d for step in range(d + 1)]
    forward, backward = [], []
    for step in range(d):
        sent, received = block[order[step]], block[order[step + 1]]
        kv = [("send", sent * itemsize), ("recv", received * itemsize)] * 2 \
            if step < d - 1 else []
        forward += kv
        backward += kv + [("send", sent * 4), ("recv", received * 4)] * 2
    return (forward + backward) if d > 1 else []


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
@pytest.mark.parametrize("s", [16, 10], ids=["even", "uneven"])
def test_ring_equals_unsharded(multidevice_test, causal, qkv_format, s):
    d = multidevice_test.size
    fd = Attention(2, s, causal, qkv_format)
    _sequence_sharded(fd, mesh_1d(multidevice_test))
    inputs = _global_inputs(2, s, qkv_format)
    outputs, expected, comms = _run(multidevice_test, fd, inputs)
    _assert_equal(outputs, expected)
    assert "context_parallel='ring'" in fd.explain()
    p2p = [(c.kind, c.bytes) for c in comms]
    assert p2p == _expected_transfers(s, d, 2, 4, multidevice_test.rank)
    assert all(c.kind in ("send", "recv") for c in comms), "a ring gathers nothing"


@pytest.mark.mpi
def test_ring_peers_and_explain_match_what_ran(multidevice_test):
    """Each send goes to the next rank and each recv comes from the previous; explain's
    planned transfers, without inputs, are the records that ran."""
    d, rank = multidevice_test.size, multidevice_test.rank
    fd = Attention(2, 12, True)
    _sequence_sharded(fd, mesh_1d(multidevice_test))
    _, _, comms = _run(multidevice_test, fd, _global_inputs(2, 12, QkvFormat.BHSE))
    assert {c.peer for c in comms if c.kind == "send"} <= {(rank + 1) % d}
    assert {c.peer for c in comms if c.kind == "recv"} <= {(rank - 1) % d}
    runner = fd._get_runner()
    planned = [c for ring in planned_rings(runner.fusion, rank) for c in ring.communications()]
    assert planned == comms
    text = fd.explain()
    assert ("ring over mesh axis 0" in text) == (d > 1)


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forced_allgather(multidevice_test, causal):
    """``context_parallel="allgather"``: k and v are gathered, no point-to-point transfer."""
    d = multidevice_test.size
    fd = Attention(2, 8, causal, strategy="allgather")
    _sequence_sharded(fd, mesh_1d(multidevice_test))
    outputs, expected, comms = _run(multidevice_test, fd, _global_inputs(2, 8, QkvFormat.BHSE))
    _assert_equal(outputs, expected)
    assert not any(c.kind in ("send", "recv") for c in comms)
    assert any(c.kind == "allgather" for c in comms) == (d > 1)
    assert "context_parallel='allgather'" in fd.explain()


@pytest.mark.mpi
def test_bfloat16_ring(multidevice_test):
    fd = Attention(2, 32, True, dtype=DataType.BFloat16)
    _sequence_sharded(fd, mesh_1d(multidevice_test))
    inputs = _global_inputs(2, 32, QkvFormat.BHSE, torch.bfloat16)
    outputs, expected, _ = _run(multidevice_test, fd, inputs)
    _assert_equal(outputs, expected, tol=3e-2)


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_heads_by_sequence_2x2(multidevice_test, causal):
    """Heads on one mesh axis, the sequence on the other: a ring of 2 in each head group."""
    mesh = mesh_2x2(multidevice_test)
    fd = Attention(4, 12, causal, QkvFormat.BSHE)
    for tv in fd.tensors():
        shard(tv, 1, mesh, MY)
        shard(tv, 2, mesh, MX)
    outputs, expected, comms = _run(multidevice_test, fd, _global_inputs(4, 12, QkvFormat.BSHE))
    _assert_equal(outputs, expected)
    rank = multidevice_test.rank
    partner = rank ^ 1  # the other rank of this rank's row of [[0, 1], [2, 3]]
    assert {c.peer for c in comms} == {partner}
    assert [(c.kind, c.bytes) for c in comms] == _expected_transfers(12, 2, 2, 4, rank % 2)


@pytest.mark.mpi
def test_ring_refused_when_keys_are_not_sharded_alike(multidevice_test):
    """Asking for a ring whose k is replicated is a ShardingError naming k, on every rank;
    left to the cost estimate, the same program gathers nothing and is right."""
    if multidevice_test.size == 1:
        pytest.skip("one rank holds the whole sequence")
    mesh = mesh_1d(multidevice_test)
    fd = Attention(2, 8, False, strategy="ring")
    for tv in fd.tensors():
        if tv is fd.k:
            tv.set_device_mesh(mesh)
        else:
            shard(tv, 2, mesh)
    inputs = _global_inputs(2, 8, QkvFormat.BHSE)
    with pytest.raises(ShardingError, match=r"context_parallel='ring' cannot run: T1 \(k\)"):
        fd.execute([shard_tensor(t, tv, multidevice_test.rank) for t, tv in
                    zip(inputs, fd.tensors())])


def test_unknown_strategy_is_a_definition_error():
    with pytest.raises(DefinitionError, match="'spiral' is not a context-parallel strategy"):
        Attention(2, 8, False, strategy="spiral").tensors()
