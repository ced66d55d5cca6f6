"""Ring transfers made by the GPUs' copy engines through symmetric memory (CUDA only).

NCCL's send and receive run as kernels: while a ring's block travels they hold streaming
multiprocessors that the attention kernels beside them would use (on 2 H200s a causal ring
call's attention kernels run 1-2 ms longer next to them). Here a block is copied with one
``cudaMemcpyAsync`` into a buffer of the next rank that torch's symmetric memory maps into
this process: a copy engine moves it over NVLink and no SM works but for two barriers of one
thread block each.

**Slots.** The receiving buffers are persistent symmetric allocations, one *slot* per
``(group, name, shapes, dtypes)``, made (a collective: every rank of the group makes the
same shifts in the same order) at the first shift that needs it, the device synchronized
between the allocation and the rendezvous (:func:`meshfuse.runtime.comm.symmetric_memory.allocate`:
the first call pays it once). A shift into slot ``name`` overwrites what the previous shift into it
received, so its caller must have queued every use of that result before it launches the next shift
of the same name (the ring alternates two names by step).

**One shift**, on a side stream of the device (the *copy stream*):

1. the copy stream waits for everything queued so far on the current stream: the tensors
   sent are written, and the kernels that read this rank's slot have run;
2. a barrier of the group: every rank got there, so the next rank's slot is free;
3. each tensor copied into the next rank's slot (a copy engine);
4. a barrier: every copy into this rank's slot has landed;
5. with ``into``, the slot copied into those tensors (a local copy, a copy engine too);
6. :meth:`Shifted.wait` makes the current stream wait for the copy stream; the host never
   waits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshfuse.runtime.comm import symmetric_memory

BARRIER_TIMEOUT_MS = 120_000  # a peer that never comes is a device error, not a hang
_ALIGN = 256  # bytes between the tensors of one slot


@dataclasses.dataclass
class _Slot:
    """One symmetric allocation holding one tensor per shape: this rank's views, and the
    next rank's, mapped here."""

    handle: object  # torch's _SymmetricMemory
    buffer: torch.Tensor  # this rank's allocation (bytes)
    local: list[torch.Tensor]
    remote: list[torch.Tensor]


_slots: dict[tuple, _Slot] = {}
_streams: dict[int, torch.cuda.Stream] = {}


def _stream(device: torch.device) -> torch.cuda.Stream:
    """The device's copy stream, of high priority: its one-block barrier kernels become ready
    with the attention kernels they must run beside, and the block scheduler then gives
    them an SM first (else they may wait for a whole kernel to end, and the copies with
    them)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index, priority=-1)
    return _streams[index]


def _offsets(shapes, dtypes) -> tuple[list[int], int]:
    """Each tensor's byte offset in a slot, and the slot's bytes."""
    offsets, at = [], 0
    for shape, dtype in zip(shapes, dtypes):
        offsets.append(at)
        nbytes = math.prod(shape) * dtype.itemsize
        at += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    return offsets, at


def _slot(process_group, after: int, name: str, shapes, dtypes, device) -> _Slot:
    """The slot ``name`` of these shapes and dtypes (made on first use, collectively)."""
    key = (process_group.group_name, after, name, tuple(map(tuple, shapes)), tuple(dtypes))
    if key in _slots:
        return _slots[key]
    offsets, size = _offsets(shapes, dtypes)
    handle, buffer = symmetric_memory.allocate(process_group, size, device)
    peer = dist.get_group_rank(process_group, after)
    local, remote = [], []
    for at, shape, dtype in zip(offsets, shapes, dtypes):
        count = math.prod(shape)
        local.append(buffer[at:at + count * dtype.itemsize].view(dtype).view(tuple(shape)))
        remote.append(handle.get_buffer(peer, tuple(shape), dtype, at // dtype.itemsize))
    _slots[key] = _Slot(handle, buffer, local, remote)
    return _slots[key]


class Shifted:
    """A shift in flight: ``received``, the tensors it writes (this rank's slot, or
    ``into``), to be read after :meth:`wait`, which orders the current stream after it (the
    host does not wait)."""

    def __init__(self, done: torch.cuda.Event, received: list[torch.Tensor],
                 device: torch.device):
        self._done, self.received, self._device = done, received, device

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._done)


def shift(tensors: Sequence[torch.Tensor], process_group, after: int, name: str,
          into: Sequence[torch.Tensor] | None = None) -> Shifted:
    """``tensors`` (contiguous CUDA tensors) copied into slot ``name`` of rank ``after`` (a
    global rank), and the previous rank's copied into this rank's: see the module doc.
    ``into``: contiguous tensors of the same shapes and dtypes the received blocks are copied
    to (else the result is the slot itself, valid until the next shift into ``name``)."""
    device = tensors[0].device
    shapes, dtypes = [tuple(t.shape) for t in tensors], [t.dtype for t in tensors]
    slot = _slot(process_group, after, name, shapes, dtypes, device)
    current, copier = torch.cuda.current_stream(device), _stream(device)
    copier.wait_stream(current)
    with torch.cuda.stream(copier):
        slot.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        for remote, t in zip(slot.remote, tensors):
            remote.copy_(t)  # contiguous, same dtype: cudaMemcpyAsync, a copy engine
            t.record_stream(copier)  # the caller may free it before the copy has run
        slot.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        received = slot.local
        if into is not None:
            for out, local in zip(into, slot.local):
                out.copy_(local)
                out.record_stream(copier)
            received = list(into)
        done = torch.cuda.Event()
        done.record(copier)
    return Shifted(done, list(received), device)
