"""Indices out of range (``meshfuse/ops/indexing/checks.py``): never a silent value.

A lookup along a sharded axis finds an out-of-range position on no rank (zeros), and the
fused cross entropy gives NaN; with ``MESHFUSE_CHECK_INDICES=1`` every lookup and the cross
entropy raise a typed error naming the index tensor, on every rank. Where only the rank that
holds the bad index fails (indices sharded), the others learn it while waiting in a
collective and the ranks are out of step: each test then recovers, as a program would.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mesh_helpers import mesh_1d, shard

from meshfuse import DataType, FusionDefinition, shard_tensor
from meshfuse.errors import InputError, MeshfuseError
from meshfuse.ops.indexing import CHECK_INDICES_ENV, IndexCheck
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.testing.utils import current_device

V, E, N = 7, 4, 6


def _lookups(mesh, op: str):
    """``op`` looking up ``ids`` in a table whose indexed axis is split over the mesh."""
    with FusionDefinition() as fd:
        ids = fd.define_tensor([N], dtype=DataType.Int, name="ids")
        table = fd.define_tensor([V, E] if op != "take_along_axis" else [N, V],
                                 dtype=DataType.Double, name="table")
        if op == "embedding_fwd":
            out = fd.ops.embedding_fwd(ids, table)
        elif op == "index_select":
            out = fd.ops.index_select(table, ids, 0)
        else:
            out = fd.ops.take_along_axis(table, fd.ops.broadcast_in_dim(ids, [N, 1], [0]), 1)
        fd.add_output(out)
    for tv in (ids, table, out):
        tv.set_device_mesh(mesh)
    shard(table, 0 if op != "take_along_axis" else 1, mesh)
    return fd, (ids, table)


def _values(bad: int):
    ids = torch.arange(N) % V
    ids[3] = bad
    return ids


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["embedding_fwd", "index_select", "take_along_axis"])
def test_out_of_range_lookup_raises_on_every_rank_when_checked(multidevice_test, monkeypatch,
                                                               op):
    rank = multidevice_test.rank
    monkeypatch.setenv(CHECK_INDICES_ENV, "1")
    fd, tvs = _lookups(mesh_1d(multidevice_test), op)
    table = torch.randn(V, E if op != "take_along_axis" else V, dtype=torch.float64)
    table = table if op != "take_along_axis" else torch.randn(N, V, dtype=torch.float64)
    for bad in (V, -1):
        inputs = [shard_tensor(v, tv, rank).to(current_device())
                  for v, tv in zip((_values(bad), table), tvs)]
        with pytest.raises(MeshfuseError, match=f"{op}: index .* holds {bad} .*axis .* of "
                                                f"table has {V} positions"):
            fd.execute(inputs)
        Communicator.instance().recover()
    good = [shard_tensor(v, tv, rank).to(current_device())
            for v, tv in zip((_values(2), table), tvs)]
    fd.execute(good)  # in range: runs


def _cross_entropy(mesh, axis: int):
    """Cross entropy of [N, V] logits split on ``axis`` (0: the fused op on row shards; 1:
    classes split, its decomposition)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([N, V], dtype=DataType.Double)
        t = fd.define_tensor([N], dtype=DataType.Int, name="target")
        loss = fd.ops.cross_entropy(x, t)
        fd.add_output(loss)
    for tv in (x, t, loss):
        tv.set_device_mesh(mesh)
    shard(x, axis, mesh)
    if axis == 0:
        shard(t, 0, mesh)
    return fd, (x, t)


@pytest.mark.mpi
@pytest.mark.parametrize("axis", [0, 1])
def test_cross_entropy_target_out_of_range(multidevice_test, monkeypatch, axis):
    """Unchecked, the loss is NaN; checked (the setting read when a program is built), a
    typed error naming the target on every rank."""
    rank, mesh = multidevice_test.rank, mesh_1d(multidevice_test)
    values = (torch.randn(N, V, dtype=torch.float64), _values(V))
    fd, tvs = _cross_entropy(mesh, axis)
    (got,) = fd.execute([shard_tensor(v, tv, rank).to(current_device())
                         for v, tv in zip(values, tvs)])
    assert got.isnan(), got
    monkeypatch.setenv(CHECK_INDICES_ENV, "1")
    fd, tvs = _cross_entropy(mesh, axis)
    with pytest.raises(MeshfuseError, match=f"index target holds {V} .*axis 1 of .* has {V} "
                                            "positions"):
        fd.execute([shard_tensor(v, tv, rank).to(current_device())
                    for v, tv in zip(values, tvs)])
    Communicator.instance().recover()


def test_index_check_names_the_tensor_and_the_fix():
    check = IndexCheck("embedding_fwd", "ids", "table", 0, 5)
    check(torch.tensor([0, 4]))
    with pytest.raises(InputError, match=r"index ids holds 5 \(2 value\(s\) out of range\), but "
                                         r"axis 0 of table has 5 positions; give indices in "
                                         r"\[0, 5\)"):
        check(torch.tensor([5, 1, -2]))
    IndexCheck("cross_entropy_fwd", "t", "x", 1, 5, ignored=-100)(torch.tensor([-100, 2]))


def test_unchecked_by_default(monkeypatch):
    """Without the setting a program reads no index back (torch's own refusal remains
    where the lookup is not sharded)."""
    monkeypatch.delenv(CHECK_INDICES_ENV, raising=False)
    with FusionDefinition() as fd:
        x = fd.define_tensor([N, V], dtype=DataType.Double)
        t = fd.define_tensor([N], dtype=DataType.Int)
        fd.add_output(fd.ops.cross_entropy(x, t))
    (got,) = fd.execute([torch.randn(N, V, dtype=torch.float64), _values(V)])
    assert got.isnan()
    ref = F.cross_entropy(torch.zeros(2, V, dtype=torch.float64), torch.tensor([0, 1]))
    (ok,) = fd.execute([torch.zeros(N, V, dtype=torch.float64), torch.arange(N) % V])
    torch.testing.assert_close(ok, ref)
