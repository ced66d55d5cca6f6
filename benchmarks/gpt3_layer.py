"""The GPT-3 layer of nvFuser's multi-device transformer test, for the ``gpt3_layer`` case:
its FLOPs. The torch modules of the baselines and DTensor's plan are
:mod:`meshfuse.examples.gpt_torch` (``Gpt3Block``, ``parallelize``); the meshfuse programs
are :class:`~meshfuse.examples.gpt.GptBlock` (forward only, backward derived) and
:class:`~meshfuse.examples.gpt.GptBlockWithBackward` (backward written by hand).
"""

from __future__ import annotations


def layer_flops(b: int, s: int, e: int) -> float:
    """Forward and backward: 3 x (the linears' 24 b s e^2 + attention's 4 b s^2 e)."""
    return 3.0 * (24.0 * b * s * e * e + 4.0 * b * s * s * e)
