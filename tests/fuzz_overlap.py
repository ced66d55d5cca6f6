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

from meshfuse.runtime.allreduce_loop_cost import CHUNKS_ENV

CHUNKS = (1, 2, 3, 4)  # MESHFUSE_OVERLAP_CHUNKS drawn per program
GEMM_WEIGHT = 12  # the matmul statement's weight with the feature (3 without)
_GEMM = re.compile(r"^(t\d+) = fd\.ops\.(?:linear|matmul)\((t\d+), (t\d+)(?:, (t\d+))?")
_DEFINED = re.compile(r"^((?:t\d+, )*t\d+) = ")


def add_overlap(program, rng: random.Random) -> None:
    """Appends ``set_overlap(True)`` calls to ``program.schedule`` and draws its
    ``overlap_chunks``: on every tensor a GEMM reads or writes (half the programs), or on
    each tensor of the program with probability 0.4."""
    gemm = [n for line in program.fd_lines if (m := _GEMM.match(line))
            for n in m.groups() if n is not None]
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


def loops(program, rank: int, device) -> int:
    """How many stream loops ``fd.explain(inputs)`` lists for ``program`` on this rank (a
    fresh build, under :func:`chunks_env`): the check that the feature forms loops."""
    from fuzz_programs import build, reference
    from fuzz_runner import local_inputs

    with chunks_env(program):
        fd, _ = build(program)
        inputs, _ = reference(program)
        text = fd.explain(local_inputs(fd.fusion, inputs, rank, device))
    return sum(1 for line in text.splitlines() if "stream loop: " in line
               and "next to" in line)
