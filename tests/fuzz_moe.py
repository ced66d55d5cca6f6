"""Random mixture-of-experts programs for the differential fuzzer (``test_fuzz_moe.py``).

Each program is a :class:`~fuzz_programs.Program` run by ``fuzz_runner.run_program`` against
plain torch on the global tensors (float64, outputs cast to float32): a router
(``linear`` then ``moe_route``) and the routed experts (``moe_experts``), often followed by
their backward (``moe_experts_bwd`` with a given cotangent). A seed draws, independently:

- sizes: 2-9 experts, top-k 1-3, 3-16 tokens (the ranks often do not divide them, nor the
  experts), hidden 4 or 8, expert ffn 4 or 6;
- the routing: softmax or sigmoid scores, normalized or not, a scale, sometimes groups of
  experts (group-limited choice), sometimes a bias that favours a few experts (others, and
  the ranks that hold them, left without tokens);
- sometimes a capacity (rows an expert computes at most);
- the tokens: ``[T, H]``, or ``[B, S, H]`` (batch 1-3) as transformer blocks hold them;
- the layout: expert parallel (tokens and experts over the ranks; ``[B, S, H]``: the
  sequence), data parallel (tokens only), replicated, or on a 2x2 mesh (4 and 8 ranks: 2x4)
  EP x TP (expert parallel over ``mesh_y``, the experts' ffn over ``mesh_x``) or EP x DP
  (the tokens over ``mesh_y`` then ``mesh_x``, ``[B, S, H]``: the batch over ``mesh_y``
  and the sequence over ``mesh_x``; the experts over ``mesh_x``); no capacity with EP x DP
  or a batch above 1 (refused: the ranks would not hold the tokens in order).
"""

from __future__ import annotations

import dataclasses
import random

from fuzz_programs import Program

LAYOUTS = ("ep", "ep", "ep", "dp", "replicated")


@dataclasses.dataclass(frozen=True)
class Draw:
    experts: int
    top_k: int
    tokens: int
    dim: int
    ffn: int
    score: str
    normalize: bool
    scale: float
    groups: int | None
    top_groups: int | None
    biased: bool
    capacity: int | None
    layout: str
    backward: bool
    batch: int | None  # [B, S, H] tokens (S = tokens), or None: [T, H]


def _draw(rng: random.Random, d: int) -> Draw:
    experts = rng.randint(2, 9)
    top_k = rng.randint(1, min(3, experts))
    groups = rng.choice([g for g in (2, 3) if experts % g == 0 and experts // g >= 2] or
                        [None]) if rng.random() < 0.3 else None
    top_groups = rng.randint(1, groups) if groups else None
    if groups:
        top_k = min(top_k, top_groups * (experts // groups))
    tokens = rng.randint(3, 16)
    batch = rng.randint(1, 3) if rng.random() < 0.3 else None
    capacity = rng.randint(1, tokens) if rng.random() < 0.25 else None
    layout = rng.choice(["ep_tp", "ep_dp"]) if d in (4, 8) and rng.random() < 0.4 else \
        rng.choice(LAYOUTS)
    if layout == "ep_dp" and batch == 1:  # a batch of 1 is not split
        batch = 2
    if layout == "ep_dp" or batch not in (None, 1):  # refused: ranks out of token order
        capacity = None
    return Draw(experts, top_k, tokens, rng.choice([4, 8]), rng.choice([4, 6]),
                rng.choice(["softmax", "sigmoid"]), rng.random() < 0.7,
                rng.choice([1.0, 2.5]), groups, top_groups, rng.random() < 0.3, capacity,
                layout, rng.random() < 0.7, batch)


def generate(seed: int, world_size: int) -> Program:
    """A random MoE program (see the module doc), the same on every rank for one seed."""
    x = _draw(random.Random(seed * 7919 + world_size), world_size)
    e, h, f = x.experts, x.dim, x.ffn
    tokens = (x.tokens,) if x.batch is None else (x.batch, x.tokens)
    shapes = {"t0": (*tokens, h), "t1": (e, h), "t2": (e, f, h), "t3": (e, h, f),
              "t4": (e, f, h)}
    if x.biased:
        shapes["t5"] = (e,)
    if x.backward:
        shapes["t6"] = (*tokens, h)
    bias = "t5" if x.biased else "None"
    routing = (f"top_k={x.top_k}, score={x.score!r}, normalize={x.normalize}, "
               f"scale={x.scale}, groups={x.groups}, top_groups={x.top_groups}")
    fd_lines = ["t7 = fd.ops.linear(t0, t1)",
                f"t8, t9 = fd.ops.moe_route(t7, {bias}, {routing})",
                f"t10, t11, _ = fd.ops.moe_experts(t0, t9, t8, t2, t3, t4, {x.capacity})"]
    outputs = ["t10", "t11"]
    if x.backward:
        fd_lines.append(f"t12, t13, t14, t15, t16 = fd.ops.moe_experts_bwd(t6, t0, t9, t8, "
                        f"t2, t3, t4, {x.capacity})")
        outputs += ["t13", "t12", "t14", "t15", "t16"]
    program = Program(seed, world_size, list(shapes.items()), fd_lines,
                      _reference_lines(x), outputs)
    half = world_size // 2
    mesh = [list(range(half)), list(range(half, world_size))] if x.layout in ("ep_tp", "ep_dp") \
        else list(range(world_size))
    program.meshes = {"mesh": mesh}
    program.schedule = _schedule(x, shapes)
    program.mode = ", ".join([x.layout, f"tokens {list(tokens)}", f"{e} experts",
                             f"top-{x.top_k}"] + [
        words for words, drawn in (("groups", x.groups), ("biased", x.biased),
                                   (f"capacity {x.capacity}", x.capacity is not None),
                                   ("backward", x.backward)) if drawn])
    return program


def _split(name: str, axis: int, pt: str, parts: int) -> list[str]:
    return [f"{name}.outer_split({axis}, {parts})",
            f"{name}.axis({axis}).parallelize(ParallelType.{pt})"]


def _schedule(x: Draw, shapes: dict) -> list[str]:
    lines = [f"{name}.set_device_mesh(mesh)" for name in shapes]
    if x.layout == "replicated":
        return lines
    ep, parts = ("mesh_y", 2) if x.layout == "ep_tp" else ("mesh_x", "mesh.size")
    seq = 0 if x.batch is None else 1  # the token axis split over the expert axis
    if x.layout == "ep_dp":
        parts = "mesh.size // 2"
    for name in ["t0"] + (["t6"] if x.backward else []):
        if x.layout == "ep_dp":  # the tokens (or the batch) over mesh_y first
            lines += _split(name, 0, "mesh_y", 2)
            seq += 1
        lines += _split(name, seq, ep, parts)
        seq -= x.layout == "ep_dp"
    for name in ["t2", "t3", "t4"] if x.layout != "dp" else []:
        lines += _split(name, 0, ep, parts)
    if x.layout == "ep_tp":  # the ffn: axis 1 of w1 and w3, axis 2 of w2
        for name, axis in (("t2", 2), ("t3", 3), ("t4", 2)):  # (after the experts' split)
            lines += _split(name, axis, "mesh_x", "mesh.size // 2")
    return lines


def _reference_lines(x: Draw) -> list[str]:
    """Plain torch in float64 from t0..t6: routing (meshfuse's routing functions, checked
    against torch in the op table), then each expert's tokens in token order."""
    bias = "t5.double()" if x.biased else "None"
    return [
        "from meshfuse.ops.moe.routing import choose as choose_, scores_of as scores_",
        "from meshfuse.ops.moe.routing import weights_of as weights_of_",
        "silu_ = torch.nn.functional.silu",
        "with torch.enable_grad():",
        "    shape_ = t0.shape[:-1]",
        "    x_, w1_, w2_, w3_ = (t.double().requires_grad_() for t in (",
        "        t0.reshape(-1, t0.shape[-1]), t2, t3, t4))",
        f"    s_ = scores_(x_.detach() @ t1.double().t(), {x.score!r})",
        f"    i_ = choose_(s_, {bias}, {x.top_k}, {x.groups}, {x.top_groups})",
        f"    r_ = weights_of_(s_, i_, {x.normalize}, {x.scale}).requires_grad_()",
        "    y_, rows_ = torch.zeros_like(x_), torch.zeros(w1_.shape[0])",
        f"    for e_ in range({x.experts}):",
        "        tok_, slot_ = torch.nonzero(i_ == e_, as_tuple=True)",
        f"        tok_, slot_ = tok_[:{x.capacity}], slot_[:{x.capacity}]",
        "        rows_[e_] = len(tok_)",
        "        h_ = silu_(x_[tok_] @ w1_[e_].t()) * (x_[tok_] @ w3_[e_].t())",
        "        y_ = y_.index_add(0, tok_, (h_ @ w2_[e_].t()) * r_[tok_, slot_, None])",
        "    t10, t11 = y_.detach().float().reshape(t0.shape), rows_",
    ] + ([
        "    t12, t13, t14, t15, t16 = (g.float() for g in torch.autograd.grad(",
        "        y_, (x_, r_, w1_, w2_, w3_), t6.double().reshape(y_.shape)))",
        "    t12, t13 = t12.reshape(t0.shape), t13.reshape(*shape_, -1)",
    ] if x.backward else [])
