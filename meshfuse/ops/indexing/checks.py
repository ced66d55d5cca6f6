"""``MESHFUSE_CHECK_INDICES=1``: lookups check their integer indices on the host.

An index out of range is not always an error by itself: a lookup along a sharded axis
(a vocabulary-parallel embedding, loss parallel) finds the position on no rank and writes
zeros, and the fused cross entropy writes NaN. With ``MESHFUSE_CHECK_INDICES=1`` set when a
program is built (its first call for an input signature), ``take_along_axis``, ``gather``,
``index_select``, ``embedding_fwd`` and ``cross_entropy_fwd`` check the index values each
rank reads against the global extent of the indexed axis, before looking up, and raise an
:class:`~meshfuse.errors.InputError` naming the op, the index tensor, the offending value
and the extent (the runtime tells the other ranks, which raise it too).

Off by default: the check reads the indices back to the host, one synchronization per op
and call, which stalls the GPU's queue and cannot be captured in a CUDA graph; the
unchecked paths stay asynchronous. torch's own kernels still refuse an index out of range
where the lookup is not sharded (an IndexError on the CPU, a device-side assert on CUDA).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from meshfuse.errors import InputError

CHECK_INDICES_ENV = "MESHFUSE_CHECK_INDICES"


def checks_enabled() -> bool:
    """Whether ``MESHFUSE_CHECK_INDICES`` asks for the checks (set and not ``0``)."""
    return os.environ.get(CHECK_INDICES_ENV, "0") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class IndexCheck:
    """A check of index values: each in ``[0, extent)`` or equal to ``ignored``.

    Attributes:
        op: the op that looks up.
        index: the name of the index tensor.
        target: the name of the tensor looked up, and ``axis`` the axis indexed.
        extent: that axis's global extent.
        ignored: a value allowed besides (cross entropy's ``ignore_index``), or None.
    """

    op: str
    index: str
    target: str
    axis: int
    extent: int
    ignored: int | None = None

    def __call__(self, values: torch.Tensor) -> None:
        bad = (values < 0) | (values >= self.extent)
        if self.ignored is not None:
            bad &= values != self.ignored
        count = int(bad.sum())
        if not count:
            return
        first = int(values[bad].flatten()[0])
        allowed = f"[0, {self.extent})" + ("" if self.ignored is None else
                                           f" or {self.ignored} (ignored)")
        raise InputError(
            f"{self.op}: index {self.index} holds {first} ({count} value(s) out of range), "
            f"but axis {self.axis} of {self.target} has {self.extent} positions; give indices "
            f"in {allowed}")


def index_check(op: str, index, target, axis: int, extents,
                ignored: int | None = None) -> dict:
    """``localize``'s keyword for an op's implementation: ``{"check": IndexCheck}`` when the
    checks are on, else nothing. ``index`` and ``target`` are the expression's tensors,
    ``extents`` the bound global extents of its IDs."""
    if not checks_enabled():
        return {}
    extent = extents[target.materialized()[axis]]
    return {"check": IndexCheck(op, index.name, target.name, axis, extent, ignored)}
