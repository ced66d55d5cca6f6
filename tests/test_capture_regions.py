"""Higher-order ops in the captured graph: ``torch.no_grad()`` and ``torch.autocast`` blocks
are inlined (their ops fused, no gradient out of a no-grad block, autocast's casts made
explicit); another higher-order op (``torch.cond``) is a graph break that calls its
submodules. Hugging Face's rotary embedding of transformers 5.17 is a ``@torch.no_grad()``
function: its block read by a break failed before (``KeyError: 'submod_3'``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.capture.trace import capture
from meshfuse.runtime.comm.collectives import record_communications

E, HIDDEN = 8, 10  # HIDDEN shards unevenly over 3 and 4 ranks
PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class Blocks(torch.nn.Module):
    """A no-grad block reading a parameter and a buffer, an autocast-off block, and (with
    ``low``) a bfloat16 autocast block."""

    def __init__(self, low: bool = False):
        super().__init__()
        self.up = torch.nn.Linear(E, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, E)
        self.gate = torch.nn.Linear(E, E)
        self.register_buffer("freq", torch.arange(E, dtype=torch.float32))
        self.low = low

    def forward(self, x):
        with torch.no_grad():
            scale = torch.sigmoid(self.gate(x))  # a parameter read without gradient
            table = torch.cos(self.freq * 0.5)  # static: folded at capture
        with torch.autocast("cpu", enabled=False):
            h = F.gelu(self.up(x))
        if self.low:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = self.down(h).float()
        else:
            y = self.down(h)
        return (x + y * scale + table).sum(), y


class Branch(torch.nn.Module):
    """``torch.cond``: a higher-order op meshfuse runs as a graph break."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(E, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, E)

    def forward(self, x):
        h = self.up(x)
        h = torch.cond(h.sum() > 0, lambda t: t * 2.0, lambda t: torch.cos(t), (h,))
        return self.down(h).sum()


def _run(reference, x, size, **tolerance):
    mesh = DeviceMesh(range(size))
    model = meshfuse.parallelize(copy.deepcopy(reference), mesh, PLAN)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with record_communications() as forward:
            out = model(x)
    breaks = [str(w.message) for w in caught if w.category is GraphBreakWarning]
    expected = reference(x)
    loss, ref_loss = (out[0], expected[0]) if isinstance(out, tuple) else (out, expected)
    torch.testing.assert_close(loss, ref_loss, **tolerance)
    loss.backward()
    ref_loss.backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        if ref.grad is None:  # no gradient flows (meshfuse may pass zeros)
            assert p.grad is None or not p.grad.full_tensor().any(), name
            continue
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, **tolerance,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return model, breaks, [c.kind for c in forward if len(c.ranks) > 1]


@pytest.mark.mpi
def test_no_grad_and_autocast_off_blocks_are_fused_without_breaks(multidevice_test):
    torch.manual_seed(0)
    x = torch.randn(4, E, generator=torch.Generator().manual_seed(1))
    model, breaks, forward = _run(Blocks(), x, multidevice_test.size, rtol=1e-5, atol=1e-5)
    assert breaks == []
    assert "0 graph break(s)" in model.explain()
    assert model.gate.weight.grad is None or not model.gate.weight.grad.full_tensor().any()
    assert forward == (["allreduce"] if multidevice_test.size > 1 else [])  # Megatron's


@pytest.mark.mpi
def test_a_bfloat16_autocast_block_computes_its_linear_in_bfloat16(multidevice_test):
    torch.manual_seed(0)
    x = torch.randn(4, E, generator=torch.Generator().manual_seed(1))
    _, breaks, _ = _run(Blocks(low=True), x, multidevice_test.size, rtol=2e-2, atol=2e-2)
    assert breaks == []


def test_autocast_casts_are_explicit_after_inlining():
    """The bfloat16 block's linear reads casts of its float32 input, weight and bias; the
    graph keeps no higher-order op."""
    captured = capture(Blocks(low=True), (torch.randn(4, E),), {})
    nodes = list(captured.graph.nodes)
    assert not any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in nodes)
    linear = [n for n in nodes if n.target is torch.ops.aten.linear.default][-1]
    assert [a.target for a in linear.args] == [torch.ops.aten.to.dtype] * 3
    assert [a.args[1] for a in linear.args] == [torch.bfloat16] * 3
    assert captured.attributes == {}


@pytest.mark.mpi
def test_another_higher_order_op_is_a_graph_break_calling_its_submodules(multidevice_test):
    for seed in (1, 2):  # one input takes each branch
        torch.manual_seed(0)
        x = torch.randn(4, E, generator=torch.Generator().manual_seed(seed))
        _, breaks, _ = _run(Branch(), x, multidevice_test.size, rtol=1e-5, atol=1e-5)
        assert len(breaks) == 1 and "cond in the top module" in breaks[0]
