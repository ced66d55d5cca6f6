"""Named regressions of derived backwards: each program here once failed (wrong gradients, an
untyped crash, a refusal of a valid program, or a hang), found by the gradient fuzzer
(``test_fuzz_autodiff.py``).

Two tables, as in ``test_fuzz_regressions.py``: :data:`CASES`, programs written by hand (the
smallest form of a failure), and :data:`SEEDS`, fuzzer programs kept as drawn (seed and world
size). Every case runs at world sizes 1, 2 and 4 (two meshes from 2 ranks) through
``fd.as_autograd_function()`` with random cotangents, and compares each rank's outputs and
input gradient shards with ``torch.autograd`` on the global tensors, sliced by
``shard_tensor`` (``fuzz_gradients.check_gradients``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fuzz_cases import Case, set_up
from fuzz_gradients import check_gradients, run_gradients
from fuzz_programs import Features, generate
from mesh_helpers import MX, shard

from meshfuse import DataType, DeviceMesh, FusionDefinition, shard_tensor
from meshfuse.runtime.comm.communicator import Communicator

pytestmark = pytest.mark.mpi

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _run(multidevice_test, case: Case) -> str:
    """``case`` forward and backward on this rank's shards against torch; what differs."""
    rank, device = multidevice_test.rank, multidevice_test.device
    fd, inputs, gen = set_up(multidevice_test, case)
    inputs = [x.requires_grad_() for x in inputs]
    expected = case.reference(*inputs)
    cotangents = [torch.randn(e.shape, generator=gen) for e in expected]
    return check_gradients(fd, fd.as_autograd_function(), inputs, expected, cotangents, rank,
                           device, lambda ref: TOLERANCE)


# --- the programs -------------------------------------------------------------------------

def _minimum_on_the_other_mesh(fd, d):
    x = fd.define_tensor([2 * d + 1], dtype=DataType.Float)
    s = fd.define_tensor([], dtype=DataType.Float)
    y = fd.ops.minimum(x, s)
    fd.add_output(y)
    return x, s, y


def _inputs_on_b_output_on_a(t, mesh_a, mesh_b):
    shard(t[0], 0, mesh_b)
    t[1].set_device_mesh(mesh_b)
    t[2].set_device_mesh(mesh_a)


def _full_reductions(fd, d):
    x = fd.define_tensor([2 * d + 1, 3], dtype=DataType.Float)
    _var, mean = fd.ops.var_mean(x, dims=None, correction=0, keepdim=False)
    fd.add_output(mean)
    fd.add_output(fd.ops.sum(x, dims=[0], keepdim=True))
    return (x,)


def _full_reductions_reference(x):
    return [x.mean(), x.sum(0, keepdim=True)]


def _minimum_over_cyclic_rows(fd, d):
    x = fd.define_tensor([4 * d, 2 * d + 1], dtype=DataType.Float)
    m = fd.ops.min(x, dims=[0], keepdim=False)
    fd.add_output(m)
    return x, m


def _cyclic_rows_block_result(t, mesh):
    shard(t[0], 0, mesh, inner=True)
    shard(t[1], 0, mesh)


def _sum_then_scale(fd, d):
    x = fd.define_tensor([2 * d + 1, 4], dtype=DataType.Float)
    s = fd.ops.sum(x, dims=[0], keepdim=True)
    fd.add_output(fd.ops.mul(s, 0.5))
    return x, s


def _sum_pinned_partial(t, mesh):
    """The sum's reduction axis (loop axis 0) split over the mesh: a partial result."""
    t[1].set_device_mesh(mesh)
    t[1].outer_split(0, mesh.size)
    t[1].axis(0).parallelize(MX)


def _cat_of_an_expanded_broadcast(fd, d):
    x = fd.define_tensor([3, 8], dtype=DataType.Float)
    y = fd.define_tensor([3, 2 * d + 1, 4], dtype=DataType.Float)
    b = fd.ops.broadcast_in_dim(x, shape=[3, 2 * d + 1, 8], broadcast_dims=[0, 2])
    fd.add_output(fd.ops.cat([b, y], dim=2))
    return x, y


def _cat_of_an_expanded_broadcast_reference(x, y):
    return [torch.cat([x[:, None, :].expand(3, y.shape[1], 8), y], 2)]


def _minimum_of_an_expanded_broadcast(fd, d):
    x = fd.define_tensor([2 * d + 2], dtype=DataType.Float)
    b = fd.ops.broadcast_in_dim(x, shape=[2 * d + 2, 4], broadcast_dims=[0])
    y = fd.ops.minimum(b, 0.5)
    fd.add_output(y)
    return x, y


def _minimum_then_exp(fd, d):
    x = fd.define_tensor([2 * d + 1, 2 * d], dtype=DataType.Float)
    m = fd.ops.min(x, dims=[0], keepdim=True)
    y = fd.ops.exp(m)
    fd.add_output(y)
    return x, m, y


def _cyclic_rows_minimum_pinned_partial_on_blocks(t, mesh):
    shard(t[0], 0, mesh, inner=True)
    _sum_pinned_partial(t, mesh)
    shard(t[2], 1, mesh)


def _sum_of_an_expanded_product(fd, d):
    v = fd.define_tensor([2 * d + 2], dtype=DataType.Float)
    w = fd.define_tensor([2 * d + 2, 2], dtype=DataType.Float)
    m = fd.ops.sum(w, dims=[1], keepdim=True)  # extent 1 along axis 1
    b = fd.ops.broadcast_in_dim(v, shape=[2 * d + 2, 3], broadcast_dims=[0])
    fd.add_output(fd.ops.sum(fd.ops.mul(b, m), dims=[1]))
    return v, w


def _broadcast_again_and_kept(fd, d):
    x = fd.define_tensor([2 * d + 2], dtype=DataType.Float)
    s = fd.define_tensor([], dtype=DataType.Float)
    b = fd.ops.broadcast_in_dim(x, shape=[2 * d + 2, 6], broadcast_dims=[0])
    again = fd.ops.broadcast_in_dim(b, shape=[4, 2 * d + 2, 6], broadcast_dims=[1, 2])
    fd.add_output(fd.ops.sub(s, again))
    fd.add_output(b)
    return x, s


def _broadcast_again_and_kept_reference(x, s):
    b = x[:, None].expand(x.shape[0], 6)
    return [s - b[None].expand(4, *b.shape), b]


def _product_of_expanded_broadcasts_broadcast_again(fd, d):
    x = fd.define_tensor([2 * d + 2], dtype=DataType.Float)
    y = fd.define_tensor([2 * d + 2], dtype=DataType.Float)
    bx, by = (fd.ops.broadcast_in_dim(t, shape=[2 * d + 2, 6], broadcast_dims=[0])
              for t in (x, y))
    fd.add_output(fd.ops.broadcast_in_dim(fd.ops.mul(bx, by), shape=[3, 2 * d + 2, 6],
                                          broadcast_dims=[1, 2]))
    return x, y


def _product_of_expanded_broadcasts_broadcast_again_reference(x, y):
    product = x[:, None].expand(x.shape[0], 6) * y[:, None].expand(y.shape[0], 6)
    return [product[None].expand(3, *product.shape)]


def _linear_of_an_expanded_broadcast(fd, d):
    x = fd.define_tensor([2 * d, 8], dtype=DataType.Float)
    w = fd.define_tensor([4, 8], dtype=DataType.Float)
    b = fd.ops.broadcast_in_dim(x, shape=[2 * d, 3, 8], broadcast_dims=[0, 2])
    fd.add_output(fd.ops.linear(b, w, None))
    return x, w


def _three_projections_of_one_input(fd, d):
    x = fd.define_tensor([4, 6], dtype=DataType.Float)
    ws = [fd.define_tensor(shape, dtype=DataType.Float) for shape in ([4, 6], [4, 6], [16, 6])]
    for w in ws:
        fd.add_output(fd.ops.linear(x, w, None))
    return x, *ws


def _rows_of_the_weights(t, mesh):
    for w in t[1:]:
        shard(w, 0, mesh)


def _batched_matmul_summed_over_its_batch(batch):
    def define(fd, d):
        a = fd.define_tensor([batch(d), 4, 3], dtype=DataType.Float)
        w = fd.define_tensor([batch(d), 3, 5], dtype=DataType.Float)
        fd.add_output(fd.ops.sum(fd.ops.matmul(a, w), dims=[0]))
        return a, w
    return define


def _batches_sharded(t, mesh):
    shard(t[0], 0, mesh)
    shard(t[1], 0, mesh)


def _linear_by_heads(fd, d):
    x = fd.define_tensor([2, 3, 6], dtype=DataType.Float)
    w = fd.define_tensor([8, 4, 6], dtype=DataType.Float)  # [heads, head dim, features]
    b = fd.define_tensor([8, 4], dtype=DataType.Float)
    y = fd.ops.linear(x, w, b)  # [heads, batch, sequence, head dim]
    fd.add_output(fd.ops.permute(y, [1, 0, 2, 3]))
    return x, w, b


def _linear_with_more_ranks_than_leading_indices(fd, d):
    x = fd.define_tensor([4, 6], dtype=DataType.Float)
    w = fd.define_tensor([2, 5, 6], dtype=DataType.Float)
    b = fd.define_tensor([2, 5], dtype=DataType.Float)
    fd.add_output(fd.ops.linear(x, w, b))
    return x, w, b


def _linear_by_heads_of_an_expanded_broadcast(fd, d):
    x = fd.define_tensor([3, 3], dtype=DataType.Float)
    w = fd.define_tensor([4, 4, 3], dtype=DataType.Float)
    b = fd.define_tensor([4, 4], dtype=DataType.Float)
    tokens = fd.ops.broadcast_in_dim(x, shape=[3, 2, 3], broadcast_dims=[0, 2])
    fd.add_output(fd.ops.linear(tokens, w, b))
    return x, w, b


def _chained_batched_matmuls(fd, d):
    a = fd.define_tensor([3, 6, 3], dtype=DataType.Float)
    b = fd.define_tensor([3, 3, 8], dtype=DataType.Float)
    c = fd.define_tensor([3, 8, 5], dtype=DataType.Float)
    y = fd.ops.matmul(fd.ops.matmul(a, b), c)
    z = fd.ops.cast(y, DataType.Double)
    fd.add_output(fd.ops.cast(z, DataType.Float))
    fd.add_output(y)
    return a, b, c, y, z


def _contraction_and_batch_of_a_consumer_sharded(t, mesh):
    """c's contracted rows split (the product partial), its cast's batch split (the
    product, also an output, then takes that split: a partial sum to reduce-scatter)."""
    t[0].set_device_mesh(mesh)
    shard(t[2], 1, mesh)
    shard(t[4], 0, mesh)


CASES: dict[str, Case] = {
    "inputs_on_other_ranks_meshes": Case(
        "a hang (collective timeout): the ranks that hold no input (they pass None) derived "
        "no backward and never ran the one the others ran (gradient fuzzer seed 0 at 2 "
        "ranks)",
        _minimum_on_the_other_mesh, _inputs_on_b_output_on_a,
        lambda x, s: [torch.minimum(x, s)], lambda d: [[2 * d + 1], []], meshes="two"),
    "gradient_of_a_full_reduction_pinned_to_a_sharded_input": Case(
        "refused, ScheduleError 'axis 0 of T3 is a broadcast axis ... cannot be sharded': "
        "the gradient of a mean over every axis is an expanded broadcast, pinned to the "
        "input's sharded axis (gradient fuzzer seeds 33, 146 and 337 at 2 ranks)",
        _full_reductions, lambda t, mesh: shard(t[0], 0, mesh), _full_reductions_reference,
        lambda d: [[2 * d + 1, 3]]),
    "extremum_gradient_reads_a_resharded_expanded_broadcast": Case(
        "ExecutionError 'The size of tensor a (4) must match the size of tensor b (8)': min's "
        "gradient compares the input with its result broadcast back, resharded (so made "
        "contiguous); the pointwise op took the expanded axis for an iteration axis "
        "(gradient fuzzer seeds 262 and 329 at 2 ranks)",
        _minimum_over_cyclic_rows, _cyclic_rows_block_result,
        lambda x: [torch.amin(x, dim=0)], lambda d: [[4 * d, 2 * d + 1]]),
    "result_pinned_partial_keeps_its_pin_in_the_derivation": Case(
        "refused, InputError 'input T0 axis 0 has local extent 4, but the definition says "
        "6': the derivation's copy of the fusion dropped the pin of a reduction's partial "
        "result (the schedule of its reduction axis), so its input was sharded otherwise "
        "than shard_tensor shards it (gradient fuzzer seed 339 at 2 ranks)",
        _sum_then_scale, _sum_pinned_partial,
        lambda x: [x.sum(0, keepdim=True) * 0.5], lambda d: [[2 * d + 1, 4]]),
    "cat_of_an_expanded_broadcast_and_an_iteration_axis": Case(
        "silently wrong gradient of the second input (off by up to 4.4): cat's result took "
        "the first input's expanded broadcast axis for its own, so the backward summed the "
        "whole cotangent over it (gradient fuzzer seed 359 at 2 ranks)",
        _cat_of_an_expanded_broadcast, lambda t, mesh: shard(t[1], 1, mesh, inner=True),
        _cat_of_an_expanded_broadcast_reference, lambda d: [[3, 8], [3, 2 * d + 1, 4]]),
    "pointwise_gradient_of_an_expanded_broadcast_summed_once": Case(
        "silently wrong gradient, 4 times too large: the gradient of an op's result whose "
        "axis is an expanded broadcast (extent 4) was summed over that axis, then expanded "
        "again by the next rule's mask and summed once more by broadcast_in_dim's rule "
        "(gradient fuzzer seed 875 at 2 ranks)",
        _minimum_of_an_expanded_broadcast, lambda t, mesh: shard(t[1], 0, mesh),
        lambda x: [torch.minimum(x[:, None].expand(x.shape[0], 4), torch.tensor(0.5))],
        lambda d: [[2 * d + 2]]),
    "extremum_gradient_reads_a_partial_result_resharded_twice": Case(
        "refused, DefinitionError 'the backward needs T9, a partial sum in the forward ... "
        "never reduced': a minimum computed partial over cyclic shards was resharded to the "
        "block-partial pin, then reduced; the rule reading it looked one copy far (gradient "
        "fuzzer seed 797 at 2 ranks)",
        _minimum_then_exp, _cyclic_rows_minimum_pinned_partial_on_blocks,
        lambda x: [torch.exp(torch.amin(x, dim=0, keepdim=True))],
        lambda d: [[2 * d + 1, 2 * d]]),
    "gradient_expanded_along_a_broadcast_axis_of_extent_1_is_summed": Case(
        "silently wrong gradient (3 times too small, or of the wrong shape): a gradient "
        "that is an expanded broadcast (3 equal gradients) was taken as one where it flows "
        "to a value of extent 1 there (layer norm's mean, gradient fuzzer seed 174 at 4 "
        "ranks)",
        _sum_of_an_expanded_product, lambda t, mesh: shard(t[0], 0, mesh),
        lambda v, w: [torch.sum(v[:, None].expand(v.shape[0], 3) * w.sum(1, keepdim=True),
                                1)],
        lambda d: [[2 * d + 2], [2 * d + 2, 2]]),
    "broadcast_of_an_expanded_broadcast_that_is_also_an_output": Case(
        "silently wrong gradient (off by up to 40): broadcasting a tensor whose axis is "
        "already an expanded broadcast summed its gradient over that axis, one value for "
        "its 6 elements; added to the per-element gradient of the tensor's other use (an "
        "output), it counted 6 times over (gradient fuzzer seed 2315 at 2 ranks)",
        _broadcast_again_and_kept, lambda t, mesh: shard(t[0], 0, mesh),
        _broadcast_again_and_kept_reference, lambda d: [[2 * d + 2], []]),
    "product_of_expanded_broadcasts_broadcast_again": Case(
        "silently wrong gradient, 6 times too large: the broadcast summed its operand's "
        "gradient over the operand's expanded axis (extent 6); the product's rule then "
        "multiplied that sum by the other factor's 6 values along the axis, and the "
        "broadcasts that made the axis summed them",
        _product_of_expanded_broadcasts_broadcast_again, lambda t, mesh: shard(t[0], 0, mesh),
        _product_of_expanded_broadcasts_broadcast_again_reference,
        lambda d: [[2 * d + 2], [2 * d + 2]]),
    "weight_gradient_of_a_linear_over_an_expanded_broadcast": Case(
        "refused, DefinitionError 'squeeze: axis 1 has extent 3; only axes of extent 1 can "
        "be squeezed': the weight's gradient took every broadcast token axis of the "
        "linear's input for one of extent 1 (gradient fuzzer seed 959 at 3 ranks)",
        _linear_of_an_expanded_broadcast, lambda t, mesh: shard(t[0], 0, mesh),
        lambda x, w: [torch.nn.functional.linear(x[:, None].expand(x.shape[0], 3, 8), w)],
        lambda d: [[2 * d, 8], [4, 8]]),
    "input_gradient_adds_partial_sums_over_axes_of_other_lengths": Case(
        "refused at 3 ranks, ShardingError 'add(...): ... axis 1 is replicated but reduced "
        "is DIDx (owners [0, 0, 0, 0, 0, 0, 1, 1]...)': x's gradient adds partial sums over "
        "the rows of weights of 4 and 16 rows (the k/v and q projections of grouped-query "
        "attention); propagation would not copy a split of 16 onto an axis of 4 that 3 does "
        "not divide, so resharding wanted one addend reduced while the sum stayed partial",
        _three_projections_of_one_input, _rows_of_the_weights,
        lambda x, *ws: [torch.nn.functional.linear(x, w) for w in ws],
        lambda d: [[4, 6], [4, 6], [4, 6], [16, 6]]),
    "batched_matmul_gradient_over_a_summed_sharded_batch": Case(
        "ExecutionError at 2 ranks 'The size of tensor a (6) must match the size of tensor b "
        "(3)': the gradient of the sum over the batch is an expanded broadcast whose local "
        "extent is the global one, which matmul took for a batch to match the sharded "
        "operand's (nvFuser broadcasts it, torch.matmul does not)",
        _batched_matmul_summed_over_its_batch(lambda d: 2 * d + 2), _batches_sharded,
        lambda a, w: [torch.matmul(a, w).sum(0)],
        lambda d: [[2 * d + 2, 4, 3], [2 * d + 2, 3, 5]]),
    "linear_with_leading_weight_axes_split_by_heads": Case(
        "refused, DefinitionError 'linear: the gradient of a linear whose weight has leading "
        "axes ... is not derived': the head-aligned form of a projection (weights [H, D, E], "
        "8 heads over 3 ranks give 3, 3, 2 heads) had no gradient",
        _linear_by_heads, lambda t, mesh: (shard(t[1], 0, mesh), shard(t[2], 0, mesh)),
        lambda x, w, b: [torch.stack([torch.nn.functional.linear(x, w[h], b[h])
                                      for h in range(8)]).permute(1, 0, 2, 3)],
        lambda d: [[2, 3, 6], [8, 4, 6], [8, 4]]),
    "linear_with_leading_weight_axes_on_an_empty_shard": Case(
        "untyped at 3 and 4 ranks, 'cannot reshape tensor of 0 elements into shape "
        "[-1, 0, 6]': linear's implementation for weights with leading axes reshaped with "
        "-1, which an empty shard (2 leading indices over 3 ranks) leaves ambiguous (heads "
        "fuzzer seeds 4, 58, 94, ... at 3 ranks, 7, 17, 32, ... at 4)",
        _linear_with_more_ranks_than_leading_indices,
        lambda t, mesh: (shard(t[1], 0, mesh), shard(t[2], 0, mesh)),
        lambda x, w, b: [torch.stack([torch.nn.functional.linear(x, w[i], b[i])
                                      for i in range(2)])],
        lambda d: [[4, 6], [2, 5, 6], [2, 5]]),
    "linear_with_leading_weight_axes_over_an_expanded_broadcast": Case(
        "refused, DefinitionError 'matmul: contracted extents differ: axis 3 of the first "
        "operand has 2, axis 2 of the second has 1': the weight gradient broadcast x to "
        "the leading axes keeping its extents with -1, which made its expanded broadcast "
        "token axis (extent 2) one of extent 1 (heads fuzzer seed 617 at 2 ranks)",
        _linear_by_heads_of_an_expanded_broadcast,
        lambda t, mesh: (shard(t[1], 0, mesh), shard(t[2], 0, mesh)),
        lambda x, w, b: [torch.stack([torch.nn.functional.linear(
            x[:, None].expand(3, 2, 3), w[i], b[i]) for i in range(4)])],
        lambda d: [[3, 3], [4, 4, 3], [4, 4]]),
    "partial_product_sharded_by_its_consumer_and_an_output": Case(
        "refused at 2 ranks, ShardingError 'matmul(...): ... axis 2 is replicated but "
        "reduced is DIDx': a product partial over its contraction took its consumer's batch "
        "split on the same mesh axis (to be reduce-scattered); being an output too, "
        "resharding gathered its inputs on the batch instead, and the product kept its "
        "partial mark (heads fuzzer seed 464 at 2 ranks)",
        _chained_batched_matmuls, _contraction_and_batch_of_a_consumer_sharded,
        lambda a, b, c: [torch.matmul(torch.matmul(a, b), c)] * 2,
        lambda d: [[3, 6, 3], [3, 3, 8], [3, 8, 5]]),
    "batched_matmul_gradient_over_a_summed_batch_one_element_a_rank": Case(
        "silently wrong gradients (as many times too large as there are ranks): as the case "
        "above, with one batch element a rank, where torch.matmul broadcast the extent 1 of "
        "the sharded operand against the whole batch of the expanded gradient",
        _batched_matmul_summed_over_its_batch(lambda d: d), _batches_sharded,
        lambda a, w: [torch.matmul(a, w).sum(0)], lambda d: [[d, 4, 3], [d, 3, 5]]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_regression(multidevice_test, name):
    failure = _run(multidevice_test, CASES[name])
    assert not failure, failure


# The features the seeds below were drawn with, unless they name theirs (symbolic extents
# came later: the same seeds' programs, some with symbolic extents).
DRAWN_WITH = Features(uneven=True, any_to_any=True, integers=True, extrema=True,
                      differentiable=True)
SYMBOLIC = dataclasses.replace(DRAWN_WITH, symbolic=True)
HEADS = dataclasses.replace(DRAWN_WITH, heads=True)
INDEXING_SYMBOLIC = dataclasses.replace(DRAWN_WITH, indexing=True, symbolic=True)


@dataclasses.dataclass(frozen=True)
class Seed:
    """A gradient fuzzer program (``generate(seed, world_size, features)``) that once
    failed."""

    seed: int
    world_size: int
    was: str
    features: Features = DRAWN_WITH
    open: bool = False  # still failing: expected to fail (strict) until fixed


SEEDS: dict[str, Seed] = {
    "inputs_on_other_ranks_meshes-0": Seed(0, 2, "a hang: see the case of that name"),
    "gradient_of_a_full_reduction-33": Seed(33, 2, "refused: see the case of that name"),
    "extremum_gradient_reads_a_resharded_expanded_broadcast-329": Seed(
        329, 2, "untyped: see the case of that name"),
    "result_pinned_partial_keeps_its_pin-339": Seed(339, 2, "refused: see the case"),
    "cat_of_an_expanded_broadcast-359": Seed(359, 2, "wrong gradient: see the case"),
    "pointwise_gradient_of_an_expanded_broadcast-875": Seed(
        875, 2, "wrong gradient: see the case"),
    "extremum_gradient_reads_a_partial_result_resharded_twice-797": Seed(
        797, 2, "refused: see the case"),
    "gradient_expanded_along_a_broadcast_axis_of_extent_1-174": Seed(
        174, 4, "wrong gradient: see the case"),
    "broadcast_of_an_expanded_broadcast_that_is_also_an_output-2315": Seed(
        2315, 2, "wrong gradient: see the case"),
    "weight_gradient_of_a_linear_over_an_expanded_broadcast-959": Seed(
        959, 3, "refused: see the case"),
    # Symbolic extents (issue 31 item 6; tests/test_symbolic_extents.py has their cases).
    "gradient_of_a_symbolic_input_on_other_ranks_mesh-0": Seed(
        0, 2, "untyped: 'returned an invalid gradient at index 0 - got [0] but expected "
        "shape compatible with [6]' (a meta stand-in got an empty gradient)",
        features=SYMBOLIC),
    "gradient_of_a_symbolic_fusion-1": Seed(
        1, 2, "refused: 'the gradient of prod needs the extents of T1, which are symbolic'",
        features=SYMBOLIC),
    "symbolic_gradient_outputs_laid_out_as_the_build-67": Seed(
        67, 2, "mismatch: the output of a reshape of -1 axes came back sharded (the fusion "
        "made static propagated otherwise) where shard_tensor says whole",
        features=SYMBOLIC),
    "partial_product_sharded_by_its_consumer_and_an_output-464": Seed(
        464, 2, "refused: see the case", features=HEADS),
    "linear_with_leading_weight_axes_on_an_empty_shard-4": Seed(
        4, 3, "untyped: see the case", features=HEADS),
    "linear_with_leading_weight_axes_on_an_empty_shard-7": Seed(
        7, 4, "untyped: see the case", features=HEADS),
    "linear_with_leading_weight_axes_over_an_expanded_broadcast-617": Seed(
        617, 2, "refused: see the case", features=HEADS),
    "broadcast_keeping_an_expanded_axis_keeps_its_extent-156": Seed(
        156, 3, "refused: 'matmul: contracted extents differ: axis 2 of the first operand has "
        "1, axis 1 of the second has 6' (tests/test_expanded_broadcast.py has its case)",
        features=dataclasses.replace(HEADS, indexing=True, symbolic=True)),
    "take_along_axis_gradient_through_a_broadcast-4": Seed(
        4, 1, "untyped: 'IndexError: tuple index out of range' in _held_rows: the backward "
        "of take_along_axis(x, index, 0) under broadcast_in_dim, whose gradient (a sum over "
        "the broadcast axis) has a reduction axis: its rows were looked up by logical axis, "
        "the held indices count materialized axes only", features=INDEXING_SYMBOLIC),
    "keepdim_gradient_combined_with_a_slice_of_extent_1-60300": Seed(
        60300, 4, "unknown refusal: 'broadcast_in_dim: input axis 0 has extent 1 but output "
        "axis 0 asks for 6' in the backward of maximum(mean(x, [0], keepdim=True), "
        "x[3:4]): the cotangent's kept axis became an iteration axis of extent 1 (the "
        "slice's), which mean's gradient broadcast as a broadcast axis; expand_back now "
        "squeezes the kept axes first. Found by the heads gradient fuzz run of 2026-12-05 "
        "(seed 60000 on)", features=dataclasses.replace(INDEXING_SYMBOLIC, heads=True)),
    "gradient_of_an_ill_conditioned_normalization-100381": Seed(
        100381, 2, "mismatch: the gradient of y in minimum(y, x) normalized by var_mean over "
        "8 values, 7 of them y (var near 0, rsqrt 70): 2.7e-4 off torch's float32 gradient, "
        "which is itself 2.4e-4 off the float64 one; the oracle now allows 4 times torch's "
        "own roundoff (fuzz_gradients.float64_reference). Found by the gradient fuzz run of "
        "2026-12-05 (seed 100000 on)",
        features=dataclasses.replace(INDEXING_SYMBOLIC, remat=True)),
    "grouped_heads_computed_as_a_cyclic_output_from_another_mesh-240167": Seed(
        240167, 4, "unknown refusal: 'T51 axis 1 is replicated but axis 1 of T23 is DIDx "
        "(owners [0, 1, 2, 3, 0, 1, 2, 3])': grouped-query attention (8 query, 4 key/value "
        "heads) whose q came from another mesh, its output pinned with the heads split "
        "cyclically: the key/value heads were planned by groups against q as it was, then "
        "the attention ran as its output lies, where no split of them serves; they are now "
        "taken from a whole copy (groups.attention_kv_layout). Found by the heads gradient "
        "fuzz run of 2026-12-05 (seed 240000 on)",
        features=dataclasses.replace(INDEXING_SYMBOLIC, heads=True, remat=True)),
    "grouped_heads_in_uneven_blocks_of_whole_groups-341217": Seed(
        341217, 3, "unknown refusal: 'T15 axis 1 is replicated but axis 1 of T11 is DIDx "
        "(owners [0, 0, 1, 1])': grouped-query attention (4 query, 2 key/value heads), k's "
        "heads split over 3 ranks (one holds none), q's split alike by propagation: each "
        "rank's key/value heads served its query heads, so they were taken as sharded by "
        "groups, but the blocks are uneven and resharding carries a split onto the key/value "
        "heads only in even blocks: it gathered k, the attention's domain map still paired "
        "k's heads with the query heads. Now taken as gathered. Found by the heads gradient "
        "fuzz run of 2026-12-05 (seed 340000 on, 3 ranks)",
        features=dataclasses.replace(INDEXING_SYMBOLIC, heads=True, remat=True)),
    "product_of_every_element_of_a_grouped_attention_output-460684": Seed(
        460684, 2, "mismatch: the product of all 128 elements of a grouped-query attention's "
        "output (8 query heads, 1 key/value head) 5.5e-4 off torch's float32 product "
        "(tolerance 1e-4): a product's relative error is the sum of its factors', and "
        "factors near 0 carry float32's roundoff large; forward outputs, as gradients, now "
        "get 4 times torch's own float32 roundoff against float64 "
        "(fuzz_gradients.float64_reference). Found by the heads gradient fuzz run of "
        "2026-12-05 (seed 460000 on, 2 ranks)",
        features=dataclasses.replace(INDEXING_SYMBOLIC, heads=True, remat=True)),
    "product_gradient_of_an_overflowing_product-600756": Seed(
        600756, 3, "mismatch: NaN in 2 of 384 elements of a linear weight's gradient where "
        "torch's float32 gradient is infinite: a product of 200 factors (true values up to "
        "1e41) overflows float32, and which of inf and NaN its gradient leaves depends on the "
        "order of the operations (torch's own float32 gradient holds many NaN and inf); the "
        "oracle now accepts a non-finite result where torch's is not finite "
        "(fuzz_gradients._compare). Found by the heads gradient fuzz run of 2026-12-05 (seed "
        "600000 on, 3 ranks)",
        features=dataclasses.replace(INDEXING_SYMBOLIC, heads=True, remat=True)),
    "grouped_attention_backward_with_uneven_key_value_heads-601225": Seed(
        601225, 3, "unknown refusal: 'sdpfa_bwd(...): T15 axis 1 is DIDx (owners [0, 1]) but "
        "axis 1 of grad_T0 is replicated; this needs a communication': grouped-query "
        "attention (4 query heads, replicated; 2 key/value heads split over 3 ranks, one "
        "holding none): the forward runs, the derived backward is refused. Found by the "
        "heads gradient fuzz run of 2026-12-05 (seed 600000 on, 3 ranks). The backward's "
        "key/value gradients took k's split from the copies into k's sharding, and the "
        "attention was computed as they lay; now they are computed whole where they do not "
        "lie by groups against q (groups._gradients_by_groups)",
        features=dataclasses.replace(INDEXING_SYMBOLIC, heads=True, remat=True)),
    "autograd_output_laid_out_as_execute_lays_it_out-680268": Seed(
        680268, 3, "mismatch (the output's shape: [2, 5] on rank 0 where [4, 5] was due): an "
        "embedding's output, unscheduled, came back from the autograd function split over "
        "the rows (as the ids are) where execute returns it whole: the derived forward's "
        "clone, without the program's unread cast, was propagated otherwise. The clone's "
        "unscheduled inputs and outputs are now pinned as execute lays them out "
        "(derivation._pin_ends_as_executed). Found by the gradient fuzz run of "
        "2026-12-05 (seed 680000 on, 3 ranks)", features=INDEXING_SYMBOLIC),
}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=s.was)) if s.open else n
    for n, s in SEEDS.items()])
def test_gradient_fuzz_seed(multidevice_test, name):
    seed = SEEDS[name]
    if multidevice_test.size != seed.world_size:
        pytest.skip(f"the program of seed {seed.seed} was drawn for {seed.world_size} ranks")
    outcome = run_gradients(generate(seed.seed, seed.world_size, seed.features),
                            multidevice_test.rank, multidevice_test.device)
    assert outcome.kind == "match", outcome.report()


def test_set_timeout_after_a_mesh_without_this_rank(multidevice_test):
    """``Communicator.set_timeout`` once a mesh of some ranks has run: the ranks outside it
    hold a non-member entry for its group (the gradient fuzzer's recovery raised
    ``ValueError: Invalid process group specified`` there, at 4 ranks)."""
    d = multidevice_test.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([2 * d], dtype=DataType.Float)
        fd.add_output(fd.ops.sum(x, dims=[0]))  # an allreduce among the sub-mesh's ranks
    shard(x, 0, DeviceMesh(range(max(1, d // 2))))
    full = torch.arange(2.0 * d)
    local = shard_tensor(full, x).to(multidevice_test.device) \
        if multidevice_test.rank < max(1, d // 2) else None
    fd.execute([local])
    comm = Communicator.instance()
    timeout = comm.timeout
    comm.set_timeout(timeout + 1)
    assert comm.timeout == timeout + 1
    comm.set_timeout(timeout)
