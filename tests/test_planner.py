"""The planner (``meshfuse/planner/``): its choice is the exact best of the layouts it costs
(never worse than the hand-written Megatron TP+SP plan or plain FSDP), it follows the budget,
the batch and the sequence the way the cost model says it should, and the integer program's
size does not grow with the layers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import meshfuse
from meshfuse.cost import CostModel, load
from meshfuse.errors import InputError
from meshfuse.examples.gpt import GptBlock, parameter_shapes
from meshfuse.examples.gpt_stack import GptStack
from meshfuse.examples.llama import LlamaConfig, block_parameter_shapes
from meshfuse.planner import TransformerSpec, plan, spec_of
from meshfuse.planner.estimate import layout_cost, stage_split
from meshfuse.planner.layouts import Layout, enumerate_layouts, fsdp, megatron
from meshfuse.planner.projection import meshes, project
from meshfuse.planner.spec import GPT3_175B, LLAMA3_8B

GIB = 1 << 30
CALIBRATIONS = ("cpu_gloo", "h200")
SHAPES = [(2,), (4,), (8,), (2, 2), (2, 4), (4, 2)]
BLOCKS = {"gpt3": dataclasses.replace(GPT3_175B, layers=8, batch=8),
          "llama": dataclasses.replace(LLAMA3_8B, batch=8, seq=4096)}


def _with_recompute(cost, budget):
    """A layout's least step time within ``budget`` over its recomputed block counts."""
    if cost.infeasible:
        return math.inf
    fits = [cost.step_s + r * cost.recompute_s for r in range(cost.blocks + 1)
            if budget is None or cost.memory_bytes - r * cost.recompute_saves <= budget]
    return min(fits, default=math.inf)


@pytest.mark.parametrize("calibration", CALIBRATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block", sorted(BLOCKS))
@pytest.mark.parametrize("budgeted", [False, True])
def test_the_choice_is_no_worse_than_megatron_or_fsdp(block, shape, calibration, budgeted):
    spec, model = BLOCKS[block], CostModel(load(calibration))
    baselines = {name: layout_cost(spec, layout(shape), model)
                 for name, layout in (("megatron", megatron), ("fsdp", fsdp))}
    budget = None
    if budgeted:  # room for FSDP with every block recomputed, and a fifth more
        f = baselines["fsdp"]
        budget = 1.2 * (f.memory_bytes - f.blocks * f.recompute_saves)
    chosen = plan(spec, shape, budget, calibration=model)
    assert budget is None or chosen.memory_bytes <= budget * (1 + 1e-9)
    for name, cost in baselines.items():
        assert chosen.step_s <= _with_recompute(cost, budget) * (1 + 1e-9), name
    # and the best of every layout it considered, recomputation included
    best = min(_with_recompute(layout_cost(spec, layout, model), budget)
               for layout in enumerate_layouts(shape))
    assert chosen.step_s == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("calibration", CALIBRATIONS)
@pytest.mark.parametrize("shape", [(4,), (8,), (2, 4)], ids=str)
def test_fsdp_when_the_budget_forbids_replicated_weights(calibration, shape):
    """Replicated weights with their Adam state do not fit: the parameters are sharded
    over a data-parallel axis (FSDP), and the plan fits the budget."""
    spec = TransformerSpec("wide", 2048, 16, 16, 8192, 8, 1024, 1024, 16, dtype_bytes=2)
    model = CostModel(load(calibration))
    replicated = spec.parameters() * 16
    budget = 0.9 * replicated
    chosen = plan(spec, shape, budget, calibration=model)
    assert "dp" in chosen.layout.roles and chosen.memory_bytes <= budget
    replicas = Layout(shape, ("ddp",) * len(shape))
    assert _with_recompute(layout_cost(spec, replicas, model), budget) == math.inf


@pytest.mark.parametrize("calibration", CALIBRATIONS)
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_tensor_and_sequence_parallel_when_activations_dominate(calibration, ranks):
    """One sequence a step (the batch cannot be split) of moderate length through a wide
    block: the activations are split by TP+SP, whose collectives beat context parallelism's
    where the GEMMs, not attention, are most of the work (context parallelism hides its
    transfers under attention only, and keeps every weight whole)."""
    spec = TransformerSpec("one sequence", 4096, 32, 32, 16384, 8, 1024, 2048, 1,
                           dtype_bytes=2)
    chosen = plan(spec, (ranks,), calibration=calibration)
    assert chosen.layout.roles == ("tp",)
    explained = chosen.explain()
    assert "runner-up" in explained and chosen.runner_up.step_s >= chosen.step_s


@pytest.mark.parametrize("calibration", CALIBRATIONS)
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_ring_for_long_sequences(calibration, ranks):
    """A 64k-token sequence through a Llama-8B-wide block: attention's quadratic work hides
    the ring's block transfers, while TP+SP's collectives grow with the tokens and the
    all-gather strategy exposes its gathers: the ring is the best context strategy and beats
    TP+SP's whole collectives, and it is the plan where TP's collectives are not overlapped
    (as Megatron and torchtitan run them). TP+SP overlapped by the copy engines hides about
    as much (the two are within 1%: the same GEMMs, each exposing a little). At 2k tokens
    TP+SP wins."""
    spec = TransformerSpec("long", 4096, 32, 8, 14336, 4, 1024, 65536, 1, dtype_bytes=2)
    model = CostModel(load(calibration))
    costs = {layout: _with_recompute(layout_cost(spec, layout, model), None)
             for layout in enumerate_layouts((ranks,))}
    ring = Layout((ranks,), ("cp",), "ring")
    assert min((c, l.cp_strategy) for l, c in costs.items() if l.roles == ("cp",))[1] == "ring"
    assert costs[ring] < costs[Layout((ranks,), ("tp",))]
    chosen = plan(spec, (ranks,), calibration=model, overlap=False)
    assert chosen.layout == ring and chosen.context_parallel == "ring"
    overlapped = plan(spec, (ranks,), calibration=model)
    assert overlapped.layout == ring or overlapped.step_s == pytest.approx(costs[ring], rel=0.01)
    short = plan(dataclasses.replace(spec, seq=2048), (ranks,), calibration=calibration)
    assert short.layout.roles == ("tp",)


def test_repeated_layers_are_solved_once():
    """The integer program has two variables per layout whatever the layers: a 32-layer
    Llama on 4x8 is one block's problem (and a 2-layer one the same size)."""
    budget = 60 * GIB
    deep = plan(LLAMA3_8B, (4, 8), budget)
    shallow = plan(dataclasses.replace(LLAMA3_8B, layers=2), (4, 8), budget)
    assert deep.variables == shallow.variables == 2 * deep.considered
    assert deep.considered == len(enumerate_layouts((4, 8)))
    assert deep.memory_bytes <= budget
    piped = plan(LLAMA3_8B, (8, 8), budget)
    assert piped.variables == 2 * len(enumerate_layouts((8, 8)))


def test_pipeline_stages_split_the_layers_and_pay_a_bubble():
    spec = dataclasses.replace(GPT3_175B, batch=64)
    model = CostModel(load("h200"))
    one = layout_cost(spec, Layout((8, 8), ("pp", "tp"), schedule="1f1b"), model)
    two = layout_cost(spec, Layout((8, 8), ("pp", "tp"), schedule="interleaved"), model)
    assert one.blocks == max(one.stages) and sum(one.stages) == spec.layers == 96
    assert 0 < two.parts["pp bubble"] < one.parts["pp bubble"]


def test_the_stage_split_gives_the_head_s_stage_fewer_blocks():
    assert stage_split(32, 4, 1.0, 0.0) == (8, 8, 8, 8)
    assert stage_split(32, 4, 1.0, 3.5) == (9, 9, 9, 5)  # the slowest stage: 9, not 11.5
    for layers, stages, head in [(7, 2, 0.0), (126, 8, 2.0), (96, 12, 30.0)]:
        split = stage_split(layers, stages, 1.0, head)
        assert sum(split) == layers and len(split) == stages and min(split) >= 1
        slowest = max(*split[:-1], split[-1] + head)
        assert all(slowest <= max(math.ceil((layers - k) / (stages - 1)), k + head)
                   for k in range(1, layers - stages + 2))


def test_a_budget_nothing_fits_is_refused_with_the_least_need():
    with pytest.raises(InputError, match="least any needs"):
        plan(LLAMA3_8B, (2,), memory_budget=GIB)
    with pytest.raises(InputError, match="DeviceMesh"):
        plan(LLAMA3_8B, "four by eight")


def test_the_spec_is_read_from_configs_and_example_inputs():
    cfg = LlamaConfig(vocab=96, hidden=96, heads=12, kv_heads=2, ffn=96, seq=12, layers=3)
    spec = spec_of(cfg, example_inputs=(torch.zeros(5, 12, dtype=torch.long),))
    assert (spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.layers, spec.vocab,
            spec.seq, spec.batch, spec.gated, spec.dtype_bytes) == (
                96, 12, 2, 96, 3, 96, 12, 5, True, 4)
    assert spec.block_parameters() == sum(
        math.prod(s) for s in block_parameter_shapes(cfg).values())
    assert meshfuse.plan is plan
    gpt = spec_of(GptStack(12, 8, 16, 4, 3))
    assert (gpt.hidden, gpt.heads, gpt.layers, gpt.batch, gpt.seq, gpt.gated) == (
        16, 4, 3, 12, 8, False)
    assert spec_of(GptBlock(2, 16, 32, 4)).layers == 1
    # a GPT block's parameters as the example declares them
    assert gpt.block_parameters() == sum(math.prod(s) for s in parameter_shapes(16).values())
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                                  max_position_embeddings=32)
    spec = spec_of(hf, example_inputs=torch.zeros(3, 16, dtype=torch.long))
    assert (spec.hidden, spec.kv_heads, spec.ffn, spec.batch, spec.seq, spec.gated) == (
        64, 2, 128, 3, 16, True)


def test_projection_searches_node_shaped_meshes_and_faster_links_help():
    assert (8, 8) in meshes(64, 8) and (2, 4, 8) in meshes(64, 8)
    assert all(math.prod(s) == 64 and s[-1] <= 8 for s in meshes(64, 8))
    spec = dataclasses.replace(LLAMA3_8B, batch=64)
    slow = project(spec, 64, inter_node_gb_per_s=5.0)
    fast = project(spec, 64, inter_node_gb_per_s=100.0)
    assert fast.plan.step_s < slow.plan.step_s and 0 < slow.mfu < fast.mfu < 1
