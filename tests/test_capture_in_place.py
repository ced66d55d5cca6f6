"""A forward that writes into tensors it made (``q = k.new_empty(...)``,
``q[..., :d] = a``: DeepSeek's attention fills its queries so) is captured functionally:
PyTorch's functionalization makes the writes ``copy`` and ``slice_scatter``, which meshfuse
translates (the fusion computes the filled tensor as a value); before, the write ran as a
graph break on a fusion's output and PyTorch refused it (a view made inside an autograd
Function, modified in place). Values and gradients against the module at every world
size, with the projections column- and row-parallel."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from capture_checks import check_gradients
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.capture.partition import fold, partition, simplify, static_nodes
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.capture.trace import capture
from meshfuse.testing.utils import current_device

B, S, D = 2, 6, 8


class Filled(torch.nn.Module):
    """Two projections whose halves are written, swapped and scaled, into a tensor made
    with ``new_empty`` (a middle range too), then projected back."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(D, 2 * D)
        self.down = torch.nn.Linear(2 * D, D)

    def forward(self, x):
        h = self.up(x)
        a, b = h.split([D, D], dim=-1)
        q = h.new_empty(h.shape)
        q[..., :D] = b * 2
        q[..., D:] = a
        q[..., 2:4] = torch.tanh(a[..., :2])  # overwrite a middle range
        return self.down(q).pow(2).mean()


def _x(device: torch.device | str = "cpu"):
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(1)).to(device)


def test_the_writes_become_rules_not_breaks():
    module = Filled()
    captured = capture(module, (_x(),), {})
    targets = {str(n.target) for n in captured.graph.nodes if n.op == "call_function"}
    assert "aten.copy_.default" not in targets and "aten.slice_scatter.default" in targets
    simplify(captured.graph)
    constants = fold(static_nodes(captured), dict(captured.constants))
    assert [str(b.node.target) for b in partition(captured.graph, constants).breaks] == \
        ["aten.new_empty.default"]


@pytest.mark.mpi
@pytest.mark.parametrize("plan", [{}, {"up": ColwiseParallel(), "down": RowwiseParallel()}],
                         ids=["replicated", "tp"])
def test_values_and_gradients_match_the_module(multidevice_test, plan):
    torch.manual_seed(0)
    reference = Filled().to(current_device())
    model = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(model, DeviceMesh(range(multidevice_test.size)), plan)
        loss = model(_x(current_device()))
    expected = reference(_x(current_device()))
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.backward()
    check_gradients(model, reference)
