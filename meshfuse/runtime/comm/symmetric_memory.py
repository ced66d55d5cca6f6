"""One symmetric allocation of torch's symmetric memory, made safely (CUDA only).

The copy-engine transports (:mod:`meshfuse.runtime.comm.peer_copy` for context parallelism's ring,
:mod:`meshfuse.runtime.comm.copy_engine` for stream loops) each keep persistent byte buffers that
every rank of a process group maps; both make them here.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed import _symmetric_memory as symm_mem


def allocate(process_group, nbytes: int, device: torch.device) -> tuple[object, torch.Tensor]:
    """A symmetric byte buffer of ``nbytes`` on ``device``, rendezvoused over
    ``process_group`` (collective: every rank of the group calls it alike, in the same
    order); returns torch's handle and this rank's buffer.

    The allocation zeroes its signal pad on the device without waiting for it (torch 2.11: a
    memset queued behind this rank's pending kernels). A peer may signal into the pad as soon
    as the rendezvous has handed it over; a zeroing that lands after that signal erases it,
    and both ranks then wait for a signal that never comes (a barrier's time limit, then a
    device error). Waiting for the device here orders the zeroing before the rendezvous,
    which no rank leaves before every rank has entered it.
    """
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed by older torch, a deprecated no-op in newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(process_group.group_name)
    return symm_mem.rendezvous(buffer, process_group.group_name), buffer
