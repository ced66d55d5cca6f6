"""``TensorView``: a tensor of a fusion, with its domains and its schedule.

A TensorView has:

- a **logical domain**: one IterDomain per axis, with the *global* extent;
- a **loop domain**: the logical domain after the schedule's splits, merges and reorders;
  each loop ID is executed serially or over a mesh axis (:class:`ParallelType`);
- an **allocation domain** (optional here): the memory order and contiguity of the local
  buffer; when absent, a pass derives it (see ``meshfuse.passes.layout``);
- a **device mesh**, or none for a single-device tensor.

The scheduling methods check what they can when called and raise :class:`ScheduleError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from meshfuse.dtypes import DataType
from meshfuse.errors import ScheduleError
from meshfuse.ir.iter_domain import (
    IterDomain,
    Split,
    Transform,
    format_id,
    merge_ids,
    split_ids,
)
from meshfuse.ir.memory_type import MemoryType
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType

if TYPE_CHECKING:
    from meshfuse.ir.fusion import Expr, Fusion


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The memory order of a local buffer, outermost first, and each ID's contiguity.

    ``contiguity[i]`` is ``True`` when ID ``i``'s stride is the product of the local extents
    inside it, ``False`` when it may be larger, and ``None`` for broadcast IDs (any stride).
    """

    ids: tuple[IterDomain, ...]
    contiguity: tuple[bool | None, ...]


class Val:
    """A value of a fusion: a :class:`TensorView` or a :class:`Scalar`."""

    name: str
    definition: Expr | None = None

    def copy_into(self, fusion: Fusion) -> Val:
        """This value for a copy of its fusion: same name, dtype and schedule, no definition
        (the copied expression sets it)."""
        raise NotImplementedError


class Scalar(Val):
    """A scalar of a fusion: a constant (``value`` set) or an input bound at execute time."""

    def __init__(self, dtype: DataType, value=None):
        self.dtype = dtype
        self.value = value
        self.name = "S?"

    @property
    def is_constant(self) -> bool:
        return self.value is not None

    def copy_into(self, fusion: Fusion) -> Scalar:
        new = Scalar(self.dtype, self.value)
        new.name = self.name
        return new


class Axis:
    """A handle on one loop (or logical) IterDomain of a tensor, as returned by ``tv.axis(i)``.

    It reads as an IterDomain (``extent``, ``parallel_type``) and parallelizes it in place.
    """

    def __init__(self, tv: TensorView, id_: IterDomain):
        self.tv = tv
        self.id = id_

    @property
    def extent(self) -> int | None:
        return self.id.extent

    @property
    def parallel_type(self) -> ParallelType:
        return self.tv.parallel_type(self.id)

    def parallelize(self, parallel_type: ParallelType) -> None:
        self.tv.parallelize(self.tv.loop.index(self.id), parallel_type)

    def is_reduction(self) -> bool:
        return self.id.is_reduction

    def is_broadcast(self) -> bool:
        return self.id.is_broadcast

    def __repr__(self) -> str:
        return format_id(self.id, self.parallel_type)


class TensorView(Val):
    """A tensor of a fusion. Created by ``define_tensor`` or by an op; see the module doc."""

    def __init__(
        self,
        fusion: Fusion,
        logical: Sequence[IterDomain],
        dtype: DataType,
        allocation: Allocation | None = None,
    ):
        self.fusion = fusion
        self.logical: tuple[IterDomain, ...] = tuple(logical)
        # materialized()'s answer, with the logical domain it was read from (asked often).
        self._materialized: tuple[tuple | None, tuple[IterDomain, ...]] = (None, ())
        self.dtype = dtype
        self.loop: list[IterDomain] = list(self.logical)
        self.transforms: list[Transform] = []
        self.parallel: dict[IterDomain, ParallelType] = {}
        # Loop IDs in ring order over a mesh axis (swizzle1d): stream chunk i on the device at
        # coordinate c of that axis is block (i + c) mod d.
        self.swizzles: dict[IterDomain, ParallelType] = {}
        self.memory_type = MemoryType.global_
        # Decompose the communication next to this tensor's GEMM into a stream loop: True
        # forces it, False forbids it, None leaves it to the cost estimate.
        self.overlap: bool | None = None
        self.allocation = allocation
        self.mesh: DeviceMesh | None = None
        # A 0-d fusion input that stays on the CPU beside GPU inputs (define_tensor(is_cpu=True)).
        self.is_cpu = False
        self.name = "T?"

    def copy_into(self, fusion: Fusion) -> TensorView:
        new = TensorView(fusion, self.logical, self.dtype, self.allocation)
        new.loop = list(self.loop)
        new.transforms = list(self.transforms)
        new.parallel = dict(self.parallel)
        new.swizzles = dict(self.swizzles)
        new.memory_type = self.memory_type
        new.overlap = self.overlap
        new.mesh = self.mesh
        new.name = self.name
        return new

    # ----- reading -----------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of materialized logical axes (reduction IDs are not materialized)."""
        return len(self.materialized())

    def materialized(self) -> tuple[IterDomain, ...]:
        """The logical IDs a local tensor has an axis for: all but reduction IDs."""
        logical, materialized = self._materialized
        if logical is not self.logical:  # read again for a new logical domain (rfactor)
            materialized = tuple(i for i in self.logical if not i.is_reduction)
            self._materialized = (self.logical, materialized)
        return materialized

    def parallel_type(self, id_: IterDomain) -> ParallelType:
        return self.parallel.get(id_, ParallelType.Serial)

    def axis(self, i: int) -> Axis:
        """The loop ID at position ``i`` (negative counts from the end)."""
        return Axis(self, self.loop[self._loop_pos(i)])

    def get_loop_domain(self) -> list[Axis]:
        return [Axis(self, i) for i in self.loop]

    def get_logical_domain(self) -> list[Axis]:
        return [Axis(self, i) for i in self.logical]

    def get_allocation_domain(self) -> list[Axis] | None:
        return None if self.allocation is None else [Axis(self, i) for i in self.allocation.ids]

    @property
    def is_scheduled(self) -> bool:
        """True once the user gave this tensor a mesh or any schedule."""
        return self.mesh is not None or bool(self.transforms) or bool(self.parallel)

    # ----- scheduling --------------------------------------------------------------------
    def set_device_mesh(self, mesh: DeviceMesh) -> None:
        """Places this tensor on ``mesh``; without a parallelized axis it is replicated."""
        if not isinstance(mesh, DeviceMesh):
            raise ScheduleError(f"{self.name}.set_device_mesh expects a DeviceMesh, got {mesh!r}")
        self.mesh = mesh

    def split(self, axis: int, factor: int, inner_split: bool = True,
              zigzag: bool = False) -> TensorView:
        """Splits loop ID ``axis`` in two.

        With ``inner_split=True`` the inner ID has extent ``factor``; with ``False`` the outer
        one does. Example, outer split of axis 1 by 2: ``[iB{2}, iH{12}]`` becomes
        ``[iB{2}, i{2}, i{6}]``. ``factor`` need not divide the extent: the other part gets
        ``ceil(extent / factor)``, and a device-parallel part shards the axis unevenly as
        DTensor's ``Shard`` does (12 over 5 devices: 3, 3, 3, 3, 0; see ``ir/layout.py``).
        """
        pos = self._loop_pos(axis)
        old = self.loop[pos]
        if not isinstance(factor, int) or isinstance(factor, bool) or factor <= 0:
            raise ScheduleError(
                f"split of axis {axis} of {self.name}: factor must be a positive int, "
                f"got {factor!r}"
            )
        if old in self.parallel:
            raise ScheduleError(
                f"axis {axis} of {self.name} is already parallelized on "
                f"{self.parallel[old].value}; split it before parallelizing"
            )
        if zigzag:
            self._check_zigzag(axis, old, factor, inner_split)
        record = split_ids(old, factor, inner_split, zigzag)
        self.transforms.append(record)
        self.loop[pos : pos + 1] = [record.outer, record.inner]
        return self

    def outer_split(self, axis: int, factor: int) -> TensorView:
        """``split(axis, factor, inner_split=False)``: the outer ID has extent ``factor``."""
        return self.split(axis, factor, inner_split=False)

    def zigzag_split(self, axis: int, factor: int) -> TensorView:
        """An outer split into ``factor`` head-tail pairs of ``2 * factor`` equal chunks:
        outer index ``o`` holds chunks ``o`` and ``2 * factor - 1 - o`` (the load-balanced
        layout of a causal attention's sequence). Example, ``zigzag_split(2, 2)`` of a
        sequence of 8: outer 0 holds rows 0, 1, 6, 7 and outer 1 rows 2, 3, 4, 5. The extent
        must be a multiple of ``2 * factor``."""
        return self.split(axis, factor, inner_split=False, zigzag=True)

    def _check_zigzag(self, axis: int, old, factor: int, inner_split: bool) -> None:
        if inner_split:
            raise ScheduleError(f"split of axis {axis} of {self.name}: a zig-zag split is an "
                                "outer split; pass inner_split=False (or use zigzag_split)")
        if old.extent is not None and old.extent % (2 * factor):
            raise ScheduleError(
                f"zig-zag split of axis {axis} of {self.name}: extent {old.extent} is not a "
                f"multiple of 2 * {factor} (the head-tail chunks must be equal); choose a "
                f"length divisible by {2 * factor} or use outer_split")

    def inner_split(self, axis: int, factor: int) -> TensorView:
        """``split(axis, factor, inner_split=True)``: the inner ID has extent ``factor``."""
        return self.split(axis, factor, inner_split=True)

    def merge(self, axis_outer: int, axis_inner: int | None = None) -> TensorView:
        """Merges loop IDs ``axis_outer`` and ``axis_inner`` (default ``axis_outer + 1``),
        which must be adjacent, into one ID at ``axis_outer``'s position."""
        outer = self._loop_pos(axis_outer)
        inner = outer + 1 if axis_inner is None else self._loop_pos(axis_inner)
        if inner != outer + 1:
            raise ScheduleError(
                f"merge of {self.name}: axes {axis_outer} and {axis_inner} are not adjacent; "
                "reorder them next to each other first"
            )
        for pos in (outer, inner):
            if self.loop[pos] in self.parallel:
                raise ScheduleError(
                    f"merge of {self.name}: loop axis {pos} is parallelized; merge before "
                    "parallelizing"
                )
        record = merge_ids(self.loop[outer], self.loop[inner])
        self.transforms.append(record)
        self.loop[outer : inner + 1] = [record.out]
        return self

    def reorder(self, old_to_new: Mapping[int, int]) -> TensorView:
        """Permutes the loop domain: ``{old: new}`` moves loop ID ``old`` to position ``new``;
        the IDs not named keep their relative order in the remaining positions.

        Example: ``[iB, iDIDx, iH, iS, iE]`` with ``{2: 3, 3: 2}`` gives ``[iB, iDIDx, iS, iH, iE]``.
        """
        n = len(self.loop)
        moves = {self._loop_pos(o): self._loop_pos(p) for o, p in dict(old_to_new).items()}
        if len(set(moves.values())) != len(moves):
            raise ScheduleError(
                f"reorder of {self.name}: {dict(old_to_new)} sends two axes to one position"
            )
        order: list[IterDomain | None] = [None] * n
        for old, new in moves.items():
            order[new] = self.loop[old]
        rest = iter(i for pos, i in enumerate(self.loop) if pos not in moves)
        self.loop = [slot if slot is not None else next(rest) for slot in order]
        return self

    def parallelize(self, axis: int, parallel_type: ParallelType) -> TensorView:
        """Executes loop ID ``axis`` as ``parallel_type`` (``Serial`` undoes it).

        A device type shards the tensor over that mesh axis; each device type can be used
        once per tensor among its iteration IDs, and once among its reduction IDs (a
        reduction over the devices whose result is sharded: a reduce-scatter). A broadcast
        ID (extent 1) may be parallelized only over a mesh axis of one device (checked with
        the mesh, as any extent); it holds its one element there.
        """
        pos = self._loop_pos(axis)
        id_ = self.loop[pos]
        if not isinstance(parallel_type, ParallelType):
            raise ScheduleError(
                f"parallelize of axis {axis} of {self.name}: expected a ParallelType, got "
                f"{parallel_type!r}"
            )
        if parallel_type.is_device:
            devices = self._devices_along(parallel_type)
            if id_.is_broadcast and devices not in (None, 1):
                raise ScheduleError(
                    f"axis {axis} of {self.name} is a broadcast axis (extent 1) and cannot be "
                    f"sharded over {parallel_type.value}, a mesh axis of {devices} devices; "
                    "parallelize it only over a mesh axis of one device, or shard the tensor "
                    "it is broadcast against"
                )
            for other, pt in self.parallel.items():
                # A reduction ID and an iteration ID may share a device type: the reduction
                # crosses the devices and each keeps its shard of the result (a
                # reduce-scatter, written nvFuser's way).
                if pt is parallel_type and other is not id_ and \
                        other.is_reduction == id_.is_reduction:
                    raise ScheduleError(
                        f"{parallel_type.value} is used twice in {self.name} (axes "
                        f"{self._describe_pos(other)} and {pos}); a device parallel type shards "
                        "one axis per tensor: use another mesh axis (mesh_y, mesh_z)"
                    )
        if parallel_type is ParallelType.Serial:
            self.parallel.pop(id_, None)
        else:
            self.parallel[id_] = parallel_type
        return self

    def swizzle1d(self, axis: int, parallel_type: ParallelType) -> TensorView:
        """Visits loop ID ``axis`` in ring order over the mesh axis of ``parallel_type``
        (nvFuser's ``swizzle1d``): once ``axis`` is parallelized on ``ParallelType.stream``,
        chunk ``i`` on the device at coordinate ``c`` of that mesh axis works on block
        ``(i + c) mod d``, so an allgather feeding the loop becomes point-to-point transfers
        (a collective permute) instead of one broadcast per chunk. The domain is unchanged:
        ``[iDIDx{d}, i{n/d}]`` -> ``outer_split(0, d)`` -> ``swizzle1d(0, mesh_x)`` ->
        ``[iStream{d}, i{n/d}]`` once parallelized, with the chunk order swizzled.
        """
        if not isinstance(parallel_type, ParallelType) or not parallel_type.is_device:
            raise ScheduleError(
                f"swizzle1d of axis {axis} of {self.name}: expected a device parallel type "
                f"(ParallelType.mesh_x, mesh_y or mesh_z), got {parallel_type!r}"
            )
        self.swizzles[self.loop[self._loop_pos(axis)]] = parallel_type
        return self

    def set_overlap(self, enabled: bool | None) -> TensorView:
        """Whether the allgather feeding, or the reduce-scatter or allreduce following, a
        GEMM that reads or writes this tensor runs decomposed as a stream-parallel loop (one
        chunk per device, or row chunks for an allreduce; see ``docs/overlap.md``): ``True``
        always, ``False`` never, ``None`` (the default) when the cost estimate says it is
        faster."""
        if enabled not in (True, False, None):
            raise ScheduleError(f"set_overlap of {self.name}: expected True, False or None, "
                                f"got {enabled!r}")
        self.overlap = enabled
        return self

    def set_memory_type(self, memory_type: MemoryType) -> TensorView:
        """Allocates this tensor in ``memory_type`` (nvFuser's ``set_memory_type``); see
        :mod:`meshfuse.ir.memory_type` for what ``MemoryType.symmetric`` does here."""
        if not isinstance(memory_type, MemoryType):
            raise ScheduleError(f"set_memory_type of {self.name}: expected a MemoryType, got "
                                f"{memory_type!r}")
        self.memory_type = memory_type
        return self

    def set_allocation_domain(
        self, ids: Iterable[Axis | IterDomain], contiguity: bool | Sequence[bool | None] = True
    ) -> TensorView:
        """Sets the memory order of the local buffer, outermost first.

        ``ids`` are IDs of this tensor (loop, logical, or between them) that together cover
        each materialized logical axis once. ``contiguity`` is one flag for all or one per ID.
        """
        id_list = [i.id if isinstance(i, Axis) else i for i in ids]
        if isinstance(contiguity, bool):
            contig = tuple(None if i.is_broadcast else contiguity for i in id_list)
        else:
            contig = tuple(contiguity)
        if len(contig) != len(id_list):
            raise ScheduleError(
                f"set_allocation_domain of {self.name}: {len(id_list)} IDs but "
                f"{len(contig)} contiguity flags; give one per ID"
            )
        self.allocation = Allocation(tuple(id_list), contig)
        check_allocation(self)
        return self

    def set_allocation_as_loop(self) -> TensorView:
        """Makes the allocation domain the current loop domain (all contiguous)."""
        return self.set_allocation_domain(
            [i for i in self.loop if not i.is_reduction], contiguity=True
        )

    # ----- helpers -----------------------------------------------------------------------
    def _loop_pos(self, axis: int) -> int:
        n = len(self.loop)
        if not isinstance(axis, int) or not -n <= axis < n:
            raise ScheduleError(
                f"axis {axis!r} is out of range for {self.name}, whose loop domain has {n} axes"
            )
        return axis % n

    def _devices_along(self, parallel_type: ParallelType) -> int | None:
        """The size of the mesh axis of ``parallel_type``, or None while unknown (no mesh
        yet, or one without that axis: the schedule check reports it)."""
        if self.mesh is None:
            return None
        try:
            return self.mesh.axis_size(parallel_type)
        except (ScheduleError, ValueError):
            return None

    def _describe_pos(self, id_: IterDomain) -> int | str:
        return self.loop.index(id_) if id_ in self.loop else repr(id_)

    def __repr__(self) -> str:
        """One line: ``T3[iS{2}, iDIDx{2}, iS{4}] Float mesh=DeviceMesh([0, 1])``, the loop
        domain; ``meshfuse.ir.printer.format_tensor`` prints every domain."""
        ids = ", ".join(format_id(i, self.parallel_type(i)) for i in self.loop)
        mesh = "" if self.mesh is None else f" mesh={self.mesh!r}"
        return f"{self.name}[{ids}] {self.dtype.name}{mesh}"


def check_allocation(tv: TensorView) -> None:
    """The allocation domain covers each materialized logical axis exactly once.

    For one logical axis, the allocation may hold the logical ID itself or any complete set
    of the IDs it was split into (e.g. ``[DIDx{d}, i{h/d}]``), in any positions.
    """
    assert tv.allocation is not None
    ids = list(tv.allocation.ids)
    if len(set(ids)) != len(ids):
        raise ScheduleError(f"the allocation domain of {tv.name} names an ID twice")
    chosen = set(ids)
    frontier = {i for i in tv.logical if not i.is_reduction}
    for t in tv.transforms:
        if isinstance(t, Split) and t.in_id in frontier and t.in_id not in chosen:
            frontier.remove(t.in_id)
            frontier.update(t.outputs)
        elif not isinstance(t, Split) and t.outer in frontier and t.inner in frontier and \
                t.outer not in chosen and t.inner not in chosen:
            frontier -= {t.outer, t.inner}
            frontier.add(t.out)
    if frontier != chosen:
        missing = [i for i in frontier - chosen]
        extra = [i for i in chosen - frontier]
        raise ScheduleError(
            f"the allocation domain of {tv.name} must cover each logical axis exactly once; "
            f"missing {[format_id(i) for i in missing]}, not part of {tv.name} or covered twice "
            f"{[format_id(i) for i in extra]}. Use set_allocation_as_loop() or list IDs of "
            "this tensor's loop domain"
        )
