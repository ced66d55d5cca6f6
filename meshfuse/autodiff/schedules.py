"""Which tensors of a fusion the user scheduled. Copying a schedule is
:func:`meshfuse.passes.schedule_copy.copy_schedule` (below autodiff: a strategy copies
schedules too)."""

from __future__ import annotations

from meshfuse.ir.tensor_view import TensorView
from meshfuse.passes.schedule_copy import copy_schedule

__all__ = ["copy_schedule", "is_pinned"]


def is_pinned(tv: TensorView) -> bool:
    """Whether the user scheduled ``tv`` (read before or after the fusion was compiled)."""
    if tv.fusion.propagated:
        return tv in tv.fusion.user_scheduled
    return tv.is_scheduled
