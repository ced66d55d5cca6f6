"""``snapshot(fusion)``: everything a compiler pass could change in a user's fusion, to compare
before and after ``compile``, ``explain``, ``shard_tensor`` or ``execute``."""

from __future__ import annotations

from meshfuse.ir.domain import domain
from meshfuse.ir.printer import format_fusion


def snapshot(fusion) -> tuple:
    """The fusion's structure by identity (values, expressions, inputs, outputs), each
    tensor's schedule (mesh, transforms, loop, parallel types, allocation) and split chains
    (``domain``), its flags, and its printed form."""
    tensors = [(tv, tv.name, tuple(tv.logical), tuple(tv.loop), tuple(tv.transforms),
                tuple(tv.parallel.items()), tv.allocation, tv.mesh, tv.definition,
                _domain(tv)) for tv in fusion.tensors()]
    exprs = [(e, e.op, tuple(e.args), tuple(e.outputs), dict(e.id_map), dict(e.attrs))
             for e in fusion.exprs]
    flags = (fusion.propagated, frozenset(fusion.user_scheduled))
    return tensors, exprs, fusion.inputs(), fusion.outputs(), flags, format_fusion(fusion)


def _domain(tv) -> tuple:
    d = domain(tv)
    return (tuple(d.roots.items()), tuple((k, tuple(v)) for k, v in d.device_ids.items()))
