"""Context parallelism for ``sdpfa_fwd``/``sdpfa_bwd``: the record of a sequence-sharded
attention and the per-block arithmetic its strategies share.

When q, k and v are sharded on their sequence axis over one mesh axis, each rank holds some
query rows and the key/value rows of the same positions. Attention then runs with one of
three *strategies* (:data:`STRATEGIES`), chosen at compile time by
:mod:`meshfuse.passes.context_parallel` and forceable with the op's ``context_parallel``
argument:

- ``"ring"``: key/value blocks travel around the ranks of the mesh axis by point-to-point
  send/recv; at each step a rank computes its query rows against the block it holds (the
  machine's fastest kernel, one call per pair of contiguous row runs) and merges the partial
  outputs by their log-sum-exp. The backward passes k/v and their gradient accumulators the
  same way and sends the accumulators home at the end.
- ``"allgather"``: k and v are gathered (a communication in the fusion, as for any axis an op
  needs whole); each rank computes its own query rows against all keys.
- ``"alltoall"`` (DeepSpeed Ulysses): q, k and v go from sequence-sharded to head-sharded
  by all-to-all, attention runs on whole sequences, and the output comes back.

A ring attention's step carries a :class:`ContextParallel` record (its strategy, mesh axis,
ranks, this rank's position and which global rows every position holds), printed in the
program and in ``explain``. Causal attention is masked per pair of runs: a key run wholly
before the query run is *full*, the same run is the *diagonal* (a causal kernel call), a run
after it is *skipped*. A split's layout decides the runs: a block split gives one run per
position; the head-tail (zig-zag) layout gives two, chunk ``r`` and chunk ``2n - 1 - r``,
which balances causal work.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
from fractions import Fraction

import torch

from meshfuse.errors import DefinitionError
from meshfuse.ir.global_index import GlobalIndex
from meshfuse.ir.layout import device_ids, local_extent, split_indices
from meshfuse.ops import attention_kernels, rng
from meshfuse.ops.attention_backends import AttentionBackend, select_backend
from meshfuse.ops.attention_dropout import GLOBAL, DropoutSite, kernel_state

ENV_VAR = "MESHFUSE_CONTEXT_PARALLEL"
HOME_PARTS_VAR = "MESHFUSE_CP_HOME_PARTS"  # "1": the ring's finished sums go home whole
RING, ALLGATHER, ALLTOALL, AUTO = "ring", "allgather", "alltoall", "auto"
STRATEGIES = (RING, ALLGATHER, ALLTOALL)


def requested_strategy(op: str, value: str | None) -> str:
    """The strategy asked for: ``value`` (the op's ``context_parallel`` argument), else
    ``MESHFUSE_CONTEXT_PARALLEL``, else ``"auto"`` (the cost estimate picks)."""
    where = f"context_parallel={value!r}"
    if value is None:
        value = os.environ.get(ENV_VAR, "").strip().lower() or AUTO
        where = f"{ENV_VAR}={value!r}"
    if value not in STRATEGIES + (AUTO,):
        raise DefinitionError(
            f"{op}: {where} is not a context-parallel strategy; use one of "
            f"{', '.join(repr(s) for s in STRATEGIES + (AUTO,))}")
    return value


class Block(enum.Enum):
    """How one query run meets one key run under a causal mask (top-left aligned)."""

    FULL = "full"
    DIAGONAL = "diagonal"
    SKIPPED = "skipped"


Run = tuple[int, int]  # global rows [start, stop) of one contiguous piece of a shard


def block_kind(query: Run, key: Run, causal: bool) -> Block:
    """Full, diagonal or skipped. Runs of one split are equal or disjoint: a key run that
    starts after the query run ends is skipped, the same run is the diagonal."""
    if not causal or key[1] <= query[0]:
        return Block.FULL
    if key[0] >= query[1]:
        return Block.SKIPPED
    assert key == query, f"runs {query} and {key} overlap without being equal"
    return Block.DIAGONAL


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
        rows: for each position, the runs of global sequence rows it holds (queries and
            keys alike).
        backward: the record of an ``sdpfa_bwd`` (k/v and their gradients travel).
        home_parts: in how many equal parts of the batch axis (of the heads when the batch
            is 1) the ring's last step computes and sends the finished dk/dv sums home: each
            part goes as soon as its kernels finish, so only the last one's transfer waits.
    """

    strategy: str
    mesh_axis: int
    ranks: tuple[int, ...]
    position: int
    rows: tuple[tuple[Run, ...], ...]
    backward: bool = False
    home_parts: int = 1

    @property
    def size(self) -> int:
        return len(self.ranks)

    def holder(self, step: int) -> int:
        """The position whose key/value block this rank computes with at ``step``: its own
        first, then the previous position's, and so on around the ring."""
        return (self.position - step) % self.size

    def local_runs(self, position: int) -> tuple[tuple[Run, Run], ...]:
        """Each run of ``position``'s rows, paired with where it sits in that position's
        local tensor: ``((global start, stop), (local start, stop))``."""
        result, at = [], 0
        for a, b in self.rows[position]:
            result.append(((a, b), (at, at + b - a)))
            at += b - a
        return tuple(result)

    def global_rows(self, position: int, local: Run) -> torch.Tensor:
        """The global row indices of local rows ``local`` of ``position``'s shard."""
        rows = torch.cat([torch.arange(a, b) for a, b in self.rows[position]])
        return rows[local[0]:local[1]]

    def length(self, position: int) -> int:
        return sum(b - a for a, b in self.rows[position])

    def describe(self) -> str:
        """One line: the strategy, group, block order and the rows of every position."""
        runs = "; ".join(f"{c}: " + ", ".join(f"{a}..{b - 1}" if b > a else "none"
                                             for a, b in r)
                         for c, r in enumerate(self.rows))
        order = ", ".join(str(self.holder(s)) for s in range(self.size))
        return (f"{self.strategy} attention over mesh axis {self.mesh_axis}, ranks "
                f"{list(self.ranks)}, position {self.position}, key/value blocks of positions "
                f"{order}; sequence rows by position {runs}")

    @functools.cached_property
    def sums_in_input_dtype(self) -> bool:
        """Whether every sum of partial results (a query row's merged output and its dq over
        the steps, a key row's dk/dv over the ring) has at most two terms, causal or not.
        Then summing in the inputs' dtype rounds once, exactly as a float32 sum cast at the
        end does (the kernels return the terms in that dtype and an add of two of them rounds
        its float32 result once), so the sums are kept and sent in the inputs' dtype: a ring
        of two ranks. Longer rings sum in float32."""
        return max(most_terms(self, causal) for causal in (False, True)) <= 2

    def transfers(self) -> list[tuple[str, int | None, str, int | Fraction]]:
        """The communications this rank makes, in the order it launches them: ``(kind, peer
        rank or None for a collective, tensor, sequence rows)`` (a part of the finished sums
        counts the fraction of the rows' bytes it carries: rows over :attr:`home_parts`). Tensors: ``q``, ``k``,
        ``v``, ``grad``, ``attn``, ``dq``, ``dk``, ``dv`` in the inputs' dtype, ``lse``, and
        ``dk32``, ``dv32``: float32 gradient sums (:attr:`sums_in_input_dtype`: ``dk``, ``dv``). Rows are those the recorder counts (an
        uneven all-gather pads each block to the longest)."""
        if self.size == 1:
            return []
        if self.strategy == RING:
            return self._ring_transfers()
        lengths = [self.length(c) for c in range(self.size)]
        if self.strategy == ALLGATHER:
            result = [("allgather", None, t, max(lengths)) for t in ("k", "v")]
            if self.backward:
                result += [("reduce_scatter", None, t, self.size * max(lengths))
                           for t in ("dk32", "dv32")]
            return result
        tensors = ("grad", "q", "k", "v", "attn", "lse", "dq", "dk", "dv") if self.backward \
            else ("q", "k", "v", "lse", "attn")
        return [("all_to_all", None, t, lengths[self.position]) for t in tensors]

    def _ring_transfers(self) -> list[tuple[str, int, str, int]]:
        after = self.ranks[(self.position + 1) % self.size]
        before = self.ranks[(self.position - 1) % self.size]
        result = []
        travelling = ("dk", "dv") if self.sums_in_input_dtype else ("dk32", "dv32")
        for step in range(self.size):
            sent, received = self.length(self.holder(step)), self.length(self.holder(step + 1))
            moved = ("k", "v") if step < self.size - 1 else ()
            if self.backward and step < self.size - 1:
                moved += travelling
            for tensor in moved:
                result += [("send", after, tensor, sent), ("recv", before, tensor, received)]
        if self.backward:  # the finished sums go home, cast, in parts
            sent = Fraction(self.length(self.holder(self.size - 1)), self.home_parts)
            received = Fraction(self.length(self.position), self.home_parts)
            for _ in range(self.home_parts):
                for tensor in ("dk", "dv"):
                    result += [("send", after, tensor, sent),
                               ("recv", before, tensor, received)]
        return result


ATTENTION = ("sdpfa_fwd", "sdpfa_bwd")


def _arg(expr, name: str):
    return expr.args[[p.name for p in expr.op.params].index(name)]


def sequence_parallel(expr) -> str | None:
    """The strategy of an attention that runs context-parallel itself (its sequences mapped
    together by :mod:`meshfuse.passes.context_parallel`), else None (an attention whose
    key/value sequence, if sharded, the engine gathers)."""
    if getattr(expr, "op", None) is None or expr.op.name not in ATTENTION:
        return None
    q, k = _arg(expr, "q"), _arg(expr, "k")
    if len(q.materialized()) != 4:
        return None
    out = expr.outputs[0]
    if k.logical[2] not in expr.id_map.get(out.logical[2], ()):
        return None
    return _arg(expr, "context_parallel")


def sequence_mesh_axis(expr) -> tuple:
    """``(mesh, mesh axis)`` the query sequence of a context-parallel attention is sharded
    over."""
    q = _arg(expr, "q")
    (_, pt), = device_ids(q)[q.logical[-2]]
    return q.mesh, q.mesh.axis_of(pt)


def context_record(expr, here) -> ContextParallel:
    """The :class:`ContextParallel` record of a context-parallel attention ``expr`` on the
    rank ``here`` (a :class:`~meshfuse.ops.registry.LocalContext`): the owners of q's
    sequence rows."""
    q = _arg(expr, "q")
    sequence = q.logical[-2]
    (leaf, pt), = device_ids(q)[sequence]
    owners = split_indices(q, sequence, here.extents)[leaf]
    axis = q.mesh.axis_of(pt)
    ranks = q.mesh.group_ranks(here.rank, axis)
    rows = tuple(runs_of(torch.nonzero(owners == c).flatten()) or ((0, 0),)
                 for c in range(len(ranks)))
    backward = expr.op.name == "sdpfa_bwd"
    return ContextParallel(sequence_parallel(expr), axis, ranks,
                           q.mesh.coordinate(here.rank)[axis], rows, backward,
                           home_parts(expr, here) if backward and len(ranks) > 1 else 1)


def home_parts(expr, here) -> int:
    """The parts a ring backward sends its finished dk/dv sums home in: two halves of the
    local batch (of the heads when the batch is 1: of the query heads and of the key/value
    heads alike) when that extent is even and there is no dropout (a block's mask is drawn
    whole), else one; ``MESHFUSE_CP_HOME_PARTS=1`` asks for one (to measure what the halves
    gain). The halves are contiguous slices of the sums, sent and received in place."""
    q, k = _arg(expr, "q"), _arg(expr, "k")
    dropout = _arg(expr, "dropout_p")
    if getattr(dropout, "value", dropout) != 0.0 or os.environ.get(HOME_PARTS_VAR) == "1":
        return 1
    for position in range(2):  # batch, then heads
        extents = [_local(t, t.logical[position], here) for t in (q, k)]
        if None in extents:  # a symbolic extent
            return 1
        if extents[0] > 1:
            return 2 if all(e % 2 == 0 for e in extents) else 1
    return 1


def _local(tv, axis, here) -> int | None:
    """This rank's extent of ``tv``'s ``axis`` (None: symbolic)."""
    if axis not in here.extents:
        return None
    coordinate = tv.mesh.coordinate(here.rank)
    coords = {pt: coordinate[tv.mesh.axis_of(pt)] for shards in device_ids(tv).values()
              for _, pt in shards}
    return local_extent(tv, axis, here.extents, coords)


# ----------------------------------------------------------------------------------------------
# Per-block kernels and the log-sum-exp merge


def _sequence(t: torch.Tensor, run: Run) -> torch.Tensor:
    return t[..., run[0]:run[1], :]


@dataclasses.dataclass(frozen=True)
class BlockDropout:
    """The dropout of one context-parallel attention call: each kernel call's keep mask,
    drawn from ``seed``/``offset`` and the call's global position (``site``: the rank's
    batch and head indices, the global extents and the mode).

    - ``global`` mode: the unsharded run's mask, ``uniform(seed, offset) >= p`` at each
      element's global (batch, head, query, key) position, whatever the strategy;
    - ``shard`` mode: a stream per block, keyed by the seed, the offset and the block's first
      global batch, head, query and key index; the backward redraws it from the same key.
    """

    p: float
    seed: int
    offset: int
    site: DropoutSite

    def keep(self, query_rows: torch.Tensor, key_rows: torch.Tensor,
             device: torch.device) -> torch.Tensor:
        """The bool keep mask ``[b, h, len(query_rows), len(key_rows)]`` (True: kept)."""
        index = self.site.index
        if self.site.mode == GLOBAL:
            block = GlobalIndex(index.extents, index.indices[:-2] + (query_rows, key_rows))
            return rng.unit_uniform(rng.stream_key(self.seed, self.offset),
                                    block.linear(device), torch.float32) >= self.p
        shape = (*index.local_shape[:-2], len(query_rows), len(key_rows))
        key = rng.stream_key(self.seed, self.offset, *index.starts[:-2], int(query_rows[0]),
                             int(key_rows[0]))
        counters = torch.arange(math.prod(shape), device=device).view(shape)
        return rng.unit_uniform(key, counters, torch.float32) >= self.p


def block_forward(q, k, v, scale, kind: Block, keep: torch.Tensor | None = None,
                  p: float = 0.0):
    """One query run against one key run: ``(attn, log_sumexp)`` of the machine's fastest
    kernel (cuDNN on Hopper, flash elsewhere, the CPU kernels on CPU); with a dropout keep
    mask, the math kernel."""
    causal = kind is Block.DIAGONAL
    if keep is not None:
        attn, lse, _, _ = attention_kernels.sdpa_forward(q, k, v, p, causal, scale,
                                                         AttentionBackend.MATH, keep)
        return attn, lse
    backend = select_backend(q, k, v, 0.0, causal)
    attn, lse, _, _ = attention_kernels.sdpa_forward(q, k, v, 0.0, causal, scale, backend)
    return attn, lse


def block_backward(grad, q, k, v, attn, lse, scale, kind: Block,
                   keep: torch.Tensor | None = None, p: float = 0.0):
    """The gradients of one query run against one key run, from the *merged* output and
    log-sum-exp (so each block's probabilities are exact): ``(dq, dk, dv)``."""
    causal = kind is Block.DIAGONAL
    backend = AttentionBackend.MATH if keep is not None else select_backend(q, k, v, 0.0,
                                                                            causal)
    seed, offset = kernel_state(backend, None, None, 0.0, q.device)
    return attention_kernels.sdpa_backward(grad, q, k, v, attn, lse, p if keep is not None
                                           else 0.0, causal, seed, offset, scale, backend,
                                           keep)


class Merged:
    """The output and log-sum-exp of this rank's query rows, merged over key blocks.

    ``add(rows, attn, lse)`` folds in one block's result for local rows ``rows``: with
    ``w = exp(lse - m)``, ``m = logaddexp(L, lse)``, the output becomes ``lerp(O, attn, w)``
    (``O * (1 - w) + attn * w``) computed in float32, and the log-sum-exp ``m``. Every row a
    kernel returns has met at least one key (a causal diagonal block holds its own), so ``m``
    is finite. The first result that covers every row is kept as it is (no copy); the output
    is kept in ``dtype``: the inputs' dtype where every row merges at most two results
    (:attr:`ContextParallel.sums_in_input_dtype`, one rounding either way), else float32.
    """

    def __init__(self, q: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> None:
        self._shape = (*q.shape[:-1], v.shape[-1])
        self._dtype, self._device = dtype, q.device
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self._fresh = [(0, q.shape[-2])]  # local row ranges no block has reached

    def add(self, rows: Run, attn: torch.Tensor, lse: torch.Tensor) -> None:
        if self.out is None and rows == (0, self._shape[-2]) and attn.dtype == self._dtype:
            self.out, self.lse, self._fresh = attn, lse, []
            return
        if self.out is None:
            self.out = torch.zeros(self._shape, dtype=self._dtype, device=self._device)
            self.lse = torch.full(self._shape[:-1], -math.inf, dtype=torch.float,
                                  device=self._device)
        out, old = _sequence(self.out, rows), self.lse[..., rows[0]:rows[1]]
        if rows in self._fresh:
            out.copy_(attn)
            old.copy_(lse)
            self._fresh.remove(rows)
            return
        merged = torch.logaddexp(old, lse)
        weight = torch.exp(lse - merged).unsqueeze(-1)
        total = out.float()  # out itself when it is float32
        total.lerp_(attn.float(), weight)
        if total is not out:
            out.copy_(total)
        old.copy_(merged)
        self._fresh = [r for r in self._fresh if r[1] <= rows[0] or r[0] >= rows[1]]

    def result(self, dtype: torch.dtype):
        """``(attn, log_sumexp)``: attn in ``dtype``."""
        if self.out is None:  # no block reached this rank's rows: it holds none
            self.out = torch.zeros(self._shape, dtype=dtype, device=self._device)
            self.lse = torch.full(self._shape[:-1], -math.inf, device=self._device)
        return self.out.to(dtype), self.lse


def add_rows(total: torch.Tensor | None, rows: Run, part: torch.Tensor, like: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    """``total`` (None: zeros shaped as ``like``, in ``dtype``) with ``part`` added to its
    local rows ``rows``. A part that covers every row of a total not started yet becomes the
    total (no zero fill, no copy); a part of another dtype is cast first (one vectorized
    cast and a same-dtype add are far faster than PyTorch's mixed-dtype add)."""
    part = part.to(dtype)
    if total is None:
        if rows == (0, like.shape[-2]):
            return part
        total = torch.zeros(like.shape, dtype=dtype, device=like.device)
    _sequence(total, rows).add_(part)
    return total


@functools.lru_cache(maxsize=1024)
def kernel_calls(record: ContextParallel, position: int, causal: bool):
    """The kernel calls of this rank's queries against ``position``'s key/value block:
    ``(local query rows, local key rows, kind)``, with neighbouring runs joined where the
    whole join is computed in full (a zig-zag rank's two query chunks against a key chunk
    before both: one call, not two) or is the rank's own block (one causal call)."""
    queries = [(g, at) for g, at in record.local_runs(record.position) if at[1] > at[0]]
    keys = [(g, at) for g, at in record.local_runs(position) if at[1] > at[0]]
    kinds = {(qa, ka): block_kind(qg, kg, causal) for qg, qa in queries for kg, ka in keys}

    def joined(runs):
        return (runs[0][1][0], runs[-1][1][1])

    if not queries or not keys:
        return ()
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


def _keep(dropout: BlockDropout | None, record: ContextParallel, position: int, rows: Run,
          keys: Run, device) -> dict:
    """The keyword arguments of a block kernel: its dropout mask, or none."""
    if dropout is None:
        return {}
    mask = dropout.keep(record.global_rows(record.position, rows),
                        record.global_rows(position, keys), device)
    return {"keep": mask, "p": dropout.p}


def forward_blocks(q, k, v, scale, causal: bool, record: ContextParallel, position: int,
                   merged: Merged, dropout: BlockDropout | None = None) -> None:
    """This rank's queries against ``position``'s key/value block (``k``, ``v``: that
    block, local), merged into ``merged``."""
    for rows, keys, kind in kernel_calls(record, position, causal):
        merged.add(rows, *block_forward(_sequence(q, rows), _sequence(k, keys),
                                        _sequence(v, keys), scale, kind,
                                        **_keep(dropout, record, position, rows, keys,
                                                q.device)))


def backward_blocks(grad, q, k, v, attn, lse, scale, causal: bool, record: ContextParallel,
                    position: int, dq: torch.Tensor | None, dropout: BlockDropout | None = None):
    """The gradients of this rank's queries against ``position``'s key/value block: returns
    ``(dq, parts)``: ``dq`` with the block's query gradients added (see :func:`add_rows`; the
    sums' dtype is :func:`sums_dtype`), and the block's key/value gradients as ``[(local key
    rows, dk, dv)]``, one per kernel call (none when every pair is skipped), for
    :func:`add_key_gradients`."""
    parts = []
    for rows, keys, kind in kernel_calls(record, position, causal):
        gq, gk, gv = block_backward(_sequence(grad, rows), _sequence(q, rows),
                                    _sequence(k, keys), _sequence(v, keys),
                                    _sequence(attn, rows), lse[..., rows[0]:rows[1]], scale,
                                    kind, **_keep(dropout, record, position, rows, keys,
                                                  q.device))
        dq = add_rows(dq, rows, gq, q, sums_dtype(record, q))
        parts.append((keys, gk, gv))
    return dq, parts


def add_key_gradients(parts, sums, block, dtype: torch.dtype) -> list[torch.Tensor]:
    """The block's ``[dk, dv]`` sums (None where not started; new ones in ``dtype``) with
    :func:`backward_blocks`' key/value gradients added; ``block``: the block's k and v."""
    sums = list(sums)
    for keys, *grads in parts:
        sums = [add_rows(s, keys, g, t, dtype) for s, g, t in zip(sums, grads, block)]
    return [s if s is not None else torch.zeros(t.shape, dtype=dtype, device=t.device)
            for s, t in zip(sums, block)]


def sums_dtype(record: ContextParallel, like: torch.Tensor) -> torch.dtype:
    """The dtype of this record's sums of partial results: ``like``'s when every sum has at
    most two terms (:attr:`ContextParallel.sums_in_input_dtype`), else float32."""
    return like.dtype if record.sums_in_input_dtype else torch.float
