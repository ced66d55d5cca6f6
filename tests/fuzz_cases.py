"""Hand-written regression cases of the fuzzers: the record and its set-up, shared by
``test_fuzz_regressions.py`` (values and collectives) and ``test_fuzz_autodiff_regressions.py``
(derived gradients).

A :class:`Case` is the smallest form of a program that once failed: its definition for ``d``
ranks, its schedule on the meshes of its kind, its global input shapes and the same computation
in torch. :func:`set_up` defines and schedules it and draws its global inputs; each test file
runs it from there and compares its own way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from mesh_helpers import meshes_of_kind

from meshfuse import FusionDefinition


@dataclasses.dataclass(frozen=True)
class Case:
    """A hand-written program that once failed.

    Attributes:
        was: what went wrong before the fix.
        define: ``define(fd, d) -> tensors`` defines the fusion for ``d`` ranks.
        schedule: ``schedule(tensors, *meshes)`` pins some of them.
        reference: the same computation in torch: global inputs -> outputs.
        shapes: ``shapes(d)``: the global input shapes.
        meshes: ``"1d"`` (every rank), ``"2x2"`` (4 ranks only) or ``"two"`` (two meshes
            of half the ranks each, from 2 ranks); see ``mesh_helpers.meshes_of_kind``.
        comms: ``comms(d, kinds)``: whether the collectives that ran over more than one rank
            (their kinds, sorted) are the ones expected; None: not checked. Read by
            ``test_fuzz_regressions.py`` only.
        tol: tolerances of the comparison of the outputs (default: torch's for the dtype).
            Read by ``test_fuzz_regressions.py`` only; the gradient cases use one tolerance.
    """

    was: str
    define: Callable
    schedule: Callable
    reference: Callable
    shapes: Callable[[int], list[list[int]]]
    meshes: str = "1d"
    comms: Callable[[int, list[str]], bool] | None = None
    tol: dict = dataclasses.field(default_factory=dict)


def set_up(multidevice_test, case: Case) -> tuple[FusionDefinition, list[torch.Tensor],
                                                   torch.Generator]:
    """Defines ``case`` for this test's world size and schedules it on its meshes (skips the
    test where they need other world sizes).

    Returns:
        The fusion, the global inputs (on the CPU, the same on every rank) and the generator
        they were drawn from (seeded 0), for further draws the same on every rank.
    """
    d = multidevice_test.size
    meshes = meshes_of_kind(multidevice_test, case.meshes)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, generator=gen) for s in case.shapes(d)]
    with FusionDefinition() as fd:
        tensors = case.define(fd, d)
    case.schedule(tensors, *meshes)
    return fd, inputs, gen
