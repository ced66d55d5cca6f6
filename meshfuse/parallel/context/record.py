"""Context parallelism for ``sdpfa_fwd``/``sdpfa_bwd``: the record of a sequence-sharded
attention (the per-block arithmetic its strategies share is in
:mod:`meshfuse.parallel.context.blocks`).

When q, k and v are sharded on their sequence axis over one mesh axis, each rank holds some
query rows and the key/value rows of the same positions (of another length in cross
attention: the same split of the key sequence). Attention then runs with one of
three *strategies* (:data:`STRATEGIES`), chosen at compile time by
:mod:`meshfuse.parallel.context.planning` and forceable with the op's ``context_parallel``
argument:

- ``"ring"``: key/value blocks travel around the ranks of the mesh axis by point-to-point
  send/recv; at each step a rank computes its query rows against the block it holds (the
  machine's fastest kernel, one call per pair of contiguous row runs) and merges the partial
  outputs by their log-sum-exp. The backward passes k/v and their gradient accumulators the
  same way, with accumulators of their dk/dv that go home at the end.
- ``"allgather"``: k and v are gathered (a communication in the fusion, as for any axis an op
  needs whole); each rank computes its own query rows against all keys.
- ``"alltoall"`` (DeepSpeed Ulysses): q, k and v go from sequence-sharded to head-sharded
  by all-to-all, attention runs on whole sequences, and the output comes back.

A ring attention's step carries a :class:`ContextParallel` record (its strategy, mesh axis,
ranks, this rank's position and which global query and key rows every position holds),
printed in the program and in ``explain``. A split's layout decides the rows: a block split
gives one run per position; the head-tail (zig-zag) layout gives two, chunk ``r`` and chunk
``2n - 1 - r``, which balances causal work.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os

import torch

from meshfuse.errors import DefinitionError
from meshfuse.ir.layout import device_ids, local_extent, split_indices
from meshfuse.ops.attention.groups import replicated_kv_axes
from meshfuse.ops.attention.sequence import (
    ALLGATHER,
    AUTO,
    RING,
    argument,
    sequence_parallel,
)
from meshfuse.passes.localization import register_local_attrs

Run = tuple[int, int]  # global rows [start, stop) of one contiguous piece of a shard

OWN_PARTS_VAR = "MESHFUSE_CP_OWN_PARTS"  # parts of a ring backward's own block (2)
TRANSPORT_VAR = "MESHFUSE_CP_TRANSPORT"  # how the ring's blocks travel (TRANSPORTS)
MERGE_VAR = "MESHFUSE_CP_MERGE"  # how the forward merges its blocks' outputs (MERGES)
NCCL, COPY_ENGINE = "nccl", "copy_engine"
EAGER, COMPILED = "eager", "compiled"
TRANSPORTS = (NCCL, COPY_ENGINE, AUTO)
MERGES = (EAGER, COMPILED, AUTO)
DEFAULT_TRANSPORT, DEFAULT_MERGE = AUTO, AUTO  # CUDA: copy engines (equal blocks), compiled


def runs_of(rows: torch.Tensor) -> tuple[Run, ...]:
    """The maximal contiguous runs ``[start, stop)`` of ascending global row indices."""
    runs: list[list[int]] = []
    for i in rows.tolist():
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return tuple((a, b) for a, b in runs)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """One rank's part of a ring attention (a local attribute of its program step).

    Attributes:
        strategy: ``"ring"``.
        mesh_axis: the mesh axis the sequence is sharded over.
        ranks: the ranks along it, by coordinate (the ring's order).
        position: this rank's coordinate on it.
        rows: for each position, the runs of global sequence rows it holds (queries, and
            keys too unless ``key_rows`` is given).
        backward: the record of an ``sdpfa_bwd`` (k/v and their gradients travel).
        own_parts: in how many equal parts of the batch axis (of the heads when the batch
            is 1) a ring backward computes its queries against its own key/value block: the
            first part while the first k/v transfer runs, the others after the last step,
            while the finished dk/dv sums travel home.
        key_rows: for each position, the runs of global key/value rows it holds when the key
            sequence has another length than the query sequence (cross attention); None:
            ``rows``.
        transport: how the ring's blocks travel: ``"nccl"`` (send/recv: NCCL's kernels on
            GPUs, gloo on CPUs) or ``"copy_engine"`` (copies by the GPUs' copy engines into
            symmetric memory, no SM taken from the attention kernels: CUDA, blocks of one
            size). ``MESHFUSE_CP_TRANSPORT`` sets it (``auto``: the copy engines on CUDA
            where the blocks are of one size, else send/recv). A record planned without a
            device keeps ``"auto"`` where the device decides.
        merge: how the forward merges the blocks' outputs: ``"eager"`` (torch operations)
            or ``"compiled"`` (one ``torch.compile``'d pass over each merged output).
            ``MESHFUSE_CP_MERGE`` sets it (``auto``, the default: compiled on CUDA, where
            it measured faster, else eager; kept ``"auto"`` in a record planned without a
            device).
    """

    strategy: str
    mesh_axis: int
    ranks: tuple[int, ...]
    position: int
    rows: tuple[tuple[Run, ...], ...]
    backward: bool = False
    own_parts: int = 1
    key_rows: tuple[tuple[Run, ...], ...] | None = None  # cross attention: keys' own rows
    transport: str = NCCL  # _options resolves auto for a known device (copy_engine or nccl)
    merge: str = EAGER  # _options resolves auto for a known device (compiled or eager)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def holder(self, step: int) -> int:
        """The position whose key/value block this rank computes with at ``step``: its own
        first, then the previous position's, and so on around the ring."""
        return (self.position - step) % self.size

    @property
    def keys(self) -> tuple[tuple[Run, ...], ...]:
        """For each position, the runs of global key/value rows it holds."""
        return self.rows if self.key_rows is None else self.key_rows

    def local_runs(self, position: int, keys: bool = False) -> tuple[tuple[Run, Run], ...]:
        """Each run of ``position``'s query rows (``keys``: key rows), paired with where it
        sits in that position's local tensor: ``((global start, stop), (local start,
        stop))``."""
        result, at = [], 0
        for a, b in (self.keys if keys else self.rows)[position]:
            result.append(((a, b), (at, at + b - a)))
            at += b - a
        return tuple(result)

    def global_rows(self, position: int, local: Run, keys: bool = False) -> torch.Tensor:
        """The global row indices of local rows ``local`` of ``position``'s shard of the
        queries (``keys``: of the keys)."""
        runs = (self.keys if keys else self.rows)[position]
        rows = torch.cat([torch.arange(a, b) for a, b in runs])
        return rows[local[0]:local[1]]

    @property
    def equal_blocks(self) -> bool:
        """Whether every position holds as many query rows, and as many key rows."""
        return len({self.length(c) for c in range(self.size)}) == 1 and \
            len({self.key_length(c) for c in range(self.size)}) == 1

    def length(self, position: int) -> int:
        """How many query rows ``position`` holds."""
        return sum(b - a for a, b in self.rows[position])

    def key_length(self, position: int) -> int:
        """How many key/value rows ``position`` holds."""
        return sum(b - a for a, b in self.keys[position])

    def describe(self) -> str:
        """One line: the strategy, group, block order and the rows of every position."""
        def runs(rows):
            return "; ".join(f"{c}: " + ", ".join(f"{a}..{b - 1}" if b > a else "none"
                                                  for a, b in r)
                             for c, r in enumerate(rows))

        order = ", ".join(str(self.holder(s)) for s in range(self.size))
        keys = "" if self.key_rows is None else f"; key rows by position {runs(self.key_rows)}"
        return (f"{self.strategy} attention over mesh axis {self.mesh_axis}, ranks "
                f"{list(self.ranks)}, position {self.position}, key/value blocks of positions "
                f"{order}; sequence rows by position {runs(self.rows)}{keys}")

    @functools.cached_property
    def sums_in_input_dtype(self) -> bool:
        """Whether every sum of partial results (a query row's merged output and its dq over
        the steps, a key row's dk/dv over the ring) has at most two terms, causal or not.
        Then summing in the inputs' dtype rounds once, exactly as a float32 sum cast at the
        end does (the kernels return the terms in that dtype and an add of two of them rounds
        its float32 result once), so the sums are kept and sent in the inputs' dtype: a ring
        of two ranks. Longer rings sum in float32."""
        return max(most_terms(self, causal) for causal in (False, True)) <= 2

    def transfers(self) -> list[tuple[str, int | None, str, int]]:
        """The communications this rank makes, in the order it launches them: ``(kind, peer
        rank or None for a collective, tensor, sequence rows)``. Tensors: ``q``, ``k``,
        ``v``, ``grad``, ``attn``, ``dq``, ``dk``, ``dv`` in the inputs' dtype, ``lse``, and
        ``dk32``, ``dv32``: float32 gradient sums (:attr:`sums_in_input_dtype`: ``dk``,
        ``dv``). Rows are those the recorder counts (an uneven all-gather pads each block to
        the longest): query rows for the query-shaped tensors, key rows for the others."""
        if self.size == 1:
            return []
        if self.strategy == RING:
            return self._ring_transfers()
        keys = [self.key_length(c) for c in range(self.size)]
        if self.strategy == ALLGATHER:
            result = [("allgather", None, t, max(keys)) for t in ("k", "v")]
            if self.backward:
                result += [("reduce_scatter", None, t, self.size * max(keys))
                           for t in ("dk32", "dv32")]
            return result
        tensors = ("grad", "q", "k", "v", "attn", "lse", "dq", "dk", "dv") if self.backward \
            else ("q", "k", "v", "lse", "attn")
        return [("all_to_all", None, t, self._rows_of(t, self.position)) for t in tensors]

    def _rows_of(self, tensor: str, position: int) -> int:
        """The sequence rows of ``tensor`` (a name of :meth:`transfers`) at ``position``."""
        keyed = tensor in ("k", "v", "dk", "dv", "dk32", "dv32")
        return self.key_length(position) if keyed else self.length(position)

    def _ring_transfers(self) -> list[tuple[str, int, str, int]]:
        """Step ``s < n - 1`` moves on the k/v block it holds; in a backward, step ``s >= 1``
        then moves on that block's dk/dv sums (begun at step 1: the own block's stay home),
        the last step's to the block's home."""
        after = self.ranks[(self.position + 1) % self.size]
        before = self.ranks[(self.position - 1) % self.size]
        result = []
        travelling = ("dk", "dv") if self.sums_in_input_dtype else ("dk32", "dv32")
        for step in range(self.size):
            sent = self.key_length(self.holder(step))
            received = self.key_length(self.holder(step + 1))
            moved = ("k", "v") if step < self.size - 1 else ()
            if self.backward and step >= 1:
                moved += travelling
            for tensor in moved:
                result += [("send", after, tensor, sent), ("recv", before, tensor, received)]
        return result


@register_local_attrs
def context_attrs(expr, here) -> dict | None:
    """A context-parallel attention's local attribute on the rank ``here``: ``context``, the
    record of its strategy (the keyword its implementation in
    :mod:`meshfuse.parallel.context.lowering` reads); None for any other op."""
    if sequence_parallel(expr) is None:
        return None
    return {"context": context_record(expr, here)}


def context_record(expr, here) -> ContextParallel:
    """The :class:`ContextParallel` record of a context-parallel attention ``expr`` on the
    rank ``here`` (a :class:`~meshfuse.ops.registry.LocalContext`): the owners of q's
    sequence rows (and of k's, when its sequence has another length)."""
    q, k = argument(expr, "q"), argument(expr, "k")
    (_, pt), = device_ids(q)[q.logical[-2]]
    axis = q.mesh.axis_of(pt)
    ranks = q.mesh.group_ranks(here.rank, axis)
    rows = _position_rows(q, here, len(ranks))
    keys = None
    if here.extents.get(k.materialized()[-2]) != here.extents.get(q.materialized()[-2]):
        keys = _position_rows(k, here, len(ranks))
    backward = expr.op.name == "sdpfa_bwd"
    record = ContextParallel(sequence_parallel(expr), axis, ranks,
                             q.mesh.coordinate(here.rank)[axis], rows, backward,
                             own_parts(expr, here) if backward and len(ranks) > 1 else 1, keys)
    return dataclasses.replace(record, **_options(record, expr, here))


def _options(record: ContextParallel, expr, here) -> dict[str, str]:
    """The record's ``transport`` and ``merge`` from the environment, ``auto`` resolved for
    this rank's device (the transport of a ring of two ranks or more: the others move
    nothing, or by collectives). Planned without a device (``here.device`` None, as
    ``explain`` without inputs may be), an ``auto`` that the device decides stays ``auto``.

    Raises:
        DefinitionError: a value that is no option; the copy engines asked for tensors off
            CUDA (on a known device), or for blocks of different sizes.
    """
    transport = _option(TRANSPORT_VAR, TRANSPORTS, DEFAULT_TRANSPORT)
    merge = _option(MERGE_VAR, MERGES, DEFAULT_MERGE)
    if record.strategy != RING or record.size == 1:
        transport = NCCL
    if transport == COPY_ENGINE and not record.equal_blocks:
        q, k = argument(expr, "q"), argument(expr, "k")
        raise DefinitionError(
            f"{expr.op.name}: {TRANSPORT_VAR}=copy_engine moves blocks of one size, and the "
            f"sequence rows of {q.name} (or of {k.name}) over {record.size} ranks are of "
            f"different sizes; use a zig-zag split, an extent that divides, or "
            f"{TRANSPORT_VAR}=auto")
    if transport == AUTO and not record.equal_blocks:
        transport = NCCL
    if here.device is None:  # planned without a device: what the device decides stays auto
        return {"transport": transport, "merge": merge}
    cuda = torch.device(here.device).type == "cuda"
    if transport == COPY_ENGINE and not cuda:
        raise DefinitionError(f"{expr.op.name}: {TRANSPORT_VAR}=copy_engine copies blocks "
                              f"between CUDA devices, and this rank's tensors are on "
                              f"{here.device}: use nccl or auto")
    if transport == AUTO:
        transport = COPY_ENGINE if cuda else NCCL
    if merge == AUTO:
        merge = COMPILED if cuda else EAGER
    return {"transport": transport, "merge": merge}


def _option(variable: str, choices: tuple[str, ...], default: str) -> str:
    """The value of the environment ``variable``, one of ``choices`` (unset: ``default``).

    Raises:
        DefinitionError: any other value.
    """
    value = os.environ.get(variable, "").strip().lower() or default
    if value not in choices:
        raise DefinitionError(f"{variable}={value!r}: use one of "
                              f"{', '.join(repr(c) for c in choices)}")
    return value


def _position_rows(tv, here, size: int) -> tuple[tuple[Run, ...], ...]:
    """For each position of the mesh axis sharding ``tv``'s sequence, its runs of rows."""
    sequence = tv.materialized()[-2]
    (leaf, _), = device_ids(tv)[sequence]
    owners = split_indices(tv, sequence, here.extents)[leaf]
    return tuple(runs_of(torch.nonzero(owners == c).flatten()) or ((0, 0),)
                 for c in range(size))


def own_parts(expr, here) -> int:
    """The parts a ring backward computes its own block in (:attr:`ContextParallel.own_parts`):
    ``parts`` equal slices of the local batch (of the heads when the batch is 1: of the
    query heads and of the key/value heads alike) when that extent divides by it and there is
    no dropout (a block's mask is drawn whole), else one. ``parts`` is 2, or
    ``MESHFUSE_CP_OWN_PARTS`` (1: the whole own block first, to measure what the parts gain;
    the finished sums' trip home then waits after the last kernels).

    Raises:
        DefinitionError: ``MESHFUSE_CP_OWN_PARTS`` is not a positive integer.
    """
    q, k = argument(expr, "q"), argument(expr, "k")
    dropout = argument(expr, "dropout_p")
    parts = _requested_parts()
    if getattr(dropout, "value", dropout) != 0.0 or parts == 1:
        return 1
    for position in range(2):  # batch, then heads
        if position == 1 and replicated_kv_axes(expr, q, {"k": k, "v": argument(expr, "v")}):
            return 1  # the kernels see the key/value heads this rank's query heads need
        extents = [_local(t, t.logical[position], here) for t in (q, k)]
        if None in extents:  # a symbolic extent
            return 1
        if extents[0] > 1:
            return parts if all(e % parts == 0 for e in extents) else 1
    return 1


def _requested_parts() -> int:
    value = os.environ.get(OWN_PARTS_VAR, "").strip() or "2"
    if not value.isdigit() or int(value) < 1:
        raise DefinitionError(f"{OWN_PARTS_VAR}={value!r}: give the number of parts a ring "
                              "backward computes its own block in, a positive integer "
                              "(default 2)")
    return int(value)


def _local(tv, axis, here) -> int | None:
    """This rank's extent of ``tv``'s ``axis`` (None: symbolic)."""
    if axis not in here.extents:
        return None
    coordinate = tv.mesh.coordinate(here.rank)
    coords = {pt: coordinate[tv.mesh.axis_of(pt)] for shards in device_ids(tv).values()
              for _, pt in shards}
    return local_extent(tv, axis, here.extents, coords)


# ----------------------------------------------------------------------------------------------
# The kernel calls each position makes, and the sums they add up to

class Block(enum.Enum):
    """How one query run meets one key run under a causal mask (top-left aligned)."""

    FULL = "full"
    DIAGONAL = "diagonal"
    SKIPPED = "skipped"



def block_kind(query: Run, key: Run, causal: bool) -> Block:
    """Full, diagonal or skipped. Runs of one split are equal or disjoint: a key run that
    starts after the query run ends is skipped, the same run is the diagonal."""
    if not causal or key[1] <= query[0]:
        return Block.FULL
    if key[0] >= query[1]:
        return Block.SKIPPED
    assert key == query, f"runs {query} and {key} overlap without being equal"
    return Block.DIAGONAL


@functools.lru_cache(maxsize=1024)
def kernel_calls(record: ContextParallel, position: int, causal: bool):
    """The kernel calls of this rank's queries against ``position``'s key/value block:
    ``(local query rows, local key rows, kind)``, with neighbouring runs joined where the
    whole join is computed in full (a zig-zag rank's two query chunks against a key chunk
    before both: one call, not two) or is the rank's own block (one causal call)."""
    queries = [(g, at) for g, at in record.local_runs(record.position) if at[1] > at[0]]
    keys = [(g, at) for g, at in record.local_runs(position, keys=True) if at[1] > at[0]]
    if not queries or not keys:
        return ()
    if not causal:  # everything in full: one call
        return ((_joined(queries), _joined(keys), Block.FULL),)
    if record.key_rows is not None:
        return tuple(c for q in queries for k in keys for c in cross_pieces(q, k))
    kinds = {(qa, ka): block_kind(qg, kg, causal) for qg, qa in queries for kg, ka in keys}
    joined = _joined
    if all(k is Block.FULL for k in kinds.values()):  # everything in full: one call
        return ((joined(queries), joined(keys), Block.FULL),)
    if position == record.position:
        # This rank's own block: its rows, in ascending global order, are the queries and the
        # keys, so the causal mask of the local rows is the global one: one causal call.
        return ((joined(queries), joined(keys), Block.DIAGONAL),)
    calls = []
    if len(queries) > 1:  # a key run that every query run meets in full, the rest skipped
        for kg, ka in keys:
            column = [kinds[qa, ka] for _, qa in queries]
            others = [kinds[qa, kb] for _, qa in queries for _, kb in keys if kb != ka]
            if all(k is Block.FULL for k in column) and \
                    all(k is Block.SKIPPED for k in others):
                return ((joined(queries), ka, Block.FULL),)
    for qg, qa in queries:
        row = [kinds[qa, ka] for _, ka in keys]
        if len(keys) > 1 and all(k is Block.FULL for k in row):
            calls.append((qa, joined(keys), Block.FULL))
            continue
        calls += [(qa, ka, kinds[qa, ka]) for _, ka in keys if kinds[qa, ka] is not Block.SKIPPED]
    return tuple(calls)


def _joined(runs) -> Run:
    """The local rows from the first run's start to the last run's end."""
    return (runs[0][1][0], runs[-1][1][1])


def cross_pieces(query: tuple[Run, Run], key: tuple[Run, Run]):
    """The causal kernel calls of one query run against one key run of another sequence
    (cross attention), each ``(local query rows, local key rows, kind)``: for global query
    rows ``[a, b)`` and key rows ``[c, d)``, the rows below ``c`` see no key (no call); the
    rows ``[max(a, c), min(b, d))`` see the keys before them in full and the keys of the same
    indices as a diagonal; the rows from ``d`` on see every key (full)."""
    (a, b), (qa, _) = query
    (c, d), (ka, _) = key

    def local(rows, keys, kind):
        return ((qa + rows[0] - a, qa + rows[1] - a), (ka + keys[0] - c, ka + keys[1] - c),
                kind)

    pieces = []
    middle = (max(a, c), min(b, d))
    if middle[1] > middle[0]:
        if middle[0] > c:
            pieces.append(local(middle, (c, middle[0]), Block.FULL))
        pieces.append(local(middle, middle, Block.DIAGONAL))
    if b > max(a, d):
        pieces.append(local((max(a, d), b), (c, d), Block.FULL))
    return pieces


def most_terms(record: ContextParallel, causal: bool) -> int:
    """The most kernel results that any one sum of the ring adds: a query row's over the
    blocks (its merged output, its dq), a key row's dk/dv over the ranks."""
    at = [dataclasses.replace(record, position=c) for c in range(record.size)]
    counts = [0]
    for c in range(record.size):
        queries = [rows for p in range(record.size) for rows, _, _ in kernel_calls(at[c], p, causal)]
        keys = [k for r in at for _, k, _ in kernel_calls(r, c, causal)]
        counts += [_deepest(queries), _deepest(keys)]
    return max(counts)


def _deepest(runs: list[Run]) -> int:
    """The most runs that overlap at one row."""
    edges = sorted([(a, 1) for a, b in runs if b > a] + [(b, -1) for a, b in runs if b > a])
    depth = deepest = 0
    for _, step in edges:  # a run's end sorts before another's start at the same row
        depth += step
        deepest = max(deepest, depth)
    return deepest
