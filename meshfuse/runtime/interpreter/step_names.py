"""Each step of a program named in ``torch.profiler``'s traces, while a profiler records.

A profile of a meshfuse call otherwise lists PyTorch's operators and kernels with nothing
that says which step of the program launched them: a derived backward's forty kernels read
as forty anonymous reductions and copies. While a profiler records (``torch.profiler``,
``torch.autograd.profiler``: :func:`profiling`), the interpreter runs each step inside a
``record_function`` range named ``meshfuse step I of N: <the step's label>``; the
operators, kernels and GPU time of the step are that range's children in the trace and in
``key_averages()`` (its device time is the step's kernels'). Outside a profile nothing is
wrapped (the check costs about 0.1 us per call).

A call replayed from a CUDA graph launches its kernels as one graph: they show under the
graph's launch, not under steps. ``MESHFUSE_CUDA_GRAPH=0`` gives the step-by-step view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

PREFIX = "meshfuse step "
LONGEST = 200  # characters of a step's label kept in its name (a segment's lists its steps)

profiling = torch.autograd._profiler_enabled  # whether a profiler records on this thread


def step_name(index: int, count: int, label: str) -> str:
    """The profiler name of step ``index`` of ``count``: unique within a program, and the
    number of steps tells programs apart (a forward's from its backward's)."""
    text = label if len(label) <= LONGEST else label[:LONGEST - 3] + "..."
    return f"{PREFIX}{index} of {count}: {text}"


def named_calls(labels: Sequence[str], calls: Sequence[Callable]) -> tuple[Callable, ...]:
    """``calls``, each running inside a ``record_function`` range named after its step."""
    return tuple(_named(step_name(i, len(calls), label), call)
                 for i, (label, call) in enumerate(zip(labels, calls, strict=True)))


def _named(name: str, call: Callable) -> Callable:
    def named(*args, **kwargs):
        with torch.profiler.record_function(name):
            return call(*args, **kwargs)

    return named
