"""The per-block arithmetic of context-parallel attention: which kernel calls a rank's queries
make against a position's key/value block, the calls themselves (with their dropout masks),
and the sums of their results: the outputs merged by their log-sum-exp, the query gradients
over the blocks, the key/value gradients over the ranks. The record that says which rows
every position holds is :class:`~meshfuse.parallel.context.record.ContextParallel`.

Causal attention (top-left aligned, as PyTorch's: query ``i`` sees keys ``j <= i``) is masked
per pair of runs: a key run wholly before the query run is *full*, the same run is the
*diagonal* (a causal kernel call), a run after it is *skipped*. In cross attention (key rows
of another sequence length) a pair may be cut into pieces: the query rows that see no key
(skipped), those that see every key (full), and between them a full part and a diagonal.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from meshfuse.ir.global_index import GlobalIndex
from meshfuse.ops.attention import kernels as attention_kernels
from meshfuse.ops.attention.backends import AttentionBackend, select_backend
from meshfuse.ops.attention.dropout import GLOBAL, DropoutSite, kernel_state
from meshfuse.ops.random import rng
from meshfuse.parallel.context.record import Block, ContextParallel, Run, kernel_calls

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
    ``compiled``: each merge is one ``torch.compile``'d pass (:func:`merge_into`) instead of
    about eight torch operations, four of them over the whole output.
    """

    def __init__(self, q: torch.Tensor, v: torch.Tensor, dtype: torch.dtype,
                 compiled: bool = False) -> None:
        self._shape = (*q.shape[:-1], v.shape[-1])
        self._dtype, self._device, self._compiled = dtype, q.device, compiled
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
        if self._compiled:
            compiled_merge()(out, old, attn, lse)
        else:  # merge_into's arithmetic, in place where out is float32 already
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


def merge_into(out: torch.Tensor, out_lse: torch.Tensor, attn: torch.Tensor,
               lse: torch.Tensor) -> None:
    """One block's ``(attn, lse)`` merged into ``(out, out_lse)`` in place (see
    :class:`Merged`), in float32, the output rounded once to its dtype."""
    merged = torch.logaddexp(out_lse, lse)
    weight = torch.exp(lse - merged).unsqueeze(-1)
    out.copy_(torch.lerp(out.float(), attn.float(), weight))
    out_lse.copy_(merged)


@functools.cache
def compiled_merge():
    """:func:`merge_into` compiled by ``torch.compile`` (on first use: importing the compiler
    costs seconds): on CUDA one generated kernel reads the two outputs and writes the
    merged one."""
    return torch.compile(merge_into, fullgraph=True)


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
        # Zeros around the part and the part copied in: a write and a copy where a zero fill
        # and an add would read the zeros again.
        total = torch.empty(like.shape, dtype=dtype, device=like.device)
        _sequence(total, (0, rows[0])).zero_()
        _sequence(total, (rows[1], like.shape[-2])).zero_()
        _sequence(total, rows).copy_(part)
        return total
    _sequence(total, rows).add_(part)
    return total


def _keep(dropout: BlockDropout | None, record: ContextParallel, position: int, rows: Run,
          keys: Run, device) -> dict:
    """The keyword arguments of a block kernel: its dropout mask, or none."""
    if dropout is None:
        return {}
    mask = dropout.keep(record.global_rows(record.position, rows),
                        record.global_rows(position, keys, keys=True), device)
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
