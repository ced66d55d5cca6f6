"""The compile pipeline: the user's fusion is never changed, and compiling is repeatable."""

import gc
import weakref

import pytest
import torch
from fusion_snapshot import snapshot
from fuzz_programs import Features, build, generate
from mesh_helpers import mesh_1d, shard

from meshfuse import DataType, DeviceMesh, FusionDefinition
from meshfuse.errors import MeshfuseError, ScheduleError
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention
from meshfuse.ir.fusion import Reshard
from meshfuse.ir.lint import lint
from meshfuse.ir.placement import Replicate, Shard, placements
from meshfuse.ops.registry import REGISTRY
from meshfuse.passes.localization import localize
from meshfuse.passes.pipeline import compile, compiled_for
from meshfuse.runtime.interpreter.binding import bind, local_context
from meshfuse.runtime.interpreter.executor import Slot
from meshfuse.runtime.interpreter.program import build_program
from meshfuse.sharding import shard_tensor


def _partly_scheduled(mesh: DeviceMesh) -> tuple[FusionDefinition, object, object]:
    """x sharded on rows, the output on columns, the tensors between unscheduled: the
    passes must fill the middle and insert a resharding."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 12], dtype=DataType.Float)
        bias = fd.define_tensor([1, 12], dtype=DataType.Float)
        y = fd.ops.exp(fd.ops.add(x, bias))
        out = fd.ops.mul(y, 2.0)
        fd.add_output(out)
    shard(x, 0, mesh)
    shard(out, 1, mesh)
    return fd, x, out


def test_compile_leaves_the_fusion_as_the_user_wrote_it():
    fd, _, _ = _partly_scheduled(DeviceMesh(range(2)))
    before = snapshot(fd.fusion)
    compiled = compile(fd.fusion, 2)
    assert snapshot(fd.fusion) == before
    assert len(compiled.fusion.exprs) > len(fd.fusion.exprs)  # the resharding is in the copy
    assert not set(compiled.fusion.tensors()) & set(fd.fusion.tensors())


@pytest.mark.parametrize("world_size", [2, 4])
def test_compile_leaves_fuzzer_programs_as_written(world_size):
    """Random programs and schedules (the fuzzer's, every feature): compiling one changes
    nothing of the user's fusion: structure, schedules, split chains, flags, printed form."""
    features = Features(uneven=True, any_to_any=True)
    for seed in range(150):
        fd, _ = build(generate(seed, world_size, features))
        before = snapshot(fd.fusion)
        try:
            compile(fd.fusion, world_size, lint=True)
        except MeshfuseError:
            pass  # a refusal must leave the fusion alone too
        assert snapshot(fd.fusion) == before, f"seed {seed}"


def test_each_user_tensor_maps_to_its_compiled_counterpart():
    fd, x, out = _partly_scheduled(DeviceMesh(range(2)))
    compiled = compile(fd.fusion, 2)
    for tv in fd.fusion.tensors():
        assert compiled[tv].name == tv.name and compiled[tv].logical == tv.logical
    assert placements(compiled[x]) == (Shard(0, None),)
    assert placements(compiled[out]) == (Shard(1, None),)
    assert fd.fusion.inputs()[1].mesh is None  # the user's bias stays unscheduled
    assert placements(compiled[fd.fusion.inputs()[1]]) == (Replicate(),)
    assert compiled[compiled[x]] is compiled[x]  # a compiled tensor is its own counterpart


def test_the_same_definition_compiles_to_the_same_text():
    fd, _, _ = _partly_scheduled(DeviceMesh(range(2)))
    first, second = compile(fd.fusion, 2), compile(fd.fusion, 2)
    assert first.explain() == second.explain()
    assert first.fusion is not second.fusion


def test_one_fusion_compiles_for_several_world_sizes():
    fd, _, _ = _partly_scheduled(DeviceMesh(range(2)))
    two, four = compile(fd.fusion, 2), compile(fd.fusion, 4)
    assert (two.world_size, four.world_size) == (2, 4)
    assert two.explain() == four.explain()
    wide, _, _ = _partly_scheduled(DeviceMesh(range(4)))
    with pytest.raises(ScheduleError, match="world has 2 processes"):
        compile(wide.fusion, 2)
    assert compile(wide.fusion, 4).world_size == 4
    compile(wide.fusion)  # no world size: only the meshes' consistency is checked


def test_one_build_serves_every_world_that_holds_its_meshes():
    fd, _, _ = _partly_scheduled(DeviceMesh(range(2)))
    any_world = compiled_for(fd.fusion)
    two, four = compiled_for(fd.fusion, 2), compiled_for(fd.fusion, 4)
    assert (any_world.world_size, two.world_size, four.world_size) == (None, 2, 4)
    assert two.fusion is any_world.fusion is four.fusion  # built once
    assert compiled_for(fd.fusion, 2) is two
    assert two.explain() == compile(fd.fusion, 2).explain()
    wide, _, _ = _partly_scheduled(DeviceMesh(range(4)))
    compiled_for(wide.fusion)
    with pytest.raises(ScheduleError, match="world has 2 processes"):
        compiled_for(wide.fusion, 2)  # too small for the build's meshes: the checks' error
    bias = fd.fusion.inputs()[1]
    shard(bias, 1, DeviceMesh(range(2)))  # a new schedule: a new build
    rebuilt = compiled_for(fd.fusion, 2)
    assert rebuilt.fusion is not two.fusion
    assert placements(rebuilt[bias]) == (Shard(1, None),)


def test_a_build_goes_with_its_fusion():
    fd = _partly_scheduled(DeviceMesh(range(2)))[0]
    compiled_for(fd.fusion, 2)
    gone = weakref.ref(fd.fusion)
    del fd
    gc.collect()
    assert gone() is None


def _attributes(fusion) -> list:
    """Every attribute of ``fusion`` and of its tensors: plain values, other objects by
    identity."""
    return [(name, value if isinstance(value, int | bool | str | type(None)) else id(value))
            for obj in (fusion, *fusion.tensors()) for name, value in vars(obj).items()]


def test_memoized_builds_leave_the_fusions_attributes_alone():
    """``compiled_for`` keeps its builds off the fusion: no attribute of the fusion (nor of
    its tensors) is added, replaced or changed, and the fusion and its build are freed
    together (the memo holds the fusion weakly, and its build nothing of it)."""
    fd = _partly_scheduled(DeviceMesh(range(2)))[0]
    before = _attributes(fd.fusion)
    compiled = compiled_for(fd.fusion, 2)
    assert compiled_for(fd.fusion, 4).fusion is compiled.fusion  # still memoized
    assert _attributes(fd.fusion) == before
    shard(fd.fusion.inputs()[1], 1, DeviceMesh(range(2)))  # a schedule change: a new build
    assert compiled_for(fd.fusion, 2).fusion is not compiled.fusion
    gone, built = weakref.ref(fd.fusion), weakref.ref(compiled.fusion)
    del fd, compiled
    gc.collect()
    assert gone() is None and built() is None


def test_shard_tensor_follows_a_schedule_changed_after_an_earlier_call():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], dtype=DataType.Float)
        fd.add_output(fd.ops.neg(x))
    t = torch.arange(24.0).reshape(4, 6)
    x.set_device_mesh(DeviceMesh(range(2)))
    assert torch.equal(shard_tensor(t, x, rank=1), t)
    shard(x, 1, DeviceMesh(range(2)))
    assert torch.equal(shard_tensor(t, x, rank=1), t[:, 3:])


def test_execute_explain_and_shard_tensor_leave_the_user_fusion_alone(multidevice_test):
    mesh, rank = mesh_1d(multidevice_test), multidevice_test.rank
    fd, x, out = _partly_scheduled(mesh)
    before = snapshot(fd.fusion)
    gen = torch.Generator().manual_seed(0)  # every rank makes the same global tensors
    gx, gbias = torch.randn(8, 12, generator=gen), torch.randn(1, 12, generator=gen)
    inputs = [shard_tensor(gx, x, rank).to(multidevice_test.device),
              shard_tensor(gbias, fd.fusion.inputs()[1], rank).to(multidevice_test.device)]
    assert snapshot(fd.fusion) == before
    text = fd.explain(inputs)
    assert snapshot(fd.fusion) == before
    local, = fd.execute(inputs)
    assert snapshot(fd.fusion) == before
    torch.testing.assert_close(local.cpu(),
                               shard_tensor(torch.exp(gx + gbias) * 2.0, out, rank))
    whole = multidevice_test.unshard_tensor(local, out)
    torch.testing.assert_close(whole.cpu(), torch.exp(gx + gbias) * 2.0)
    assert snapshot(fd.fusion) == before
    assert fd.explain(inputs) == text


def test_golden_resharding_is_a_communication_with_both_placements():
    fd, _, _ = _partly_scheduled(DeviceMesh(range(2)))
    compiled = compile(fd.fusion, 2)
    exprs = [repr(e) for e in compiled.fusion.exprs]
    assert exprs == [
        "T2 = add(T0, T1)",
        "T3 = exp(T2)",
        "T5 = reshard(T3, [S(0)] -> [S(1)])",
        "T4 = mul(T5, 2.0)",
    ], compiled.explain()
    reshard, = [e for e in compiled.fusion.exprs if isinstance(e, Reshard)]
    assert (reshard.source, reshard.target) == ((Shard(0, None),), (Shard(1, None),))
    assert reshard.op is None


def test_golden_partial_sum_is_reduced_by_a_communication():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], dtype=DataType.Float)
        fd.add_output(fd.ops.max(x, dims=[1]))
    shard(x, 1, DeviceMesh(range(2)))
    exprs = [repr(e) for e in compile(fd.fusion, 2).fusion.exprs]
    assert exprs == ["T2 = max(T0, dims=[1], keepdim=False, dtype=None)",
                     "T1 = reshard(T2, [P(max)] -> [R])"]


def test_a_user_set_stays_an_op_with_the_communication_beside_it():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], dtype=DataType.Float)
        y = fd.ops.set(x)
        fd.add_output(y)
    shard(x, 0, DeviceMesh(range(2)))
    shard(y, 1, DeviceMesh(range(2)))
    exprs = [repr(e) for e in compile(fd.fusion, 2).fusion.exprs]
    assert exprs == ["T2 = reshard(T0, [S(0)] -> [S(1)])", "T1 = set(T2)"]
    assert [repr(e) for e in fd.fusion.exprs] == ["T1 = set(T0)"]


def test_between_meshes_the_communication_names_both_meshes():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], dtype=DataType.Float)
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0]))
    y.set_device_mesh(DeviceMesh([1]))
    exprs = [repr(e) for e in compile(fd.fusion, 2).fusion.exprs]
    assert exprs == ["T2 = reshard(T0, DeviceMesh([0]) [R] -> DeviceMesh([1]) [R])",
                     "T1 = set(T2)"]


# ----- localization and program records -----------------------------------------------------

def _records(rank: int) -> str:
    """The records of a row-parallel linear with a bias and a mean over a sharded axis, on
    ``rank`` of 2 (communications left unlowered: a record of their own, no groups)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8], dtype=DataType.Float)
        w = fd.define_tensor([6, 8], dtype=DataType.Float)
        b = fd.define_tensor([6], dtype=DataType.Float)
        fd.add_output(fd.ops.reshape(fd.ops.linear(x, w, b), [24]))
        fd.add_output(fd.ops.mean(x, dims=[1]))
    mesh = DeviceMesh(range(2))
    shard(x, 1, mesh)
    shard(w, 1, mesh)
    compiled = compile(fd.fusion, 2)
    inputs = [shard_tensor(torch.zeros(shape), tv, rank)
              for shape, tv in zip([(4, 8), (6, 8), (6,)], fd.fusion.inputs())]
    binding = bind(compiled.fusion, compiled.allocations, inputs, rank)
    local = localize(compiled.fusion, binding.extents, binding.layouts,
                     local_context(binding, rank, torch.device("cpu")))
    return build_program(compiled.fusion, binding, local, rank).records()


def test_golden_records_hold_each_ranks_local_attributes():
    """The mean divides by the global count (8, not the local 4); the reshape gets its local
    output shape; rank 1 leaves the bias out of the partial linear (rank 0 adds it once) and
    tells the implementation so (it adds a zero bias, to run rank 0's kernel)."""
    assert _records(0) == "\n".join([
        "Program (rank 0) inputs %0, %1, %2",
        "  %3 = linear(%0, %1, %2); free %1, %2    # T3 = linear(T0, T1, T2)",
        "  %5 = reshard(%3); free %3    # T6 = reshard(T3, [P] -> [R]): a local copy",
        ("  %4 = mean(%0, [1], False, None, reduced_count=8); free %0    "
         "# T7 = mean(T0, dims=[1], keepdim=False, dtype=None)"),
        "  %7 = reshard(%4); free %4    # T5 = reshard(T7, [P] -> [R]): a local copy",
        ("  %6 = reshape(%5, [24], out_shapes=[(24,)]); free %5    "
         "# T4 = reshape(T6, new_shape=[24])"),
        "  outputs %6, %7",
    ])
    rank1 = _records(1).splitlines()
    assert rank1[1] == ("  %3 = linear(%0, %1, None, dropped_addends=(2,)); free %1, %2    "
                        "# T3 = linear(T0, T1, T2)")
    assert rank1[2:] == _records(0).splitlines()[2:]


def test_records_are_plain_data_and_dispatch_through_the_registry():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], dtype=DataType.Float)
        fd.add_output(fd.ops.exp(fd.ops.neg(x)))
    compiled = compile(fd.fusion, 1)
    x_local = torch.randn(4, 6)
    binding = bind(compiled.fusion, compiled.allocations, [x_local], 0)
    local = localize(compiled.fusion, binding.extents, binding.layouts,
                     local_context(binding, 0, torch.device("cpu")))
    program = build_program(compiled.fusion, binding, local, 0)
    assert [(s.op, s.args, s.outputs, s.free) for s in program.steps] == [
        ("neg", (Slot(0),), (1,), (0,)), ("exp", (Slot(1),), (2,), (1,))]
    assert program.calls == (REGISTRY["neg"].impl, REGISTRY["exp"].impl)
    out, = program.run([x_local])
    torch.testing.assert_close(out, torch.exp(-x_local))
    again = build_program(compiled.fusion, binding, local, 0)
    assert again.steps == program.steps


# ----- lint between passes ---------------------------------------------------------------------

def test_every_pass_leaves_a_well_formed_graph():
    fd, _, _ = _partly_scheduled(DeviceMesh(range(2)))
    compile(fd.fusion, 2, lint=True)
    with FusionDefinition() as between:
        x = between.define_tensor([4, 6], dtype=DataType.Float)
        between.add_output(fd_set := between.ops.set(x))
    x.set_device_mesh(DeviceMesh([0]))
    fd_set.set_device_mesh(DeviceMesh([1]))
    compile(between.fusion, 2, lint=True)
    for layout in QkvFormat:  # the seed's attention, forward and backward, sequence-sharded
        seed = SeedAttention(layout, DeviceMesh(range(2)), 2, 4, 8, 32)
        seed.definition()
        for t in (seed.q, seed.k, seed.v, seed.out_grad):
            shard(t, 1, DeviceMesh(range(2)))
        compile(seed.fusion, 2, lint=True)


def test_lint_names_the_pass_that_broke_the_graph():
    fd, _, _ = _partly_scheduled(DeviceMesh(range(2)))
    compiled = compile(fd.fusion, 2)
    broken = compiled.fusion
    broken.exprs.reverse()  # a consumer before its producer
    with pytest.raises(AssertionError, match=r"T4 = mul\(T5, 2.0\) after resharding: reads T5 before it is defined"):
        lint(broken, "resharding")
