"""Grouped-query attention read as such: a captured attention whose keys and values a model
repeated over each group of query heads reads the key/value heads themselves.

``transformers``' Llama, Qwen2, Mistral (and most grouped-query decoders) repeat each
key/value head over its group before attention (``repeat_kv``: ``unsqueeze(2)``, ``expand``,
``reshape``), so the captured program would copy the keys and values ``H / Hkv`` times at
every layer, and the attention's backward would read the copies (on a Llama-3.2-1B step:
32 copy kernels of 32 MiB each, and their memory). meshfuse's attention takes ``Hkv``
key/value heads as they are (PyTorch's ``enable_gqa=True``: query head ``h`` attends with
key/value head ``h // (H / Hkv)``, as the repeat lays them out), and its backward sums each
group's gradients inside the kernel. :func:`read_grouped_heads` rewrites the capture's graph
so: the attention's ``k`` and ``v`` become the un-repeated tensors and ``enable_gqa=True``
(a graph break then runs PyTorch's op with the same meaning); the repeat, left without
users, is dropped.
"""

from __future__ import annotations

import torch
from torch.fx import Node

aten = torch.ops.aten

__all__ = ["read_grouped_heads"]

_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def read_grouped_heads(graph: torch.fx.Graph) -> int:
    """Rewrites each ``scaled_dot_product_attention`` of ``graph`` (the capture's own) whose
    ``k`` and ``v`` are both repeats of ``[B, Hkv, S, E]`` tensors over the query heads'
    groups to read those tensors; returns how many it rewrote."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.scaled_dot_product_attention.default:
            continue
        q, k, v = node.args[:3]
        sources = [_repeated(x, _heads(q)) for x in (k, v)]
        if None in sources or node.kwargs.get("enable_gqa", False):
            continue
        node.args = (q, *sources, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for repeat in dict.fromkeys((k, v)):  # one repeat may feed both
            _drop_unused(graph, repeat)
        rewritten += 1
    return rewritten


def _heads(x) -> int | None:
    val = x.meta.get("val") if isinstance(x, Node) else None
    return int(val.shape[1]) if val is not None and val.dim() == 4 else None


def _repeated(x, heads: int | None) -> Node | None:
    """The ``[B, Hkv, S, E]`` tensor that ``x`` repeats over ``heads / Hkv`` groups as
    ``repeat_kv`` does (``reshape(expand(unsqueeze(t, 2), [B, Hkv, G, S, E]), [B, Hkv * G, S,
    E])``), or None."""
    if heads is None or not isinstance(x, Node) or x.target not in _RESHAPES:
        return None
    expand = x.args[0]
    if not isinstance(expand, Node) or expand.target != aten.expand.default:
        return None
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, Node) or unsqueeze.target != aten.unsqueeze.default \
            or unsqueeze.args[1] not in (2, -3):
        return None
    source = unsqueeze.args[0]
    vals = [n.meta.get("val") if isinstance(n, Node) else None
            for n in (source, expand, x)]
    if any(v is None for v in vals):
        return None
    src, expanded, out = (tuple(int(d) for d in v.shape) for v in vals)
    if len(src) != 4 or len(expanded) != 5:
        return None
    b, kv_heads, s, e = src
    group = expanded[2]
    if expanded != (b, kv_heads, group, s, e) or out != (b, kv_heads * group, s, e) \
            or kv_heads * group != heads:
        return None
    return source


def _drop_unused(graph: torch.fx.Graph, node: Node) -> None:
    """Erases ``node`` and then its inputs, as long as nothing else uses them (the repeat's
    reshape, expand and unsqueeze)."""
    while isinstance(node, Node) and node.op == "call_function" and not node.users:
        source = node.args[0]
        graph.erase_node(node)
        node = source
