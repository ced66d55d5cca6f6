"""``fd.explain()``: what a compiled fusion does on one rank, in a few readable lines.

The compact view lists, in program order, one line per tensor: its name, global shape, dtype,
mesh, placements (one per mesh axis, as in DTensor: ``S(a)`` sharded on logical axis ``a``,
``S(a)c`` cyclically, ``P`` partial, ``R`` replicated), its local shape on this rank and its
memory order (logical axes, outermost first); then the communications the program will run on
this rank, each with its plan step, its group and the bytes this rank sends in it. Extents
come from the inputs when they are given, else from the definition's static extents; a
symbolic extent is named after the input axis it comes from (``s0``: axis 0 of ``T0``).

``explain(verbose=True)`` adds the domain-level printout (:mod:`meshfuse.ir.printer`).

Example (the README's Megatron MLP on two ranks; rank 0)::

    rank 0 of 2, extents from the definition
      placements: ...
      tensor  global    dtype  mesh    placements  local     memory  defined by
      T0      [8, 16]   Float  [0, 1]  [R]         [8, 16]   [0, 1]  input
      ...
      T5      [8, 16]   Float  [0, 1]  [R]         [8, 16]   [0, 1]  reshard(T6)
    outputs: T5
    communications on rank 0:
      T5 = reshard(T6): allreduce(sum) over mesh axis 0, ranks [0, 1], 512 B
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction

import torch

from meshfuse.errors import MeshfuseError
from meshfuse.ir.fusion import Expr, Fusion, Reshard, partial_reduce_op
from meshfuse.ir.iter_domain import IterDomain, Split
from meshfuse.ir.layout import derived_extents, local_indices, shard_factor
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.placement import placements
from meshfuse.ir.printer import format_call, format_expr
from meshfuse.ir.tensor_view import Allocation, TensorView
from meshfuse.passes.head_alignment import unaligned_head_splits
from meshfuse.passes.layout import memory_positions
from meshfuse.runtime.comm.collectives import Communication
from meshfuse.runtime.comm.reshard_plan import ReshardStep, plan_resharding
from meshfuse.runtime.interpreter.binding import device_coords, held_here

LOCAL_STEPS = ("slice",)  # plan steps that move no data
LEGEND = ("  placements: S(a) sharded on axis a (c: cyclic), P partial, R replicated; "
          "memory: axes outermost first")


@dataclasses.dataclass(frozen=True)
class Size:
    """A count that may involve symbolic extents: ``coefficient * product(symbols)``."""

    coefficient: Fraction
    symbols: tuple[str, ...] = ()

    @staticmethod
    def of(n: int) -> Size:
        return Size(Fraction(n))

    @property
    def static(self) -> int | None:
        """The count, when it involves no symbol."""
        return None if self.symbols else int(self.coefficient)

    def __mul__(self, other: Size) -> Size:
        return Size(self.coefficient * other.coefficient,
                    tuple(sorted(self.symbols + other.symbols)))

    def __str__(self) -> str:
        if not self.symbols:
            return str(int(self.coefficient))
        c = self.coefficient
        text = "*".join(self.symbols)
        if c.numerator != 1:
            text = f"{c.numerator}*{text}"
        return text if c.denominator == 1 else f"{text}/{c.denominator}"


@dataclasses.dataclass(frozen=True)
class PlannedCommunication:
    """One step of a resharding plan as this rank will run it.

    ``ranks`` is the group in coordinate order; ``bytes`` what this rank sends (as
    :func:`~meshfuse.runtime.comm.collectives.record_communications` counts it).
    """

    expr: Expr
    step: ReshardStep
    ranks: tuple[int, ...]
    bytes: Size

    @property
    def moves_data(self) -> bool:
        return self.step.kind not in LOCAL_STEPS

    def communication(self) -> Communication:
        """The record the collective will leave (static extents only)."""
        assert self.bytes.static is not None, "symbolic extents: no byte count yet"
        reduce_op = self.step.reduce_op if self.step.kind in ("allreduce", "reduce_scatter") \
            else None
        return Communication(self.step.kind, self.ranks, self.step.mesh_axis,
                             self.bytes.static, reduce_op)

    def __str__(self) -> str:
        head = f"{short_expr(self.expr)}: {self.step}"
        if not self.moves_data:
            return f"{head} (local, no traffic)"
        return f"{head}, ranks {list(self.ranks)}, {format_bytes(self.bytes)}"


class Extents:
    """Every ID's global extent: known ones (from inputs or the definition) as numbers,
    symbolic ones as names of the input axis they come from."""

    def __init__(self, fusion: Fusion, known: Mapping[IterDomain, int] | None = None):
        self.symbols = _symbol_names(fusion)
        self.known = dict(known) if known is not None else _static_extents(fusion)
        # Stand-ins for symbolic extents that every split divides: plans read the
        # structure of the shards, which does not depend on these values.
        factors = [t.factor for tv in fusion.tensors() for t in tv.transforms
                   if isinstance(t, Split)]
        stand_in = 2 * math.prod(factors)
        self.planning = {i: self.known.get(i, stand_in) for tv in fusion.tensors()
                         for i in tv.logical}
        for tv in fusion.tensors():
            self.planning.update(derived_extents(tv, self.planning))
            if known is None:
                self.known.update(_derived_known(tv, self.known))

    def global_size(self, id_: IterDomain) -> Size:
        if id_ in self.known:
            return Size.of(self.known[id_])
        return Size(Fraction(1), (self.symbols.get(id_, "?"),))

    def local_size(self, tv: TensorView, id_: IterDomain, rank: int) -> Size:
        """The extent of logical ``id_`` of ``tv`` on ``rank`` (a rank of ``tv``'s mesh)."""
        if tv.mesh is None:
            return self.global_size(id_)
        if id_ in self.known and all(i in self.known for i in _split_ids(tv, id_)):
            index = local_indices(tv, id_, self.known, device_coords(tv, rank))
            return self.global_size(id_) if index is None else Size.of(index.numel())
        factor = shard_factor(tv, id_)
        return Size(Fraction(1, factor)) * self.global_size(id_)


def explain(fusion: Fusion, allocations: Mapping[TensorView, Allocation], rank: int,
            world_size: int, extents: Mapping[IterDomain, int] | None = None,
            device: torch.device | None = None) -> str:
    """The compact view of a compiled ``fusion`` on ``rank`` (see the module doc).

    Args:
        fusion: a fusion after the build passes (every tensor scheduled, communications in).
        allocations: every tensor's memory order.
        rank: the rank whose local shapes and communications are shown.
        world_size: the number of ranks the program runs on.
        extents: bound global extents of every ID (from inputs); None: the definition's.
        device: where the rank's tensors live, which decides how a context-parallel
            attention moves and merges its blocks; None: not known (the lines say what each
            kind of device runs).
    """
    sizes = Extents(fusion, extents)
    source = "the inputs" if extents is not None else "the definition"
    lines = [f"rank {rank} of {world_size}, extents from {source}",
             LEGEND]
    lines += _table(_rows(fusion, allocations, sizes, rank))
    lines.append("outputs: " + ", ".join(tv.name for tv in fusion.outputs()))
    lines += [f"  {symbol} = {where}" for symbol, where in _symbol_legend(fusion, sizes)]
    planned = planned_communications(fusion, rank, sizes)
    for strategy in _STRATEGY_COMMUNICATIONS:
        planned += strategy(fusion, rank, sizes, device)
    lines.append(f"communications on rank {rank}:" if planned
                 else f"communications on rank {rank}: none")
    lines += [f"  {p}" for p in planned]
    notes = unaligned_head_splits(fusion)
    if notes:
        lines.append("notes:")
        lines += [f"  {note}" for note in notes]
    return "\n".join(lines)


# A strategy's own communications on a rank (what its steps run besides the fusion's
# reshards), each printed as one line: ``(fusion, rank, sizes, device) -> [planned, ...]``.
StrategyCommunications = Callable[[Fusion, int, "Extents", "torch.device | None"], list]
_STRATEGY_COMMUNICATIONS: list[StrategyCommunications] = []


def register_communications(planned: StrategyCommunications) -> StrategyCommunications:
    """Registers a parallelism's planned communications (registered when its package is
    imported): :func:`explain` lists them after the fusion's own. Returns ``planned``."""
    if planned not in _STRATEGY_COMMUNICATIONS:
        _STRATEGY_COMMUNICATIONS.append(planned)
    return planned


def describe_program(program, outputs: Sequence[TensorView]) -> str:
    """This rank's program for one input signature, its outputs named by the fusion's
    ``outputs`` (``program.outputs`` is in their order) rather than by value slots."""
    lines = [f"program on rank {program.rank}: {len(program.steps)} steps"]
    lines += [f"  {i}: {s.label}" + (f"  # {s.note}" if s.note else "")
              for i, s in enumerate(program.steps)]
    lines += [f"  output {tv.name}: local shape {list(o.shape)}, strides {list(o.strides)}"
              for tv, o in zip(outputs, program.outputs, strict=True)]
    return "\n".join(lines)


def planned_communications(fusion: Fusion, rank: int,
                           sizes: Extents | None = None) -> list[PlannedCommunication]:
    """The resharding steps ``rank`` takes part in, in the order it issues them (the order
    of the fusion's Reshard expressions, each plan's steps in order), local slices included."""
    sizes = sizes or Extents(fusion)
    planned = []
    for expr in fusion.exprs:
        if not isinstance(expr, Reshard):
            continue
        src, dst = expr.args[0], expr.outputs[0]
        if src.mesh is None or not src.logical:
            continue
        shape = [sizes.local_size(src, i, rank) if held_here(src, rank) else None
                 for i in src.materialized()]
        for step in plan_resharding(src, dst, sizes.planning):
            mesh = step.mesh or src.mesh
            if rank not in mesh:
                continue
            shape_before = shape
            shape = _after(step, shape, src, dst, sizes, rank)
            sent = shape if step.kind in ("broadcast", "send_recv") else \
                _padded(step, shape_before, rank)
            count = math.prod(sent, start=Size.of(src.dtype.torch_dtype.itemsize))
            planned.append(PlannedCommunication(expr, step, mesh.group_ranks(rank, step.mesh_axis),
                                                count))
    return planned


def _padded(step: ReshardStep, shape: list[Size], rank: int) -> list[Size]:
    """The shape of what this rank sends in ``step``: its shape before, except that an
    uneven gather sends its part padded to the group's longest, and a reduce-scatter sends
    one such padded part per member (as the collectives pad uneven shards)."""
    if step.kind not in ("allgather", "reduce_scatter") or \
            any(s is None or s.static is None for s in shape):
        return shape
    coords, m = step.before.mesh.coordinate(rank), step.mesh_axis
    spec = step.before if step.kind == "allgather" else step.after
    parts = []
    for c in range(step.before.mesh.shape[m]):
        index = spec.held(coords[:m] + (c,) + coords[m + 1:])[step.axis]
        parts.append(step.before.shape[step.axis] if index is None else index.numel())
    longest = max(parts) * (len(parts) if step.kind == "reduce_scatter" else 1)
    return [Size.of(longest) if a == step.axis else s for a, s in enumerate(shape)]


def _after(step: ReshardStep, shape: list, src: TensorView, dst: TensorView, sizes: Extents,
           rank: int) -> list[Size]:
    """This rank's local shape after ``step``, from its shape before."""
    shape = list(shape)
    if step.kind in ("broadcast", "send_recv"):
        return [sizes.global_size(i) for i in src.materialized()]
    ids = dst.materialized()
    if step.kind in ("allgather", "all_to_all"):
        shape[step.axis] = sizes.global_size(ids[step.axis])
    if step.kind in ("reduce_scatter", "slice"):
        shape[step.axis] = sizes.local_size(dst, ids[step.axis], rank)
    if step.kind == "all_to_all":
        shape[step.to_axis] = sizes.local_size(dst, ids[step.to_axis], rank)
    return shape


def short_expr(expr: Expr) -> str:
    """``expr`` printed, a communication without its placements (the table shows them)."""
    if isinstance(expr, Reshard):
        return f"{expr.outputs[0].name} = reshard({expr.args[0].name})"
    return format_expr(expr)


def _defined_tensors(fusion: Fusion) -> list[tuple[TensorView, str]]:
    """Every tensor in program order, with the op that defines it, printed short."""
    tensors = [(v, "input") for v in fusion.inputs() if isinstance(v, TensorView)]
    for expr in fusion.exprs:
        call = (f"reshard({expr.args[0].name})" if isinstance(expr, Reshard)
                else format_call(expr, skip_defaults=True))
        tensors += [(tv, call if k == 0 else f"{expr.op.name}(...)[{expr.outputs.index(tv)}]")
                    for k, tv in enumerate(expr.tensor_outputs)]
    return tensors


def _rows(fusion: Fusion, allocations, sizes: Extents, rank: int) -> list[list[str]]:
    rows = [["tensor", "global", "dtype", "mesh", "placements", "local", "memory", "defined by"]]
    for tv, defined_by in _defined_tensors(fusion):
        ids = tv.materialized()
        held = held_here(tv, rank)
        local = _shape(sizes.local_size(tv, i, rank) for i in ids) if held else "-"
        rows.append([
            tv.name, _shape(sizes.global_size(i) for i in ids), tv.dtype.name,
            "-" if tv.mesh is None else _mesh(tv.mesh),
            "-" if tv.mesh is None else "[" + ", ".join(map(str, placements(
                tv, partial_reduce_op(tv)))) + "]",
            local, str(memory_order(tv, allocations[tv])), defined_by,
        ])
    return rows


def explain_unbuilt(fusion: Fusion, rank: int, world_size: int, stage: str,
                    reason: Exception) -> str:
    """What can be shown of a fusion whose build failed: each tensor with the mesh and
    placements its build had decided when it stopped (``stage`` says where), and the reason.
    A tensor not scheduled yet shows ``-``; one whose placements cannot be read, ``?``."""
    try:
        global_size = Extents(fusion).global_size
    except MeshfuseError:  # a schedule the failed pass left half-made: the definition's
        def global_size(id_: IterDomain) -> str:
            return "?" if id_.extent is None else str(id_.extent)
    rows = [["tensor", "global", "dtype", "mesh", "placements", "defined by"]]
    for tv, defined_by in _defined_tensors(fusion):
        try:
            where = "-" if tv.mesh is None else "[" + ", ".join(map(str, placements(
                tv, partial_reduce_op(tv)))) + "]"
        except MeshfuseError:
            where = "?"
        rows.append([tv.name, _shape(global_size(i) for i in tv.materialized()),
                     tv.dtype.name, "-" if tv.mesh is None else _mesh(tv.mesh), where,
                     defined_by])
    lines = [(f"rank {rank} of {world_size}: the fusion cannot be built; its tensors as the "
             f"build left them ({stage}, '-': not decided)"), *_table(rows),
             "outputs: " + ", ".join(tv.name for tv in fusion.outputs()),
             f"not built: {type(reason).__name__}: {reason}"]
    return "\n".join(lines)


def memory_order(tv: TensorView, allocation: Allocation) -> list[int]:
    """``tv``'s logical axes (reductions excluded) from outermost to innermost in memory."""
    positions = memory_positions(tv, allocation)
    ids = tv.materialized()
    return sorted(range(len(ids)), key=lambda a: positions.get(ids[a], a))


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
            for r in rows]


def _shape(sizes) -> str:
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def _mesh(mesh: DeviceMesh) -> str:
    return repr(mesh).removeprefix("DeviceMesh(").removesuffix(")")


def format_bytes(size: Size) -> str:
    n = size.static
    if n is None:
        return f"{size} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n} B ({n / scale:.3g} {unit})"
    return f"{n} B"


def _symbol_names(fusion: Fusion) -> dict[IterDomain, str]:
    """``s0``, ``s1``, ... for the symbolic axes of the inputs, in input order, carried to
    every ID the domain maps equate with them."""
    names: dict[IterDomain, str] = {}
    for tv in (v for v in fusion.inputs() if isinstance(v, TensorView)):
        for id_ in tv.materialized():
            if id_.extent is None and not id_.is_broadcast:
                names[id_] = f"s{len(names)}"
    for expr in fusion.exprs:
        for out_id, sources in expr.id_map.items():
            named = [names[s] for s in sources if s in names]
            if out_id.extent is None and named and out_id not in names:
                names[out_id] = named[0]
    return names


def _symbol_legend(fusion: Fusion, sizes: Extents) -> list[tuple[str, str]]:
    legend = []
    for tv in (v for v in fusion.inputs() if isinstance(v, TensorView)):
        for axis, id_ in enumerate(tv.materialized()):
            symbol = sizes.symbols.get(id_)
            if symbol is not None and id_ not in sizes.known and symbol not in dict(legend):
                legend.append((symbol, f"axis {axis} of {tv.name} (symbolic)"))
    return legend


def _static_extents(fusion: Fusion) -> dict[IterDomain, int]:
    return {i: i.extent for tv in fusion.tensors() for i in tv.logical if i.extent is not None}


def _derived_known(tv: TensorView, known: Mapping[IterDomain, int]) -> dict[IterDomain, int]:
    """The extents of ``tv``'s split IDs whose logical ID is known."""
    if all(i in known for i in tv.logical):
        return derived_extents(tv, known)
    partial = {i: n for i, n in known.items() if i in tv.logical}
    result = {}
    for t in tv.transforms:
        if isinstance(t, Split) and t.in_id in partial:
            n = partial[t.in_id]
            rest = -(-n // t.factor)
            partial[t.outer], partial[t.inner] = (
                (rest, t.factor) if t.inner_split else (t.factor, rest))
            result.update({t.outer: partial[t.outer], t.inner: partial[t.inner]})
    return result


def _split_ids(tv: TensorView, id_: IterDomain) -> list[IterDomain]:
    """The IDs split (directly or not) from ``id_``."""
    found, frontier = [], {id_}
    for t in tv.transforms:
        if isinstance(t, Split) and t.in_id in frontier:
            frontier |= {t.outer, t.inner}
            found += [t.outer, t.inner]
    return found
