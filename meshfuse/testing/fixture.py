"""``MultideviceTest``: what the ``multidevice_test`` fixture gives a multi-device test."""

from __future__ import annotations

import torch

from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.passes.pipeline import compiled_for
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.sharding import shard_tensor, unshard_tensor


class MultideviceTest:
    """This process's view of a multi-device test: its rank, device, and sharding helpers.

    Every rank runs the test body; ``size`` is the world size the test runs at.

    Example:
        >>> def test_shard(multidevice_test):
        ...     t = torch.arange(4 * multidevice_test.size)
        ...     local = multidevice_test.shard_tensor(t, 0)
        ...     assert local.tolist() == [4 * multidevice_test.rank + i for i in range(4)]
    """

    def __init__(self, communicator: Communicator) -> None:
        self._communicator = communicator

    @property
    def communicator(self) -> Communicator:
        """The process's :class:`~meshfuse.runtime.comm.communicator.Communicator`."""
        return self._communicator

    @property
    def size(self) -> int:
        """The world size."""
        return self._communicator.size

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._communicator.rank

    @property
    def local_size(self) -> int:
        """The number of processes on this host."""
        return self._communicator.local_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its host."""
        return self._communicator.local_rank

    @property
    def device(self) -> torch.device:
        """This process's device (its GPU with NCCL, else the CPU)."""
        return self._communicator.device

    def shard_tensor(
        self, t: torch.Tensor, dim_or_tensorview: object, mesh: DeviceMesh | None = None
    ) -> torch.Tensor:
        """This rank's shard of the global tensor ``t``, on :attr:`device`.

        Args:
            t: the global (unsharded) tensor, the same on every rank.
            dim_or_tensorview: an int: the block shard of that axis along ``mesh_x`` of
                ``mesh`` (:meth:`DeviceMesh.shard_tensor`); a meshfuse TensorView: the shard
                its schedule gives this rank (``meshfuse.sharding.shard_tensor``).
            mesh: with an int only; defaults to ``DeviceMesh(range(size))``.
        """
        if _is_dim(dim_or_tensorview):
            mesh = self._mesh(mesh)
            local = mesh.shard_tensor(t, dim_or_tensorview, ParallelType.mesh_x, self.rank)
        else:

            _no_mesh_with_tensorview(mesh, "shard_tensor")
            local = shard_tensor(t, dim_or_tensorview, self.rank)
        return local.to(self.device)

    def unshard_tensor(
        self, t: torch.Tensor, dim_or_tensorview: object, mesh: DeviceMesh | None = None
    ) -> torch.Tensor:
        """The global tensor whose shards the ranks hold as ``t``; a collective over ``mesh``.

        Args:
            t: this rank's shard; every rank of the mesh must call this.
            dim_or_tensorview: an int: ``t`` is the block shard of that axis along ``mesh_x``
                of ``mesh`` (ranks that differ only on other mesh axes hold replicas); a
                meshfuse TensorView: the shards of every device of its mesh are gathered and
                passed to ``meshfuse.sharding.unshard_tensor`` (shards of an uneven split may
                have different shapes).
            mesh: with an int only; defaults to ``DeviceMesh(range(size))``.
        """
        if _is_dim(dim_or_tensorview):
            mesh = self._mesh(mesh)
            shards = self._communicator.allgather(t.to(self.device), mesh, ParallelType.mesh_x)
            return torch.cat(shards, dim=dim_or_tensorview)

        _no_mesh_with_tensorview(mesh, "unshard_tensor")
        tv = compiled_for(dim_or_tensorview.fusion)[dim_or_tensorview]  # its sharding as run
        if tv.mesh is None:
            return unshard_tensor([t], tv)
        # Every device's shard, in the order of the mesh's device ids.
        flat = DeviceMesh(tv.mesh.device_ids)
        return unshard_tensor(self._allgather_shapes(t.to(self.device), flat), tv)

    def _allgather_shapes(self, t: torch.Tensor, mesh: DeviceMesh) -> list[torch.Tensor]:
        """Every device's ``t`` over a 1-D ``mesh``, shapes allowed to differ: the shapes are
        gathered first, then the tensors padded to the largest."""
        shape = torch.tensor(t.shape, dtype=torch.int64, device=self.device)
        shapes = [s.tolist() for s in self._communicator.allgather(shape, mesh, 0)]
        largest = [max(s[a] for s in shapes) for a in range(t.ndim)]
        padded = t.new_zeros(largest)
        padded[tuple(slice(0, n) for n in t.shape)] = t
        gathered = self._communicator.allgather(padded, mesh, 0)
        return [g[tuple(slice(0, n) for n in s)] for g, s in zip(gathered, shapes)]

    def _mesh(self, mesh: DeviceMesh | None) -> DeviceMesh:
        return DeviceMesh(range(self.size)) if mesh is None else mesh


def _is_dim(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_mesh_with_tensorview(mesh: DeviceMesh | None, method: str) -> None:
    if mesh is not None:
        raise TypeError(
            f"{method}: a TensorView carries its own mesh; pass mesh only with an int dim"
        )
