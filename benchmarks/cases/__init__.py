"""The benchmark cases, one module per family; each case is ``run(ctx) -> list[Record]``.

``CASES`` lists them in the order they run; ``ALIASES`` names groups for ``--cases``.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.cases import (
    attention,
    attention_dropout,
    autodiff,
    collectives,
    context_parallel,
    fusion,
    gpt3,
    mlp,
    overhead,
    overlap,
)
from benchmarks.context import Context
from benchmarks.harness import Record

CASES: dict[str, Callable[[Context], list[Record]]] = {
    "attention_seed": attention.seed_case,
    "attention_large": attention.large_case,
    "attention_dropout": attention_dropout.run,
    "overhead": overhead.run,
    "mlp": mlp.run,
    "mlp_autodiff": autodiff.mlp_run,
    "collectives": collectives.run,
    "fusion": fusion.run,
    "gpt3_layer": gpt3.run,
    "overlap": overlap.run,
    "context_parallel": context_parallel.run,
}

ALIASES: dict[str, tuple[str, ...]] = {
    "all": tuple(CASES),
    "attention": ("attention_seed", "attention_large", "attention_dropout"),
    # issue 16: the seed's attention with dropout 0.1 against 0.0
    "dropout": ("attention_dropout",),
    # issue 2: execute against the same torch calls made directly (case 1's meshfuse/direct
    # ratio, case 3's host overhead)
    "issue2": ("attention_seed", "overhead"),
    # issue 13's "done when", in one run: fused segments against torch eager, torch.compile
    # and the memory floor; the seed attention's plain execute against bare aten calls; the
    # large attention against direct cuDNN; the Megatron MLP against DTensor and one GPU;
    # host time per call
    "issue13": ("fusion", "attention_seed", "attention_large", "overhead", "mlp"),
    # issue 17: fwd+bwd through derived backwards against hand-written ones and DTensor
    "autodiff": ("mlp_autodiff", "gpt3_layer"),
    # issue 19: nvFuser's GPT-3 layer, TP + SP, against DTensor and one GPU
    "issue19": ("gpt3_layer",),
    # issue 18: row/column-parallel linears with stream-parallel loops against no overlap
    # and PyTorch's async TP
    "issue18": ("overlap",),
    # issue 14: ring / all-gather / all-to-all attention on a sharded sequence, torch's
    # context_parallel, one GPU
    "issue14": ("context_parallel",),
}


def resolve(spec: str) -> list[str]:
    """Case names from a comma-separated list of names and aliases, in ``CASES`` order.

    Raises:
        ValueError: for a name that is neither a case nor an alias.
    """
    wanted: set[str] = set()
    for name in filter(None, (part.strip() for part in spec.split(","))):
        if name in ALIASES:
            wanted.update(ALIASES[name])
        elif name in CASES:
            wanted.add(name)
        else:
            known = ", ".join([*CASES, *ALIASES])
            raise ValueError(f"unknown case {name!r}; choose from: {known}")
    return [name for name in CASES if name in wanted]
