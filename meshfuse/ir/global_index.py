"""Where a rank's local elements sit in the global tensor.

Ops whose values depend on the *global* position of an element (random numbers drawn per
element, attention dropout masks) read a :class:`GlobalIndex` of their output: per materialized
logical axis, its global extent and the ascending global indices this rank holds on it. The
global linear index of each local element follows, so a value computed from it is the same
whatever the sharding (block, cyclic, uneven, several mesh axes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.layout import local_indices
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.ir.tensor_view import TensorView


@dataclasses.dataclass(frozen=True)
class GlobalIndex:
    """The global positions of one rank's local elements of a tensor.

    Attributes:
        extents: global extent of each materialized logical axis.
        indices: per axis, the global indices held here (ascending, int64, on the CPU), or
            None when this rank holds the whole axis.

    Example:
        >>> gi = GlobalIndex((4, 6), (torch.tensor([2, 3]), None))  # rows 2..3 of a [4, 6]
        >>> gi.local_shape, gi.starts
        ((2, 6), (2, 0))
        >>> gi.linear()[0, :3].tolist()
        [12, 13, 14]
    """

    extents: tuple[int, ...]
    indices: tuple[torch.Tensor | None, ...]

    @staticmethod
    def whole(extents) -> GlobalIndex:
        """The index of an unsharded tensor of global shape ``extents``."""
        extents = tuple(int(e) for e in extents)
        return GlobalIndex(extents, (None,) * len(extents))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(n if i is None else len(i) for n, i in zip(self.extents, self.indices))

    @property
    def starts(self) -> tuple[int, ...]:
        """The first global index held on each axis (the extent for an axis held empty)."""
        return tuple(0 if i is None else (int(i[0]) if len(i) else n)
                     for n, i in zip(self.extents, self.indices))

    def axis(self, axis: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global indices held on ``axis``, as an int64 tensor on ``device``."""
        held = self.indices[axis]
        if held is None:
            return torch.arange(self.extents[axis], device=device)
        return held.to(device)

    def linear(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The row-major global linear index of every local element (int64, local shape)."""
        shape = self.local_shape
        result = torch.zeros(shape, dtype=torch.int64, device=device)
        for a, n in enumerate(self.extents):
            stride = math.prod(self.extents[a + 1:])
            view = [1] * len(shape)
            view[a] = shape[a]
            result += (self.axis(a, device) * stride).view(view)
        return result

    def describe(self, names=None) -> str:
        """``b 0..1, h 2..3, s all 16``: the held index range of each axis, named by
        ``names`` (a sequence of strings; default ``a, b, c, ...``)."""
        names = names or [chr(ord("a") + a) for a in range(len(self.extents))]
        parts = []
        for name, n, held in zip(names, self.extents, self.indices):
            if held is None:
                parts.append(f"{name} all {n}")
            elif len(held) == 0:
                parts.append(f"{name} none")
            elif int(held[-1]) - int(held[0]) + 1 == len(held):
                parts.append(f"{name} {int(held[0])}..{int(held[-1])}")
            else:
                parts.append(f"{name} {len(held)} of {n} from {int(held[0])}")
        return ", ".join(parts)


def global_index(tv: TensorView, extents: Mapping[IterDomain, int],
                 coords: Mapping[ParallelType, int]) -> GlobalIndex:
    """The :class:`GlobalIndex` of ``tv`` on the device at ``coords`` (its coordinate on the
    mesh axis of each device parallel type), given every ID's global extent."""
    ids = tv.materialized()
    return GlobalIndex(
        tuple(extents[i] for i in ids),
        tuple(local_indices(tv, i, extents, coords) for i in ids),
    )
