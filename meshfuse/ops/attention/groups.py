"""Grouped-query attention under a sharding: every rank must hold, with its query heads, the
key/value heads that serve them.

In grouped-query attention (PyTorch's SDPA with ``enable_gqa=True``) q has ``H`` heads and k
and v ``Hkv``, a divisor of ``H``; query head ``h`` attends with key/value head ``h // G``,
``G = H / Hkv``. A rank computes its query heads with the key/value heads it holds, so the
heads must be sharded *by groups*: on every mesh axis, the owner of query head ``h`` is the
owner of key/value head ``h // G``. Block splits of both head axes into the same number of
shards do that exactly when that number divides ``Hkv`` (8 query and 4 key/value heads over
2 ranks: query heads 0-3 with key/value heads 0-1 on rank 0). Local heads then form groups
of the same ``G``, in order, and the kernels run grouped-query attention locally.
"""

from __future__ import annotations

import torch

from meshfuse.errors import ShardingError
from meshfuse.ir.layout import derived_extents, device_ids, split_indices
from meshfuse.ir.printer import format_expr
from meshfuse.ir.tensor_view import TensorView


def head_owners(tv: TensorView) -> dict[str, torch.Tensor] | None:
    """For each device parallel type that shards ``tv``'s heads (axis -3 of its
    materialized axes), the coordinate owning each global head; None when an extent is not
    known before execute."""
    if any(i.extent is None for i in tv.logical):
        return None
    heads = tv.materialized()[-3]
    extents = derived_extents(tv, {i: i.extent for i in tv.logical})
    indices = split_indices(tv, heads, extents)
    return {pt.value: indices[leaf] for leaf, pt in device_ids(tv).get(heads, [])}


def check_grouped_heads(expr, q: TensorView, kv: dict[str, TensorView]) -> None:
    """Raises :class:`ShardingError` unless every rank holds the key/value heads of ``kv``
    (``{"k": k, "v": v}``) that serve its query heads of ``q`` (see the module doc).
    Nothing to check with as many key/value heads as query heads, or symbolic extents."""
    q_owners = head_owners(q)
    for name, tv in kv.items():
        kv_owners = head_owners(tv)
        if q_owners is None or kv_owners is None:
            return
        heads, kv_heads = q.materialized()[-3].extent, tv.materialized()[-3].extent
        if heads == kv_heads:
            continue
        group = heads // kv_heads
        served = {pt: owners[torch.arange(heads) // group] for pt, owners in kv_owners.items()}
        if served.keys() != q_owners.keys() or \
                any(not torch.equal(served[pt], q_owners[pt]) for pt in served):
            raise ShardingError(
                f"{format_expr(expr)}: the {kv_heads} key/value heads of {tv.name} ({name}) "
                f"are not sharded with the {heads} query heads of {q.name} (q) that they "
                f"serve (query head h needs key/value head h // {group} on its rank); split "
                "both head axes alike over the same mesh axes into a number of blocks that "
                f"divides {kv_heads}, or leave the heads unsharded")
