"""The checkpoint fuzzer (``fuzz_checkpoint.py``): tensors of random shapes and dtypes saved
under one random layout (meshfuse block/cyclic/uneven/2-D schedules on meshes of some of the
ranks, DTensor placements, whole) and loaded under another; every shard must equal the
same slice of the global tensor exactly, on every rank. The regression tests below are
cases it found, by name.

CI runs ``DEFAULT_CASES`` cases per world size (a few seconds); the long mode runs more:
``MESHFUSE_FUZZ_CHECKPOINT_CASES=300 python -m pytest tests/test_fuzz_checkpoint.py``, from
seed ``MESHFUSE_FUZZ_SEED`` (default 0) on.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from fuzz_checkpoint import Case, Layout, Tensor, case_dir, generate, run
from fuzz_runner import seeds

pytestmark = pytest.mark.mpi

DEFAULT_CASES = 8
CASES_ENV = "MESHFUSE_FUZZ_CHECKPOINT_CASES"


def _run_all(test, cases: list[Case]) -> None:
    base = tempfile.mkdtemp(prefix="meshfuse-ckpt-fuzz-") if test.rank == 0 else None
    base = test.communicator.allgather_object(base)[0]
    meshes, wrong = {}, {}
    try:
        for case in cases:
            found = run(case, case_dir(base, case), test.rank, meshes)
            everyone = [w for ws in test.communicator.allgather_object(found) for w in ws]
            if everyone:
                wrong[case.seed] = (case, everyone)
    finally:
        test.communicator.allgather_object(None)  # every rank done with the files
        if test.rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    assert not wrong, f"{len(wrong)} of {len(cases)} cases loaded other values:\n\n" + \
        "\n\n".join(case.report() + "\n  " + "\n  ".join(w[:6])
                    for case, w in list(wrong.values())[:3])


def test_fuzz_checkpoint_layouts_round_trip(multidevice_test):
    size = multidevice_test.size
    _run_all(multidevice_test, [generate(seed, size)
                                for seed in seeds(size, CASES_ENV, DEFAULT_CASES)])


def _case(world: int, *tensors: Tensor) -> Case:
    return Case(-1, world, tensors)


MX = "t.axis({}).parallelize(ParallelType.mesh_x)"
MY = "t.axis({}).parallelize(ParallelType.mesh_y)"


def test_cyclic_twice_on_a_2x2_mesh_into_2d_dtensor_shards(multidevice_test):
    """An axis split cyclically over both axes of a 2x2 mesh (16 boxes of one element per
    rank and axis) loaded as a DTensor sharding the same axis twice (nested blocks), and
    back; an uneven extent (7) leaves some ranks shorter."""
    if multidevice_test.size != 4:
        pytest.skip("a 2x2 mesh needs 4 ranks")
    grid = ((0, 1), (2, 3))
    cyclic = Layout("meshfuse", grid, ("t.inner_split(0, 2)", MY.format(1),
                                       "t.inner_split(0, 2)", MX.format(1)))
    nested = Layout("dtensor", grid, ("S(0)", "S(0)"))
    _run_all(multidevice_test, [_case(4, Tensor((7, 3), torch.float32, cyclic, nested),
                                      Tensor((7, 3), torch.bfloat16, nested, cyclic))])


def test_disjoint_sub_meshes_and_ranks_that_hold_nothing(multidevice_test):
    """Saved by some ranks (the others hold nothing), loaded by the other ranks: the readers
    never wrote, the writers read nothing; empty shards (extent 1 over 2 or 3 ranks)."""
    world = multidevice_test.size
    if world < 2:
        pytest.skip("two sub-meshes need 2 ranks")
    first, rest = (0,), tuple(range(1, world))
    split = (f"t.outer_split(0, {len(rest)})", MX.format(0))
    _run_all(multidevice_test, [_case(
        world,
        Tensor((5, 2), torch.float64, Layout("meshfuse", first), Layout("meshfuse", rest, split)),
        Tensor((1,), torch.int32, Layout("dtensor", rest, ("S(0)",)), Layout("dtensor", first,
                                                                               ("R",))),
        Tensor((), torch.float32, Layout("whole"), Layout("meshfuse", rest)))])
