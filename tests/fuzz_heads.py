"""The fuzzer's statements of heads and batches (``Features.heads``): the class of programs a
Llama block is made of and the gradient fuzzer once never drew.

- ``grouped_attention``: grouped-query attention (``h`` query heads, ``hkv`` key/value heads,
  every divisor), q, k and v inputs or projected from one input by ``linear`` and reshaped
  into heads (so that x's gradient adds partial sums over weights of different row counts);
- ``batched_matmul``: ``matmul`` of two batched operands, often summed over the batch axis
  (a reduction over an axis the schedules shard; its gradient is an expanded broadcast);
- ``lead_linear``: ``linear`` with a weight of leading axes (nvFuser's ``[d, n, k]``, the
  heads of a projection), with or without bias.

Each writes its FusionDefinition line and the same computation in torch, through the
generator's ``emit`` (``fuzz_programs._Gen``).
"""

from __future__ import annotations


def grouped_attention(g) -> None:
    b, s, e = g.rng.choice([1, 2]), g.rng.choice([4, 6]), 4
    h = g.rng.choice([2, 4, 8])
    hkv = g.rng.choice([d for d in (1, 2, 4, 8) if h % d == 0])
    causal = g.rng.random() < 0.5
    projected = g.rng.random() < 0.5
    if projected:
        q, k, v = (_projected(g, b, s, heads, e) for heads in (h, hkv, hkv))
    else:
        q = (g.pick(lambda t: tuple(t.tensor.shape) == (b, h, s, e)) or
             g.new_input((b, h, s, e))).name
        k, v = (g.new_input((b, hkv, s, e)).name for _ in range(2))
    attn, lse, seed, off = g.fresh(4)
    group = h // hkv
    scores = (f"({q} @ {k}.repeat_interleave({group}, 1).transpose(-2, -1)) / math.sqrt({e})")
    if causal:
        scores += f" + torch.full(({s}, {s}), float('-inf')).triu(1)"
    detached = ".detach()" if g.differentiable else ""
    g.emit(f"{attn}, {lse}, {seed}, {off} = fd.ops.sdpfa_fwd({q}, {k}, {v}, 0.0, {causal}, "
           "None)",
           f"{attn} = torch.nn.functional.scaled_dot_product_attention({q}, {k}, {v}, "
           f"is_causal={causal}, enable_gqa=True)\n"
           f"{lse} = torch.logsumexp({scores}, -1){detached}\n{seed} = {off} = None",
           [attn, lse], False)
    g.values = [x for x in g.values if x.name not in (seed, off)]
    g.features.add(f"gqa {h}/{hkv}" + (" projected" if projected else ""))


def _projected(g, b: int, s: int, heads: int, e: int) -> str:
    """``heads`` heads of ``e`` projected from the block's input ``[b, s, 8]`` (one input
    for the three projections): ``permute(reshape(linear(x, w)))``."""
    x = getattr(g, "_heads_input", None)
    if x is None or tuple(x.tensor.shape) != (b, s, 8):
        x = g._heads_input = g.new_input((b, s, 8))
    w = g.new_input((heads * e, 8))
    flat, split, out = g.fresh(3)
    g.emit(f"{flat} = fd.ops.linear({x.name}, {w.name}, None)",
           f"{flat} = torch.nn.functional.linear({x.name}, {w.name})", [flat], False)
    g.emit(f"{split} = fd.ops.reshape({flat}, new_shape={[b, s, heads, e]})",
           f"{split} = {flat}.reshape({[b, s, heads, e]})", [split], False)
    g.emit(f"{out} = fd.ops.permute({split}, dims=[0, 2, 1, 3])",
           f"{out} = {split}.permute([0, 2, 1, 3])", [out], False)
    return out


def batched_matmul(g) -> None:
    batch, m, k, n = g.extent(), g.extent(), g.extent(), g.extent()
    a = g.pick(lambda t: t.tensor.ndim == 3 and 1 not in t.tensor.shape)
    if a is None or g.rng.random() < 0.3:
        a = g.new_input((batch, m, k))
    batch, k = a.tensor.shape[0], a.tensor.shape[2]
    w = g.new_input((batch, k, n))
    (y,) = g.fresh()
    g.emit(f"{y} = fd.ops.matmul({a.name}, {w.name})", f"{y} = torch.matmul({a.name}, {w.name})",
           [y], False)
    if g.rng.random() < 0.6:
        dims = [0] if g.rng.random() < 0.7 else [0, 1]
        (z,) = g.fresh()
        g.emit(f"{z} = fd.ops.sum({y}, dims={dims}, keepdim=False)",
               f"{z} = torch.sum({y}, dim={dims}, keepdim=False)", [z], False)
    g.features.add("batched matmul")


def lead_linear(g) -> None:
    x = g.pick(lambda t: 1 <= t.tensor.ndim <= 3 and 1 not in t.tensor.shape)
    if x is None or g.rng.random() < 0.3:
        x = g.random_input(g.rng.randint(1, 3))
    k = x.tensor.shape[-1]
    lead = [g.extent()] + ([g.extent()] if g.rng.random() < 0.2 else [])
    n = g.extent()
    w = g.new_input((*lead, n, k))
    bias = g.new_input((*lead, n)) if g.rng.random() < 0.5 else None
    (y,) = g.fresh()
    tokens = x.tensor.ndim - 1
    ones = ", ".join(["1"] * len(lead))
    xs = f"{x.name}.reshape(({ones}, *{x.name}.shape, 1))"  # [*1, *tokens, k, 1]
    ws = f"{w.name}.reshape(({', '.join(map(str, lead))}, {'1, ' * tokens}{n}, {k}))"
    code = f"({ws} @ {xs}).squeeze(-1)"  # [*lead, *tokens, n]
    if bias is not None:
        code += f" + {bias.name}.reshape(({', '.join(map(str, lead))}, {'1, ' * tokens}{n}))"
    b = "None" if bias is None else bias.name
    g.emit(f"{y} = fd.ops.linear({x.name}, {w.name}, {b})", f"{y} = {code}", [y], False)
    g.features.add("lead linear")
