"""Grouped-query attention read as such (``meshfuse.capture.partition.read_grouped_heads``): a captured
attention whose keys and values the model repeated over the query heads' groups
(``transformers``' ``repeat_kv``) reads the key/value heads themselves; other repeats are
left as they are. Values are PyTorch's."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from capture_checks import check_gradients

import meshfuse
from meshfuse.capture.partition import read_grouped_heads
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.capture.trace import capture
from meshfuse.testing.utils import current_device

aten = torch.ops.aten
B, H, KV, S, E = 2, 6, 2, 5, 4


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """``transformers``' repeat of each key/value head over its group."""
    b, heads, s, e = x.shape
    return x[:, :, None, :, :].expand(b, heads, n, s, e).reshape(b, heads * n, s, e)


class _Attention(torch.nn.Module):
    def __init__(self, repeat) -> None:
        super().__init__()
        self.repeat = repeat

    def forward(self, q, k, v):
        k, v = self.repeat(k), self.repeat(v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, S, E, generator=g), torch.randn(B, KV, S, E, generator=g),
            torch.randn(B, KV, S, E, generator=g))


def _attention_args(graph: torch.fx.Graph) -> list:
    (node,) = [n for n in graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    return [node.args[1].meta["val"].shape, node.args[2].meta["val"].shape,
            node.kwargs.get("enable_gqa", False)]


def test_a_repeat_over_the_groups_is_read_as_grouped_heads():
    module = _Attention(lambda x: _repeat_kv(x, H // KV))
    captured = capture(module, _inputs(), {})
    assert read_grouped_heads(captured.graph) == 1
    assert _attention_args(captured.graph) == [(B, KV, S, E), (B, KV, S, E), True]
    assert not [n for n in captured.graph.nodes if n.target == aten.expand.default]
    captured.graph.lint()
    q, k, v = _inputs()
    got = torch.fx.GraphModule(torch.nn.Module(), captured.graph)(q, k, v)
    want = module(q, k, v)
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, want)


def test_other_repeats_are_left_as_they_are():
    """Heads interleaved otherwise (``repeat``: key/value head ``h % Hkv``, not
    ``h // G``), or a repeat of one of k and v only: the graph is not rewritten."""
    cases = [lambda x: x.repeat(1, H // KV, 1, 1)]
    for repeat in cases:
        captured = capture(_Attention(repeat), _inputs(), {})
        assert read_grouped_heads(captured.graph) == 0

    class _OneRepeated(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, _repeat_kv(k, H // KV),
                                                  v.repeat(1, H // KV, 1, 1))
    captured = capture(_OneRepeated(), _inputs(), {})
    assert read_grouped_heads(captured.graph) == 0


def test_a_transformers_llamas_attention_reads_its_key_value_heads():
    """An unmodified ``transformers`` Llama (GQA 4/2): no layer's fusion repeats keys or
    values, and its loss and gradients are the module's."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).to(current_device())
    model = meshfuse.parallelize(copy.deepcopy(reference), meshfuse.DeviceMesh([0]), {})
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ids = ids.to(current_device())
    loss = model(input_ids=ids, labels=ids).loss
    want = reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    loss.backward()
    want.backward()
    check_gradients(model, reference)
    graph = model._meshfuse.last.captured.graph
    attention = [n for n in graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    assert len(attention) == 2 and all(n.kwargs.get("enable_gqa") for n in attention)
    assert all(n.args[1].meta["val"].shape[1] == 2 for n in attention)
    assert not [n for n in graph.nodes if n.target == aten.expand.default
                and len(n.meta["val"].shape) == 5]


class _Projected(torch.nn.Module):
    """Attention over projected heads, its keys and values repeated by ``repeat``."""

    def __init__(self, heads: int, kv_heads: int, e: int, repeat: str, causal: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.e = heads, kv_heads, e
        self.q = torch.nn.Linear(8, heads * e, bias=False)
        self.kv = torch.nn.Linear(8, 2 * kv_heads * e, bias=False)
        self.repeat, self.causal = repeat, causal

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.e).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2 * self.kv_heads, self.e).transpose(1, 2).chunk(2, 1)
        group = self.heads // self.kv_heads
        if self.repeat == "repeat_kv":
            k, v = _repeat_kv(k, group), _repeat_kv(v, group)
        elif self.repeat == "interleave":
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        else:  # whole blocks: head h reads key/value head h % Hkv, not grouped-query
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return out.transpose(1, 2).reshape(b, s, -1).square().mean()


def test_random_repeats_through_parallelize_match_pytorch():
    """A differential fuzzer of the rewrite: random head counts, groups, sizes, causal or
    not, keys and values repeated as ``repeat_kv`` does, by ``repeat_interleave`` (the same
    layout) or by ``repeat`` (another: never rewritten); loss and gradients through
    ``meshfuse.parallelize`` equal the module's."""
    rng = torch.Generator().manual_seed(7)
    for case in range(6):
        kv_heads, group, e, s = (int(torch.randint(lo, hi, (), generator=rng))
                                 for lo, hi in ((1, 4), (1, 4), (2, 6), (3, 9)))
        repeat = ("repeat_kv", "interleave", "blocks")[case % 3]
        causal = bool(torch.randint(0, 2, (), generator=rng))
        torch.manual_seed(case)
        reference = _Projected(kv_heads * group, kv_heads, e, repeat, causal).double()
        reference = reference.to(current_device())
        model = meshfuse.parallelize(copy.deepcopy(reference), meshfuse.DeviceMesh([0]), {})
        x = torch.randn(2, s, 8, generator=rng, dtype=torch.float64).to(current_device())
        with warnings.catch_warnings():  # repeat() has no rule: a graph break
            warnings.simplefilter("ignore", GraphBreakWarning)
            loss = model(x)
        want = reference(x)
        torch.testing.assert_close(loss, want, msg=lambda m, case=case: f"case {case}: {m}")
        loss.backward()
        want.backward()
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad,
                                       msg=lambda m, name=name, case=case: f"case {case} {name}: {m}")
        graph = model._meshfuse.last.captured.graph
        (node,) = [n for n in graph.nodes
                   if n.target == aten.scaled_dot_product_attention.default]
        grouped = node.kwargs.get("enable_gqa", False)
        if group > 1 and repeat != "interleave":  # (interleave: as PyTorch traces it)
            assert grouped == (repeat == "repeat_kv"), (case, repeat, group)
