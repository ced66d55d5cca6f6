"""Bucketed allreduces (:mod:`meshfuse.runtime.interpreter.bucketing`): small allreduces whose
results no step reads (the gradients of replicated parameters) run as one collective, where the last
of them was planned; every sharded result still equals the unsharded one.
"""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard

from meshfuse import DataType, FusionDefinition, shard_tensor
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.runtime.comm.reshard_plan import ReshardStep, ShardingSpec
from meshfuse.runtime.interpreter import bucketing
from meshfuse.runtime.interpreter.bucketing import Candidate, plan_buckets
from meshfuse.testing.utils import current_device

ROWS, COLS = 11, 6  # 11 rows: uneven shards at 2 and 4 ranks


def _column_sums(mesh, dtypes=(DataType.Float,) * 3, reader: bool = False):
    """Rows sharded; outputs: column sums of ``x``, ``x * x`` and ``x + 1`` (each a partial
    sum over the row shards, made whole by an allreduce), in ``dtypes``; with ``reader``, a
    fourth output, ``x`` less its column sums, whose allreduce a later op reads: it cannot
    wait."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([ROWS, COLS], dtype=DataType.Float)
        sums = [fd.ops.sum(fd.ops.cast(t, dtype), dims=[0]) for t, dtype in
                zip((x, fd.ops.mul(x, x), fd.ops.add(x, 1.0)), dtypes)]
        for s in sums:
            fd.add_output(s)
        if reader:
            total = fd.ops.sum(x, dims=[0])
            fd.add_output(fd.ops.sub(x, fd.ops.broadcast_in_dim(total, [ROWS, COLS], [1])))
    shard(x, 0, mesh)
    return fd, x


def _run(fd, x, rank, compile=False):
    gx = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    local = shard_tensor(gx, x, rank).to(current_device())
    with record_communications() as comms:
        outputs = fd.execute([local], compile=compile)
    return gx, outputs, [(c.kind, c.bytes, c.reduce_op, c.mesh_axis) for c in comms]


@pytest.mark.mpi
@pytest.mark.parametrize("compile", [False, "aot_eager"], ids=["interpreted", "fused"])
def test_output_only_allreduces_run_as_one_bucket(multidevice_test, compile):
    """Interpreted, and with fused segments (the sums compiled: the bucket stays one
    communication step between them)."""
    size, rank = multidevice_test.size, multidevice_test.rank
    fd, x = _column_sums(mesh_1d(multidevice_test))
    gx, outputs, comms = _run(fd, x, rank, compile)
    for got, expected in zip(outputs, (gx.sum(0), (gx * gx).sum(0), (gx + 1).sum(0))):
        torch.testing.assert_close(got.cpu(), expected)
    assert comms == ([("allreduce", 3 * COLS * 4, "sum", 0)] if size > 1 else [])
    bucketed = f"one allreduce(sum) over mesh axis 0 of 3 tensors, {3 * COLS * 4} bytes"
    lines = fd.explain([shard_tensor(gx, x, rank).to(current_device())]).splitlines()
    if size > 1:
        heading = lines.index(f"allreduces run as one bucket on rank {rank}:")
        assert bucketed in lines[heading + 1]
    else:
        assert not any("bucket" in line for line in lines)


@pytest.mark.mpi
def test_an_allreduce_a_later_step_reads_is_not_delayed(multidevice_test):
    """The sum that feeds ``x - sum`` is allreduced alone, where it was planned (before
    the subtraction); the three that only are outputs go together."""
    size, rank = multidevice_test.size, multidevice_test.rank
    fd, x = _column_sums(mesh_1d(multidevice_test), reader=True)
    gx, (s1, s2, s3, centered), comms = _run(fd, x, rank)
    torch.testing.assert_close(s1.cpu(), gx.sum(0))
    torch.testing.assert_close(s2.cpu(), (gx * gx).sum(0))
    torch.testing.assert_close(s3.cpu(), (gx + 1).sum(0))
    torch.testing.assert_close(centered.cpu(), shard_tensor(gx - gx.sum(0), x, rank))
    if size > 1:
        assert comms == [("allreduce", 3 * COLS * 4, "sum", 0), ("allreduce", COLS * 4, "sum", 0)]


@pytest.mark.mpi
def test_buckets_hold_one_dtype(multidevice_test):
    """A bf16 sum is not flattened with float32 ones: two collectives, one per dtype."""
    size, rank = multidevice_test.size, multidevice_test.rank
    dtypes = (DataType.Float, DataType.BFloat16, DataType.Float)
    fd, x = _column_sums(mesh_1d(multidevice_test), dtypes)
    gx, outputs, comms = _run(fd, x, rank)
    torch.testing.assert_close(outputs[1].cpu(), (gx * gx).sum(0).bfloat16(), rtol=2e-2,
                               atol=2e-2)
    if size > 1:
        assert sorted(comms) == [("allreduce", COLS * 2, "sum", 0),
                                 ("allreduce", 2 * COLS * 4, "sum", 0)]


@pytest.mark.mpi
def test_buckets_hold_one_mesh_axis(multidevice_test):
    """On a 2x2 mesh, sums over rows sharded on mesh axis 0 and over columns sharded on
    mesh axis 1: one bucket per axis, each a group of two ranks."""
    mesh, rank = mesh_2x2(multidevice_test), multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([ROWS, COLS], dtype=DataType.Float)
        outs = [fd.ops.sum(x, dims=[0]), fd.ops.sum(fd.ops.abs(x), dims=[0]),
                fd.ops.sum(x, dims=[1]), fd.ops.sum(fd.ops.abs(x), dims=[1])]
        for o in outs:
            fd.add_output(o)
    x.set_device_mesh(mesh)
    for axis, pt in ((0, MY), (1, MX)):
        pos = x.loop.index(x.logical[axis])
        x.outer_split(pos, 2)
        x.axis(pos).parallelize(pt)
    gx = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    with record_communications() as comms:
        got = fd.execute([shard_tensor(gx, x, rank).to(current_device())])
    for g, o, e in zip(got, outs, (gx.sum(0), gx.abs().sum(0), gx.sum(1), gx.abs().sum(1))):
        torch.testing.assert_close(g.cpu(), shard_tensor(e, o, rank))
    kinds = sorted((c.kind, c.mesh_axis, len(c.ranks)) for c in comms)
    assert kinds == [("allreduce", 0, 2), ("allreduce", 1, 2)]


def test_plan_buckets_keeps_groups_apart_and_caps_the_bytes():
    mesh = DeviceMesh(range(2))
    spec = ShardingSpec.replicated(mesh, (4,))

    def candidate(slot, numel, op="sum", axis=0, dtype=torch.float32):
        step = ReshardStep("allreduce", axis, spec, spec, reduce_op=op)
        return Candidate(slot, f"T{slot}", step, (numel,), dtype)

    small = [candidate(0, 4), candidate(1, 4, op="max"), candidate(2, 4),
             candidate(3, 4, dtype=torch.bfloat16), candidate(4, 4, op="max")]
    assert [[m.slot for m in b.members] for b in plan_buckets(small)] == [[0, 2], [1, 4]]
    # a cap of 40 bytes: 16 + 16 fit, a third 16 starts a new bucket; 64 bytes stay alone
    capped = [candidate(0, 4), candidate(1, 4), candidate(2, 4), candidate(3, 16),
              candidate(4, 4)]
    assert [[m.slot for m in b.members] for b in plan_buckets(capped, 40)] == [[0, 1], [2, 4]]
    assert bucketing.BUCKET_BYTES == 1 << 20
