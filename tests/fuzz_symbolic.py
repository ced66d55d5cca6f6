"""Symbolic extents in fuzz programs (``Features.symbolic``).

nvFuser's ``define_tensor`` takes ``-1`` for an extent known only when the fusion runs (its
default, and what a dynamic-shape trace writes); ``1`` still declares a broadcast axis. With
this feature, a program is drawn as without it (statements, shapes, schedule: the generator's
own random stream is untouched), then a generator of its own (:func:`choose`) declares some of
its inputs' extents ``-1``: every axis of extent above 1 (most programs), or each such axis
with probability one half. So the same seed gives the same computation with static and with
symbolic extents, and a refusal of only the symbolic one is the engine's.

A rank outside a symbolic input's mesh passes a tensor of its global shape there (on the meta
device: :func:`stand_in`), from which it learns the extents.
"""

from __future__ import annotations

import random

import torch

SHARE = 0.6  # of the programs drawn with the feature, those with symbolic extents
ALL_AXES = 0.7  # of those, the ones with every extent above 1 symbolic (else each axis 1/2)


def choose(program) -> None:
    """Sets ``program.symbolic``: input name -> its declared shape, ``-1`` where symbolic
    (absent: static); drawn from the program's seed only."""
    rng = random.Random(f"symbolic {program.seed} {program.world_size}")
    if rng.random() >= SHARE:
        return
    every = rng.random() < ALL_AXES
    for name, shape in program.inputs:
        declared = [-1 if e != 1 and (every or rng.random() < 0.5) else e for e in shape]
        if declared != list(shape):
            program.symbolic[name] = declared
    if program.symbolic:
        program.features.add("symbolic")


def stand_in(tv, shape, dtype: torch.dtype) -> torch.Tensor | None:
    """What a rank outside ``tv``'s mesh passes for it: None, or for an input with symbolic
    extents a meta tensor of its global ``shape``."""
    if any(i.extent is None for i in tv.logical):
        return torch.empty(list(shape), dtype=dtype, device="meta")
    return None
