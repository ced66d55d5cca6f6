"""Random context-parallel attention programs for the differential fuzzer
(``test_fuzz_context_parallel.py``).

Each program is a :class:`~fuzz_programs.Program` (code lines, run by
``fuzz_runner.run_program`` against plain torch on the global tensors): ``sdpfa_fwd`` on q,
k and v whose sequence axis is sharded over the ranks, often followed by ``sdpfa_bwd``. A
seed draws, independently:

- sizes: batch 1-2, query heads 1-4 and a divisor of them as key/value heads (grouped-query
  attention when fewer), head dim 4 or 8, a sequence length that the ranks often do not
  divide (a zig-zag split takes a multiple of twice the ranks), sometimes a key sequence of
  another length (cross attention; causal masks aligned top-left, as PyTorch's);
- causal or not, a scale or the default, BHSE or BSHE memory order;
- the split of the sequence: block (``outer_split``, uneven where the length does not
  divide) or zig-zag (``zigzag_split``, load balanced);
- the strategy: the estimate's (``None``), ``ring``, ``allgather``, or ``alltoall`` where it
  can run (local heads and key/value heads divisible by the ranks, blocks of one size);
- at 4 ranks, sometimes a 2x2 mesh: heads over ``mesh_y`` (both head counts even), the
  sequence over ``mesh_x``;
- the outputs: attn, sometimes the log-sum-exp; with the backward dq, dk, dv; sometimes
  the output pinned whole (a gather after the attention) or the output gradient given
  whole (both resharded as q for the backward); sometimes q computed in the fusion
  (``neg``), its sharding propagated from the input's.

The reference is PyTorch's ``scaled_dot_product_attention`` in float64 (``enable_gqa``),
its log-sum-exp computed from the scores, and its gradients by autograd.
"""

from __future__ import annotations

import dataclasses
import random

from fuzz_programs import Program

B_HSE, B_SHE = [3, 2, 1, 0], [3, 1, 2, 0]
SEQUENCE_LENGTHS = [3, 5, 6, 7, 8, 10, 12, 16]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclasses.dataclass(frozen=True)
class Draw:
    """One program's choices (see the module doc); ``n``: the ranks of the sequence."""

    mesh_2d: bool
    n: int
    heads: int
    kv_heads: int
    batch: int
    e: int
    zigzag: bool
    s: int
    s_kv: int
    causal: bool
    backward: bool
    scale: float | None
    layout: list[int]
    strategy: str | None
    with_lse: bool
    gathered: bool  # the output pinned whole
    whole_grad: bool  # the output gradient given whole
    negated_q: bool  # q computed (negated) in the fusion, its sharding propagated


def _draw(rng: random.Random, d: int) -> Draw:
    mesh_2d = d == 4 and rng.random() < 0.3
    n = 2 if mesh_2d else d
    heads = rng.choice([2, 4]) if mesh_2d else rng.choice([1, 2, 3, 4])
    kv_heads = rng.choice([k for k in _divisors(heads) if not mesh_2d or k % 2 == 0])
    batch, e = rng.choice([1, 1, 2]), rng.choice([4, 8])
    zigzag = rng.random() < 0.4
    lengths = [2 * n * k for k in (1, 2, 3)] if zigzag else SEQUENCE_LENGTHS
    s = rng.choice(lengths)
    s_kv = rng.choice([x for x in lengths if x != s]) if rng.random() < 0.25 else s
    causal, backward = rng.random() < 0.6, rng.random() < 0.7
    scale, layout = rng.choice([None, None, 0.5]), rng.choice([B_HSE, B_SHE])
    strategy = rng.choice(_strategies(heads, kv_heads, (s, s_kv), n, mesh_2d, zigzag))
    return Draw(mesh_2d, n, heads, kv_heads, batch, e, zigzag, s, s_kv, causal, backward,
                scale, layout, strategy, with_lse=rng.random() < 0.3,
                gathered=rng.random() < 0.2, whole_grad=backward and rng.random() < 0.2,
                negated_q=rng.random() < 0.25)


def generate(seed: int, world_size: int) -> Program:
    """A random context-parallel attention program (see the module doc), the same on every
    rank for one seed."""
    x = _draw(random.Random(seed * 104729 + world_size), world_size)
    shapes = {"t0": (x.batch, x.heads, x.s, x.e), "t1": (x.batch, x.kv_heads, x.s_kv, x.e),
              "t2": (x.batch, x.kv_heads, x.s_kv, x.e)}
    if x.backward:
        shapes["t3"] = (x.batch, x.heads, x.s, x.e)
    q = "t11" if x.negated_q else "t0"
    cp = f", context_parallel={x.strategy!r}" if x.strategy is not None else ""
    fd_lines = ["t11 = fd.ops.neg(t0)"] if x.negated_q else []
    fd_lines.append(f"t4, t5, t6, t7 = fd.ops.sdpfa_fwd({q}, t1, t2, 0.0, {x.causal}, "
                    f"{x.scale}{cp})")
    outputs = ["t4"] + (["t5"] if x.with_lse else [])
    if x.backward:
        fd_lines.append(f"t8, t9, t10 = fd.ops.sdpfa_bwd(t3, {q}, t1, t2, t4, t5, 0.0, "
                        f"{x.causal}, t6, t7, {x.scale}{cp})")
        outputs += ["t8", "t9", "t10"]
    program = Program(seed, world_size, list(shapes.items()), fd_lines, _reference_lines(x),
                      outputs, layouts={name: B_SHE for name in shapes if x.layout == B_SHE})
    program.meshes = {"mesh": [[0, 1], [2, 3]] if x.mesh_2d else list(range(world_size))}
    program.mode = ", ".join(
        [f"{'2x2' if x.mesh_2d else '1d'}", "zig-zag" if x.zigzag else "block",
         f"strategy {x.strategy}", "BSHE" if x.layout == B_SHE else "BHSE"]
        + [words for words, drawn in ((f"{x.s_kv} keys", x.s_kv != x.s),
                                      ("output gathered", x.gathered),
                                      ("gradient whole", x.whole_grad),
                                      ("q negated", x.negated_q)) if drawn])
    sharded = [name for name in shapes if not (name == "t3" and x.whole_grad)]
    program.schedule = _schedule(sharded, x.n, x.mesh_2d, x.zigzag)
    program.schedule += [f"{name}.set_device_mesh(mesh)" for name, whole in
                         (("t3", x.whole_grad), ("t4", x.gathered)) if whole]
    return program


def _strategies(heads, kv_heads, lengths, n, mesh_2d, zigzag) -> list[str | None]:
    """The strategies that can be asked for: all-to-all needs each rank's query and
    key/value heads to divide over the ``n`` ranks of the sequence, in blocks of one size;
    cross attention (query and key ``lengths`` differ) runs context-parallel on a block
    split into equal blocks of both, else the engine gathers (``allgather`` or the
    estimate's choice only)."""
    local = (heads // 2, kv_heads // 2) if mesh_2d else (heads, kv_heads)
    equal = zigzag or all(s % n == 0 for s in lengths)
    if lengths[0] != lengths[1] and (zigzag or not equal):
        return [None, "allgather"]
    alltoall = equal and all(h % n == 0 for h in local)
    return [None, "ring", "ring", "allgather"] + (["alltoall"] if alltoall else [])


def _schedule(names: list[str], n: int, mesh_2d: bool, zigzag: bool) -> list[str]:
    """Each input's sequence (logical axis 2) split over mesh_x into ``n`` (zig-zag or
    block); on the 2x2 mesh its heads (axis 1) over mesh_y first."""
    lines = []
    for name in names:
        lines.append(f"{name}.set_device_mesh(mesh)")
        position = 2
        if mesh_2d:
            lines += [f"{name}.outer_split(1, 2)",
                      f"{name}.axis(1).parallelize(ParallelType.mesh_y)"]
            position = 3
        split = "zigzag_split" if zigzag else "outer_split"
        lines += [f"{name}.{split}({position}, {n})",
                  f"{name}.axis({position}).parallelize(ParallelType.mesh_x)"]
    return lines


def _reference_lines(x: Draw) -> list[str]:
    """Plain torch for the program's outputs, in float64, from t0..t3 (q, k, v, grad)."""
    group = x.heads // x.kv_heads
    value = x.scale if x.scale is not None else f"1 / math.sqrt({x.e})"
    q = "-t0" if x.negated_q else "t0"
    lines = [
        "with torch.enable_grad():",
        f"    q_, k_, v_ = (x.double().requires_grad_() for x in ({q}, t1, t2))",
        "    o_ = torch.nn.functional.scaled_dot_product_attention(",
        f"        q_, k_, v_, is_causal={x.causal}, scale={x.scale}, enable_gqa={group > 1})",
        "    t4 = o_.detach().float()",
        f"    s_ = (q_ @ k_.repeat_interleave({group}, 1).transpose(-1, -2)).detach() * {value}",
    ]
    if x.causal:
        lines.append("    s_ = s_.masked_fill(torch.ones(s_.shape[-2:], dtype=torch.bool)"
                     ".triu(1), -math.inf)")
    lines.append("    t5 = torch.logsumexp(s_, -1).float()")
    if x.backward:  # the gradients with respect to the attention's q (t11 when negated)
        lines.append("    t8, t9, t10 = (g.float() for g in torch.autograd.grad("
                     "o_, (q_, k_, v_), t3.double()))")
    return lines
