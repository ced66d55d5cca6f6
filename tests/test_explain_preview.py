"""``fd.explain(world_size=N)``: a rank's plan previewed from one process; ``explain`` of a
fusion (or of a program for some inputs) that cannot be built; no overlap candidate for a
communication that does not run."""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import mesh_1d, shard
from test_explain import PROGRAMS, _mlp

import meshfuse
from meshfuse import (
    DataType,
    DeviceMesh,
    FusionDefinition,
    InputError,
    ParallelType,
    ShardingError,
)
from meshfuse.testing.utils import current_device

OVERLAP = "communications next to GEMMs (overlap):"


@pytest.mark.mpi
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_the_preview_is_what_each_rank_prints(multidevice_test, program):
    size, rank = multidevice_test.size, multidevice_test.rank
    fd = PROGRAMS[program](size)
    preview = PROGRAMS[program](size).explain(world_size=size, rank=rank)
    assert fd.explain() == preview


@pytest.mark.mpi
def test_a_backward_previewed_and_explained_on_its_ranks(multidevice_test):
    size, rank = multidevice_test.size, multidevice_test.rank
    bwd = meshfuse.vjp(_mlp(mesh_1d(multidevice_test)))
    preview = meshfuse.vjp(_mlp(DeviceMesh(range(size))), world_size=size)
    assert bwd.explain() == preview.explain(world_size=size, rank=rank)
    assert str(bwd) == str(preview)


def test_previews_of_every_rank_of_four_from_one_process():
    fd = _mlp(DeviceMesh(range(4)))
    texts = [fd.explain(world_size=4, rank=r) for r in range(4)]
    for r, text in enumerate(texts):
        assert text.startswith(f"rank {r} of 4, extents from the definition")
        assert "  T5 = reshard(T6): allreduce(sum) over mesh axis 0, ranks [0, 1, 2, 3], " \
            "512 B" in text.splitlines()
        assert "  T1      [32, 16]  Float  [0, 1, 2, 3]  [S(0)]      [8, 16]" in text
    assert not fd.built  # a preview builds no runner: execute still builds its own


@pytest.mark.parametrize("kw, match", [
    ({"world_size": 0}, "world_size=0"), ({"world_size": True}, "world_size=True"),
    ({"world_size": 2, "rank": 2}, r"rank=2 is not a rank of 2; give one in \[0, 1\]")])
def test_bad_previews(kw, match):
    with pytest.raises(InputError, match=match):
        _mlp(DeviceMesh(range(2))).explain(**kw)


def test_a_preview_takes_no_inputs():
    with pytest.raises(InputError, match="leave out the inputs"):
        _mlp(DeviceMesh(range(2))).explain([torch.randn(8, 16)], world_size=2)


def test_no_overlap_candidate_at_one_rank():
    # At one rank the allreduce of the row-parallel linear does not run: nothing to overlap.
    fd = _mlp(DeviceMesh(range(1)))
    text = fd.explain()
    assert "communications on rank 0: none" in text and OVERLAP not in text
    assert OVERLAP in _mlp(DeviceMesh(range(2))).explain(world_size=2)
    # one rank of a larger world, on a mesh axis of one device: none either
    assert OVERLAP not in _mlp(DeviceMesh([1])).explain(world_size=2, rank=1)


@pytest.mark.mpi
def test_overlap_candidates_only_where_the_communication_runs(multidevice_test):
    text = _mlp(mesh_1d(multidevice_test)).explain()
    assert (OVERLAP in text) == (multidevice_test.size > 1)


def test_a_fusion_that_cannot_be_built_is_explained_up_to_where_it_stops():
    fd = _mlp(DeviceMesh(range(2)))  # 2 devices, in a world of 1 process
    with pytest.raises(meshfuse.ScheduleError) as error:
        fd.execute([torch.randn(8, 16), torch.randn(32, 16), torch.randn(16, 32)])
    expected = "\n".join([
        ("rank 0 of 1: the fusion cannot be built; its tensors as the build left them "
        "(stopped in its check_world pass, '-': not decided)"),
        "  tensor  global    dtype  mesh    placements  defined by",
        "  T0      [8, 16]   Float  -       -           input",
        "  T1      [32, 16]  Float  [0, 1]  [S(0)]      input",
        "  T2      [16, 32]  Float  [0, 1]  [S(1)]      input",
        "  T3      [8, 32]   Float  -       -           linear(T0, T1)",
        "  T4      [8, 32]   Float  -       -           gelu(T3, approximate='tanh')",
        "  T5      [8, 16]   Float  -       -           linear(T4, T2)",
        "outputs: T5",
        f"not built: ScheduleError: {error.value}",
    ])
    assert fd.explain() == expected
    assert fd.explain(world_size=1) == expected


def test_the_placements_propagation_decided_before_a_later_check_refused():
    # A grouped_mm with its groups sharded passes propagation and resharding; the program
    # for the inputs refuses it. Before the inputs, explain shows the plan.
    with FusionDefinition() as fd:
        a = fd.define_tensor([8, 4], name="a")
        b = fd.define_tensor([2, 4, 6], name="b")
        offsets = fd.define_tensor([2], dtype=DataType.Int32, name="offsets")
        fd.add_output(fd.ops.grouped_mm(a, b, offsets))
    shard(a, 0, DeviceMesh(range(2)))
    text = fd.explain(world_size=2, rank=1)
    assert "  T3       [8, 6]     Float  [0, 1]  [S(0)]      [4, 6]" in text


@pytest.mark.mpi
def test_a_program_that_cannot_be_built_for_its_inputs(multidevice_test):
    size, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        a = fd.define_tensor([8, 4], name="a")
        b = fd.define_tensor([2, 4, 6], name="b")
        offsets = fd.define_tensor([2], dtype=DataType.Int32, name="offsets")
        fd.add_output(fd.ops.grouped_mm(a, b, offsets))
    shard(a, 0, mesh_1d(multidevice_test))
    for tv in (b, offsets):
        tv.set_device_mesh(mesh_1d(multidevice_test))
    inputs = [multidevice_test.shard_tensor(t, tv).to(current_device()) for t, tv in (
        (torch.randn(8, 4), a), (torch.randn(2, 4, 6), b),
        (torch.tensor([3, 8], dtype=torch.int32), offsets))]
    with pytest.raises(ShardingError, match=r"the rows \(axis 0\) of mat1 \(a\) are sharded") \
            as error:
        fd.execute(inputs)
    text = fd.explain(inputs).splitlines()
    assert text[0] == f"rank {rank} of {size}, extents from the inputs"
    assert text[3].split()[:3] == ["a", "[8,", "4]"] and "[S(0)]" in text[3].split()
    assert text[-1] == f"no program for these inputs on rank {rank}: ShardingError: " \
        f"{error.value}"


def test_a_schedule_refused_before_propagation_shows_what_it_cannot_read():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4], name="x")
        fd.add_output(fd.ops.sum(fd.ops.neg(x), [1]))
    x.set_device_mesh(DeviceMesh(range(2)))
    x.merge(0, 1)  # 2 blocks of 6 of the merged 3 x 4: not whole rows
    x.outer_split(0, 2)
    x.axis(0).parallelize(ParallelType.mesh_x)
    lines = fd.explain(world_size=2).splitlines()
    assert lines[:5] == [
        ("rank 0 of 2: the fusion cannot be built; its tensors as the build left them "
        "(stopped in its unmerge pass, '-': not decided)"),
        "  tensor  global  dtype  mesh    placements  defined by",
        "  x       [3, 4]  Float  [0, 1]  ?           input",  # placements it cannot read
        "  T1      [3, 4]  Float  -       -           neg(x)",
        "  T2      [3]     Float  -       -           sum(T1, dims=[1])",
    ]
    assert lines[-1].startswith("not built: ScheduleError: x: a device-parallel axis is split "
                                "from the merge of axes 0 and 1")
