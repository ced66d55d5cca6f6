"""Bad definitions, schedules and inputs of sharded fusions: typed errors on every rank.

Every test runs on every rank (world sizes 1, 2, 4) and each rank asserts the error itself:
an error raised on some ranks only would leave the others waiting in a collective. The
messages must name the tensor (and the axis where there is one) and the offending values.
"""

from __future__ import annotations

import pytest
import torch

from meshfuse import (
    DeviceMesh,
    FusionDefinition,
    InputError,
    ParallelType,
    ScheduleError,
)
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

pytestmark = pytest.mark.mpi


def _relu_fusion(shape, stride_order=None):
    """``T1 = relu(T0)`` with ``T0`` of ``shape``; returns the definition and both tensors."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape, stride_order=stride_order)
        y = fd.ops.relu(x)
        fd.add_output(y)
    return fd, x, y


def _block_shard(tvs, mesh, axis):
    for tv in tvs:
        tv.set_device_mesh(mesh)
        tv.outer_split(axis, mesh.size)
        tv.axis(axis).parallelize(ParallelType.mesh_x)


def _words(message: str, *words: str) -> None:
    missing = [w for w in words if w not in message]
    assert not missing, f"{missing} not in the message: {message}"


# ----- schedules ---------------------------------------------------------------------------

def test_a_shard_of_the_wrong_extent_of_an_uneven_split(multidevice_test):
    """10 columns over d ranks (d = 4: 3, 3, 3, 1): every rank passes one column too many and
    is told the extent of its own shard."""
    d, rank = multidevice_test.size, multidevice_test.rank
    fd, x, y = _relu_fusion([2, 10])
    _block_shard([x, y], DeviceMesh(range(d)), 1)
    want = len(torch.arange(10).tensor_split([-(-10 // d) * c for c in range(1, d)])[rank])
    with pytest.raises(InputError) as info:
        fd.execute([torch.randn(2, want + 1, device=current_device())])
    _words(str(info.value), "T0", "axis 1", f"local extent {want + 1}", "10",
           f"shard of extent {want}")


def test_a_split_that_does_not_divide_a_symbolic_extent_is_uneven(multidevice_test):
    """The extent is known at execute only: the serial part of axis 0 (2 rows per rank) is
    split by 3, unevenly (positions 0, 1 of 3): legal, and the values are the reference's."""
    d = multidevice_test.size
    fd, x, y = _relu_fusion([-1, 4])
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
        tv.outer_split(0, d)
        tv.axis(0).parallelize(ParallelType.mesh_x)
        tv.split(1, 3)
    local = torch.randn(2, 4, device=current_device())
    out, = fd.execute([local])
    torch.testing.assert_close(out, local.relu())


def test_device_factor_differs_from_mesh_axis_size(multidevice_test):
    d = multidevice_test.size
    fd, x, y = _relu_fusion([24])
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
        tv.outer_split(0, 2 * d)
        tv.axis(0).parallelize(ParallelType.mesh_x)
    with pytest.raises(ScheduleError) as info:
        fd.execute([torch.randn(24 // (2 * d), device=current_device())])
    _words(str(info.value), "T0", "axis 0", f"extent {2 * d}", "DIDx", f"size {d}")


def test_logical_device_axis_of_the_wrong_extent(multidevice_test):
    d = multidevice_test.size
    fd, x, y = _relu_fusion([d + 1, 4])
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
        tv.axis(0).parallelize(ParallelType.mesh_x)
    with pytest.raises(ScheduleError) as info:
        fd.execute([torch.randn(1, 4, device=current_device())])
    _words(str(info.value), "T0", "axis 0", f"extent {d + 1}", f"size {d}")


def test_symbolic_logical_device_axis_with_a_local_extent_above_one(multidevice_test):
    """``[-1, 4]`` with axis 0 parallelized directly (nvFuser's logical-DID form): its global
    extent is the mesh axis size, so each rank must pass local extent 1."""
    d = multidevice_test.size
    fd, x, y = _relu_fusion([-1, 4])
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
        tv.axis(0).parallelize(ParallelType.mesh_x)
    with pytest.raises(InputError) as info:
        fd.execute([torch.randn(2, 4, device=current_device())])
    _words(str(info.value), "T0", "axis 0", "1", "2")


def test_mesh_with_more_devices_than_the_world(multidevice_test):
    size = multidevice_test.size
    fd, x, y = _relu_fusion([6])
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(size + 1)))
    with pytest.raises(ScheduleError) as info:
        fd.execute([torch.randn(6, device=current_device())])
    _words(str(info.value), "T0", f"device {size}", f"{size} processes")


def test_device_parallel_type_used_twice_in_one_tensor(multidevice_test):
    d = multidevice_test.size
    _, x, _ = _relu_fusion([4 * d, 4 * d])
    x.set_device_mesh(DeviceMesh(range(d)))
    x.outer_split(0, d).outer_split(2, d)
    x.axis(0).parallelize(ParallelType.mesh_x)
    with pytest.raises(ScheduleError) as info:
        x.axis(2).parallelize(ParallelType.mesh_x)
    _words(str(info.value), "T0", "DIDx", "twice", "axes 0 and 2")


def test_parallelizing_a_broadcast_axis(multidevice_test):
    """Legal over a mesh axis of one device (as nvFuser at d == 1); an error over more."""
    d = multidevice_test.size
    fd, x, y = _relu_fusion([1, 4])
    if d == 1:
        for tv in (x, y):
            tv.set_device_mesh(DeviceMesh(range(d)))
            tv.axis(0).parallelize(ParallelType.mesh_x)
        ones = torch.ones(1, 4, device=current_device())
        torch.testing.assert_close(fd.execute([ones])[0], ones)
        return
    x.set_device_mesh(DeviceMesh(range(d)))
    with pytest.raises(ScheduleError) as info:
        x.axis(0).parallelize(ParallelType.mesh_x)
    _words(str(info.value), "T0", "axis 0", "broadcast", "one device")


def test_device_parallel_type_beyond_the_mesh_rank(multidevice_test):
    """mesh_y on a 1-D mesh."""
    d = multidevice_test.size
    fd, x, y = _relu_fusion([4 * d, 3])
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
        tv.outer_split(0, d)
        tv.axis(0).parallelize(ParallelType.mesh_y)
    with pytest.raises(ScheduleError) as info:
        fd.execute([torch.randn(4, 3, device=current_device())])
    _words(str(info.value), "T0", "axis 0", "mesh_y", "2 axes")


def test_device_axis_from_a_merge_whose_parts_are_no_blocks(multidevice_test):
    """5 x (d + 1) elements merged, in blocks of ceil(5 (d + 1) / d): at 2, 3 and 4 ranks a
    block cuts rows apart (a ScheduleError naming the tensor and the merged axes); at 1 the
    one block is the tensor (tests/test_merged_axes.py runs the merges that are blocks)."""
    d = multidevice_test.size
    fd, x, y = _relu_fusion([5, d + 1])
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
        tv.merge(0)
        tv.outer_split(0, d)
        tv.axis(0).parallelize(ParallelType.mesh_x)
    gx = torch.randn(5, d + 1, device=current_device())
    if d == 1:
        torch.testing.assert_close(fd.execute([gx])[0], gx.relu())
        return
    with pytest.raises(ScheduleError, match=r"T[01]\b") as info:
        fd.execute([gx[:1]])
    _words(str(info.value), "merge of axes 0 and 1", "split one logical axis")


# ----- shardings that need communication ------------------------------------------------
#
# Resharding (docs/design.md, section 6) gives these the right values with the communication they need;
# what it cannot do is refused before anything runs, on every rank alike.

def _correct(fd, local_inputs, expected, communications):
    """The ``expected`` outputs after exactly the ``communications`` (kinds of collectives;
    at world size 1, any of them)."""
    with record_communications() as comms:
        outputs = fd.execute(local_inputs)
    assert len(outputs) == len(expected)
    for out, want in zip(outputs, expected):
        torch.testing.assert_close(out, want)
    kinds = [c.kind for c in comms]
    if torch.distributed.get_world_size() > 1:
        assert kinds == communications
    else:
        assert set(kinds) <= set(communications)


def test_reduction_over_a_sharded_axis(multidevice_test):
    """The output keeps its reduced axis unsharded: the shards' sums must be added up."""
    d, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4 * d])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
    x.set_device_mesh(DeviceMesh(range(d)))
    x.outer_split(1, d)
    x.axis(1).parallelize(ParallelType.mesh_x)
    s.set_device_mesh(DeviceMesh(range(d)))
    t = torch.randn(3, 4 * d, generator=torch.Generator().manual_seed(0)).to(current_device())
    _correct(fd, [t[:, 4 * rank:4 * rank + 4].contiguous()], [t.sum(1)], ["allreduce"])


def test_reduction_over_a_sharded_axis_as_a_partial_result(multidevice_test):
    """The output's reduction ID is sharded like the input: each rank holds a partial sum
    (docs/design.md, section 4), which is what a user who parallelized the reduction axis gets."""
    d, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4 * d])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
    _block_shard((x, s), DeviceMesh(range(d)), 1)
    t = torch.randn(3, 4 * d, generator=torch.Generator().manual_seed(1)).to(current_device())
    local = t[:, 4 * rank:4 * rank + 4].contiguous()
    _correct(fd, [local], [local.sum(1)], [])


def test_input_and_output_sharded_differently(multidevice_test):
    d, rank = multidevice_test.size, multidevice_test.rank
    fd, x, y = _relu_fusion([4 * d, 4 * d])
    _block_shard([x], DeviceMesh(range(d)), 0)
    _block_shard([y], DeviceMesh(range(d)), 1)
    t = torch.randn(4 * d, 4 * d, generator=torch.Generator().manual_seed(2)).to(current_device())
    _correct(fd, [t[4 * rank:4 * rank + 4]], [t.relu()[:, 4 * rank:4 * rank + 4]],
             ["all_to_all"])


def test_tensors_of_one_op_on_meshes_of_different_ranks(multidevice_test):
    """x on a 1-D mesh, y on a [1, d] mesh of the same devices, both replicated: every device
    holds x already, so the move between the meshes communicates nothing."""
    d = multidevice_test.size
    fd, x, y = _relu_fusion([4, 3])
    x.set_device_mesh(DeviceMesh(range(d)))
    y.set_device_mesh(DeviceMesh(torch.arange(d).reshape(1, d)))
    t = torch.randn(4, 3, generator=torch.Generator().manual_seed(3)).to(current_device())
    _correct(fd, [t], [t.relu()], [])


# ----- inputs ------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, -1], ids=["one_row_more", "one_row_less"])
def test_local_input_shape_does_not_match_its_schedule(multidevice_test, rows):
    d = multidevice_test.size
    fd, x, y = _relu_fusion([4 * d, 3])
    _block_shard((x, y), DeviceMesh(range(d)), 0)
    with pytest.raises(InputError) as info:
        fd.execute([torch.randn(4 + rows, 3, device=current_device())])
    _words(str(info.value), "T0", "axis 0", f"{4 + rows}", f"{4 * d}")


def test_global_tensor_passed_instead_of_the_shard(multidevice_test):
    d = multidevice_test.size
    if d == 1:
        pytest.skip("at world size 1 the shard is the global tensor")
    fd, x, y = _relu_fusion([4 * d, 3])
    _block_shard((x, y), DeviceMesh(range(d)), 0)
    with pytest.raises(InputError) as info:
        fd.execute([torch.randn(4 * d, 3, device=current_device())])
    _words(str(info.value), "T0", "axis 0", f"{d} shards", "shard of extent 4")


def test_local_input_with_the_wrong_memory_order(multidevice_test):
    """BSHE declared (and scheduled as the seed does), a row-major (BHSE) shard passed."""
    d = multidevice_test.size
    fd, x, y = _relu_fusion([2, 4 * d, 3, 5], stride_order=[3, 1, 2, 0])
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
        tv.outer_split(1, d)
        tv.axis(1).parallelize(ParallelType.mesh_x)
        tv.reorder({2: 3, 3: 2})
        tv.set_allocation_as_loop()
    with pytest.raises(InputError) as info:
        fd.execute([torch.randn(2, 4, 3, 5, device=current_device())])
    _words(str(info.value), "T0", "strides")


def test_symbolic_extents_that_do_not_broadcast(multidevice_test):
    d = multidevice_test.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 3])
        w = fd.define_tensor([-1, 3])
        fd.add_output(fd.ops.add(x, w))
    _block_shard(fd.fusion.tensors(), DeviceMesh(range(d)), 0)
    with pytest.raises(InputError) as info:
        fd.execute([torch.randn(2, 3, device=current_device()),
                    torch.randn(3, 3, device=current_device())])
    _words(str(info.value), "add", "T0", "T1", "axis 0", f"{2 * d}", f"{3 * d}")


# ----- ranks that disagree (check_ranks) -------------------------------------------------------

def _symbolic_sharded_relu(d):
    fd, x, y = _relu_fusion([-1, 3])
    _block_shard((x, y), DeviceMesh(range(d)), 0)
    return fd


def _require_ranks(multidevice_test):
    if multidevice_test.size < 2:
        pytest.skip("needs two ranks to disagree")


@pytest.mark.parametrize("how", ["argument", "environment"])
@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_ranks_that_disagree_on_an_input(multidevice_test, monkeypatch, what, how):
    """Rank 1 passes a local shard of another shape (or dtype) than the other ranks: every
    rank raises InputError before running anything, and afterwards the ranks still agree on
    their collectives (a consistent call runs)."""
    _require_ranks(multidevice_test)
    d, rank = multidevice_test.size, multidevice_test.rank
    fd = _symbolic_sharded_relu(d)
    good = torch.randn(2, 3, device=current_device())
    bad = torch.randn(3, 3, device=current_device()) if what == "shape" else good.double()
    options = {"check_ranks": True}
    if how == "environment":
        monkeypatch.setenv("MESHFUSE_CHECK_RANKS", "1")
        options = {}
    with pytest.raises(InputError) as info:
        fd.execute([bad if rank == 1 else good], **options)
    _words(str(info.value), "rank 1", "T0", "axis 0" if what == "shape" else "float64")

    (out,) = fd.execute([good], **options)
    torch.testing.assert_close(out, good.relu())
