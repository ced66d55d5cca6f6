"""Grouped-query attention (fewer key/value heads than query heads, PyTorch's
``enable_gqa=True``) unsharded, head-parallel and context-parallel.

Every run is checked against PyTorch's unsharded ``scaled_dot_product_attention(...,
enable_gqa=True)`` and its autograd gradients; the ring's transfers carry the smaller k/v
(their bytes are the theory's with the key/value heads).
"""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard
from test_context_parallel import Attention, B, E

from meshfuse import DataType, DefinitionError, FusionDefinition, ScheduleError, ShardingError
from meshfuse.examples.seed_sdpa import QkvFormat
from meshfuse.ops.attention.backends import AttentionBackend, own_limits
from meshfuse.ops.attention.kernels import sdpa_backward, sdpa_forward
from meshfuse.parallel.context.cost import Machine, Problem, estimate
from meshfuse.parallel.context.explain import planned_context_parallel
from meshfuse.runtime.comm.collectives import record_communications


class GroupedAttention(Attention):
    """Attention forward and backward with ``h`` query and ``hkv`` key/value heads; outputs
    attn, q_grad, k_grad, v_grad."""

    def __init__(self, h, hkv, s, causal, qkv_format=QkvFormat.BHSE, strategy=None, batch=B):
        super().__init__(h, s, causal, qkv_format, strategy, batch=batch, kv_heads=hkv)


def _inputs(h, hkv, s, qkv_format=QkvFormat.BHSE, batch=B):
    """q, k, v, the output gradient: global tensors laid out as ``qkv_format``."""
    torch.manual_seed(11)
    shapes = [(batch, heads, s, E) for heads in (h, hkv, hkv, h)]
    if qkv_format is QkvFormat.BSHE:
        return [torch.randn(b, n, heads, e).transpose(1, 2) for b, heads, n, e in shapes]
    return [torch.randn(shape) for shape in shapes]


def _reference(q, k, v, g, causal):
    """PyTorch's unsharded grouped-query attention and its autograd gradients (float64)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                           enable_gqa=True)
    out.backward(g.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _check(multidevice_test, fd, inputs):
    """Runs ``fd`` on this rank's shards of ``inputs``; asserts every output equals the
    reference's shard; returns the communications that ran."""
    tensors = fd.tensors()
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(inputs, tensors)]
    with record_communications() as comms:
        outputs = fd.execute(local)
    expected = _reference(*inputs, fd.causal)
    for name, out, ref, tv in zip(("attn", "q_grad", "k_grad", "v_grad"), outputs, expected,
                                  fd.fusion.outputs()):
        torch.testing.assert_close(out, multidevice_test.shard_tensor(ref.float(), tv),
                                   atol=1e-5, rtol=1e-5, msg=name)
    return comms


def _sequence_sharded(fd, mesh, layout, pt=MX):
    for tv in fd.tensors():
        if layout == "zigzag":
            tv.set_device_mesh(mesh)
            pos = tv.loop.index(tv.logical[2])
            tv.zigzag_split(pos, mesh.axis_size(pt))
            tv.parallelize(pos, pt)
        else:
            shard(tv, 2, mesh, pt)


def _zigzag_refused(fd, multidevice_test, layout, s) -> bool:
    """Whether a zig-zag split of ``s`` rows over the ranks (two equal chunks each) is
    impossible (3 ranks, 16 rows): then scheduling it is refused, naming the fix."""
    d = multidevice_test.size
    if layout != "zigzag" or s % (2 * d) == 0:
        return False
    with pytest.raises(ScheduleError, match=rf"extent {s} is not a multiple of 2 \* {d}"):
        _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    return True


def _rows(s, d, layout):
    if layout == "zigzag":
        chunks = torch.arange(s).chunk(2 * d)
        return [torch.cat([chunks[r], chunks[2 * d - 1 - r]]) for r in range(d)]
    blocks = list(torch.arange(s).chunk(d))
    return blocks + [torch.arange(0)] * (d - len(blocks))


def _ring_bytes(s, d, kv_heads, position, layout):
    """The ring's theory (float32 inputs) with ``kv_heads`` local key/value heads: k/v move
    ``n - 1`` times in the forward and in the backward, the backward's dk/dv sums ``n - 1``
    times (the last time home)."""
    block = [len(r) * kv_heads * E * 4 for r in _rows(s, d, layout)]
    order = [(position - step) % d for step in range(d + 1)]
    moves = [[("send", block[order[step]]), ("recv", block[order[step + 1]])] * 2
             for step in range(d)]
    forward = [t for step in range(d - 1) for t in moves[step]]
    backward = [t for step in range(d) for t in (moves[step] if step < d - 1 else [])
                + (moves[step] if step >= 1 else [])]
    return forward + backward if d > 1 else []


def test_unsharded_grouped_query_attention_equals_pytorch():
    """8 query heads, 2 key/value heads (each serves 4 query heads), causal and not, with
    a key sequence of another length too: equal to PyTorch's enable_gqa=True."""
    for causal in (False, True):
        fd = GroupedAttention(8, 2, 12, causal)
        inputs = _inputs(8, 2, 12)
        fd.tensors()
        outputs = fd.execute(inputs)
        for out, ref in zip(outputs, _reference(*inputs, causal)):
            torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)


def test_key_value_heads_must_divide_the_query_heads():
    with pytest.raises(DefinitionError, match="k is 3 but q's is 8, not a multiple of it"):
        GroupedAttention(8, 3, 8, False).tensors()


RING_CASES = [(layout, s, causal, fmt) for layout, s in (("block", 16), ("uneven", 10),
                                                         ("zigzag", 16))
              for causal in (False, True) for fmt in (QkvFormat.BHSE, QkvFormat.BSHE)]


@pytest.mark.mpi
@pytest.mark.parametrize("layout,s,causal,qkv_format", RING_CASES,
                         ids=[f"{c[0]}-{'causal' if c[2] else 'full'}-{c[3].name}"
                              for c in RING_CASES])
def test_ring_moves_the_smaller_key_value_blocks(multidevice_test, layout, s, causal,
                                                 qkv_format):
    """8 query heads, 2 key/value heads: the ring equals unsharded GQA, and each transfer
    carries 2 heads of k/v (a quarter of what q's heads would), as its theory says."""
    d = multidevice_test.size
    fd = GroupedAttention(8, 2, s, causal, qkv_format, strategy="ring")
    if _zigzag_refused(fd, multidevice_test, layout, s):
        return
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag" if layout == "zigzag" else "block")
    comms = _check(multidevice_test, fd, _inputs(8, 2, s, qkv_format))
    assert [(c.kind, c.bytes) for c in comms] == _ring_bytes(
        s, d, 2, multidevice_test.rank, "zigzag" if layout == "zigzag" else "block")
    planned = planned_context_parallel(fd.compiled().fusion, multidevice_test.rank)
    assert [c for p in planned for c in p.communications()] == comms


OTHER_CASES = [(strategy, layout, causal, fmt) for strategy in ("allgather", "alltoall")
               for layout in ("block", "zigzag") for causal in (False, True)
               for fmt in (QkvFormat.BHSE, QkvFormat.BSHE)]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy,layout,causal,qkv_format", OTHER_CASES,
                         ids=[f"{c[0]}-{c[1]}-{'causal' if c[2] else 'full'}-{c[3].name}"
                              for c in OTHER_CASES])
def test_other_strategies_with_grouped_heads(multidevice_test, strategy, layout, causal,
                                             qkv_format):
    """All-gather (gathers the 4 key/value heads, not 8) and all-to-all (each rank takes a
    block of query heads and the block of key/value heads that serves it)."""
    fd = GroupedAttention(8, 4, 16, causal, qkv_format, strategy=strategy)
    if _zigzag_refused(fd, multidevice_test, layout, 16):
        return
    _sequence_sharded(fd, mesh_1d(multidevice_test), layout)
    if strategy == "alltoall" and 4 % multidevice_test.size:  # heads over the ranks
        with pytest.raises(ShardingError, match="'alltoall' cannot run: the 8 local heads"):
            _check(multidevice_test, fd, _inputs(8, 4, 16, qkv_format))
        return
    comms = _check(multidevice_test, fd, _inputs(8, 4, 16, qkv_format))
    assert f"context_parallel='{strategy}'" in fd.explain()
    planned = planned_context_parallel(fd.compiled().fusion, multidevice_test.rank)
    assert comms == [c for p in planned for c in p.communications()]
    d = multidevice_test.size
    if strategy == "allgather" and d > 1:
        rows = max(len(r) for r in _rows(16, d, layout))
        gathered = [c.bytes for c in comms if c.kind == "allgather"]
        assert gathered == [rows * 4 * E * 4] * 4  # k, v: 4 heads (forward and backward)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_heads_by_sequence_2x2(multidevice_test, strategy, causal):
    """Heads on one mesh axis (8 query heads, 4 key/value heads: each half of the query
    heads with the half of the key/value heads that serves it), the sequence on the other."""
    mesh = mesh_2x2(multidevice_test)
    fd = GroupedAttention(8, 4, 12, causal, QkvFormat.BSHE, strategy=strategy)
    for tv in fd.tensors():
        shard(tv, 1, mesh, MY)
        shard(tv, 2, mesh, MX)
    comms = _check(multidevice_test, fd, _inputs(8, 4, 12, QkvFormat.BSHE))
    rank = multidevice_test.rank
    assert all(c.ranks == (rank & 2, (rank & 2) + 1) for c in comms)
    if strategy == "ring":
        assert [(c.kind, c.bytes) for c in comms] == _ring_bytes(12, 2, 2, rank % 2, "block")


@pytest.mark.mpi
def test_head_parallel_grouped_attention(multidevice_test):
    """Heads sharded alone (no context parallelism): rank r holds query heads of block r
    and the key/value heads of block r, which serve exactly them: no communication."""
    mesh = mesh_1d(multidevice_test)
    d = multidevice_test.size
    fd = GroupedAttention(4 * d, d, 8, True)
    for tv in fd.tensors():
        shard(tv, 1, mesh)
    comms = _check(multidevice_test, fd, _inputs(4 * d, d, 8))
    assert comms == []


@pytest.mark.mpi
def test_key_value_heads_that_do_not_divide_over_the_ranks_are_gathered(multidevice_test):
    """2 key/value heads split over 4 ranks (the query heads would divide): a rank's query
    heads need key/value heads it does not hold, so k and v are gathered whole (then each
    rank takes those it needs; see test_attention_kv_replication.py)."""
    d = multidevice_test.size
    if d < 4:
        pytest.skip("needs 4 ranks")
    fd = GroupedAttention(8, 2, 8, False)
    for tv in fd.tensors():
        shard(tv, 1, mesh_1d(multidevice_test))
    comms = _check(multidevice_test, fd, _inputs(8, 2, 8))
    assert [c.kind for c in comms][:2] == ["allgather", "allgather"]


class GroupedDropout(FusionDefinition):
    """Causal GQA with dropout: q/k of head dim S, v the identity (so ``attn`` is the
    dropped-out probability matrix: its zeros are the mask)."""

    def __init__(self, strategy, mode="shard", p=0.3):
        super().__init__()
        self.strategy, self.mode, self.p = strategy, mode, p

    def definition(self):
        self.q, self.k, self.v, self.g = (self.define_tensor([B, heads, 16, 16],
                                                             dtype=DataType.Float)
                                          for heads in (4, 2, 2, 4))
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


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_dropout_gradients_use_the_forwards_masks(multidevice_test, strategy):
    """The mask of each query head is read off the output (v is the identity); a reference
    with those masks and the key/value heads repeated over their groups, differentiated by
    autograd, gives the same gradients (k_grad, v_grad summed over each group)."""
    torch.manual_seed(3)
    q, k, g = torch.randn(B, 4, 16, 16), torch.randn(B, 2, 16, 16), torch.randn(B, 4, 16, 16)
    inputs = [q, k, torch.eye(16).expand(B, 2, 16, 16).contiguous(), g]
    fd = GroupedDropout(strategy)
    if _zigzag_refused(fd, multidevice_test, "zigzag", 16):
        return
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(inputs, fd.tensors())]
    outputs = fd.execute(local)
    attn = multidevice_test.unshard_tensor(outputs[0], fd.fusion.outputs()[0]).cpu()
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    keep = (attn != 0) | ~causal
    q, k, v = (t.double().requires_grad_() for t in inputs[:3])
    kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v))
    scores = (q @ kk.transpose(-2, -1) / 4.0).masked_fill(~causal, float("-inf"))
    out = (scores.softmax(-1) * keep / 0.7) @ vv
    out.backward(inputs[3].double())
    for got, ref, tv in zip(outputs, (out.detach(), q.grad, k.grad, v.grad),
                            fd.fusion.outputs()):
        torch.testing.assert_close(got, multidevice_test.shard_tensor(ref.float(), tv),
                                   atol=1e-5, rtol=1e-5)
    dropped = ((~keep & causal).sum() / (causal.sum() * 4 * B)).item()
    assert 0.2 < dropped < 0.4, dropped


def test_cost_estimate_moves_the_key_value_heads():
    """The ring and the all-gather move k/v blocks of the key/value heads; the all-to-all
    moves q-sized tensors (q, the output) and k/v-sized ones."""
    m = Machine(kernel_flops=1e12, link_bytes=1e9, latency=0.0)
    grouped = Problem(1, 8, 4096, 64, 64, 2, 2, causal=False, backward=False, balanced=True,
                      kv_heads=2)
    compute = 4 * 8 * 4096 ** 2 * 64 / 2 / 1e12
    block = 2 * 2048 * 128 * 2 / 1e9  # k and v of 2 heads, 2048 rows, bf16
    assert estimate("ring", grouped, m) == pytest.approx(max(compute / 2, block) + compute / 2)
    assert estimate("allgather", grouped, m) == pytest.approx(compute + block)
    query = block * 4  # q of 8 heads, as k and v of 2 together would be at 8
    assert estimate("alltoall", grouped, m) == pytest.approx(
        compute + 2 * query / 2 / 2 + 2 * block / 2 / 2)


@pytest.mark.mpi
def test_alltoall_needs_key_value_heads_that_divide(multidevice_test):
    """2 key/value heads cannot be spread over 4 ranks by all-to-all: refused, naming k."""
    d = multidevice_test.size
    if d < 4:
        pytest.skip("needs 4 ranks")
    fd = GroupedAttention(8, 2, 16, True, strategy="alltoall")
    _sequence_sharded(fd, mesh_1d(multidevice_test), "zigzag")
    with pytest.raises(ShardingError, match="the 2 local heads of T1 do not divide over 4"):
        fd.compiled()


def _kernel_cases():
    """Every backend that runs grouped-query attention on this machine's device."""
    if torch.cuda.is_available():
        return [("cuda", b) for b in ("cudnn", "flash", "math")]
    return [("cpu", b) for b in ("cpu_flash", "math")]


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` in float64."""
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("device,backend", _kernel_cases())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernels_run_grouped_query_attention(device, backend, causal):
    """Each kernel, forward and backward, on 8 query and 2 key/value heads: close to
    PyTorch's enable_gqa=True reference (float64), and to the same kernel run with each
    key/value head repeated over its group (its dk, dv summed over the group); the
    memory-efficient kernel is refused with a reason."""
    dtype, e = (torch.bfloat16, 64) if device == "cuda" else (torch.float32, E)
    torch.manual_seed(2)
    q, g = (torch.randn(B, 8, 128, e, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, 2, 128, e, device=device, dtype=dtype) for _ in range(2))
    if (reason := own_limits(AttentionBackend(backend), q, k, v, 0.0, causal)) is not None:
        pytest.skip(f"{backend} {reason}")
    attn, lse, seed, offset = sdpa_forward(q, k, v, 0.0, causal, None, backend)
    got = (attn, *sdpa_backward(g, q, k, v, attn, lse, 0.0, causal, seed, offset, None, backend))
    kr, vr = (t.repeat_interleave(4, dim=1) for t in (k, v))
    attn_r, lse_r, seed, offset = sdpa_forward(q, kr, vr, 0.0, causal, None, backend)
    dq_r, dk_r, dv_r = sdpa_backward(g, q, kr, vr, attn_r, lse_r, 0.0, causal, seed, offset,
                                     None, backend)
    repeated = (attn_r, dq_r, *(t.unflatten(1, (2, 4)).sum(2) for t in (dk_r, dv_r)))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, out, ref, same in zip(("attn", "dq", "dk", "dv"), got, _reference(q, k, v, g,
                                                                              causal), repeated):
        assert out.shape == ref.shape, name
        assert _relative_error(out, ref) < tol, (name, _relative_error(out, ref))
        assert _relative_error(out, same) < tol, (name, _relative_error(out, same))
    if device == "cuda":
        assert own_limits(AttentionBackend.EFFICIENT, q, k, v, 0.0, causal) == \
            "has no grouped-query attention"
