"""Persistent kernels for reductions along rows of up to 4096 elements, on GPUs.

A segment that reduces along rows (:mod:`~meshfuse.runtime.interpreter.segment_reductions`:
a norm's or a softmax's statistics over the features) is compiled by Inductor with
:class:`PersistentRows` as its heuristics: a reduction along rows of at most
:data:`PERSISTENT_ROW` elements becomes a *persistent* kernel, each row held whole in
registers and read once. Inductor's own bound (1024) loops over longer rows and reads them
more than once: softmax over rows of 4096 (bf16, 8192 rows per H200) took 80.5 us looped
and 38.7 us persistent, where a copy of its bytes takes 34.9. Its ``triton.multi_kernel``
setting, which generates both kernels and keeps the faster at the first run, keeps the
buffers of both as well: a layer norm's derived backward wrote a float32 ``[tokens,
features]`` product that only the looped kernel reads (64 MiB per step at the medium GPT
layer, 2 x 4096 tokens of 4096 features).

Imported where a segment is compiled for a GPU, not with meshfuse (Inductor's modules take
a second to import).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

# the longest rows (elements) reduced by a persistent kernel
PERSISTENT_ROW = 4096


class PersistentRows(InductorChoices):
    """Inductor's heuristics, but a reduction along rows of at most :data:`PERSISTENT_ROW`
    elements is persistent (see the module doc)."""

    @staticmethod
    def should_use_persistent_reduction(features, cooperative_reduction: bool) -> bool:
        if (torch._inductor.config.triton.persistent_reductions and not cooperative_reduction
                and features.get_reduction_hint() == ReductionHint.INNER
                and V.graph.sizevars.statically_known_leq(features.reduction_numel,
                                                          PERSISTENT_ROW)):
            return True
        return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

    def uuid(self) -> str:
        """Its part of Inductor's cache key (as torch's ``inductor_choices_class``)."""
        return f"meshfuse.PersistentRows({PERSISTENT_ROW})"


# how :func:`~meshfuse.runtime.interpreter.fused.inductor_patches` names :class:`PersistentRows`
# among a segment's Inductor settings, as ``inductor_choices_class`` (a name: the settings are
# made without importing this module)
NAME = "meshfuse.PersistentRows"


def compiling(patches: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(context, settings)`` to compile a segment with Inductor's ``patches``: where their
    ``inductor_choices_class`` is :data:`NAME`, the context makes :class:`PersistentRows`
    Inductor's heuristics, and the settings hold the class there where this torch has that
    setting (part of Inductor's cache key, so that kernels compiled with other heuristics
    are not reused), none elsewhere."""
    if patches.get("inductor_choices_class") != NAME:
        return contextlib.nullcontext(), patches
    settings = {k: v for k, v in patches.items() if k != "inductor_choices_class"}
    if hasattr(torch._inductor.config, "inductor_choices_class"):
        settings["inductor_choices_class"] = PersistentRows
    return V.set_choices_handler(PersistentRows()), settings
