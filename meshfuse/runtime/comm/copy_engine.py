"""The copy-engine transport of stream loops' decomposed communications (CUDA only).

NCCL moves data with kernels, and cuBLAS's Hopper GEMMs are persistent kernels that hold
every streaming multiprocessor until they end: a NCCL transfer launched beside a GEMM waits
for it, so a stream loop over NCCL hides nothing. Here a block moves by one
``cudaMemcpyAsync`` out of (or into) a buffer that torch's symmetric memory maps into every
rank of the group: a copy engine moves it over NVLink while the GEMMs hold the SMs. Only
the barriers (a one-block kernel each) need an SM; they are queued on the GEMMs' stream,
between GEMMs, so none waits for a GEMM it does not follow.

**Workspace.** Two symmetric allocations per ``(group, device, place)`` (``place``: the
communication's position in its loop), made or grown at the first loop that needs them (a
collective: every rank computes the same size from global extents, so every rank makes the
same ones in the same order) and taken in turn by later loops (:func:`next_workspace`). A
loop needs no barrier at its end: a peer's reads of a workspace (its pulls) end before that
peer's next loop at the same place reaches its first barrier, and this rank writes that
workspace again only in the loop after, past that barrier. A loop captured into a CUDA graph
replays the same workspace each time, so there it ends with a barrier
(:func:`closing_barrier`).

**An allgather of the stream axis** (:class:`Gathering`, chunk ``i`` working on block ``b``):

1. at the loop's start, on the current stream: this rank's shard copied into its workspace,
   then a barrier (every rank's shard is staged);
2. the own block's chunk (the loop's first) runs on the shard itself; once it is issued,
   when the loop first asks for another rank's block, a side stream (the *copy stream*,
   after the barrier) is given the copies of every other block at once, in the loop's order,
   each out of its owner's workspace (a copy engine, no SM) with an event of its own; a
   chunk's stream waits for its block's copy only, so the copies run under the GEMMs of the
   earlier chunks, the first under the own block's. The copies are issued after the own
   block's GEMM, as torch's fused all-gather-matmul does (issued before it, the copies ran
   beside the GEMMs 9% of their time on 2 H200s, torch's 85%);
3. at the loop's end, the current stream waits for every pull (and the barrier).

**A reduce-scatter onto the stream axis** (:class:`Reducing`): the chunks visit the other
ranks' blocks first and this rank's own last. Step ``s`` (the ``s``-th other block, ``(c + s
+ 1) mod d`` at coordinate ``c``): this rank's partial of that block is copied into slot ``s``
of its workspace, then a barrier (every rank's slot ``s`` is written); the copy stream then
pulls slot ``s`` of rank ``(c - s - 1) mod d``, which holds that rank's partial of this
rank's block, under the next GEMM. The own block's chunk adds the pulled partials to this
rank's own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

from meshfuse.runtime.comm import symmetric_memory
from meshfuse.runtime.comm.collectives import Group, record_transfer
from meshfuse.runtime.comm.launch_env import launch_info_from_env

BARRIER_TIMEOUT_MS = 120_000  # a peer that never comes is a device error, not a hang
_ALIGN = 256  # bytes between the regions of a workspace
COMBINE = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}


def unavailable(device: torch.device, group: Group | None = None) -> str | None:
    """Why the copy-engine transport cannot carry a communication of ``group`` (None: of
    any group) on ``device``, or None when it can."""
    if device.type != "cuda":
        return "copy engines are CUDA's (a CPU device uses the process group)"
    if not hasattr(symm_mem, "rendezvous") or not hasattr(symm_mem, "empty"):
        return f"torch {torch.__version__} has no symmetric memory"
    if group is None:
        return None
    if group.process_group is None or not dist.is_initialized():
        return "no process group"
    if "nccl" not in str(dist.get_backend(group.process_group)):
        return "the process group is not NCCL's"
    if len(hosts(group.ranks)) > 1:
        return (f"ranks {list(group.ranks)} are on several hosts (the copy engines reach "
                "only the GPUs of one host)")
    return None


def hosts(ranks: Sequence[int]) -> set[int]:
    """The hosts of ``ranks``, numbered as torchrun and mpirun place ranks: the launcher's
    local size in consecutive ranks per host (without a launcher's variables: one rank per GPU
    of this host). The same on every rank, so every rank picks the same transport."""
    launch = launch_info_from_env()
    per_host = launch.local_size if launch.launcher != "none" else \
        max(1, torch.cuda.device_count())
    return {rank // per_host for rank in ranks}


@dataclasses.dataclass
class _Workspace:
    handle: Any  # torch's _SymmetricMemory
    buffer: torch.Tensor  # this rank's allocation (bytes)
    # the views handed out, made once: a loop asks for the same regions at every call
    views: dict[tuple, torch.Tensor] = dataclasses.field(default_factory=dict)

    def local(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        key = (None, offset, tuple(shape), dtype)
        if key not in self.views:
            count = math.prod(shape)
            self.views[key] = self.buffer[offset:offset + count * dtype.itemsize] \
                .view(dtype).view(tuple(shape))
        return self.views[key]

    def remote(self, peer: int, offset: int, shape: Sequence[int],
               dtype: torch.dtype) -> torch.Tensor:
        """The region of ``peer`` (a rank of the group's torch order), mapped here."""
        key = (peer, offset, tuple(shape), dtype)
        if key not in self.views:
            self.views[key] = self.handle.get_buffer(peer, tuple(shape), dtype,
                                                     offset // dtype.itemsize)
        return self.views[key]

    def barrier(self) -> None:
        self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)


_workspaces: dict[tuple, _Workspace] = {}
_copy_streams: dict[int, torch.cuda.Stream] = {}


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // _ALIGN) * _ALIGN


def workspace(group: Group, place: object, nbytes: int, device: torch.device) -> _Workspace:
    """The workspace of ``group`` at ``place`` holding at least ``nbytes`` (collective when
    made or grown)."""
    key = (group.process_group.group_name, device.index, place)
    found = _workspaces.get(key)
    if found is not None and found.buffer.numel() >= nbytes:
        return found
    if found is not None:  # no copy, here or on a peer, may still read the old one
        found.barrier()
        torch.cuda.synchronize(device)
    size = max(_aligned(nbytes), 2 * found.buffer.numel() if found is not None else 0)
    _workspaces[key] = _Workspace(*symmetric_memory.allocate(group.process_group, size, device))
    return _workspaces[key]


_turns: dict[tuple, int] = {}


def next_workspace(group: Group, place: object, nbytes: int,
                   device: torch.device) -> _Workspace:
    """The workspace of the next loop run at ``place``: the two of ``place`` in turn
    (module doc), each holding at least ``nbytes``."""
    key = (group.process_group.group_name, device.index, place)
    turn = _turns.get(key, 0)
    _turns[key] = 1 - turn
    return workspace(group, (place, turn), nbytes, device)


def closing_barrier(space: _Workspace) -> None:
    """Ends a loop run with a barrier when it is being captured into a CUDA graph: a graph
    replays the workspaces it captured, not the next ones in turn, so a replay would write
    the workspace a slower peer may still be pulling from the replay before. After this
    rank's pulls (the current stream waits for them first), the barrier lets no rank go on
    until every rank's pulls have landed. Run eagerly, the turns already order them."""
    if torch.cuda.is_current_stream_capturing():
        space.barrier()


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device.index not in _copy_streams:
        _copy_streams[device.index] = torch.cuda.Stream(device)
    return _copy_streams[device.index]


def peer(group: Group, coordinate: int) -> int:
    """The rank of torch's group order (symmetric memory's) at mesh ``coordinate``."""
    return dist.get_group_rank(group.process_group, group.ranks[coordinate])


def pull(source: torch.Tensor, out: torch.Tensor, after: torch.cuda.Event) -> torch.cuda.Event:
    """``source`` (another rank's memory) copied into ``out`` by a copy engine on the copy
    stream once ``after`` has happened; the event of the copy's end."""
    copier = _copy_stream(out.device)
    copier.wait_event(after)
    with torch.cuda.stream(copier):
        out.copy_(source)  # same dtype, contiguous: cudaMemcpyAsync on a copy engine
        done = torch.cuda.Event()
        done.record(copier)
    return done


class Gathering:
    """An allgather of one loop run, as copy-engine pulls (module doc): ``shapes[b]`` is the
    shape of block ``b`` (the shard of coordinate ``b``), ``x`` this rank's shard. Made on
    the stream the loop starts from: this rank's shard is staged, a barrier, and the blocks'
    buffers are allocated there (before the copies are ordered after it, so no copy writes
    memory that stream still uses); the pulls are issued by :meth:`issue`, at the latest when
    :meth:`block` is first asked for another rank's block."""

    def __init__(self, x: torch.Tensor, group: Group, shapes: Sequence[Sequence[int]],
                 place: int, barrier_aside: bool = False):
        """``barrier_aside``: the staging barrier runs on the copy stream, so the own block's
        GEMM need not wait for the other ranks to have staged (it is launched before the
        GEMM, whose persistent blocks would otherwise hold every SM it needs)."""
        self.x, self.group = x.contiguous(), group
        me, d, device = group.coordinate, group.size, x.device
        self.shapes = [tuple(s) for s in shapes]
        nbytes = max(math.prod(s) for s in shapes) * x.dtype.itemsize
        self.workspace = next_workspace(group, place, nbytes, device)
        self.order = [(me + s) % d for s in range(1, d)]
        self.outs = {b: torch.empty(self.shapes[b], dtype=x.dtype, device=device)
                     for b in self.order}
        self.workspace.local(0, x.shape, x.dtype).copy_(self.x)
        self.staged = torch.cuda.Event()
        if barrier_aside:
            copier = _copy_stream(device)
            copier.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(copier):
                self.workspace.barrier()
                self.staged.record()
        else:
            self.workspace.barrier()
            self.staged.record()
        self.blocks: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    def issue(self) -> None:
        """Gives the copy stream the pulls of every other rank's block, in ring order, each
        with its own end event (once per run; later calls do nothing)."""
        if self.blocks or not self.outs:
            return
        x, group = self.x, self.group
        for b in self.order:
            out = self.outs[b]
            if out.numel() == 0:  # an empty last block (uneven shards): nothing to move
                self.blocks[b] = (out, None)
                continue
            source = self.workspace.remote(peer(group, b), 0, self.shapes[b], x.dtype)
            self.blocks[b] = (out, pull(source, out, self.staged))
            record_transfer("copy_engine_pull", group, out, peer=group.ranks[b])

    def block(self, b: int) -> torch.Tensor:
        """Block ``b`` of the gathered tensor, once its copy has landed (the current stream
        waits for it; the host does not). The first call for another rank's block issues
        the pulls (:meth:`issue`), after whatever the own block's chunk has issued."""
        if b == self.group.coordinate:
            return self.x
        self.issue()
        out, done = self.blocks[b]
        if done is not None:
            torch.cuda.current_stream(out.device).wait_event(done)
        return out

    def finish(self) -> None:
        """The current stream (after the loop's chunks) waits for the staging barrier and
        every pull: what this rank does next comes after its reads of the peers' workspaces
        (module doc)."""
        current = torch.cuda.current_stream(self.x.device)
        current.wait_event(self.staged)
        for _, done in self.blocks.values():
            if done is not None:
                current.wait_event(done)
        closing_barrier(self.workspace)
        self.blocks.clear()
        self.outs.clear()


class Reducing:
    """A reduce-scatter of one loop run, as copy-engine pulls of partial blocks (module
    doc). ``shapes[b]``: the shape of block ``b``; ``dtype``: the partials'."""

    def __init__(self, group: Group, shapes: Sequence[Sequence[int]], dtype: torch.dtype,
                 reduce_op: str, place: int, device: torch.device):
        self.group, self.shapes, self.dtype = group, [tuple(s) for s in shapes], dtype
        self.combine, self.reduce_op = COMBINE[reduce_op], reduce_op
        self.slot = _aligned(max(math.prod(s) for s in self.shapes) * dtype.itemsize)
        self.workspace = next_workspace(group, place, self.slot * max(1, group.size - 1),
                                        device)
        self.device, self.step, self.pulled = device, 0, []
        # allocated now, on the stream the loop starts from (see Gathering)
        self.received = [torch.empty(self.shapes[group.coordinate], dtype=dtype, device=device)
                         for _ in range(group.size - 1)]

    @staticmethod
    def order(coordinate: int, size: int) -> list[int]:
        """The blocks in the order the loop must visit them: the others', then its own."""
        return [(coordinate + s + 1) % size for s in range(size)]

    def target(self, b: int) -> torch.Tensor | None:
        """Where the partial of block ``b`` is best written (its workspace slot, which
        :meth:`partial` then need not copy), or None for this rank's own block."""
        if b == self.group.coordinate:
            return None
        return self.workspace.local(self.step * self.slot, self.shapes[b], self.dtype)

    def partial(self, b: int, x: torch.Tensor) -> torch.Tensor | None:
        """This rank's partial ``x`` of block ``b`` given; the reduced block when ``b`` is
        this rank's own (visited last), else None."""
        me, d = self.group.coordinate, self.group.size
        if b != me:
            s = self.step
            self.step += 1
            slot = self.workspace.local(s * self.slot, x.shape, x.dtype)
            if slot.data_ptr() != x.data_ptr() or slot.stride() != x.stride():
                slot.copy_(x)
            self.workspace.barrier()
            if self.received[s].numel() == 0:  # an empty own block: nothing to pull
                return None
            written = torch.cuda.Event()
            written.record()
            source = self.workspace.remote(peer(self.group, (me - s - 1) % d), s * self.slot,
                                           self.shapes[me], self.dtype)
            self.pulled.append((self.received[s], pull(source, self.received[s], written)))
            record_transfer("copy_engine_pull", self.group, x,
                            peer=self.group.ranks[(me - s - 1) % d], reduce_op=self.reduce_op)
            return None
        current = torch.cuda.current_stream(self.device)
        out = x
        for part, done in self.pulled:
            current.wait_event(done)
            out = self.combine(out, part)
        return out

    def finish(self) -> None:
        """The current stream (after the loop's chunks) waits for every pull (module doc)."""
        current = torch.cuda.current_stream(self.device)
        for _, done in self.pulled:
            current.wait_event(done)
        closing_barrier(self.workspace)
        self.pulled.clear()
