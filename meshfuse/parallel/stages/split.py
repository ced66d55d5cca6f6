"""Cutting a model into pipeline stages: consecutive pieces per stage, chosen by layer index,
by piece name, or balanced by cost.

A model to pipeline is given as its *pieces*: ``(name, module)`` pairs that run one after
the other, each taking the previous one's output (for a Llama: the embedding, each decoder
layer, the final norm with the head). :func:`stage_bounds` groups them into stages;
:class:`StageModule` runs one stage's pieces in order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from meshfuse.errors import DefinitionError


class StageModule(torch.nn.Module):
    """The pieces of one stage, run in order; its parameters are those of the pieces (the
    same tensors as the whole model's, so an optimizer over either sees the same)."""

    def __init__(self, pieces: Sequence[tuple[str, torch.nn.Module]]) -> None:
        super().__init__()
        self.names = [name for name, _ in pieces]
        self.pieces = torch.nn.ModuleList(module for _, module in pieces)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The pieces in order on ``inputs`` (several: one tuple given to the first piece;
        a piece may return a tuple, which the next takes whole)."""
        x = inputs[0] if len(inputs) == 1 else inputs
        for piece in self.pieces:
            x = piece(x)
        return x

    def extra_repr(self) -> str:
        return describe(self.names)


def describe(names: Sequence[str]) -> str:
    """A short text for a stage's pieces: ``a``, or ``a .. b (n pieces)``."""
    if len(names) == 1:
        return names[0]
    return f"{names[0]} .. {names[-1]} ({len(names)} pieces)"


def stage_bounds(names: Sequence[str], n_stages: int,
                 boundaries: Sequence[int | str] | None = None,
                 costs: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """The ``[start, stop)`` piece ranges of ``n_stages`` stages over the pieces ``names``.

    Args:
        names: the pieces' names, in order.
        n_stages: how many stages.
        boundaries: where stages 1, 2, ... start: piece indices or names (``n_stages - 1``
            of them, increasing); by default the pieces are balanced by ``costs``.
        costs: each piece's cost (default 1 each): the split minimises the largest stage's
            cost, earlier stages taking the extra piece when it does not divide.

    Example::

        >>> stage_bounds(["embed", "l0", "l1", "l2", "head"], 2, boundaries=["l1"])
        [(0, 2), (2, 5)]
    """
    if not 1 <= n_stages <= len(names):
        raise DefinitionError(f"cannot cut {len(names)} pieces into {n_stages} pipeline "
                              f"stages; use 1 to {len(names)} stages")
    if boundaries is None:
        return _balanced(costs if costs is not None else [1.0] * len(names), n_stages)
    starts = [_index(names, b) for b in boundaries]
    if len(starts) != n_stages - 1 or starts != sorted(set(starts)) or \
            (starts and (starts[0] <= 0 or starts[-1] >= len(names))):
        raise DefinitionError(f"pipeline boundaries {list(boundaries)} must be {n_stages - 1} "
                              f"increasing piece indices or names, each after the first "
                              f"piece: the start of stages 1 .. {n_stages - 1}")
    edges = [0, *starts, len(names)]
    return list(itertools.pairwise(edges))


def _index(names: Sequence[str], bound: int | str) -> int:
    if isinstance(bound, int):
        return bound
    if bound not in names:
        raise DefinitionError(f"no piece named {bound!r} to start a pipeline stage at; the "
                              f"pieces are {', '.join(names)}")
    return list(names).index(bound)


def _balanced(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges minimising the largest sum (ties: earlier stages larger)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest largest-stage cost of pieces i.. in k stages
    best = [[float("inf")] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[n] * (n + 1) for _ in range(n_stages + 1)]
    best[0][n] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(n - 1, -1, -1):
            for j in range(n - k + 1, i, -1):  # largest first stage among the ties
                worst = max(prefix[j] - prefix[i], best[k - 1][j])
                if worst < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = worst, j
    bounds, i = [], 0
    for k in range(n_stages, 0, -1):
        bounds.append((i, cut[k][i]))
        i = cut[k][i]
    return bounds


def parameter_counts(pieces: Sequence[tuple[str, torch.nn.Module]]) -> list[float]:
    """Each piece's number of parameters: a cost to balance stages' memory by."""
    return [float(sum(p.numel() for p in module.parameters())) for _, module in pieces]


def split_pieces(pieces: Sequence[tuple[str, torch.nn.Module]], n_stages: int,
                 boundaries: Sequence[int | str] | None = None,
                 costs: Sequence[float] | None = None) -> list[StageModule]:
    """The stage modules of ``pieces`` cut by :func:`stage_bounds`."""
    bounds = stage_bounds([name for name, _ in pieces], n_stages, boundaries, costs)
    return [StageModule(pieces[a:b]) for a, b in bounds]
