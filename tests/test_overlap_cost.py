"""The overlap cost estimate (``parallel/overlap/cost.py``): which sequence-parallel
communications the engine decomposes into stream loops, from the figures measured on 2
H200s, and the figures a user gives in ``MESHFUSE_OVERLAP_COST``."""

from __future__ import annotations

import re
from collections import Counter

import pytest

import meshfuse
from meshfuse import DataType
from meshfuse.errors import InputError
from meshfuse.examples.gpt import GptBlock
from meshfuse.parallel.overlap.candidates import (
    ALLGATHER_GEMM,
    GEMM_REDUCE_SCATTER,
    overlap_candidates,
)
from meshfuse.parallel.overlap.cost import (
    DEFAULT_COSTS,
    MARGIN,
    OverlapCost,
    choose_loops,
    cost_for,
)
from meshfuse.passes.pipeline import compile as compile_fusion

# nvFuser's column-parallel linear on 2 GPUs (t = h = 8192): 8192 x 16384 x 8192 per
# device, 64 MiB gathered from the other device.
COLUMN = (2 * 8192 * 16384 * 8192, 8192 * 8192 * 2 / 2)


def test_nccl_transfers_stay_whole_with_the_measured_figures():
    """On 2 H200s no decomposition was faster (docs/overlap.md): the CUDA figures, whose
    transfers cost the GEMMs beside them their whole time, never choose a loop."""
    cost = DEFAULT_COSTS["cuda"]
    for flops, moved in (COLUMN, (2 * 64 * 64 * 64, 64 * 64 * 2), (2 * 1024 ** 3, 2 ** 30)):
        for chunks in (2, 4, 8):
            plain, looped = cost.estimate_ms(flops, moved, chunks)
            assert looped >= plain


def test_a_transport_beside_gemms_makes_the_loop_pay():
    """With a low contention (copies that leave the GEMMs' SMs alone) large GEMMs run as
    loops; launch-bound ones still do not."""
    cost = OverlapCost(link_gb_per_s=160.0, gemm_tflops=700.0, chunk_overhead_us=20.0,
                       contention=0.1)
    plain, looped = cost.estimate_ms(*COLUMN, 2)
    assert looped < 0.95 * plain
    plain, looped = cost.estimate_ms(2 * 64 * 64 * 64, 64 * 64 * 2, 2)
    assert looped > plain


def _gpt3_candidates(d: int, s: int = 2048):
    """The GPT-3 layer's forward (e=12288, ``s`` tokens, h=96, bf16), TP+SP over ``d``
    devices, compiled for ``d`` processes: its candidates and static extents."""
    block = GptBlock(1, s, 12288, 96, DataType.BFloat16,
                     meshfuse.DeviceMesh(range(d))).define()
    fusion = compile_fusion(block.fusion, d).fusion
    extents = {i: i.extent for tv in fusion.tensors() for i in tv.logical}
    return overlap_candidates(fusion, []), extents


@pytest.mark.parametrize("d", [2, 4])
def test_gpt3_layer_keeps_its_collectives_whole(d, monkeypatch):
    """The GPT-3 layer's allgathers before the q/k/v and fc1 GEMMs and its reduce-scatters
    after the out and fc2 GEMMs are candidates; with the CUDA figures each runs whole, and
    explain says why with both estimates. Figures with a low contention loop the large
    ones."""
    monkeypatch.delenv("MESHFUSE_OVERLAP", raising=False)
    monkeypatch.delenv("MESHFUSE_OVERLAP_COST", raising=False)
    candidates, extents = _gpt3_candidates(d)
    assert Counter(c.kind for c in candidates) == {ALLGATHER_GEMM: 2, GEMM_REDUCE_SCATTER: 2}
    plans, lines = choose_loops(candidates, extents, "cuda")
    assert plans == []
    assert len(lines) == 4 and all("as a whole (" in line and " ms in " in line
                                   for line in lines)
    monkeypatch.setenv("MESHFUSE_OVERLAP_COST", "160,700,20,0.1")
    plans, lines = choose_loops(candidates, extents, "cuda")
    assert len(plans) >= 2 and sum("stream loop: " in line for line in lines) == len(plans)


def test_cost_from_the_environment(monkeypatch):
    monkeypatch.setenv("MESHFUSE_OVERLAP_COST", "100,500,10")
    assert cost_for("cuda") == OverlapCost(100.0, 500.0, 10.0, contention=1.0)
    monkeypatch.setenv("MESHFUSE_OVERLAP_COST", "100,500,10,0.25")
    assert cost_for("cpu") == OverlapCost(100.0, 500.0, 10.0, contention=0.25)
    for bad in ("100,500", "a,b,c", "0,500,10", "100,500,10,-1", "1,2,3,4,5"):
        monkeypatch.setenv("MESHFUSE_OVERLAP_COST", bad)
        with pytest.raises(InputError, match="MESHFUSE_OVERLAP_COST.*GB/s,TFLOP/s,us"):
            cost_for("cuda")


@pytest.mark.parametrize("d", [2, 4])
def test_gpt3_layer_over_copy_engines(d, monkeypatch):
    """With the copy engines' measured figures each GPT-3 candidate (s = 2048) loops exactly
    when its estimate beats the whole communication by the margin, explain giving both
    estimates and the transport assumed (a block's pull, ~0.07 ms at d = 2, is little more
    than the chunks' cost); with 4x the tokens the pulls outgrow that cost and every
    candidate loops. A tiny layer stays whole."""
    monkeypatch.delenv("MESHFUSE_OVERLAP", raising=False)
    monkeypatch.delenv("MESHFUSE_OVERLAP_COST", raising=False)
    assert cost_for("cuda", "copy_engine") == DEFAULT_COSTS["cuda_copy_engine"]
    assert cost_for("cpu", "copy_engine") == DEFAULT_COSTS["cpu"]
    candidates, extents = _gpt3_candidates(d)
    plans, lines = choose_loops(candidates, extents, "cuda", "copy_engine")
    assert len(lines) == 4
    for line in lines:
        looped, plain = (float(v) for v in
                         re.findall(r"est\. ([0-9.]+) ms in \d+ chunks by copy engines vs "
                                    r"([0-9.]+) ms without", line)[0])
        assert ("stream loop:" in line) == (looped < (1 - MARGIN) * plain), line
    assert len(plans) == sum("stream loop:" in line for line in lines)
    candidates, extents = _gpt3_candidates(d, s=8192)
    plans, lines = choose_loops(candidates, extents, "cuda", "copy_engine")
    assert len(plans) == len(candidates) == 4, lines
    cost = DEFAULT_COSTS["cuda_copy_engine"]
    plain, looped = cost.estimate_ms(2 * 64 * 64 * 64, 64 * 64 * 2, d)
    assert looped > plain
