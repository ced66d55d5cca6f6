"""Which way a segment's reductions run (``meshfuse.runtime.interpreter.segment_reductions``):
along rows (the innermost axis reduced: a norm's statistics, a softmax) or across them (a
bias's gradient), on fake tensors strided as the real ones."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from meshfuse import DataType
from meshfuse.ops.registry import lookup
from meshfuse.runtime.interpreter.segment_reductions import reduces_along_rows

X = torch.randn(4, 16, 32)


def _graph(fn) -> fx.GraphModule:
    return fx.symbolic_trace(fn)


@pytest.mark.parametrize(("name", "fn", "inputs", "along"), [
    ("bias gradient", lambda a: torch.sum(a, dim=[0, 1]), [X], False),
    ("outer softmax", lambda a: torch.softmax(a, 0), [X], False),
    ("pointwise only", lambda a: a.exp() * 2, [X], False),
    ("row sum", lambda a: torch.sum(a, dim=[-1]), [X], True),
    ("softmax", lambda a: torch.softmax(a, -1), [X], True),
    ("norm statistics", lambda a: torch.var_mean(a, dim=[-1], correction=0), [X], True),
    ("every element", lambda a: a.sum(), [X], True),
    ("the innermost axis of a transposed input", lambda a: torch.sum(a, dim=[0]),
     [X.transpose(0, 2)], True),
    ("one row of several across", lambda a: (a.sum([0]), a.amax([-1])), [X], True),
    ("cross entropy", lambda a, t: torch.nn.functional.cross_entropy(a, t),
     [torch.randn(8, 10), torch.randint(0, 10, (8,))], True),
    ("elementwise maximum", lambda a, b: torch.max(a, b), [X, X], False),
    ("norm across rows", lambda a: torch.linalg.vector_norm(a, 2, dim=[0]), [X], False),
    ("norm along rows", lambda a: torch.norm(a, 2, dim=[2]), [X], True),
])
def test_reductions_along_or_across_rows(name, fn, inputs, along):
    assert reduces_along_rows(_graph(fn), inputs) is along, name


def _calling(fn, *args) -> fx.GraphModule:
    """A graph of one call of ``fn`` on its one input, as a segment's (fused.py) are."""
    graph = fx.Graph()
    graph.output(graph.call_function(fn, (graph.placeholder("x"), *args)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_meshfuse_reductions_are_seen_through_their_implementations():
    total = lookup("sum").impl
    assert not reduces_along_rows(_calling(total, [0, 1], False, DataType.Float),
                                  [X.to(torch.bfloat16)])
    assert reduces_along_rows(_calling(total, [2], False, None), [X])


def test_a_graph_that_reads_values_is_assumed_to_reduce_along_rows():
    graph = _graph(lambda a: torch.nonzero(a).sum(0))
    assert reduces_along_rows(graph, [X])
