"""meshfuse's Inductor heuristics for segments that reduce along rows on GPUs
(``meshfuse.runtime.interpreter.persistent_rows``): persistent kernels for rows of up to
16384 elements, Inductor's own choice otherwise; applied only where a segment's settings
name them. The kernels themselves are timed on GPUs (``benchmarks/kernel_diff.py``)."""

from __future__ import annotations

import types

import pytest
import sympy
import torch
from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.sizevars import SizeVarAllocator
from torch._inductor.virtualized import V

from meshfuse.runtime.interpreter import fused, persistent_rows
from meshfuse.runtime.interpreter.persistent_rows import PERSISTENT_ROW, choices_class

PersistentRows = choices_class()


class _Features:
    """What the heuristic reads of a kernel: its reduction's extent and hint."""

    def __init__(self, extent: int, hint: ReductionHint):
        self.reduction_numel = sympy.Integer(extent)
        self.hint = hint

    def get_reduction_hint(self) -> ReductionHint:
        return self.hint


@pytest.mark.parametrize("extent", [64, 1024, 2048, PERSISTENT_ROW, 2 * PERSISTENT_ROW])
@pytest.mark.parametrize("hint", [ReductionHint.INNER, ReductionHint.OUTER,
                                  ReductionHint.DEFAULT])
def test_rows_up_to_the_bound_are_persistent_else_inductors_choice(extent, hint):
    """Along rows (Inductor's INNER hint) of up to PERSISTENT_ROW elements: persistent;
    longer rows, and reductions across rows, as Inductor decides; none where Inductor's
    persistent reductions are off."""
    with V.set_graph_handler(types.SimpleNamespace(sizevars=SizeVarAllocator())):
        features = _Features(extent, hint)
        inductors = InductorChoices.should_use_persistent_reduction(features, False)
        ours = PersistentRows().should_use_persistent_reduction(features, False)
        assert ours == (inductors or hint == ReductionHint.INNER and extent <= PERSISTENT_ROW)
        assert inductors == (extent <= (1024 if hint == ReductionHint.INNER else 64))
        with torch._inductor.config.patch({"triton.persistent_reductions": False}):
            assert not PersistentRows().should_use_persistent_reduction(features, False)
        assert PersistentRows(extent).should_use_persistent_reduction(features, False) == (
            inductors or hint == ReductionHint.INNER)


def test_the_heuristics_apply_only_where_a_segments_settings_name_them():
    """The segment settings on GPUs name the heuristics (persistent_rows.SETTING, its value
    the bound); compiling with them makes PersistentRows of that bound Inductor's handler
    for that compilation only, and gives Inductor's config the other settings; settings
    without it compile as they are."""
    assert fused.INDUCTOR_ALONG_ROWS_ON_CUDA == {persistent_rows.SETTING: PERSISTENT_ROW}
    plain = {"emulate_precision_casts": True}
    context, settings = persistent_rows.compiling(plain)
    assert settings is plain
    before = V.choices
    context, settings = persistent_rows.compiling({**plain, persistent_rows.SETTING: 2048})
    assert settings == plain
    with context:
        assert isinstance(V.choices, PersistentRows) and V.choices.row == 2048
    assert type(V.choices) is type(before)


def test_a_segment_compiled_with_the_heuristics_computes_the_same(monkeypatch):
    """A softmax and a norm over rows, compiled by Inductor (C++ on this CPU) with the
    heuristics' settings: the values of the uncompiled graph."""
    def rows(x, w):
        y = torch.softmax(x, dim=-1)
        mean = x.mean(-1, keepdim=True)
        return y * w, (x - mean) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5)

    graph = torch.fx.symbolic_trace(rows)
    x, w = torch.randn(16, 2048), torch.randn(2048)
    context, settings = persistent_rows.compiling(dict(fused.INDUCTOR_ALONG_ROWS_ON_CUDA))
    with torch._inductor.config.patch(settings), context:
        compiled = torch._dynamo.lookup_backend("inductor")(graph, [x, w])
    for got, expected in zip(compiled(x, w), rows(x, w)):
        torch.testing.assert_close(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels: CUDA only")
@pytest.mark.parametrize("features", [4096, 12288])
def test_a_norm_over_long_rows_compiles_to_one_persistent_kernel_on_a_gpu(features):
    """A segment normalizing rows of 4096 and 12288 features (bf16), compiled as meshfuse
    compiles segments on a GPU: its reduction is a persistent kernel (Inductor alone loops
    over rows longer than 1024), and the values are the uncompiled graph's."""
    from torch._inductor.utils import run_and_get_code

    def norm(x, w):
        x = x.float()
        y = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5)
        return (y * w).to(torch.bfloat16)

    graph = torch.fx.symbolic_trace(norm)
    x = torch.randn(256, features, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(features, device="cuda")
    patches = fused.inductor_patches("inductor", [x, w], graph)
    assert patches[persistent_rows.SETTING] == PERSISTENT_ROW
    context, settings = persistent_rows.compiling(patches)

    def compile_and_run():
        with torch._inductor.config.patch(settings), context:
            compiled = torch._dynamo.lookup_backend("inductor")(graph, [x, w])
        return compiled(x, w)

    (got,), codes = run_and_get_code(compile_and_run)
    code = "\n".join(codes)
    assert "persistent_reduction" in code and "@triton_heuristics.reduction(" not in code
    torch.testing.assert_close(got.float(), norm(x, w).float(), atol=2e-2, rtol=2e-2)
