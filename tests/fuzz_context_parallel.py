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
  the output pinned replicated (a gather after the attention).

The reference is PyTorch's ``scaled_dot_product_attention`` in float64 (``enable_gqa``),
its log-sum-exp computed from the scores, and its gradients by autograd.
"""

from __future__ import annotations

import random

from fuzz_programs import Program

B_HSE, B_SHE = [3, 2, 1, 0], [3, 1, 2, 0]
SEQUENCE_LENGTHS = [3, 5, 6, 7, 8, 10, 12, 16]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def generate(seed: int, world_size: int) -> Program:
    """A random context-parallel attention program (see the module doc), the same on every
    rank for one seed."""
    rng = random.Random(seed * 104729 + world_size)
    d = world_size
    mesh_2d = d == 4 and rng.random() < 0.3
    sequence_ranks = 2 if mesh_2d else d
    heads = rng.choice([2, 4]) if mesh_2d else rng.choice([1, 2, 3, 4])
    kv_heads = rng.choice([k for k in _divisors(heads) if not mesh_2d or k % 2 == 0])
    batch, e = rng.choice([1, 1, 2]), rng.choice([4, 8])
    zigzag = rng.random() < 0.4
    if zigzag:
        s = 2 * sequence_ranks * rng.choice([1, 2, 3])
    else:
        s = rng.choice(SEQUENCE_LENGTHS)
    lengths = [2 * sequence_ranks * k for k in (1, 2, 3)] if zigzag else SEQUENCE_LENGTHS
    s_kv = rng.choice([x for x in lengths if x != s]) if rng.random() < 0.25 else s
    causal, backward = rng.random() < 0.6, rng.random() < 0.7
    scale = rng.choice([None, None, 0.5])
    layout = rng.choice([B_HSE, B_SHE])
    strategy = rng.choice(_strategies(heads, kv_heads, (s, s_kv), sequence_ranks, mesh_2d,
                                      zigzag))
    with_lse = rng.random() < 0.3
    gathered = rng.random() < 0.2

    shapes = {"t0": (batch, heads, s, e), "t1": (batch, kv_heads, s_kv, e),
              "t2": (batch, kv_heads, s_kv, e)}
    if backward:
        shapes["t3"] = (batch, heads, s, e)
    cp = f", context_parallel={strategy!r}" if strategy is not None else ""
    fd_lines = [f"t4, t5, t6, t7 = fd.ops.sdpfa_fwd(t0, t1, t2, 0.0, {causal}, {scale}{cp})"]
    outputs = ["t4"] + (["t5"] if with_lse else [])
    if backward:
        fd_lines.append(f"t8, t9, t10 = fd.ops.sdpfa_bwd(t3, t0, t1, t2, t4, t5, 0.0, "
                        f"{causal}, t6, t7, {scale}{cp})")
        outputs += ["t8", "t9", "t10"]
    program = Program(seed, world_size, list(shapes.items()), fd_lines,
                      _reference_lines(heads // kv_heads, causal, scale, e, backward),
                      outputs, layouts={n: layout for n in shapes})
    program.meshes = {"mesh": [[0, 1], [2, 3]] if mesh_2d else list(range(d))}
    program.mode = (f"{'2x2' if mesh_2d else '1d'}, {'zig-zag' if zigzag else 'block'}, "
                    f"strategy {strategy}, {'BSHE' if layout == B_SHE else 'BHSE'}"
                    + (f", {s_kv} keys" if s_kv != s else "")
                    + (", output gathered" if gathered else ""))
    program.schedule = _schedule(list(shapes), sequence_ranks, mesh_2d, zigzag)
    if gathered:
        program.schedule.append("t4.set_device_mesh(mesh)")
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


def _reference_lines(group: int, causal: bool, scale, e: int, backward: bool) -> list[str]:
    """Plain torch for the program's outputs, in float64, from t0..t3 (q, k, v, grad)."""
    value = scale if scale is not None else f"1 / math.sqrt({e})"
    lines = [
        "with torch.enable_grad():",
        "    q_, k_, v_ = (x.double().requires_grad_() for x in (t0, t1, t2))",
        "    o_ = torch.nn.functional.scaled_dot_product_attention(",
        f"        q_, k_, v_, is_causal={causal}, scale={scale}, enable_gqa={group > 1})",
        "    t4 = o_.detach().float()",
        f"    s_ = (q_ @ k_.repeat_interleave({group}, 1).transpose(-1, -2)).detach() * {value}",
    ]
    if causal:
        lines.append("    s_ = s_.masked_fill(torch.ones(s_.shape[-2:], dtype=torch.bool)"
                     ".triu(1), -math.inf)")
    lines.append("    t5 = torch.logsumexp(s_, -1).float()")
    if backward:
        lines.append("    t8, t9, t10 = (g.float() for g in torch.autograd.grad("
                     "o_, (q_, k_, v_), t3.double()))")
    return lines
