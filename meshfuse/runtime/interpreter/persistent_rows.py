"""Persistent kernels for reductions along rows of up to 16384 elements, on GPUs.

A segment that reduces along rows (:mod:`~meshfuse.runtime.interpreter.segment_reductions`:
a norm's or a softmax's statistics over the features) is compiled by Inductor with
``PersistentRows`` (:func:`choices_class`) as its heuristics: a reduction along rows of at most
:data:`PERSISTENT_ROW` elements becomes a *persistent* kernel, each row held whole in
registers and read once. Inductor's own bound (1024) loops over longer rows and reads them
more than once: softmax over rows of 4096 (bf16, 8192 rows per H200) took 80.5 us looped
and 38.7 us persistent, where a copy of its bytes takes 34.9; the big GPT layer's derived
layer-norm backward over rows of 12288 (2048 tokens, bf16, H100) 294 us looped and 220
persistent, its forward 131 and 117. Inductor's ``triton.multi_kernel`` setting, which
generates both kernels and keeps the faster at the first run (meshfuse's setting until
2026-12-06), keeps the buffers of both as well: that backward wrote a float32 ``[tokens,
features]`` product that only the looped kernel reads (its row kernel 233 us at the big
layer; 84.5 against 66.8 at the medium one, 2 x 2048 tokens of 4096 features:
``benchmarks/results/2026-12-06-114*-h100-1gpu-kernel-diff-*``).

The heuristics are given to Inductor through its choices handler
(``V.set_choices_handler``) for the segment's compilation only. A segment's settings name
them (:data:`SETTING`, its value the bound): meshfuse's own key, never given to Inductor's
config, which keeps the compiled segments' cache (its key holds the settings) apart per
bound. Inductor's FX graph cache is not involved: meshfuse hands it the graph without Dynamo
(no shape environment, which that cache bypasses); its kernel caches are keyed by the
generated source. The class subclasses Inductor's ``InductorChoices``, whose modules take a
second to import: it is made at its first use (:func:`choices_class`), not when meshfuse is
imported.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

# the longest rows (elements) reduced by a persistent kernel
PERSISTENT_ROW = 16384
# the key of a segment's settings that names these heuristics (its value: the bound)
SETTING = "meshfuse.persistent_rows"


@functools.cache
def choices_class() -> type:
    """``PersistentRows(row)``: Inductor's heuristics (a subclass of its
    ``InductorChoices``), but a reduction along rows of at most ``row`` elements is
    persistent (see the module doc). Made at the first call."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class PersistentRows(InductorChoices):
        def __init__(self, row: int = PERSISTENT_ROW) -> None:
            super().__init__()
            self.row = row

        def should_use_persistent_reduction(self, features,
                                            cooperative_reduction: bool) -> bool:
            if (torch._inductor.config.triton.persistent_reductions
                    and not cooperative_reduction
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel,
                                                              self.row)):
                return True
            return InductorChoices.should_use_persistent_reduction(
                features, cooperative_reduction)

    return PersistentRows


def compiling(patches: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(context, settings)`` to compile a segment with ``patches`` (see
    :func:`~meshfuse.runtime.interpreter.fused.inductor_patches`): where they hold
    :data:`SETTING`, the context makes ``PersistentRows`` of that bound Inductor's
    heuristics, and the settings (Inductor's config) are the others."""
    row = patches.get(SETTING)
    if row is None:
        return contextlib.nullcontext(), patches
    from torch._inductor.virtualized import V

    settings = {k: v for k, v in patches.items() if k != SETTING}
    return V.set_choices_handler(choices_class()(row)), settings
