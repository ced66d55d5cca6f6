"""Stream-parallel loops in fuzz programs (``Features.overlap``; ``docs/overlap.md``).

On CPU ranks the engine's cost estimate never chooses a loop, so the fuzzer forces them:
``set_overlap(True)`` on the operands and results of the program's ``linear``/``matmul``
(every one of them, or a random part of the program's tensors), and a chunk count for the
GEMM -> allreduce loops in ``MESHFUSE_OVERLAP_CHUNKS``, set while the program is built and
run (:func:`chunks_env`) and written into its reproduction. The generator draws more GEMMs
with this feature (``GEMM_WEIGHT``), so that a sharded operand next to one is common.
"""

from __future__ import annotations

import contextlib
import os
import random
import re

from meshfuse.parallel.overlap.allreduce_loop_cost import CHUNKS_ENV

CHUNKS = (1, 2, 3, 4)  # MESHFUSE_OVERLAP_CHUNKS drawn per program, and a stream axis's
STREAM_AXIS_SHARE = 0.4  # of the allreduce and reduce-scatter patterns: x's rows on stream
GEMM_WEIGHT = 12  # the matmul statement's weight with the feature (3 without)
_GEMM = re.compile(r"^(t\d+) = fd\.ops\.(?:linear|matmul)\((t\d+), (t\d+)(?:, (t\d+))?")
_DEFINED = re.compile(r"^((?:t\d+, )*t\d+) = ")
_REDUCTION = re.compile(r"fd\.ops\.(sum|prod|max|min|mean|var|var_mean|std)\(")


def add_overlap(program, rng: random.Random, values: dict, uneven: bool,
                stream_axes: bool = False) -> None:
    """Appends to ``program.schedule`` a sharding of each GEMM's tensors that the random
    schedule left alone, in one of the patterns the engine decomposes (:func:`_gemm_pattern`),
    then ``set_overlap(True)`` calls: on every tensor a GEMM reads or writes (half the
    programs), or on each tensor of the program with probability 0.4; and draws its
    ``overlap_chunks``. ``values``: the generator's values by name (``fuzz_programs.Value``).
    ``stream_axes``: some patterns also put x's rows on stream, drawn by a generator of their
    own (the rest of the program is drawn as without them)."""
    gemms = [m.groups() for line in program.fd_lines if (m := _GEMM.match(line))]
    streams = random.Random(f"stream axes {program.seed}") if stream_axes else None
    for y, x, w, bias in gemms:
        if rng.random() < 0.8:
            _gemm_pattern(program, rng, values, (y, x, w), uneven,
                          streams if _replicated(program, bias) else None)
    gemm = [n for names in gemms for n in names if n is not None]
    if gemm and rng.random() < 0.5:
        chosen = list(dict.fromkeys(gemm))
    else:
        names = [n for n, _ in program.inputs]
        names += [n for line in program.fd_lines if (m := _DEFINED.match(line))
                  for n in m.group(1).split(", ")]
        chosen = [n for n in names if rng.random() < 0.4]
    program.schedule.extend(f"{n}.set_overlap(True)" for n in chosen)
    program.overlap_chunks = rng.choice(CHUNKS)
    program.features.add("overlap")


def _gemm_pattern(program, rng: random.Random, values: dict, names: tuple[str, str, str],
                  uneven: bool, streams: random.Random | None) -> None:
    """Shards ``y = linear/matmul(x, w)`` on the mesh axis ``mesh_x`` as one of the engine's
    loops asks, in place of what the random schedule wrote for those three tensors:
    ``allgather`` (x's rows sharded, w's and y's output features: the rows gathered before
    the GEMM, a sequence-parallel column linear),
    ``allreduce`` (x and w sharded on the contracted axis, y replicated) or
    ``reduce_scatter`` (as allreduce, y's rows sharded); y becomes an output (a GEMM no
    output reads is not run). In the last two, with ``streams``, x's rows go on
    ``ParallelType.stream`` in ``STREAM_AXIS_SHARE`` of its draws. Extents the mesh axis
    does not divide only with ``uneven``; a broadcast axis is not sharded (the pattern is
    left out)."""
    y, x, w = names
    shapes = {n: tuple(values[n].tensor.shape) for n in names}
    line = next(line for line in program.fd_lines if line.startswith(f"{y} = "))
    w_k = 1 if ".linear(" in line else 0  # w's contracted axis (1 - w_k: its features)
    d = 2 if program.mode.startswith("2x2") else program.world_size  # mesh_x's size
    pattern = rng.choice(["allgather", "allreduce", "reduce_scatter"])
    rows_x, rows_y = len(shapes[x]) - 2, len(shapes[y]) - 2
    axes = {"allgather": {x: rows_x, w: 1 - w_k, y: len(shapes[y]) - 1},
            "allreduce": {x: len(shapes[x]) - 1, w: w_k, y: None},
            "reduce_scatter": {x: len(shapes[x]) - 1, w: w_k, y: rows_y}}[pattern]
    if rows_x < 0 or rows_y < 0 or _reduced(program, x) or _reduced(program, w) or any(
            axis is not None and (values[name].broadcast[axis] or shapes[name][axis] % d
                                  and not (uneven and shapes[name][axis] >= 2))
            for name, axis in axes.items()):
        return
    program.schedule[:] = [line for line in program.schedule
                           if line.split(".", 1)[0] not in (x, w, y)]
    for name, axis in axes.items():
        program.schedule.append(f"{name}.set_device_mesh(mesh)")
        if axis is not None:
            program.schedule += [f"{name}.outer_split({axis}, {d})",
                                 f"{name}.axis({axis}).parallelize(ParallelType.mesh_x)"]
    if streams is not None and pattern != "allgather" and \
            _loop_of_the_gemm_alone(program, x, y) and streams.random() < STREAM_AXIS_SHARE:
        # x's rows on ParallelType.stream (after its mesh split of the last axis, so that
        # the index holds): a loop the user schedules, as nvFuser's row-parallel linear
        # (any chunk count) and sequence-parallel row linear (one chunk per device) do.
        chunks = streams.choice(CHUNKS) if pattern == "allreduce" else d
        program.schedule += [f"{x}.outer_split({rows_x}, {chunks})",
                             f"{x}.axis({rows_x}).parallelize(ParallelType.stream)"]
        program.features.add("stream axis")
    if y not in program.outputs:
        program.outputs.append(y)
    program.features.add(f"overlap {pattern}")


def _reduced(program, name: str) -> bool:
    """Whether ``name`` is a reduction's result: its loop domain keeps the reduced axes, so
    the axis indices the pattern writes (logical ones) would name other loop axes (a
    reduced axis sharded: a partial output, where a shard was meant)."""
    return any((m := _DEFINED.match(line)) and name in m.group(1).split(", ")
               and _REDUCTION.search(line) for line in program.fd_lines)


def _replicated(program, name: str | None) -> bool:
    """Whether the GEMM operand ``name`` (None: no bias) is whole on its mesh: a loop over a
    stream axis reads it whole in every chunk (a bias sharded on another mesh axis turns the
    GEMM's reduction into a communication of two mesh axes, which no loop can run per
    chunk: the engine refuses such a schedule)."""
    return name is None or not any(line.startswith(f"{name}.") and "parallelize" in line
                                   for line in program.schedule)


def _loop_of_the_gemm_alone(program, x: str, y: str) -> bool:
    """Whether a stream axis on x's rows makes a loop of ``y = GEMM(x, w)`` alone: x is an
    input that only the GEMM reads, and no statement reads y. (A stream axis reaches every
    op that reads the tensor, and the ops after them: one that reshards or reduces that
    axis cannot run per chunk, and the engine refuses the schedule, as nvFuser does.)"""
    readers = {name: [line for line in program.fd_lines
                      if re.search(rf"\b{name}\b", line.split(" = ", 1)[-1])]
               for name in (x, y)}
    return x in {n for n, _ in program.inputs} and len(readers[x]) == 1 and not readers[y]


@contextlib.contextmanager
def chunks_env(program):
    """``MESHFUSE_OVERLAP_CHUNKS`` as ``program`` draws it (unchanged where it draws none),
    restored on exit."""
    if not getattr(program, "overlap_chunks", 0):
        yield
        return
    before = os.environ.get(CHUNKS_ENV)
    os.environ[CHUNKS_ENV] = str(program.overlap_chunks)
    try:
        yield
    finally:
        if before is None:
            del os.environ[CHUNKS_ENV]
        else:
            os.environ[CHUNKS_ENV] = before


def repro_lines(program) -> str:
    """The lines a reproduction starts with to set the environment as the run did."""
    if not getattr(program, "overlap_chunks", 0):
        return ""
    return f'import os\nos.environ["{CHUNKS_ENV}"] = "{program.overlap_chunks}"\n'


def loops(explained: str | None) -> int:
    """How many stream loops an ``fd.explain(inputs)`` text lists (none for no text): the
    check that the feature forms loops."""
    return sum(1 for line in (explained or "").splitlines() if "stream loop: " in line
               and ("next to" in line or "chunks," in line))
