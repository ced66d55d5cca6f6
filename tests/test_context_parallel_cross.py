"""Cross attention (a key sequence of another length than the query sequence) sharded on both
sequences: every strategy against PyTorch's unsharded attention, whose causal mask is aligned
top-left (query ``i`` sees keys ``j <= i``); the ring moves key blocks of the key rows.
"""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard

from meshfuse import DataType, FusionDefinition, ScheduleError, ShardingError
from meshfuse.examples.seed_sdpa import QkvFormat
from meshfuse.parallel.context.explain import planned_context_parallel
from meshfuse.parallel.context.record import Block, cross_pieces
from meshfuse.runtime.comm.collectives import record_communications

B, H, E = 1, 4, 8
STRIDES = {QkvFormat.BHSE: [3, 2, 1, 0], QkvFormat.BSHE: [3, 1, 2, 0]}


class CrossAttention(FusionDefinition):
    """Attention forward and backward, queries of length ``s``, keys of length ``s_kv``
    (``hkv`` key/value heads); outputs attn, q_grad, k_grad, v_grad."""

    def __init__(self, s, s_kv, causal, qkv_format=QkvFormat.BHSE, strategy=None, hkv=H,
                 dropout=0.0):
        super().__init__()
        self.s, self.s_kv, self.causal, self.format = s, s_kv, causal, qkv_format
        self.strategy, self.hkv, self.dropout = strategy, hkv, dropout

    def definition(self):
        shapes = ([B, H, self.s, E], [B, self.hkv, self.s_kv, E], [B, self.hkv, self.s_kv, E],
                  [B, H, self.s, E])
        self.q, self.k, self.v, self.g = (
            self.define_tensor(shape, dtype=DataType.Float, stride_order=STRIDES[self.format])
            for shape in shapes)
        extra = {"rng_seed": 5, "rng_offset": 1, "dropout_mode": "global"} \
            if self.dropout else {}
        self.attn, self.lse, seed, offset = self.ops.sdpfa_fwd(
            self.q, self.k, self.v, self.dropout, self.causal, None,
            context_parallel=self.strategy, **extra)
        self.grads = self.ops.sdpfa_bwd(self.g, self.q, self.k, self.v, self.attn, self.lse,
                                        self.dropout, self.causal, seed, offset, None,
                                        context_parallel=self.strategy)
        for t in (self.attn, *self.grads):
            self.add_output(t)

    def tensors(self):
        self.define()
        return (self.q, self.k, self.v, self.g, self.attn, self.lse, *self.grads)


def _inputs(s, s_kv, qkv_format=QkvFormat.BHSE, hkv=H):
    torch.manual_seed(5)
    shapes = [(B, H, s, E), (B, hkv, s_kv, E), (B, hkv, s_kv, E), (B, H, s, E)]
    if qkv_format is QkvFormat.BSHE:
        return [torch.randn(b, n, h, e).transpose(1, 2) for b, h, n, e in shapes]
    return [torch.randn(shape) for shape in shapes]


def _reference(q, k, v, g, causal):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                           enable_gqa=True)
    out.backward(g.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _sequence_sharded(fd, mesh, layout, pt=MX):
    for tv in fd.tensors():
        if layout == "zigzag":
            tv.set_device_mesh(mesh)
            pos = tv.loop.index(tv.logical[2])
            tv.zigzag_split(pos, mesh.axis_size(pt))
            tv.parallelize(pos, pt)
        else:
            shard(tv, 2, mesh, pt)


def _check(multidevice_test, fd, inputs, expected=None):
    tensors = fd.tensors()
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(inputs, tensors)]
    with record_communications() as comms:
        outputs = fd.execute(local)
    expected = expected or _reference(*inputs, fd.causal)
    for name, out, ref, tv in zip(("attn", "q_grad", "k_grad", "v_grad"), outputs, expected,
                                  fd.fusion.outputs()):
        torch.testing.assert_close(out, multidevice_test.shard_tensor(ref.float(), tv),
                                   atol=1e-5, rtol=1e-5, msg=name)
    return comms


def _key_rows(s_kv, d):
    """The key rows of each position: torch.chunk's blocks."""
    blocks = [len(c) for c in torch.arange(s_kv).chunk(d)]
    return blocks + [0] * (d - len(blocks))


CASES = [(s, s_kv, causal) for s, s_kv in ((16, 8), (8, 24), (12, 20), (4, 12))
         for causal in (False, True)]


@pytest.mark.mpi
@pytest.mark.parametrize("s,s_kv,causal", CASES,
                         ids=[f"{c[0]}x{c[1]}-{'causal' if c[2] else 'full'}" for c in CASES])
def test_ring_cross_attention(multidevice_test, s, s_kv, causal):
    """Queries and keys of different lengths, both split into blocks alike: the ring equals
    PyTorch's unsharded attention (causal: top-left, so with 4 queries and 12 keys most
    blocks are skipped); its k/v transfers carry the key rows."""
    d, rank = multidevice_test.size, multidevice_test.rank
    fd = CrossAttention(s, s_kv, causal, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "block")
    if s != s_kv and (s % d or s_kv % d):  # the ring runs on equal blocks of each
        with pytest.raises(ShardingError, match=f"do not both divide over {d} ranks"):
            _check(multidevice_test, fd, _inputs(s, s_kv))
        return
    comms = _check(multidevice_test, fd, _inputs(s, s_kv))
    assert "context_parallel='ring'" in fd.explain()
    rows = _key_rows(s_kv, d)
    kv = [c.bytes for c in comms if c.kind == "send"][:2 * (d - 1)]  # the forward's k, v
    assert kv == [rows[(rank - step) % d] * H * E * 4 for step in range(d - 1)
                  for _ in ("k", "v")]
    planned = planned_context_parallel(fd.compiled().fusion, rank)
    assert [c for p in planned for c in p.communications()] == comms


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["allgather", "alltoall"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
def test_other_strategies_cross_attention(multidevice_test, strategy, causal, qkv_format):
    """All-gather of the key rows, all-to-all of both sequences (16 queries and 8 keys);
    what ran is what explain plans. Where the sequences do not both divide over the ranks
    (3), the all-to-all is refused and the all-gather is the engine's: k and v gathered,
    the queries kept sharded."""
    d = multidevice_test.size
    fd = CrossAttention(16, 8, causal, qkv_format, strategy=strategy)
    _sequence_sharded(fd, mesh_1d(multidevice_test), "block")
    if 16 % d or 8 % d:
        if strategy == "alltoall":
            with pytest.raises(ShardingError, match=f"do not both divide over {d} ranks"):
                _check(multidevice_test, fd, _inputs(16, 8, qkv_format))
            return
        comms = _check(multidevice_test, fd, _inputs(16, 8, qkv_format))
        assert planned_context_parallel(fd.compiled().fusion, multidevice_test.rank) == []
        assert comms and {c.kind for c in comms} <= {"allgather", "reduce_scatter"}, comms
        return
    comms = _check(multidevice_test, fd, _inputs(16, 8, qkv_format))
    assert f"context_parallel='{strategy}'" in fd.explain()
    planned = planned_context_parallel(fd.compiled().fusion, multidevice_test.rank)
    assert comms == [c for p in planned for c in p.communications()]


@pytest.mark.mpi
def test_cross_lengths_that_do_not_divide_are_gathered_or_refused(multidevice_test):
    """10 queries and 6 keys: over 2 ranks the ring runs; over 4 the blocks would be uneven,
    so the estimate leaves the attention to the engine (keys gathered, equal to the
    unsharded run) and asking for the ring says why not."""
    d = multidevice_test.size
    fd = CrossAttention(10, 6, True)
    _sequence_sharded(fd, mesh_1d(multidevice_test), "block")
    _check(multidevice_test, fd, _inputs(10, 6))
    runs = 10 % d == 0 and 6 % d == 0
    assert "context_parallel='allgather'" in fd.explain() or runs
    fd = CrossAttention(10, 6, True, strategy="ring")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "block")
    if runs:
        _check(multidevice_test, fd, _inputs(10, 6))
    else:
        with pytest.raises(ShardingError, match=rf"\(10, 6\) that do not both divide over {d}"):
            fd.compiled()


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zigzag_cross_attention_is_gathered_or_refused(multidevice_test, causal):
    """A zig-zag split balances causal work of equal lengths only: with 16 queries and 8
    keys the estimate leaves the attention to the engine, which gathers the keys (equal to
    the unsharded run), and asking for the ring says why not, on every rank. Over ranks
    whose two chunks per rank do not divide the sequences (3), the split itself is refused."""
    d = multidevice_test.size
    fd = CrossAttention(16, 8, causal)
    if 8 % (2 * d):
        with pytest.raises(ScheduleError, match=rf"not a multiple of 2 \* {d}"):
            _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
        return
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    _check(multidevice_test, fd, _inputs(16, 8))
    assert "context_parallel='allgather'" in fd.explain()
    if multidevice_test.size > 1:
        fd = CrossAttention(16, 8, causal, strategy="ring")
        _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
        with pytest.raises(ShardingError, match=r"different lengths \(16, 8\) and a zig-zag"):
            fd.compiled()


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_cross_attention_heads_by_sequence_2x2(multidevice_test, causal):
    """Grouped heads (4 query, 2 key/value) on one mesh axis, both sequences (12 queries, 20
    keys) on the other: a ring per head block."""
    mesh = mesh_2x2(multidevice_test)
    fd = CrossAttention(12, 20, causal, QkvFormat.BSHE, strategy="ring", hkv=2)
    for tv in fd.tensors():
        shard(tv, 1, mesh, MY)
        shard(tv, 2, mesh, MX)
    _check(multidevice_test, fd, _inputs(12, 20, QkvFormat.BSHE, hkv=2))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_cross_attention_dropout_global_mode_equals_unsharded(multidevice_test, strategy):
    """Global-mask dropout with 16 queries and 24 keys: every block's mask is the unsharded
    run's, so the sharded forward and gradients equal meshfuse's unsharded run."""
    inputs = _inputs(16, 24)
    whole = CrossAttention(16, 24, True, dropout=0.25)
    whole.tensors()
    expected = whole.execute([t.to(multidevice_test.device) for t in inputs])
    fd = CrossAttention(16, 24, True, strategy=strategy, dropout=0.25)
    _sequence_sharded(fd, mesh_1d(multidevice_test), "block")
    d = multidevice_test.size
    if strategy == "ring" and (16 % d or 24 % d):  # the ring runs on equal blocks
        with pytest.raises(ShardingError, match=f"do not both divide over {d} ranks"):
            fd.compiled()
        return
    _check(multidevice_test, fd, inputs, expected)


def test_pieces_of_a_causal_cross_block():
    """Query rows 2..5 (local 0..3) against key rows 0..3 (local 10..13): rows 2, 3 see keys
    0, 1 in full and keys 2, 3 as a diagonal; rows 4, 5 see all four keys."""
    pieces = cross_pieces(((2, 6), (0, 4)), ((0, 4), (10, 14)))
    assert pieces == [((0, 2), (10, 12), Block.FULL), ((0, 2), (12, 14), Block.DIAGONAL),
                      ((2, 4), (10, 14), Block.FULL)]
    assert cross_pieces(((0, 4), (0, 4)), ((4, 8), (0, 4))) == []  # no query sees a key
    assert cross_pieces(((8, 12), (0, 4)), ((0, 4), (0, 4))) == [((0, 4), (0, 4), Block.FULL)]
