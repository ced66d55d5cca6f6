"""Sharding propagation: golden prints per op family, the seed with partial schedules, and
random fusions on several ranks against the unsharded run."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mesh_helpers import schedule_placements, shard

from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention, random_inputs, reference
from meshfuse.ir.fusion import Reshard
from meshfuse.ir.printer import format_placements
from meshfuse.passes.propagation import propagate_shardings
from meshfuse.sharding import shard_tensor

MESH = DeviceMesh(range(2))


def _summary(fd) -> str:
    """One line per tensor: name, placements, memory order of the logical axes."""
    propagate_shardings(fd.fusion)
    from meshfuse.passes.layout import infer_allocations, memory_positions

    allocations = infer_allocations(fd.fusion)
    lines = []
    for tv in fd.fusion.tensors():
        if not tv.logical:
            continue
        positions = memory_positions(tv, allocations[tv])
        order = sorted(range(tv.ndim), key=lambda a: positions[tv.materialized()[a]])
        lines.append(f"{tv.name} {format_placements(tv)} order={order}")
    return "\n".join(lines)


def test_golden_pointwise_with_broadcast():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], dtype=DataType.Float)
        bias = fd.define_tensor([1, 6], dtype=DataType.Float)
        fd.add_output(fd.ops.exp(fd.ops.add(x, bias)))
    shard(x, 0, MESH)
    assert _summary(fd) == "T0 [S(0)] order=[0, 1]\nT1 [R] order=[0, 1]\nT2 [S(0)] order=[0, 1]\nT3 [S(0)] order=[0, 1]"


def test_golden_reduction_and_permute():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6, 8], dtype=DataType.Float, stride_order=[2, 0, 1])
        s = fd.ops.sum(x, dims=[2], keepdim=True)
        fd.add_output(fd.ops.permute(s, [2, 0, 1]))
    shard(x, 1, MESH, inner=True)
    assert _summary(fd) == "T0 [S(1)c] order=[0, 2, 1]\nT1 [S(1)c] order=[0, 2, 1]\nT2 [S(2)c] order=[1, 0, 2]"


def test_golden_sum_over_sharded_axis_is_partial():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], dtype=DataType.Float)
        fd.add_output(fd.ops.sum(x, dims=[1]))
    shard(x, 1, MESH)
    assert _summary(fd) == "T0 [S(1)] order=[0, 1]\nT1 [P] order=[0]"


def test_golden_linear_prefers_the_weight():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 16], dtype=DataType.Float)
        w = fd.define_tensor([12, 16], dtype=DataType.Float)
        fd.add_output(fd.ops.linear(x, w))
    shard(w, 0, MESH)
    assert _summary(fd) == "T0 [R] order=[0, 1]\nT1 [S(0)] order=[0, 1]\nT2 [S(1)] order=[0, 1]"


def test_golden_reshape_carries_block_shards_through_splits_and_merges():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 24], dtype=DataType.Float)    # [tokens, heads * head_dim]
        heads = fd.ops.reshape(x, [4, 6, 4])                    # [tokens, heads, head_dim]
        fd.add_output(fd.ops.reshape(fd.ops.relu(heads), [4, 24]))
    shard(x, 1, MESH)
    assert _summary(fd) == "\n".join([
        "T0 [S(1)] order=[0, 1]",
        "T1 [S(1)] order=[0, 1, 2]",
        "T2 [S(1)] order=[0, 1, 2]",
        "T3 [S(1)] order=[0, 1]",
    ])


def test_reshape_of_a_cyclic_shard_is_not_carried_over():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 24], dtype=DataType.Float)
        fd.add_output(fd.ops.reshape(x, [4, 6, 4]))
    shard(x, 1, MESH, inner=True)
    assert _summary(fd).splitlines()[1] == "T1 [R] order=[0, 1, 2]"


def test_golden_backward_fills_inputs_from_outputs():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], dtype=DataType.Float)
        y = fd.ops.tanh(x)
        fd.add_output(fd.ops.mul(y, 2.0))
    shard(fd.fusion.outputs()[0], 1, MESH)
    assert _summary(fd) == "T0 [S(1)] order=[0, 1]\nT1 [S(1)] order=[0, 1]\nT2 [S(1)] order=[0, 1]"


def test_golden_attention_bshe_keeps_bshe():
    fd = SeedAttention(QkvFormat.BSHE, MESH, 2, 4, 8, 32)
    fd.definition()
    for t in (fd.q, fd.k, fd.v, fd.out_grad):
        shard(t, 1, MESH)
    # (the log-sum-exp T5 is [B, H, S] row-major, as the kernels write it, not BSH)
    assert _summary(fd) == "T0 [S(1)] order=[0, 2, 1, 3]\nT1 [S(1)] order=[0, 2, 1, 3]\nT2 [S(1)] order=[0, 2, 1, 3]\nT3 [S(1)] order=[0, 2, 1, 3]\nT4 [S(1)] order=[0, 2, 1, 3]\nT5 [S(1)] order=[0, 1, 2]\nT6 [R] order=[0]\nT8 [S(1)] order=[0, 2, 1, 3]\nT9 [S(1)] order=[0, 2, 1, 3]\nT10 [S(1)] order=[0, 2, 1, 3]"


def test_user_pins_are_never_changed_and_conflicts_become_resharding_copies():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], dtype=DataType.Float)
        y = fd.ops.neg(x)
        fd.add_output(y)
    one = DeviceMesh([0])  # one rank: the conflict is in the schedule, not in the world size
    shard(x, 0, one)
    shard(y, 1, one)
    before = list(y.loop)
    propagate_shardings(fd.fusion)
    assert y.loop == before
    x_global = torch.randn(4, 6)
    out, = fd.execute([x_global])
    torch.testing.assert_close(out, -x_global)
    assert y.loop == before
    sets = [e for e in fd.compiled().fusion.exprs if isinstance(e, Reshard)]
    assert len(sets) == 1, fd.explain()


# ----- multi-rank: the seed with partial schedules ------------------------------------------

class InputsOnly(SeedAttention):
    def multidevice_schedule(self):
        for t in (self.q, self.k, self.v, self.out_grad):
            shard(t, 1, self.mesh)


class OutputsOnly(SeedAttention):
    def multidevice_schedule(self):
        for t in (self.attn, self.q_grad, self.k_grad, self.v_grad):
            shard(t, 1, self.mesh)


@pytest.mark.mpi
@pytest.mark.parametrize("qkv_format", list(QkvFormat))
@pytest.mark.parametrize("model", [InputsOnly, OutputsOnly, SeedAttention])
def test_seed_with_partial_schedules_matches_hand_scheduled(multidevice_test, model, qkv_format):
    d, rank = multidevice_test.size, multidevice_test.rank
    b, h, s, e = 2, 12, 256, 768
    if h % d:
        pytest.skip(f"{h} heads do not split over {d} ranks")
    mesh = DeviceMesh(range(d))
    full = SeedAttention(qkv_format, mesh, b, h, s, e).define()
    fd = model(qkv_format, mesh, b, h, s, e).define()
    globals_ = random_inputs(b, h, s, e, device=multidevice_test.device)
    outs = fd.execute(full.inputs_for(*globals_, rank=rank))
    for out, ref, tv in zip(outs, reference(*globals_),
                            (full.attn, full.q_grad, full.k_grad, full.v_grad)):
        expected = shard_tensor(ref, tv, rank)
        torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)
        assert out.stride() == expected.stride()


# ----- multi-rank: random fusions ------------------------------------------------------------

UNARY = ["exp", "tanh", "neg", "sigmoid", "abs"]


@st.composite
def programs(draw, world: int):
    """A random chain over one [B, H, S, E] input: pointwise, broadcast, reductions over
    unsharded axes, permutes, attention; and a random input schedule."""
    mesh_shape = draw(st.sampled_from([(world,), (2, 2)] if world == 4 else [(world,)]))
    sharded = draw(st.lists(st.integers(0, 3), min_size=1, max_size=len(mesh_shape),
                            unique=True))
    steps = draw(st.lists(st.sampled_from(["unary", "bias", "scale", "reduce", "permute",
                                           "attention"]), min_size=1, max_size=6))
    unaries = [draw(st.sampled_from(UNARY)) for _ in steps]
    inner = draw(st.booleans())
    return mesh_shape, sharded, steps, unaries, inner


def _build(mesh_shape, sharded, steps, unaries, inner, schedule: bool):
    shape = [4, 4, 8, 8]
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape, dtype=DataType.Float)
        bias = fd.define_tensor([1, 1, 1, 8], dtype=DataType.Float)
        t, axes = x, list(range(4))  # axes[i]: x's axis that t's axis i comes from
        for step, unary in zip(steps, unaries):
            if step == "unary":
                t = getattr(fd.ops, unary)(t)
            elif step == "bias" and len(axes) == 4 and axes[3] == 3:
                t = fd.ops.add(t, bias)
            elif step == "scale":
                t = fd.ops.mul(t, 0.5)
            elif step == "reduce":
                free = [i for i, a in enumerate(axes) if a not in sharded and len(axes) > 2]
                if free:
                    t = fd.ops.sum(t, dims=[free[-1]], keepdim=True)
                    axes[free[-1]] = None
            elif step == "permute":
                perm = [1, 0] + list(range(2, len(axes)))
                t = fd.ops.permute(t, perm)
                axes = [axes[p] for p in perm]
            elif step == "attention" and None not in axes and sorted(axes[:2]) == [0, 1] \
                    and 2 not in sharded and 3 not in sharded and axes[2:] == [2, 3]:
                t, _, _, _ = fd.ops.sdpfa_fwd(t, t, t, 0.0, True)
        fd.add_output(t)
    if schedule:
        mesh = DeviceMesh(torch.arange(len_mesh := int(torch.tensor(mesh_shape).prod()))
                          .reshape(mesh_shape))
        assert len_mesh
        types = [ParallelType.mesh_x, ParallelType.mesh_y]
        x.set_device_mesh(mesh)
        for i, axis in enumerate(sharded):
            pos = x.loop.index(x.logical[axis])
            factor = mesh_shape[len(mesh_shape) - 1 - i]
            x.split(pos, factor, inner_split=inner)
            x.parallelize(pos + 1 if inner else pos, types[i])
    return fd, x


@pytest.mark.mpi
@pytest.mark.parametrize("inner", [False, True], ids=["block", "cyclic"])
def test_reshape_of_a_sharded_axis_matches_and_communicates_only_when_cyclic(
        multidevice_test, inner):
    from meshfuse.runtime.comm.collectives import record_communications

    d, rank = multidevice_test.size, multidevice_test.rank
    if 12 % d:
        pytest.skip(f"12 heads do not split over {d} ranks")
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 12 * 4], dtype=DataType.Float)
        fd.add_output(fd.ops.reshape(fd.ops.exp(fd.ops.reshape(x, [4, 12, 4])), [4, 48]))
    out_tv = fd.fusion.outputs()[0]
    shard(x, 1, DeviceMesh(range(d)), inner=inner)
    shard(out_tv, 1, DeviceMesh(range(d)), inner=inner)
    gx = torch.randn(4, 48).to(multidevice_test.device)
    with record_communications() as comms:
        out, = fd.execute([shard_tensor(gx, x, rank)])
    torch.testing.assert_close(out, shard_tensor(gx.exp(), out_tv, rank))
    if not inner or d == 1:
        assert comms == []
    else:
        assert comms, "a cyclic shard cannot be reshaped in place"


@pytest.mark.mpi
def test_random_fusions_match_the_unsharded_run(multidevice_test):
    world, rank = multidevice_test.size, multidevice_test.rank

    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(programs(world))
    def check(program):
        reference_fd, _ = _build(*program, schedule=False)
        fd, x = _build(*program, schedule=True)
        gen = torch.Generator().manual_seed(0)
        gx, gb = (torch.randn(*shape, generator=gen).to(multidevice_test.device)
                  for shape in ((4, 4, 8, 8), (1, 1, 1, 8)))
        expected, = reference_fd.execute([gx, gb])
        bias = fd.fusion.inputs()[1]  # unscheduled: propagation may shard it like x
        out, = fd.execute([shard_tensor(gx, x, rank), shard_tensor(gb, bias, rank)])
        torch.testing.assert_close(out, shard_tensor(expected, fd.fusion.outputs()[0], rank),
                                   rtol=1e-5, atol=1e-5)

    check()


@pytest.mark.mpi
def test_reshape_keeps_a_block_shard_split_over_two_mesh_axes(multidevice_test):
    """A batch axis split over two mesh axes, one inside the other (HSDP's replicate then
    dp), merged with the sequence by a reshape (the loss's ``[b, s, V] -> [b * s, V]``):
    each rank's rows are a block of the merged axis, so it stays split and the sum to a
    scalar is allreduced; nothing is gathered. 12 rows split into 2 x 2 blocks at 4 ranks,
    2 x 1 at 2, 3 x 1 at 3."""
    from meshfuse.runtime.comm.collectives import record_communications

    d, rank = multidevice_test.size, multidevice_test.rank
    shape = (d // 2, 2) if d % 2 == 0 else (d, 1)
    mesh = DeviceMesh(torch.arange(d).reshape(shape))
    with FusionDefinition() as fd:
        x = fd.define_tensor([12, 3, 5], dtype=DataType.Float)
        y = fd.ops.exp(fd.ops.reshape(x, [36, 5]))
        fd.add_output(y)
        fd.add_output(fd.ops.sum(y, [0, 1]))
    y_tv = fd.fusion.outputs()[0]
    for tv in (x, y_tv):  # the reshape between them is left to propagation
        schedule_placements(tv, mesh, (("S", 0), ("S", 0)))
    gx = torch.randn(12, 3, 5, generator=torch.Generator().manual_seed(0))  # alike on all
    gx = gx.to(multidevice_test.device)
    with record_communications() as comms:
        y_local, total = fd.execute([shard_tensor(gx, x, rank)])
    want = gx.exp().reshape(36, 5)
    torch.testing.assert_close(y_local, shard_tensor(want, y_tv, rank))
    assert y_local.shape[0] == 36 // d
    torch.testing.assert_close(total, want.sum())
    assert all(c.kind == "allreduce" for c in comms), [c.kind for c in comms]
    assert len(comms) == (0 if d == 1 else sum(n > 1 for n in shape))
