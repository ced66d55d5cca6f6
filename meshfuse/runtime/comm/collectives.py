"""Every torch.distributed data collective of meshfuse, one function per collective.

Each function takes a local tensor, the axis it communicates, and a :class:`Group` (a process
group plus the ranks of the mesh slice in *coordinate* order); it moves the communicated axis
outermost and makes the buffer contiguous only when needed, and returns the result with the
axis back in place. Results along a gathered or scattered axis are in coordinate order.

The data collectives take ``async_op``: True launches the collective and returns a
:class:`~meshfuse.runtime.comm.pending.Pending` at once, waited for where its result is read
(:mod:`meshfuse.runtime.comm.pending`: collectives in flight, and how each is waited for). A
collective that fails (timed out, or a peer went away) raises
:class:`~meshfuse.runtime.faults.failures.CollectiveFailed` naming the collective and its group.

Every call is reported to the active :func:`record_communications` recorders (kind, group
ranks, mesh axis, bytes sent by this rank), which the tests use to assert the traffic.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from meshfuse.runtime.comm import peer_copy
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.comm.pending import Pending, Works

NCCL, COPY_ENGINE = "nccl", "copy_engine"  # how ring_shift moves its blocks
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True)
class Group:
    """A mesh slice: its process group, its ranks by coordinate, and this rank's coordinate."""

    process_group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    coordinate: int
    mesh_axis: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def torch_order(self) -> list[int]:
        """For each position of torch's group order (sorted ranks), the coordinate there."""
        return [self.ranks.index(r) for r in sorted(self.ranks)]


@dataclasses.dataclass(frozen=True)
class Communication:
    """One collective that ran: what, over which ranks and mesh axis, how many bytes."""

    kind: str
    ranks: tuple[int, ...]
    mesh_axis: int
    bytes: int
    reduce_op: str | None = None
    peer: int | None = None  # the other rank of a point-to-point send or recv


def translated(what: str, ranks: tuple[int, ...]) -> contextlib.AbstractContextManager:
    """Raises a failure of the torch.distributed calls of the block as
    :class:`~meshfuse.runtime.faults.failures.CollectiveFailed` (``what`` among ``ranks``)."""
    return Communicator.instance().translated(what, ranks)


def _label(kind: str, group: Group, reduce_op: str | None = None) -> str:
    op = f"({reduce_op})" if reduce_op else ""
    return f"{kind}{op} over mesh axis {group.mesh_axis}"


def _issued(work: dist.Work | None, buffer: torch.Tensor,
            finish: Callable[[torch.Tensor], torch.Tensor], label: str = "a collective",
            group: Group | None = None) -> torch.Tensor | Pending:
    """The result of a collective that wrote ``buffer``: at once (``work`` None: it ran
    synchronously), or a :class:`Pending` of it."""
    if work is None:
        return finish(buffer)
    return Pending(work, buffer, finish, label, group.ranks if group is not None else ())


_recorders: list[list[Communication]] = []


@contextlib.contextmanager
def record_communications() -> Iterator[list[Communication]]:
    """Collects every collective this process runs inside the block::

        with record_communications() as comms:
            fd.execute(inputs)
        assert [c.kind for c in comms] == ["allreduce"]
    """
    log: list[Communication] = []
    _recorders.append(log)
    try:
        yield log
    finally:
        _recorders.remove(log)


@contextlib.contextmanager
def captured_communications() -> Iterator[list[Communication]]:
    """Collects the collectives of the block into a list of its own, not reported to the
    active recorders: for a CUDA graph capture, which launches nothing; the graph's owner
    reports them with :func:`report` each time it replays them."""
    global _recorders
    outer, log = _recorders, []
    _recorders = [log]
    try:
        yield log
    finally:
        _recorders = outer


def report(communications: list[Communication]) -> None:
    """Reports collectives that ran without a Python call (a CUDA graph's replay)."""
    for log in _recorders:
        log.extend(communications)


def record_transfer(kind: str, group: Group, x: torch.Tensor, reduce_op: str | None = None,
                    peer: int | None = None) -> None:
    """Records a transfer made outside this module (a copy engine's) for
    :func:`record_communications`: ``x`` gives its bytes."""
    _record(kind, group, x, reduce_op, peer)


def _record(kind: str, group: Group, x: torch.Tensor, reduce_op: str | None = None,
            peer: int | None = None) -> None:
    _record_bytes(kind, group, x.numel() * x.element_size(), reduce_op, peer)


def _record_bytes(kind: str, group: Group, size: int, reduce_op: str | None = None,
                  peer: int | None = None) -> None:
    if _recorders:
        event = Communication(kind, group.ranks, group.mesh_axis, size, reduce_op, peer)
        for log in _recorders:
            log.append(event)


def _outermost(x: torch.Tensor, axis: int) -> torch.Tensor:
    return x.movedim(axis, 0).contiguous()


def _to_coordinate_order(chunks: torch.Tensor, group: Group) -> torch.Tensor:
    """``chunks`` stacked on axis 0 in torch's group order, reordered by coordinate."""
    order = group.torch_order
    if order == sorted(order):
        return chunks
    positions = [order.index(c) for c in range(group.size)]
    return chunks[torch.tensor(positions, device=chunks.device)]


def _chunks_in_torch_order(send: torch.Tensor, group: Group) -> torch.Tensor:
    """``send`` (the communicated axis outermost) as ``[members, chunk, ...]``, chunk ``c``
    for coordinate ``c``, stacked in torch's group order (sorted ranks)."""
    chunks = send.reshape(group.size, send.shape[0] // group.size, *send.shape[1:])
    order = group.torch_order
    if order != sorted(order):
        chunks = chunks[torch.tensor(order, device=send.device)]
    return chunks


def allgather(x: torch.Tensor, axis: int, group: Group, async_op: bool = False,
              sizes: Sequence[int] | None = None) -> torch.Tensor | Pending:
    """Concatenation along ``axis`` of every group member's ``x``, by coordinate.

    ``sizes`` (uneven shards): member ``c``'s extent along ``axis``; each member's part is
    padded to the largest, gathered, and the padding dropped.
    """
    send = _outermost(x, axis)
    longest = send.shape[0] if sizes is None else max(sizes)
    if send.shape[0] < longest:
        send = torch.cat([send, send.new_zeros(longest - send.shape[0], *send.shape[1:])])
    _record("allgather", group, send)
    out = torch.empty((group.size * longest, *send.shape[1:]), dtype=send.dtype,
                      device=send.device)
    label = _label("allgather", group)
    with translated(label, group.ranks):
        work = _gather(out, send, group=group.process_group, async_op=async_op)

    def finish(out: torch.Tensor) -> torch.Tensor:
        out = _to_coordinate_order(out.reshape(group.size, *send.shape), group)
        if sizes is not None and min(sizes) < longest:
            return torch.cat([out[c, :n] for c, n in enumerate(sizes)]).movedim(0, axis)
        return out.reshape(group.size * longest, *send.shape[1:]).movedim(0, axis)

    return _issued(work, out, finish, label, group)


def allreduce(x: torch.Tensor, group: Group, reduce_op: str, inplace: bool = False,
              async_op: bool = False) -> torch.Tensor | Pending:
    """The elementwise reduction of every group member's ``x``; with ``inplace`` (the caller
    gives ``x`` up) a contiguous ``x`` that is not a view of another tensor is reduced in its
    own buffer."""
    if x.is_contiguous():
        out = x if inplace and x._base is None else x.clone()
    else:
        out = x.contiguous()
    work, label = _issue_allreduce(out, group, reduce_op, async_op)
    return _issued(work, out, _same, label, group)


def _issue_allreduce(buffer: torch.Tensor, group: Group, reduce_op: str,
                     async_op: bool) -> tuple[dist.Work | None, str]:
    """Records the allreduce of ``buffer`` and issues it, the result written into ``buffer``;
    returns the work (None where it ran synchronously) and the collective's label."""
    _record("allreduce", group, buffer, reduce_op)
    label = _label("allreduce", group, reduce_op)
    with translated(label, group.ranks):
        work = dist.all_reduce(buffer, op=REDUCE_OPS[reduce_op], group=group.process_group,
                               async_op=async_op)
    return work, label


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def reduce_scatter(x: torch.Tensor, axis: int, group: Group, reduce_op: str,
                   async_op: bool = False,
                   sizes: Sequence[int] | None = None) -> torch.Tensor | Pending:
    """``x`` split along ``axis`` into chunks by coordinate (equal ones, or of extents
    ``sizes``: uneven shards, each padded to the largest); this member gets the reduction over
    all members of the chunk of its coordinate."""
    send = _outermost(x, axis)
    if sizes is not None and min(sizes) < max(sizes):
        longest = max(sizes)
        parts = send.split(list(sizes))
        send = torch.cat([torch.cat([p, p.new_zeros(longest - p.shape[0], *p.shape[1:])])
                          for p in parts])
    n = send.shape[0] // group.size
    chunks = _chunks_in_torch_order(send, group)
    _record("reduce_scatter", group, send, reduce_op)
    out = torch.empty((n, *send.shape[1:]), dtype=send.dtype, device=send.device)
    label = _label("reduce_scatter", group, reduce_op)
    with translated(label, group.ranks):
        work = _reduce_scatter(out, chunks.reshape(send.shape), op=REDUCE_OPS[reduce_op],
                               group=group.process_group, async_op=async_op)
    mine = n if sizes is None else sizes[group.coordinate]
    return _issued(work, out, lambda out: out[:mine].movedim(0, axis), label, group)


def all_to_all(x: torch.Tensor, split_axis: int, concat_axis: int, group: Group,
               async_op: bool = False) -> torch.Tensor | Pending:
    """Chunk ``c`` of ``x`` along ``split_axis`` goes to coordinate ``c``; the chunks received
    are concatenated along ``concat_axis`` by the sender's coordinate."""
    send = _outermost(x, split_axis)
    chunks = _chunks_in_torch_order(send, group)
    _record("all_to_all", group, send)
    received = torch.empty_like(chunks)
    label = _label("all_to_all", group)
    with translated(label, group.ranks):
        work = dist.all_to_all_single(received, chunks.contiguous(), group=group.process_group,
                                      async_op=async_op)

    def finish(received: torch.Tensor) -> torch.Tensor:
        received = _to_coordinate_order(received, group)  # [sender, n, ...], split axis first
        # back to x's axis order per chunk, then concatenate the chunks along concat_axis
        pieces = [received[c].movedim(0, split_axis) for c in range(group.size)]
        return torch.cat(pieces, dim=concat_axis)

    return _issued(work, received, finish, label, group)


def all_to_all_pieces(pieces: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]],
                      group: Group, async_op: bool = False) -> list[torch.Tensor] | Pending:
    """``pieces[c]`` goes to coordinate ``c``; returns the pieces received, by sender's
    coordinate, of shapes ``shapes`` (pieces of any shapes: uneven shards, or a shard whose
    owners change)."""
    order = group.torch_order
    send = [pieces[c].contiguous().flatten() for c in order]
    sizes = [p.numel() for p in send]
    recv_sizes = [_numel(shapes[c]) for c in order]
    send_buffer = torch.cat(send) if send else pieces[0].new_empty(0)
    _record("all_to_all", group, send_buffer)
    received = send_buffer.new_empty(sum(recv_sizes))
    label = _label("all_to_all", group)
    with translated(label, group.ranks):
        work = dist.all_to_all_single(received, send_buffer, recv_sizes, sizes,
                                      group=group.process_group, async_op=async_op)

    def finish(received: torch.Tensor) -> list[torch.Tensor]:
        by_torch_rank = received.split(recv_sizes)
        result: list[torch.Tensor] = [torch.empty(0)] * group.size
        for part, c in zip(by_torch_rank, order):
            result[c] = part.reshape(shapes[c])
        return result

    return _issued(work, received, finish, label, group)


def exchange_split_sizes(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """Row ``c`` of ``counts`` (``[members, m]`` integers) goes to coordinate ``c``; returns
    the rows received, by sender's coordinate: the split sizes a ragged all-to-all needs
    first (expert parallelism: how many token rows each rank sends each expert)."""
    chunks = _chunks_in_torch_order(counts.contiguous(), group)
    _record("split_sizes", group, chunks)
    received = torch.empty_like(chunks)
    with translated(_label("split_sizes", group), group.ranks):
        dist.all_to_all_single(received, chunks.contiguous(), group=group.process_group)
    return _to_coordinate_order(received.reshape(counts.shape), group)


def ragged_all_to_all(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                      group: Group) -> torch.Tensor:
    """The rows of ``x`` (axis 0) in consecutive blocks of ``send_splits[c]`` go to coordinate
    ``c``; returns the rows received, ``recv_splits[c]`` from coordinate ``c``, by sender's
    coordinate. Uneven and empty blocks are fine (a dropless token dispatch). Recorded as
    the bytes this rank sends to the others (its own block stays)."""
    order = group.torch_order
    pieces = x.split(list(send_splits))
    send = torch.cat([pieces[c] for c in order]) if order != sorted(order) else x
    off_rank = (x.numel() - pieces[group.coordinate].numel()) * x.element_size()
    _record_bytes("ragged_all_to_all", group, off_rank)
    received = x.new_empty(sum(recv_splits), *x.shape[1:])
    with translated(_label("ragged_all_to_all", group), group.ranks):
        dist.all_to_all_single(received, send.contiguous(), [recv_splits[c] for c in order],
                               [send_splits[c] for c in order], group=group.process_group)
    if order == sorted(order):
        return received
    by_torch = received.split([recv_splits[c] for c in order])
    return torch.cat([by_torch[order.index(c)] for c in range(group.size)])


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for e in shape:
        n *= e
    return n


def send_recv(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``x`` of coordinate 0 sent to coordinate 1 of a two-member group (one device to
    another, as between pipeline stages); the receiver's ``x`` gives shape and dtype."""
    out = x.contiguous()
    _record("send_recv", group, out)
    label = f"send_recv from rank {group.ranks[0]} to rank {group.ranks[1]}"
    with translated(label, group.ranks):
        if group.coordinate == 0:
            work = dist.isend(out, dst=group.ranks[1], group=group.process_group)
        else:
            work = dist.irecv(out, src=group.ranks[0], group=group.process_group)
    Communicator.instance().wait(work, label, group.ranks, point_to_point=True)
    return x if group.coordinate == 0 else out


def send(x: torch.Tensor, peer: int, group: Group, tag: int = 0) -> Pending:
    """``x`` sent to rank ``peer`` of ``group`` (a pipeline stage's output or input gradient
    to the next or previous stage), launched at once; the Pending's ``wait`` returns ``x``
    once it left. ``tag`` tells apart messages in flight between the same two ranks."""
    out = x.contiguous()
    _record("send", group, out, peer=peer)
    label = f"send from rank {group.ranks[group.coordinate]} to rank {peer}"
    with translated(label, group.ranks):
        work = dist.isend(out, dst=peer, group=group.process_group, tag=tag)
    return Pending(Works([work], [out], label, group.ranks), out, label=label,
                   ranks=group.ranks)


def recv(shape: Sequence[int], dtype: torch.dtype, device: torch.device, peer: int,
         group: Group, tag: int = 0) -> Pending:
    """A tensor of ``shape`` and ``dtype`` received from rank ``peer`` of ``group`` (the
    :func:`send` of the same ``tag``), launched at once; ``wait`` returns it."""
    buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
    _record("recv", group, buffer, peer=peer)
    label = f"recv on rank {group.ranks[group.coordinate]} from rank {peer}"
    with translated(label, group.ranks):
        work = dist.irecv(buffer, src=peer, group=group.process_group, tag=tag)
    return Pending(Works([work], [buffer], label, group.ranks), buffer, label=label,
                   ranks=group.ranks)


def broadcast(x: torch.Tensor, root: int, group: Group) -> torch.Tensor:
    """``x`` of the member at coordinate ``root`` on every member (``x`` gives the shape)."""
    out = x.contiguous().clone()
    _record("broadcast", group, out)
    # gloo has no unsigned 64-bit type (attention's RNG state is uint64): move the bits as int64.
    wire = out.view(torch.int64) if out.dtype == torch.uint64 else out
    label = f"broadcast from rank {group.ranks[root]}"
    with translated(label, group.ranks):
        work = dist.broadcast(wire, src=group.ranks[root], group=group.process_group,
                              async_op=True)
    Communicator.instance().wait(work, label, group.ranks)
    return out


def collective_permute(x: torch.Tensor, send_to: int, recv_from: int,
                       shape: Sequence[int], group: Group) -> torch.Tensor:
    """``x`` sent to coordinate ``send_to`` while a tensor of ``shape`` (``x``'s dtype) comes
    from coordinate ``recv_from``: one step of a collective permute (every member sends one
    block and receives one), as one ``batch_isend_irecv``. Returns the received tensor; with
    ``send_to == recv_from == group.coordinate``, ``x`` itself."""
    if send_to == group.coordinate and recv_from == group.coordinate:
        return x
    out = x.contiguous()
    received = torch.empty(tuple(shape), dtype=x.dtype, device=x.device)
    _record("collective_permute", group, out)
    ops = [dist.P2POp(dist.isend, out, group.ranks[send_to], group=group.process_group),
           dist.P2POp(dist.irecv, received, group.ranks[recv_from], group=group.process_group)]
    label = _label("collective_permute", group)
    with translated(label, group.ranks):
        works = dist.batch_isend_irecv(ops)
    Works(works, (), label, group.ranks).wait()
    return received


def allreduce_in_place(x: torch.Tensor, group: Group, reduce_op: str,
                       async_op: bool = False) -> torch.Tensor | Pending:
    """``x`` (contiguous; a view the caller owns, such as a block of a larger result)
    reduced over the group in its own buffer; returns ``x``, or with ``async_op`` a
    :class:`Pending` of it (the collective runs while the caller goes on)."""
    work, label = _issue_allreduce(x, group, reduce_op, async_op=True)
    if async_op:
        return Pending(work, x, label=label, ranks=group.ranks)
    Communicator.instance().wait(work, label, group.ranks)
    return x


def reduce_to(x: torch.Tensor, root: int, group: Group, reduce_op: str) -> torch.Tensor | None:
    """The reduction over the group of every member's ``x`` (a buffer the caller gives up),
    on the member at coordinate ``root``; None on the others."""
    out = x.contiguous()
    _record("reduce", group, out, reduce_op)
    label = _label("reduce", group, reduce_op)
    with translated(label, group.ranks):
        work = dist.reduce(out, dst=group.ranks[root], op=REDUCE_OPS[reduce_op],
                           group=group.process_group, async_op=True)
    Communicator.instance().wait(work, label, group.ranks)
    return out if group.coordinate == root else None


def ring_shift(tensors: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], group: Group,
               into: Sequence[torch.Tensor] | None = None, transport: str = NCCL,
               slot: str = "") -> Pending:
    """Each of ``tensors`` sent to the next coordinate of the group (``c + 1``, around), and
    as many received from the previous one, of ``shapes`` (the dtypes of ``tensors``): one
    ``batch_isend_irecv``, launched at once. Returns a :class:`Pending` of the received
    list: new tensors, or ``into`` (contiguous tensors of those shapes and dtypes, written in
    place). Recorded as one ``send`` and one ``recv`` per tensor, naming the peer.

    ``transport=COPY_ENGINE`` (CUDA; every shape equal on every rank) copies the tensors
    with the copy engines into the next rank's symmetric buffer ``slot`` instead
    (:mod:`meshfuse.runtime.comm.peer_copy`): no SM is taken from the kernels it overlaps.
    Without ``into`` the result is that slot, overwritten by the next shift into ``slot``."""
    n, c = group.size, group.coordinate
    after, before = group.ranks[(c + 1) % n], group.ranks[(c - 1) % n]
    sends = [t.contiguous() for t in tensors]
    if transport == COPY_ENGINE:
        assert all(tuple(s) == tuple(t.shape) for s, t in zip(shapes, sends)), \
            "ring_shift: a copy-engine shift moves blocks of one shape"
        for out in sends:
            _record("send", group, out, peer=after)
            _record("recv", group, out, peer=before)
        label = _label("ring_shift", group)
        with translated(label, group.ranks):
            shifted = peer_copy.shift(sends, group.process_group, after, slot, into)
        return Pending(shifted, shifted.received, label=label, ranks=group.ranks)
    if into is None:
        received = [torch.empty(tuple(s), dtype=t.dtype, device=t.device)
                    for t, s in zip(sends, shapes)]
    else:
        received = list(into)
        assert all(r.is_contiguous() and tuple(r.shape) == tuple(s) and r.dtype == t.dtype
                   for r, s, t in zip(received, shapes, sends)), "ring_shift: bad buffers"
    ops = []
    for out, buffer in zip(sends, received):
        _record("send", group, out, peer=after)
        _record("recv", group, buffer, peer=before)
        ops.append(dist.P2POp(dist.isend, out, after, group=group.process_group))
        ops.append(dist.P2POp(dist.irecv, buffer, before, group=group.process_group))
    label = _label("ring_shift", group)
    with translated(label, group.ranks):
        works = dist.batch_isend_irecv(ops)
    return Pending(Works(works, sends + received, label, group.ranks), received, label=label,
                   ranks=group.ranks)


def group_along(communicator, mesh, mesh_axis: int) -> Group | None:
    """``communicator``'s rank's Group along ``mesh_axis`` of ``mesh``, or None outside the
    mesh. Creating a group is collective: every rank of the world calls this alike."""
    process_group = communicator.group_if_member(mesh, mesh_axis)
    rank = communicator.rank
    if rank not in mesh:
        return None
    return Group(process_group, mesh.group_ranks(rank, mesh_axis),
                 mesh.coordinate(rank)[mesh_axis], mesh_axis)
