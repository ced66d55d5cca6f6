"""meshfuse's resharding plans move no more bytes than DTensor's ``redistribute``.

For each change DTensor can express (block shards, Replicate, Partial; 1-D and 2x2 meshes),
the same change runs as meshfuse's ``y = set(x)`` under the communication recorder and as
DTensor's ``redistribute`` under ``CommDebugMode`` (counting, as the recorder does, the bytes
of each collective's input on this rank). meshfuse's bytes must not exceed DTensor's, and its
values are checked against the global tensor.
"""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import schedule_placements
from torch.distributed.tensor import DeviceMesh as TorchMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from meshfuse import DataType, DeviceMesh, FusionDefinition, shard_tensor
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

pytestmark = pytest.mark.mpi

SHAPE = (8, 12)


class _CommBytes(CommDebugMode):
    """CommDebugMode that also adds up the bytes of each collective's input tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:
            sent = next(a for a in args if isinstance(a, torch.Tensor))
            self.bytes += sent.numel() * sent.element_size()
        return out


def _dtensor_placement(p: tuple):
    return {"R": Replicate, "P": Partial}[p[0]]() if p[0] != "S" else Shard(p[1])


def _dtensor_bytes(mesh: DeviceMesh, src: tuple, dst: tuple, rank: int, g: torch.Tensor,
                   partial_piece: torch.Tensor | None) -> int:
    torch_mesh = TorchMesh(current_device().type, mesh.devices)
    if partial_piece is not None:
        x = DTensor.from_local(partial_piece, torch_mesh, [_dtensor_placement(p) for p in src])
    else:
        x = distribute_tensor(g, torch_mesh, [_dtensor_placement(p) for p in src])
    with _CommBytes() as mode:
        x.redistribute(torch_mesh, [_dtensor_placement(p) for p in dst]).to_local()
    return mode.bytes


def _meshfuse_bytes(mesh: DeviceMesh, src: tuple, dst: tuple, rank: int, g: torch.Tensor):
    """Runs ``set`` from ``src`` to ``dst``; returns the bytes sent and the partial piece
    this rank started from (None without partials)."""
    partial = [m for m, p in enumerate(src) if p[0] == "P"]
    lead = 1
    for m in partial:
        lead *= mesh.shape[m]
    full = torch.randn(lead, *SHAPE, generator=torch.Generator().manual_seed(1)).to(g.device)
    full = full / lead + (g / lead) if partial else g
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(full.shape), dtype=DataType.Float)
        y = fd.ops.set(fd.ops.sum(x, dims=[0]) if partial else x)
        fd.add_output(y)
    schedule_placements(x, mesh, tuple(("S", -1) if p[0] == "P" else p for p in src),
              offset=1 if partial else 0)
    schedule_placements(y, mesh, dst)
    local = shard_tensor(full, x, rank)
    with record_communications() as comms:
        out, = fd.execute([local])
    reference = full.sum(0) if partial else full
    torch.testing.assert_close(out, shard_tensor(reference, y, rank))
    piece = local.sum(0) if partial else None
    return sum(c.bytes for c in comms if len(c.ranks) > 1), piece


CASES_1D = [
    (("S", 0),), (("S", 1),), (("R",),), (("P",),),
]
CHANGES_1D = [(a, b) for a in CASES_1D for b in CASES_1D if a != b and b[0][0] != "P"]
CHANGES_2D = [
    ((("S", 0), ("S", 1)), (("R",), ("R",))),
    ((("S", 0), ("R",)), (("R",), ("S", 0))),
    ((("S", 0), ("S", 1)), (("S", 1), ("S", 0))),
    ((("S", 0), ("S", 0)), (("R",), ("S", 1))),
    ((("S", 0), ("S", 0)), (("R",), ("R",))),
    ((("R",), ("S", 0)), (("S", 0), ("R",))),
    ((("P",), ("S", 0)), (("R",), ("R",))),
    ((("P",), ("P",)), (("S", 0), ("S", 1))),
    ((("S", 1), ("P",)), (("S", 0), ("R",))),
    ((("P",), ("R",)), (("S", 1), ("S", 0))),
]


def _compare(multidevice_test, mesh: DeviceMesh, src: tuple, dst: tuple) -> None:
    rank = multidevice_test.rank
    g = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(0)).to(current_device())
    ours, piece = _meshfuse_bytes(mesh, src, dst, rank, g)
    theirs = _dtensor_bytes(mesh, src, dst, rank, g, piece)
    assert ours <= theirs, f"{src} -> {dst}: meshfuse sends {ours} bytes, DTensor {theirs}"


@pytest.mark.parametrize("change", CHANGES_1D, ids=str)
def test_no_more_bytes_than_dtensor_on_a_1d_mesh(multidevice_test, change):
    if multidevice_test.size == 1:
        pytest.skip("nothing moves between processes at world size 1")
    _compare(multidevice_test, DeviceMesh(range(multidevice_test.size)), *change)


@pytest.mark.parametrize("change", CHANGES_2D, ids=str)
def test_no_more_bytes_than_dtensor_on_a_2x2_mesh(multidevice_test, change):
    if multidevice_test.size != 4:
        pytest.skip("a 2x2 mesh needs 4 ranks")
    _compare(multidevice_test, DeviceMesh(torch.arange(4).reshape(2, 2)), *change)
