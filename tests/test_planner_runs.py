"""A plan from ``meshfuse.plan`` runs: a small Llama (the examples' PyTorch twin) laid out by
the planner's choice through ``meshfuse.parallelize`` gives the unsharded module's loss and
gradients, with the collectives the planner's estimate counted; and the estimate's FSDP
memory is what a fully sharded GPT stack's memory account measures."""

from __future__ import annotations

import copy
import gc
import warnings
from collections import Counter

import pytest
import torch
from torch.distributed.tensor import DTensor

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.autodiff.fsdp_module import FullyShardedModule
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.cost import CostModel
from meshfuse.examples.gpt import parameter_shapes
from meshfuse.examples.gpt_stack import GptStack, stack_parameters, torch_loss
from meshfuse.examples.llama import LlamaConfig
from meshfuse.examples.llama_torch import LlamaTorch
from meshfuse.parallel.fsdp import GATHERED, NamedMesh
from meshfuse.planner import spec_of
from meshfuse.planner.estimate import layout_cost
from meshfuse.planner.layouts import fsdp
from meshfuse.runtime.comm.collectives import record_communications

pytestmark = pytest.mark.mpi

# Every size divides over 1-4 ranks but the 2 key/value heads (replicated beyond 2).
CFG = LlamaConfig(vocab=96, hidden=96, heads=12, kv_heads=2, ffn=96, seq=12, layers=2)


def _whole(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def test_the_planned_layout_runs_and_matches_the_module(multidevice_test):
    size = multidevice_test.size
    g = torch.Generator().manual_seed(0)
    ids, targets = (torch.randint(0, CFG.vocab, (1, CFG.seq), generator=g) for _ in "it")
    # One sequence a step: no data parallelism; context parallelism is not a parallelize
    # style: the planner is left tensor+sequence parallelism or one rank's layout.
    chosen = meshfuse.plan(CFG, DeviceMesh(range(size)), example_inputs=(ids, targets),
                           calibration="cpu_gloo", context=False)
    assert chosen.layout.shape == (size,)
    if size > 1:
        assert chosen.layout.roles == ("tp",), chosen.explain()
    torch.manual_seed(0)
    reference = LlamaTorch(CFG)
    model = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(model, DeviceMesh(range(size)), chosen.parallelize_plan())
        model(ids, targets)  # build
        with record_communications() as comms:
            loss = _whole(model(ids, targets))
    expected = reference(ids, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(_whole(p.grad), ref.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    traffic = Counter(c.kind for c in comms if len(c.ranks) > 1)
    if size == 1:
        assert traffic == Counter()
    else:
        # the estimate's count per block and forward: 2 reduce-scatters, 2 all-gathers (and
        # the head's gathers; k and v gathered where their 2 heads do not split)
        assert traffic["reduce_scatter"] == 2 * CFG.layers
        assert traffic["allgather"] >= 2 * CFG.layers + 2


def test_the_fsdp_estimate_is_the_memory_account(multidevice_test):
    """A GPT stack fully sharded over every rank (the plan's ``fsdp_options`` form): its loss
    is the unsharded stack's, one gather per block in the forward, and its parameters,
    gradients and AdamW moments over the ranks are the estimate's 16 bytes a parameter; the
    gathered parameters peak within the estimate's two blocks."""
    size, layers, heads = multidevice_test.size, 2, 4
    fd = GptStack(12, 8, 16, heads, layers)
    estimate = layout_cost(spec_of(fd), fsdp((size,)), CostModel.for_device("cpu"))
    assert estimate.blocks == layers and not estimate.infeasible
    fd = GptStack(12, 8, 16, heads, layers, NamedMesh(DeviceMesh(range(size)), ("dp",)))
    tvs, init = fd.parameter_inputs(), stack_parameters(16, layers)
    groups = [[f"{k}_{n}" for n in parameter_shapes(16)] for k in range(layers)]
    model = FullyShardedModule(fd, {n: (tvs[n], init[n]) for n in tvs}, groups,
                               [fd.input, fd.target], NamedMesh(DeviceMesh(range(size)),
                                                                ("dp",)), shard="dp")
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(12, 8, 16, generator=g), torch.randn(12, 8, 16, generator=g)
    gc.collect()  # gathers of earlier tests' modules that wait in reference cycles
    before = GATHERED.live
    GATHERED.reset_peak()
    with record_communications() as comms:
        loss = model(model.shard_input(fd.input, x), model.shard_input(fd.target, target))
    torch.testing.assert_close(loss, torch_loss(x, target, init, layers, heads), rtol=1e-5,
                               atol=1e-6)
    loss.backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    account = model.memory_account(opt)
    total = torch.tensor(float(account.sharded_state))
    torch.distributed.all_reduce(total)
    assert total.item() == pytest.approx(estimate.memory_parts["state"] * size, rel=1e-9)
    if size > 1:
        gathers = [c for c in comms if c.kind == "allgather" and len(c.ranks) > 1]
        assert len(gathers) == layers
        assert 0 < account.gathered_peak - before <= 1.1 * estimate.memory_parts["gathered"]
