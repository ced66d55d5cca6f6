"""The process groups meshfuse runs its collectives in, created on first use and kept.

A mesh axis is cut into slices (``mesh.all_groups(axis)``); the first time a (mesh, axis) is
asked for, every slice gets its process group at once, in a fixed order, since torch's
``new_group`` is collective over the world: every rank must ask for the same slicings in the
same order. A slice is kept by its ranks, so two meshes that share a slice share its group.
Two groups of the whole world stand beside them: the world's (the default group, where
meshfuse may use it, else a copy with meshfuse's timeout) and the cross-rank agreement's (gloo,
so that it is waited for on the host and never pairs with a program's collective). A fusion
whose meshes hold only some ranks (a pipeline stage's sub-mesh) agrees among those ranks: its
agreement group is created by them alone (named after its ranks and the groups'
generation), so that ranks of other stages, which never run that fusion, take no part.

Every group has meshfuse's timeout (:meth:`ProcessGroups.set_timeout` changes them all). The
:class:`~meshfuse.runtime.comm.communicator.Communicator` owns one :class:`ProcessGroups`: it
retires them when it recovers from a failure and destroys them at exit.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterable

import torch.distributed as dist

from meshfuse.errors import CommunicationError
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType

# ``Communicator.translated``: turns a failure of the block's torch.distributed calls into a
# CollectiveFailed naming what and among which ranks.
Translate = Callable[[str, Iterable[int]], contextlib.AbstractContextManager]


class ProcessGroups:
    """This rank's process groups: of mesh slices by their ranks, of the world, of the
    agreement.

    Attributes:
        by_ranks: each group created (or adopted: the world's default group) by its ranks in
            mesh order.
        world_is_default: whether the world's slice is torch's default group rather than a
            group of meshfuse's own: only on NCCL when meshfuse initialized it (another
            communicator costs GPU memory), and not after :meth:`retire` (an error on one rank
            only can leave a collective pending for ever in a group, which must then be
            destroyed without touching the group torch code such as DTensor shares).
    """

    def __init__(self, rank: int, size: int, timeout: datetime.timedelta, translated: Translate,
                 world_is_default: bool):
        self._rank, self._size = rank, size
        self._timeout, self._translated = timeout, translated
        self.world_is_default = world_is_default
        self.by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._slicings: set[tuple[DeviceMesh, int]] = set()
        self._agreement: dist.ProcessGroup | None = None
        self._agreements: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.generation = 0  # how many times the groups were retired (names agreement groups)

    def of_slice(self, mesh: DeviceMesh, mesh_axis: int | ParallelType
                 ) -> dist.ProcessGroup | None:
        """The group of the slice of ``mesh`` along ``mesh_axis`` that holds this rank, or
        None for a rank outside ``mesh`` (after taking part in creating the groups).

        Raises:
            CommunicationError: if the mesh has a device outside the world.
        """
        if isinstance(mesh_axis, ParallelType):
            mesh_axis = mesh.axis_of(mesh_axis)
        key = (mesh, mesh_axis % mesh.ndim)
        if key not in self._slicings:
            self._check_mesh(mesh)
            for ranks in mesh.all_groups(key[1]):
                if ranks not in self.by_ranks:
                    self.by_ranks[ranks] = self._new_group(ranks)
            self._slicings.add(key)
        if self._rank not in mesh:
            return None
        return self.by_ranks[mesh.group_ranks(self._rank, key[1])]

    def world(self) -> dist.ProcessGroup:
        """The group of the whole world with meshfuse's timeout."""
        world = tuple(range(self._size))
        if world not in self.by_ranks:
            self.by_ranks[world] = self._new_group(world)
        return self.by_ranks[world]

    def agreement(self, ranks: tuple[int, ...] | None = None) -> dist.ProcessGroup:
        """The group for the cross-rank agreement among ``ranks`` (sorted; default the
        world): gloo even beside NCCL (a few bytes, waited for on the host, where a rank can
        read the notice board, and no GPU memory for another NCCL communicator). The world's
        is created by every rank; one of fewer ranks by those ranks only, on first use (this
        rank must be one of them)."""
        backend = "gloo" if dist.is_gloo_available() else None
        if ranks is None or ranks == tuple(range(self._size)):
            if self._agreement is None:
                self._agreement = self._new_group_of(tuple(range(self._size)), backend)
            return self._agreement
        if ranks not in self._agreements:
            with self._translated("creating a process group", ranks):
                self._agreements[ranks] = self._local_group(ranks, backend)
        return self._agreements[ranks]

    def _local_group(self, ranks: tuple[int, ...], backend: str | None) -> dist.ProcessGroup:
        """A group of ``ranks`` that only they create, named after them and the groups'
        generation (torch's own local synchronization names a group by how many groups this
        process holds, which differs between ranks of different stages; and a name used
        again would meet the rendezvous keys of a destroyed group)."""
        c10d = dist.distributed_c10d
        default_backend, store = c10d._world.pg_map[c10d._get_default_group()]
        name = f"meshfuse-agreement-{self.generation}-{'-'.join(map(str, ranks))}"
        group, _ = c10d._new_process_group_helper(
            len(ranks), ranks.index(self._rank), list(ranks), backend or default_backend,
            store, name, timeout=self._timeout)
        c10d._world.pg_group_ranks[group] = {r: i for i, r in enumerate(ranks)}
        return group

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Makes ``timeout`` the timeout of every group, now and later."""
        self._timeout = timeout
        for group in {id(g): g for g in [*self.by_ranks.values(),
                                         *self._agreements.values()]}.values():
            if group is not dist.GroupMember.NON_GROUP_MEMBER:  # a slice without this rank
                dist.distributed_c10d._set_pg_timeout(timeout, group)

    def own(self) -> list[dist.ProcessGroup]:
        """The groups meshfuse created (not torch's default group), each once."""
        groups = [*self.by_ranks.values(), self._agreement, *self._agreements.values()]
        return [g for g in {id(g): g for g in groups if g is not None}.values()
                if g is not dist.group.WORLD]

    def retire(self) -> list[dist.ProcessGroup]:
        """Destroys the groups meshfuse created and forgets every group, so that later calls
        create new ones (never the default group again: see :attr:`world_is_default`).
        Returns the destroyed groups, which the caller keeps until they can be freed
        (:mod:`meshfuse.runtime.comm.retired_groups`)."""
        retired = self.own()
        self.generation += 1
        for group in retired:
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(group)
        self.forget()
        self.world_is_default = False
        return retired

    def forget(self) -> None:
        """Drops this object's references to every group."""
        self.by_ranks.clear()
        self._slicings.clear()
        self._agreement = None
        self._agreements.clear()

    def _check_mesh(self, mesh: DeviceMesh) -> None:
        outside = [d for d in mesh.device_ids if d >= self._size]
        if outside:
            raise CommunicationError(
                f"{mesh!r} has device {outside[0]} but the world has {self._size} processes; "
                f"use devices below {self._size} or launch {max(mesh.device_ids) + 1} processes"
            )

    def _new_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        if ranks == tuple(range(self._size)) and self.world_is_default:
            return dist.group.WORLD
        return self._new_group_of(ranks)

    def _new_group_of(self, ranks: tuple[int, ...], backend: str | None = None
                      ) -> dist.ProcessGroup:
        with self._translated("creating a process group", ranks):
            return dist.new_group(list(ranks), timeout=self._timeout, backend=backend)
