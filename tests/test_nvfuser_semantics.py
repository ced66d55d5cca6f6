"""nvFuser semantics that its multi-device tests rely on, written as meshfuse's own tests:
a device axis of extent 1 stays sharded, attention dropout with a leading device axis, the
RNG state form of PyTorch before 2.7 given to ``sdpfa_bwd``, and consumers' shardings taken
by the unscheduled tensors that feed them (a row-parallel result joining a sequence-sharded
residual is reduce-scattered)."""

import pytest
import torch
import torch.nn.functional as F
from mesh_helpers import mesh_1d, shard

from meshfuse import DataType, FusionDefinition, ParallelType
from meshfuse.ir.fusion import Reshard
from meshfuse.runtime.comm.collectives import record_communications

MX = ParallelType.mesh_x


@pytest.fixture(autouse=True)
def same_random_tensors_on_every_rank():
    torch.manual_seed(0)


@pytest.mark.mpi
@pytest.mark.parametrize("static", [True, False], ids=["static_d", "symbolic_d"])
def test_a_device_axis_stays_sharded_at_every_world_size(multidevice_test, static):
    """weight [d, n, k] (a logical device axis, local [1, n, k]) gives out [d, b, s, n] with
    its leading axis sharded on DIDx, as in nvFuser. Declared with a static d, at world size 1
    that axis is a broadcast (extent 1) parallelized over a mesh axis of one device; declared
    -1 it stays an iteration axis."""
    d, b, s, k, n = multidevice_test.size, 2, 3, 8, 5
    lead = d if static else -1
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        x, w, bias = fd.define_tensor([b, s, k]), fd.define_tensor([lead, n, k]), \
            fd.define_tensor([lead, n])
        fd.add_output(fd.ops.linear(x, w, bias))
        for t in (x, w, bias):
            t.set_device_mesh(mesh)
        for t in (w, bias):
            t.axis(0).parallelize(MX)
    gx, gw, gb = (torch.randn(shape).to(multidevice_test.device)
                  for shape in ((b, s, k), (d, n, k), (d, n)))
    with record_communications() as comms:
        (out,) = fd.execute([gx, multidevice_test.shard_tensor(gw, w),
                             multidevice_test.shard_tensor(gb, bias)])
    assert out.axis_sharded_on(MX) == 0 and comms == []
    ref = F.linear(gx, gw.reshape(d * n, k), gb.reshape(-1)).reshape(b, s, d, n)
    torch.testing.assert_close(out.local, ref.permute(2, 0, 1, 3)[multidevice_test.rank:][:1])


def _attention(d: int, b: int, h: int, s: int, e: int, mesh=None):
    """Attention forward and backward with dropout on [d, b, h/d, s, e] (global masks)."""
    with FusionDefinition() as fd:
        q, k, v, g = (fd.define_tensor([d, b, h // d, s, e]) for _ in range(4))
        attn, lse, seed, offset = fd.ops.sdpfa_fwd(q, k, v, 0.25, True, rng_seed=7,
                                                   rng_offset=3, dropout_mode="global")
        for out in (attn, *fd.ops.sdpfa_bwd(g, q, k, v, attn, lse, 0.25, True, seed, offset)):
            fd.add_output(out)
        if mesh is not None:
            for t in (q, k, v, g):
                t.set_device_mesh(mesh)
                t.axis(0).parallelize(MX)
    return fd


@pytest.mark.mpi
def test_attention_dropout_with_a_leading_device_axis(multidevice_test):
    """Dropout on q/k/v [d, b, h/d, s, e] sharded on the leading axis: the global mask
    counts the leading axis too, so each rank's shard is bitwise the unsharded run's."""
    d, b, h, s, e = multidevice_test.size, 2, 2 * multidevice_test.size, 8, 4
    full = [torch.randn(d, b, h // d, s, e).to(multidevice_test.device) for _ in range(4)]
    whole = _attention(d, b, h, s, e).execute(full)
    fd = _attention(d, b, h, s, e, mesh_1d(multidevice_test))
    mine = fd.execute([t[multidevice_test.rank:][:1] for t in full])
    for got, ref in zip(mine, whole):
        torch.testing.assert_close(got, ref[multidevice_test.rank:][:1], rtol=0, atol=0)
    no_dropout = F.scaled_dot_product_attention(*full[:3], is_causal=True)
    assert not torch.allclose(whole[0], no_dropout, atol=1e-3)  # the mask did drop


def test_sdpfa_bwd_takes_the_rng_state_of_pytorch_before_2_7():
    """nvFuser programs written before PyTorch 2.7 pass the forward's RNG state as a 0-d
    int64 seed and a 0-d int64 offset (on the CPU); sdpfa_bwd takes it as the [2] uint64
    pair it stands for."""
    b, h, s, e = 1, 2, 8, 4
    with FusionDefinition() as fwd:
        q = fwd.define_tensor([b, h, s, e])
        for out in fwd.ops.sdpfa_fwd(q, q, q, 0.5, False, dropout_mode="global"):
            fwd.add_output(out)
    with FusionDefinition() as bwd:
        g, q, attn = (bwd.define_tensor([b, h, s, e]) for _ in range(3))
        lse = bwd.define_tensor([b, h, s])
        seed = bwd.define_tensor(shape=[], dtype=DataType.Int, is_cpu=True)
        offset = bwd.define_tensor(shape=[], dtype=DataType.Int, is_cpu=True)
        for out in bwd.ops.sdpfa_bwd(g, q, q, q, attn, lse, 0.5, False, seed, offset,
                                     dropout_mode="global"):
            bwd.add_output(out)
    x, dy = torch.randn(b, h, s, e), torch.randn(b, h, s, e)
    attn, lse, pair, _ = fwd.execute([x])
    legacy_seed, legacy_offset = pair.view(torch.int64)
    got = bwd.execute([dy, x, attn, lse, legacy_seed.clone(), legacy_offset.clone()])
    with FusionDefinition() as same:
        g, q, attn_in = (same.define_tensor([b, h, s, e]) for _ in range(3))
        lse_in = same.define_tensor([b, h, s])
        seed_in = same.define_tensor([2], dtype=DataType.UInt64)
        offset_in = same.define_tensor([], dtype=DataType.UInt64)
        for out in same.ops.sdpfa_bwd(g, q, q, q, attn_in, lse_in, 0.5, False, seed_in,
                                      offset_in, dropout_mode="global"):
            same.add_output(out)
    ref = same.execute([dy, x, attn, lse, pair, torch.zeros((), dtype=torch.uint64)])
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=0, atol=0)


def _residual_block(tokens: int, e: int, f: int, mesh=None):
    """Tokens ``x``, a column- then row-parallel projection ``proj`` (an output), a mask
    drawn in the fusion (an output), ``y = x + where(keep, proj, 0) / 0.9``; with ``mesh``,
    x sharded on the sequence, the weights Megatron's way, nothing else scheduled."""
    with FusionDefinition() as fd:
        x, w1, w2 = fd.define_tensor([tokens, e]), fd.define_tensor([f, e]), \
            fd.define_tensor([e, f])
        proj = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1)), w2)
        keep = fd.ops.lt(fd.ops.rand_like(proj, rng_seed=3, rng_offset=0), 0.9)
        y = fd.ops.add(x, fd.ops.mul(fd.ops.where(keep, proj, 0.0), 1 / 0.9))
        for out in (proj, keep, y):
            fd.add_output(out)
        if mesh is not None:
            for tv, axis in ((x, 0), (w1, 0), (w2, 1)):
                shard(tv, axis, mesh)
    return fd, (x, w1, w2), (proj, keep, y)


@pytest.mark.mpi
@pytest.mark.parametrize("tokens", [8, 7], ids=["even", "uneven"])
def test_row_parallel_result_joining_a_sequence_sharded_residual_is_reduce_scattered(
        multidevice_test, tokens):
    """Sequence-parallel tokens; a row-parallel projection's result (a fusion output too) is
    masked by a draw of the fusion and added to the tokens. As nvFuser propagates shardings
    backward from consumers, every unscheduled tensor between the partial sum and the
    residual (the mask and its draw too) is sequence sharded: the partial sum is
    reduce-scattered, never allreduced, and every output comes back sharded on the
    sequence, equal to the unsharded program's."""
    e, f = 4, 8
    gx, gw1, gw2 = (torch.randn(shape).to(multidevice_test.device)
                    for shape in ((tokens, e), (f, e), (e, f)))
    plain, _, _ = _residual_block(tokens, e, f)
    expected = plain.execute([gx, gw1, gw2])
    torch.testing.assert_close(expected[0], F.linear(F.gelu(F.linear(gx, gw1)), gw2))
    fd, inputs, outputs = _residual_block(tokens, e, f, mesh_1d(multidevice_test))
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip((gx, gw1, gw2), inputs)]
    with record_communications() as comms:
        got = fd.execute(local)
    for out, tv, ref in zip(got, outputs, expected):
        assert out.axis_sharded_on(MX) == 0 or multidevice_test.size == 1
        torch.testing.assert_close(out.local, multidevice_test.shard_tensor(ref, tv))
    assert [c.kind for c in comms] == (
        ["allgather", "reduce_scatter"] if multidevice_test.size > 1 else [])
    # The reduce-scattered result (nvFuser's form: its reduction axis and its sequence axis
    # on one mesh axis) is complete and sequence sharded as the residual: read as it is, with
    # no copy into a tensor that lies alike.
    reshards = [e for e in fd.compiled().fusion.exprs if isinstance(e, Reshard)]
    assert len(reshards) == 2  # the allgather and the reduce-scatter (moving nothing at 1)
