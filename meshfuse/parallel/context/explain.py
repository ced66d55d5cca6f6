"""What ``explain`` says of a context-parallel attention on a rank: its strategy, mesh axis,
ranks and the transfers of its ring (or its all-gather, its all-to-all) with their bytes.

Registered with :func:`meshfuse.explain.register_communications`: the lines follow the
fusion's own communications in ``fd.explain()``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from meshfuse.explain import Extents, Size, format_bytes, register_communications, short_expr
from meshfuse.ir.fusion import Expr, Fusion
from meshfuse.ops.attention.sequence import ALLTOALL, AUTO, RING, sequence_parallel
from meshfuse.ops.registry import LocalContext
from meshfuse.parallel.context.record import (
    COMPILED,
    COPY_ENGINE,
    EAGER,
    NCCL,
    ContextParallel,
    context_record,
)
from meshfuse.runtime.comm.collectives import Communication


@dataclasses.dataclass(frozen=True)
class PlannedContextParallel:
    """A context-parallel attention's communications on this rank (see
    :mod:`meshfuse.parallel.context.record`); ``row_bytes``: one sequence row of each tensor
    that moves (named as :meth:`~meshfuse.parallel.context.record.ContextParallel.transfers`
    names them)."""

    expr: Expr
    record: ContextParallel
    row_bytes: Mapping[str, Size]

    def transfers(self) -> list[tuple[str, int | None, Size]]:
        return [(kind, peer, self.row_bytes[t] * Size.of(rows))
                for kind, peer, t, rows in self.record.transfers()]

    def communications(self) -> list[Communication]:
        """The records the communications will leave (static extents only)."""
        assert all(b.static is not None for _, _, b in self.transfers()), "symbolic extents"
        return [Communication(kind, self.record.ranks, self.record.mesh_axis, b.static,
                              "sum" if kind == "reduce_scatter" else None, peer)
                for kind, peer, b in self.transfers()]

    def __str__(self) -> str:
        record = self.record
        sent = [b for kind, _, b in self.transfers() if kind != "recv"]
        amount = ""
        if all(b.static is not None for b in sent):
            amount = f", {format_bytes(Size.of(sum(b.static for b in sent)))} sent"
        head = (f"{short_expr(self.expr)}: {record.strategy} over mesh axis {record.mesh_axis}, "
                f"ranks {list(record.ranks)}")
        if record.strategy != RING:
            kinds = sorted({kind for kind, _, _ in self.transfers()})
            return f"{head}: {len(sent)} x {'/'.join(kinds)}{amount}{_merge_words(record)}"
        peer = record.ranks[(record.position + 1) % record.size]
        moved = "k/v and dk/dv" if record.backward else "k/v"
        order = ", ".join(str(record.holder(s)) for s in range(record.size))
        return (f"{head}, blocks of positions {order}: {len(sent)} sends of {moved} to rank "
                f"{peer} (and as many receives){amount}; "
                f"transport: {TRANSPORT_WORDS[record.transport]}{_merge_words(record)}")


UNKNOWN = " (device not known yet)"
TRANSPORT_WORDS = {NCCL: "send/recv", COPY_ENGINE: "copy engines",
                   AUTO: f"copy engines on CUDA, send/recv elsewhere{UNKNOWN}"}
MERGE_WORDS = {EAGER: "eager (torch operations)", COMPILED: "compiled (one torch.compile'd pass)",
               AUTO: f"compiled on CUDA, eager elsewhere{UNKNOWN}"}


def _merge_words(record: ContextParallel) -> str:
    """How a forward that merges blocks by their log-sum-exp (the ring's, the all-gather's)
    merges them; nothing for the others."""
    if record.backward or record.strategy == ALLTOALL:
        return ""
    return f"; merge: {MERGE_WORDS[record.merge]}"


@register_communications
def planned_context_parallel(fusion: Fusion, rank: int, sizes: Extents | None = None,
                             device: torch.device | None = None
                             ) -> list[PlannedContextParallel]:
    """The context-parallel attentions ``rank`` communicates in, in program order; their
    records' ``transport`` and ``merge`` are those ``device`` runs (None: ``"auto"`` where
    the device decides)."""
    sizes = sizes or Extents(fusion)
    planned = []
    for expr in fusion.exprs:
        if sequence_parallel(expr) is None or rank not in expr.outputs[0].mesh:
            continue
        record = context_record(expr, LocalContext(rank, device, None, sizes.planning))
        if record.size > 1:
            planned.append(PlannedContextParallel(expr, record, _row_bytes(expr, sizes, rank)))
    return planned


def _row_bytes(expr: Expr, sizes: Extents, rank: int) -> dict[str, Size]:
    """Bytes of one local sequence row of each tensor a context-parallel attention moves."""
    args = dict(zip((p.name for p in expr.op.params), expr.args))
    row = {}
    for name, tv in (("q", args["q"]), ("k", args["k"]), ("v", args["v"])):
        ids = [i for a, i in enumerate(tv.materialized()) if a != 2]
        count = math.prod((sizes.local_size(tv, i, rank) for i in ids), start=Size.of(1))
        row[name] = row["d" + name] = count * Size.of(tv.dtype.torch_dtype.itemsize)
        row[name + "32"] = row["d" + name + "32"] = count * Size.of(4)
    heads = [sizes.local_size(args["q"], i, rank) for i in args["q"].materialized()[:2]]
    # [.., Ev] in q's dtype with q's heads (v may have fewer: grouped-query attention)
    value_dim = sizes.local_size(args["v"], args["v"].materialized()[3], rank)
    row["grad"] = row["attn"] = math.prod(heads, start=value_dim) * \
        Size.of(args["q"].dtype.torch_dtype.itemsize)
    row["lse"] = math.prod(heads, start=Size.of(4))
    return row
