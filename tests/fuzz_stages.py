"""Random pipelines for the differential fuzzer (``test_fuzz_stages.py``).

A seed draws, for one world size ``d`` (the pipeline ranks), independently:

- the schedule: GPipe, 1F1B, Interleaved1F1B (2 or 3 stages per rank), ZeroBubble (1 or 2
  per rank) or ZBV (2 per rank, in a V), and 1-8 microbatches (those the schedule takes);
- the model: as many pieces as stages up to four more, each a Linear (with or without
  bias, sometimes followed by tanh), a residual MLP, a LayerNorm or a parameterless tanh,
  the widths changing between pieces (so each stage boundary carries its own shape);
  sometimes an embedding first (the first stage takes integer ids), sometimes a sequence
  axis (3-D activations);
- the cut: balanced, by parameter count, or at random piece indices;
- 1-3 rows per microbatch;
- sometimes several values per stage boundary: each piece then carries, beside its
  activation, a side sum (floating, needing a gradient), integer ids and a float mask
  (neither needing one) from piece to piece, the last piece adding the side sum in;
- at an even world size, sometimes data parallel inside each stage: the ranks form a
  ``pp x 2`` grid, each stage's parameters held as a ShardedStage over its pair (gathered
  once per step), each rank running half of every microbatch's rows;
- with an embedding first, sometimes a head tied to it last (a Linear whose weight is the
  embedding's, after a projection to its width): where they fall in different stages, each
  holds a copy whose gradients :class:`~meshfuse.capture.pipeline.ties.TiedGradients` adds
  after each step (not where the first and the last stage lie on one rank as ShardedStages,
  which the pipeline refuses).

:func:`check` runs two steps of the pipeline (float64) and of the same model on one device
and returns what differs: each step's loss on the last stage, every parameter's gradient
on the rank that holds it.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from meshfuse import DeviceMesh
from meshfuse.capture.pipeline.ties import Tie, TiedGradients
from meshfuse.parallel.stages import (
    PipelineRunner,
    ShardedStage,
    parameter_counts,
    schedule,
    split_pieces,
)
from meshfuse.runtime.comm.collectives import group_along
from meshfuse.runtime.comm.communicator import Communicator

VOCAB = 11


@dataclasses.dataclass(frozen=True)
class Draw:
    name: str
    n_virtual: int | None
    microbatches: int
    pieces: tuple[tuple[str, int], ...]  # (kind, output width)
    width: int  # the model's input width (or the embedding's)
    embedding: bool
    seq: int | None
    cut: str | tuple[int, ...]  # "balanced", "parameters" or piece indices
    rows: int  # per microbatch
    dp: int  # devices per stage, each running its share of the rows
    carry: bool = False  # pieces pass on a tuple (activation, side, ids, mask)
    tied: bool = False  # a head tied to the embedding last

    def describe(self) -> str:
        return (f"{self.name} (v={self.n_virtual}), dp {self.dp}, {self.microbatches} "
                f"microbatches of {self.rows} rows, seq {self.seq}, embedding {self.embedding}, input width "
                f"{self.width}, pieces {list(self.pieces)}, cut {self.cut}, carry "
                f"{self.carry}, tied head {self.tied}")


def _microbatches(rng: random.Random, name: str, d: int) -> int:
    choices = list(range(1, 9))
    if name in ("Interleaved1F1B", "ZeroBubble"):  # whole rounds of about d microbatches
        choices = [m for m in choices if m % max(1, m // d) == 0]
    return rng.choice(choices)


def draw(seed: int, d: int) -> Draw:
    rng = random.Random(seed * 7919 + d)
    dp = 2 if d % 2 == 0 and rng.random() < 0.3 else 1
    p = d // dp
    name = rng.choice(["GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble", "ZBV"])
    n_virtual = {"Interleaved1F1B": rng.choice([2, 3]), "ZeroBubble": rng.choice([1, 2])
                 }.get(name)
    n_stages = p * ({"ZBV": 2}.get(name) or n_virtual or 1)
    n_pieces = n_stages + rng.randint(0, 4)
    embedding = rng.random() < 0.3
    pieces = []
    for i in range(n_pieces):
        kinds = ["linear", "linear_tanh", "residual", "norm", "tanh"]
        if i == 0 and embedding:
            kinds = ["embedding"]
        pieces.append((rng.choice(kinds), rng.choice([3, 4, 6])))
    if rng.random() < 0.5:
        cut: str | tuple[int, ...] = rng.choice(["balanced", "parameters"])
    else:
        cut = tuple(sorted(rng.sample(range(1, n_pieces), n_stages - 1)))
    carry = random.Random(seed * 31 + d + 1).random() < 0.3  # (the other draws unchanged)
    microbatches = _microbatches(rng, name, p)
    # (as ShardedStages, the first and the last stage on one rank would be two copies on
    # the same devices, which the pipeline refuses)
    placement = schedule(name, p, microbatches, n_virtual).placement
    tied = embedding and not carry and (dp == 1 or placement[0] != placement[-1]) and \
        random.Random(seed * 53 + d + 2).random() < 0.6
    return Draw(name, n_virtual, microbatches, tuple(pieces),
                rng.choice([3, 5]), embedding, rng.choice([None, 2]), cut,
                dp * rng.randint(1, 2 if dp > 1 else 3), dp, carry, tied)


class _Residual(torch.nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Carry(torch.nn.Module):
    """A piece passing on ``(activation, side, ids, mask)``: several values per boundary,
    one needing a gradient beside the activation, two not (integer ids, a float mask)."""

    def __init__(self, module: torch.nn.Module, last: bool) -> None:
        super().__init__()
        self.module, self.last = module, last

    def forward(self, x):
        if isinstance(x, tuple):
            x, side, ids, mask = x
        else:  # the first piece: ids and mask from the input (alike in any block of rows)
            ids = (x % 3)[..., None] if not x.is_floating_point() else \
                (x[..., :1] > 0).to(torch.int64)
            mask = (ids == 0).to(torch.float64)
            side = torch.zeros(ids.shape, dtype=torch.float64)
        y = self.module(x)
        side = side + torch.tanh(y).mean(-1, keepdim=True) * (1 + mask) * (ids + 1)
        return y + side if self.last else (y, side, ids, mask)


def _piece(kind: str, width: int, out: int) -> tuple[torch.nn.Module, int]:
    """A piece taking ``width`` features and the width it gives."""
    if kind == "embedding":
        return torch.nn.Embedding(VOCAB, out), out
    if kind in ("linear", "linear_tanh"):
        layer = torch.nn.Linear(width, out, bias=out != 4)
        return (torch.nn.Sequential(layer, torch.nn.Tanh()) if kind == "linear_tanh"
                else layer), out
    if kind == "residual":
        return _Residual(width, out), width
    if kind == "norm":
        return torch.nn.LayerNorm(width), width
    return torch.nn.Tanh(), width


def pieces(x: Draw) -> tuple[list[tuple[str, torch.nn.Module]], int]:
    """The model's pieces (float64, seeded) and its output width."""
    torch.manual_seed(0)
    made, width = [], x.width
    for i, (kind, out) in enumerate(x.pieces):
        module, width = _piece(kind, width, out)
        if x.carry:
            module = _Carry(module, i == len(x.pieces) - 1)
        made.append((f"p{i}", module.double()))
    if x.tied:  # a head whose weight is the embedding's
        table = made[0][1].weight
        if width != table.shape[1]:
            made.append(("proj", torch.nn.Linear(width, table.shape[1]).double()))
        head = torch.nn.Linear(table.shape[1], VOCAB, bias=False)
        head.weight = table
        made.append(("head", head))
        width = VOCAB
    return made, width


def batch(x: Draw, out_width: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    rows = x.rows * x.microbatches
    lead = (rows,) if x.seq is None else (rows, x.seq)
    inputs = torch.randint(0, VOCAB, lead, generator=g) if x.embedding else \
        torch.randn(*lead, x.width, generator=g, dtype=torch.float64)
    return inputs, torch.randn(*lead, out_width, generator=g, dtype=torch.float64)


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(y, target)


def check(x: Draw, rank: int, d: int, steps: int = 2) -> list[str]:
    """What differs between the pipeline and the one-device model (empty: nothing)."""
    p = d // x.dp
    plan = schedule(x.name, p, x.microbatches, x.n_virtual)
    made, out_width = pieces(x)
    whole = torch.nn.Sequential(*[m for _, m in pieces(x)[0]])
    cut = x.cut if isinstance(x.cut, tuple) else None
    costs = parameter_counts(made) if x.cut == "parameters" else None
    stages: list[torch.nn.Module] = list(split_pieces(made, plan.n_stages, cut, costs))
    grid = torch.arange(d).reshape(p, x.dp)  # pipeline rank r: devices grid[r]
    pp_rank, coordinate = divmod(rank, x.dp)
    mine = {s: stages[s] for s in plan.stages_of(pp_rank)}
    if x.dp > 1:
        pair = group_along(Communicator.instance(), DeviceMesh(grid), 1)
        mine = {s: ShardedStage(m, pair) for s, m in mine.items()}
    runner = PipelineRunner(plan, mine, _loss, grid.tolist(),
                            data_parallel=(coordinate, x.dp) if x.dp > 1 else None)
    tied = TiedGradients(_ties(made, stages), grid.tolist(), plan.placement, mine,
                         flat=x.dp > 1)
    problems = []
    for step in range(steps):
        inputs, targets = batch(x, out_width, step)
        whole.zero_grad(set_to_none=True)
        for s in mine.values():
            s.zero_grad(set_to_none=True)
        # the input needs a gradient as the pipeline's second stage's does (so that a
        # model without parameters still has a backward to run)
        out = whole(inputs.requires_grad_(True) if inputs.is_floating_point() else inputs)
        _loss(out, targets).backward()
        want = _rows_loss(out.detach(), targets, x, coordinate)
        tied.begin_step()
        got = runner.step(inputs, targets)
        tied.add_up()
        holds_last = plan.n_stages - 1 in mine
        if holds_last != (got is not None):
            problems.append(f"step {step}: loss {got} on a rank holding stages {list(mine)}")
        elif got is not None and not torch.allclose(got, want, rtol=1e-10):
            problems.append(f"step {step}: loss {got.item()} != {want.item()}")
        problems += _grad_problems(step, whole, stages, mine, coordinate)
    return problems


def _ties(made: list[tuple[str, torch.nn.Module]], stages: list[torch.nn.Module]
          ) -> list[Tie]:
    """The embedding's weight as a tie of the stages holding it (none: one stage does)."""
    if not made or not isinstance(made[0][1], torch.nn.Embedding):
        return []
    table = made[0][1].weight
    holders = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            if p is table:
                holders.setdefault(s, name)
    return [Tie(tuple(holders.items()))] if len(holders) > 1 else []


def _rows_loss(out: torch.Tensor, targets: torch.Tensor, x: Draw, coordinate: int
               ) -> torch.Tensor:
    """The mean over microbatches of the loss of this rank's block of each one's rows."""
    return torch.stack([_loss(o.chunk(x.dp)[coordinate], t.chunk(x.dp)[coordinate])
                        for o, t in zip(out.chunk(x.microbatches),
                                        targets.chunk(x.microbatches))]).mean()


def _grad_problems(step, whole, stages, mine, coordinate) -> list[str]:
    """The gradients of this rank's stages' parameters against the one-device model's (a
    ShardedStage's: its block of the flat gradients)."""
    reference = [p for _, p in whole.named_parameters(remove_duplicate=False)]  # (tied)
    offset, problems = 0, []
    for s, stage in enumerate(stages):
        params = list(stage.parameters())
        want = reference[offset:offset + len(params)]
        offset += len(params)
        if s not in mine:
            continue
        pairs = [(p.grad, q.grad) for p, q in zip(stage.parameters(), want)]
        if isinstance(mine[s], ShardedStage):
            sharded, n = mine[s], mine[s].shard.numel()
            flat = torch.cat([q.grad.reshape(-1) for q in want] +
                             [torch.zeros(2 * n, dtype=torch.float64)])
            pairs = [(sharded.shard.grad, flat[coordinate * n:(coordinate + 1) * n])]
        for i, (got, expected) in enumerate(pairs):
            if got is None and (expected is None or expected.numel() == 0):
                continue  # no gradient, or an empty shard (a stage without parameters)
            if got is None or expected is None or \
                    not torch.allclose(got, expected, rtol=1e-9, atol=1e-12):
                problems.append(f"step {step}: stage {s} parameter {i} gradient differs")
    return problems
