"""Named regressions: each program here once failed (wrong values, an untyped crash or a
refusal of a valid program), found by the fuzzer (``test_fuzz.py``) or reported in issue 11.

Two tables: :data:`CASES`, programs written by hand (the smallest form of a failure), and
:data:`SEEDS`, fuzzer programs kept as drawn (seed and world size). Every case runs at world
sizes 1, 2 and 4 (a 2x2 mesh only at 4, two meshes from 2) and compares each rank's outputs
with plain torch on the global tensors, sliced by ``shard_tensor``; where the case says which
collectives must run, those are asserted too. A seed runs at the world size it was drawn for.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fuzz_cases import Case, set_up
from fuzz_programs import Features, generate
from fuzz_runner import run_program
from mesh_helpers import MX, MY, shard

from meshfuse import DataType, shard_tensor
from meshfuse.passes.pipeline import compiled_for
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.testing.utils import current_device

pytestmark = pytest.mark.mpi


def _run(multidevice_test, case: Case) -> list[str]:
    """Runs ``case`` on this rank's shards, compares with torch; returns the kinds of the
    collectives that ran over more than one rank, sorted."""
    rank = multidevice_test.rank
    fd, inputs, _ = set_up(multidevice_test, case)
    inputs = [x.to(current_device()) for x in inputs]
    compiled = compiled_for(fd.fusion)  # every tensor has its mesh there

    def held(tv) -> bool:
        return compiled[tv].mesh is None or rank in compiled[tv].mesh

    local = [shard_tensor(x, tv, rank) if held(tv) else None
             for x, tv in zip(inputs, fd.fusion.inputs())]
    with record_communications() as comms:
        outputs = fd.execute(local)
    with torch.no_grad():
        expected = case.reference(*inputs)
    assert len(outputs) == len(expected)
    for out, ref, tv in zip(outputs, expected, fd.fusion.outputs()):
        if held(tv):
            torch.testing.assert_close(out, shard_tensor(ref, tv, rank), **case.tol)
    return sorted(c.kind for c in comms if len(c.ranks) > 1)


# --- the programs -------------------------------------------------------------------------

def _min_then_atan(fd, d):
    x = fd.define_tensor([d], dtype=DataType.Float)
    fd.add_output(fd.ops.atan(fd.ops.min(x, dims=[0])))
    return (x,)


def _sum_then_exp(fd, d):
    x = fd.define_tensor([4, 4], dtype=DataType.Float)
    fd.add_output(fd.ops.exp(fd.ops.sum(x)))
    return (x,)


def _on_half(t, mesh):
    shard(t[0], 1, type(mesh)(range(max(1, mesh.size // 2))))


def _sum_rows(fd, d):
    x = fd.define_tensor([d, 4 * d], dtype=DataType.Float)
    y = fd.ops.sum(x, [0])
    fd.add_output(y)
    return x, y


def _broadcast_axis_on_one_device(t, mesh):
    x, y = t
    for tv in t:
        tv.set_device_mesh(mesh)
    x.axis(0).parallelize(MX)  # extent d: a broadcast axis at d == 1
    y.outer_split(-1, mesh.size)
    y.axis(-2).parallelize(MX)


def _sum_of_3d(fd, d):
    x = fd.define_tensor([2 * d, 3, 4 * d], dtype=DataType.Float)
    y = fd.ops.sum(x, [0])
    fd.add_output(y)
    return x, y


def _reduction_and_iteration_on_mesh_x(t, mesh):
    x, y = t
    for tv in t:
        tv.set_device_mesh(mesh)
    x.outer_split(0, mesh.size)
    x.axis(0).parallelize(MX)
    y.outer_split(0, mesh.size)  # the reduction axis, as the input's
    y.axis(0).parallelize(MX)
    y.outer_split(-1, mesh.size)
    y.axis(-2).parallelize(MX)


def _reduce_scatter(d, kinds):
    return kinds == ([] if d == 1 else ["reduce_scatter"])


def _attention(causal: bool, shape: list[int], outputs: str = "all"):
    """sdpfa_fwd + sdpfa_bwd on q, k, v, out_grad of ``shape``; fusion outputs: the attention
    and the three gradients (``"all"``) or the gradients only (``"grads"``)."""

    def define(fd, d):
        q, k, v, grad = (fd.define_tensor(shape, dtype=DataType.Float) for _ in range(4))
        attn, lse, seed, offset = fd.ops.sdpfa_fwd(q, k, v, 0.0, causal, None)
        grads = fd.ops.sdpfa_bwd(grad, q, k, v, attn, lse, 0.0, causal, seed, offset, None)
        for t in ((attn, *grads) if outputs == "all" else grads):
            fd.add_output(t)
        return q, k, v, grad, *grads

    def reference(q, k, v, grad):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
            grads = list(torch.autograd.grad(out, leaves, grad))
        return [out.detach(), *grads] if outputs == "all" else grads

    return define, reference


def _sequence_sharded(t, mesh):
    for tv in t[:4]:
        shard(tv, 2, mesh)


def _sequence_comms(causal: bool):
    """Every tensor of the attention is sequence-sharded alike, so it runs context-parallel
    (docs/context_parallel.md), causal or not: the strategy the cost estimate picks for each
    of the forward and the backward moves only k/v blocks (ring: send/recv), or gathers k/v
    (and the backward reduce-scatters dk/dv), or all-to-alls; the query sequence is never
    gathered. (The kinds come sorted.)"""
    gathered = {(): 0, ("allgather",) * 2: 1, ("allgather",) * 2 + ("reduce_scatter",) * 2: 1,
                ("allgather",) * 4 + ("reduce_scatter",) * 2: 2}  # calls that gathered

    def check(d, kinds):
        if d == 1:
            return kinds == []
        gathers = tuple(k for k in kinds if k in ("allgather", "reduce_scatter"))
        rest = {k for k in kinds if k not in ("allgather", "reduce_scatter")}
        return gathers in gathered and rest <= {"send", "recv", "all_to_all"} and \
            bool(rest) == (gathered[gathers] < 2)

    return check


def _mixed_attention_shardings(t, mesh):
    q, k, v, grad = t[:4]
    for tv in t[:4]:
        tv.set_device_mesh(mesh)
    q.inner_split(2, 2)  # [.., 4, 2, ..]
    q.inner_split(2, mesh.size)  # [.., 4 / d, d, 2, ..]
    q.axis(3).parallelize(MX)
    shard(k, 1, mesh)
    shard(v, 3, mesh, inner=True)
    shard(grad, 2, mesh)


def _v_on_its_sequence_q_grad_on_its_head_dim(t, mesh):
    shard(t[2], 2, mesh, inner=True)
    shard(t[4], 3, mesh, inner=True)


def _var_mean(fd, d):
    x = fd.define_tensor([4, 8], dtype=DataType.Float)
    var, mean = fd.ops.var_mean(x, dims=[0], correction=1)
    fd.add_output(var)
    fd.add_output(mean)
    return x, var, mean


def _var_mean_on_two_meshes(t, mesh_a, mesh_b):
    x, var, mean = t
    shard(x, 1, mesh_a)
    shard(var, 0, mesh_b)
    mean.set_device_mesh(mesh_a)


def _minimum_with_0d(fd, d):
    x = fd.define_tensor([8], dtype=DataType.Float)
    s = fd.define_tensor([], dtype=DataType.Float)
    y = fd.ops.minimum(x, s)
    fd.add_output(y)
    return x, s, y


def _0d_on_the_other_mesh(t, mesh_a, mesh_b):
    x, s, y = t
    shard(x, 0, mesh_b)
    s.set_device_mesh(mesh_b)
    y.set_device_mesh(mesh_a)


def _add_where_sum(fd, d):
    x, y = (fd.define_tensor([4, 4, 4], dtype=DataType.Float) for _ in range(2))
    w = fd.ops.where(fd.ops.gt(x, 0.0), x, y)
    for t in (fd.ops.add(x, y), w, fd.ops.sum(w)):
        fd.add_output(t)
    return x, y


def _differently_split_on_2x2(t, mesh):
    x, y = t
    shard(x, 0, mesh, MY)
    shard(x, 2, mesh, MX)
    shard(y, 1, mesh, MY, inner=True)
    shard(y, 0, mesh, MX)


def _add_where_sum_reference(x, y):
    w = torch.where(x > 0, x, y)
    return [x + y, w, w.sum()]


def _matmul(fd, d):
    x = fd.define_tensor([8, 4], dtype=DataType.Float)
    w = fd.define_tensor([4, 8], dtype=DataType.Float)
    out = fd.ops.matmul(x, w)
    fd.add_output(out)
    return x, w, out


def _split_twice_then_mesh_y(t, mesh):
    x, _, out = t
    for tv in t:
        tv.set_device_mesh(mesh)
    x.inner_split(0, 2)  # [4, 2]
    x.axis(1).parallelize(MY)
    x.outer_split(0, 2)  # [2, 2, 2]
    x.axis(0).parallelize(MX)
    out.outer_split(1, 2)
    out.axis(1).parallelize(MY)


def _var_mean_attention(fd, d):
    x = fd.define_tensor([2, 2, 8, 4], dtype=DataType.Float)
    k = fd.define_tensor([1, 1, 8, 1], dtype=DataType.Float)
    var, mean = fd.ops.var_mean(x, dims=[0, 1, 3], correction=1, keepdim=True)
    attn, _, _, _ = fd.ops.sdpfa_fwd(mean, k, var, 0.0, False, None)
    m = fd.ops.max(attn, dims=[2], keepdim=True)
    e = fd.ops.exp(fd.ops.sub(attn, m))
    p = fd.ops.div(e, fd.ops.sum(e, dims=[2], keepdim=True))
    s = fd.ops.slice(p, [0, 0, 2, 0], [1, 1, 8, 1], [1, 1, 2, 1])
    fd.add_output(fd.ops.where(fd.ops.gt(s, 0.1), s, fd.ops.neg(s)))
    return x, k


def _var_mean_attention_reference(x, k):
    var, mean = torch.var_mean(x, dim=[0, 1, 3], correction=1, keepdim=True)
    attn = torch.nn.functional.scaled_dot_product_attention(mean, k, var)
    p = torch.softmax(attn, dim=2)[:, :, 2:8:2, :]
    return [torch.where(p > 0.1, p, -p)]


_SEQ_SHAPE = [2, 4, 128, 32]  # issue 11's b=2, h=4, s=128, head dim 32
_SMALL = [2, 4, 8, 4]
_TIGHT = {"rtol": 1e-4, "atol": 1e-4}

def _combined_extrema(fd, d):
    """add and sub of two maxima and of two minima over axis 0, and of two products."""
    x, y = (fd.define_tensor([2 * d + 1, 3], dtype=DataType.Float) for _ in range(2))
    for op in ("max", "min", "prod"):
        a, b = getattr(fd.ops, op)(x, dims=[0]), getattr(fd.ops, op)(y, dims=[0])
        fd.add_output(fd.ops.add(a, b))
        fd.add_output(fd.ops.sub(a, b))
    return x, y


def _combined_extrema_reference(x, y):
    out = []
    for reduce in (torch.amax, torch.amin, lambda t, dim: torch.prod(t, dim)):
        a, b = reduce(x, dim=0), reduce(y, dim=0)
        out += [a + b, a - b]
    return out


def _both_on_the_reduced_axis(t, mesh):
    for tv in t:
        shard(tv, 0, mesh)


def _partial_on(tv, logical_axis: int, mesh) -> None:
    """Pins ``tv`` partial: its reduction axis ``logical_axis`` block-split over the mesh."""
    tv.set_device_mesh(mesh)
    pos = tv.loop.index(tv.logical[logical_axis])
    tv.outer_split(pos, mesh.size)
    tv.parallelize(pos, MX)


def _var_mean_then_exp(fd, d):
    x = fd.define_tensor([2 * d + 1, 3], dtype=DataType.Float)
    var, mean = fd.ops.var_mean(x, dims=[0], correction=1)
    fd.add_output(fd.ops.exp(var))
    fd.add_output(mean)
    return x, var


def _var_pinned_partial(t, mesh):
    x, var = t
    shard(x, 0, mesh)
    _partial_on(var, 0, mesh)


def _attention_then_exp(fd, d):
    q, k, v = (fd.define_tensor([1, 2, 2 * d + 1, 4], dtype=DataType.Float) for _ in range(3))
    attn, _, _, _ = fd.ops.sdpfa_fwd(q, k, v, 0.0, False, None)
    fd.add_output(fd.ops.exp(attn))
    return q, k, v, attn


def _attention_pinned_partial_on_the_keys(t, mesh):
    shard(t[1], 2, mesh)
    shard(t[2], 2, mesh)
    _partial_on(t[3], 4, mesh)  # attn's reduction over the key sequence


def _gathered_then_reduced(d, kinds):
    """The op runs on whole inputs; the result pinned partial (each device a part of the
    sum, local) is reduced again for its consumer."""
    return kinds == [] if d == 1 else kinds[-1] == "allreduce" and "allgather" in kinds


def _partial_sums_added(fd, d):
    """add of two sums over a sharded axis (partial sums, added before their reduction), and
    the first sum alone."""
    x, y = (fd.define_tensor([2 * d - 1], dtype=DataType.Float) for _ in range(2))
    a = fd.ops.sum(x, dims=[0], keepdim=True)
    b = fd.ops.sum(y, dims=[0], keepdim=True)
    fd.add_output(fd.ops.add(a, b))
    fd.add_output(a)
    return x, y


def _cyclic_on_the_reduced_axis(t, mesh):
    for tv in t:
        shard(tv, 0, mesh, inner=True)


def _where_of_an_expanded_scalar(fd, d):
    x = fd.define_tensor([2 * d - 1], dtype=DataType.Float)
    s = fd.define_tensor([], dtype=DataType.Float)
    b = fd.ops.broadcast_in_dim(s, shape=[2 * d - 1], broadcast_dims=[])
    fd.add_output(fd.ops.where(fd.ops.gt(x, 0.0), b, 0.0))
    fd.add_output(fd.ops.mul(x, b))
    return x, s


def _expanded_against_shards(fd, d):
    """Pointwise ops between ``broadcast_in_dim``'s expanded axis and a tensor sharded on it
    (of extent 2d - 1: the last shard has 1 element): the expanded operand gathered first
    (materialized by the allgather), or replicated all along (a stride-0 view)."""
    n = _odd(d)
    x, z = (fd.define_tensor([3], dtype=DataType.Float) for _ in range(2))
    y = fd.define_tensor([3, n], dtype=DataType.Float)
    gathered = fd.ops.exp(fd.ops.broadcast_in_dim(x, shape=[3, n], broadcast_dims=[0]))
    replicated = fd.ops.broadcast_in_dim(z, shape=[3, n], broadcast_dims=[0])
    added = fd.ops.add(gathered, y)
    chosen = fd.ops.where(fd.ops.gt(y, 0.0), replicated, y)
    fd.add_output(added)
    fd.add_output(chosen)
    return x, y, z, added, chosen


def _odd(d: int) -> int:
    return max(3, 2 * d - 1)


def _expanded_reference(x, z, y):
    return [x.exp()[:, None] + y, torch.where(y > 0, z[:, None].expand_as(y), y)]


def _rows_sharded_outputs_on_the_expanded_axis(t, mesh):
    x, y, z, added, chosen = t
    shard(x, 0, mesh)
    z.set_device_mesh(mesh)
    for tv in (y, added, chosen):
        shard(tv, 1, mesh)


def _linear_of_expanded(fd, d):
    """``linear`` contracting ``broadcast_in_dim``'s expanded axis with a weight sharded on
    its contracted axis (extent 2d + 1)."""
    x = fd.define_tensor([4, 3], dtype=DataType.Float)
    w = fd.define_tensor([6, 2 * d + 1], dtype=DataType.Float)
    expanded = fd.ops.broadcast_in_dim(x, shape=[4, 3, 2 * d + 1], broadcast_dims=[0, 1])
    fd.add_output(fd.ops.linear(expanded, w))
    return x, w


def _matmul_on_short_contracted_axis(fd, d):
    """``matmul`` contracting an axis of ``d - 1`` elements block-sharded over ``d`` ranks
    (the last rank's shard empty; 2 elements below 3 ranks, where none is), its partial
    result allreduced in a forced loop."""
    k = _short(d)
    x = fd.define_tensor([3, k], dtype=DataType.Float)  # a result smaller than x and w, so
    w = fd.define_tensor([k, 1], dtype=DataType.Float)  # that it is reduced, not they gathered
    y = fd.ops.matmul(x, w)
    fd.add_output(y)
    return x, w, y


def _short(d: int) -> int:
    return d - 1 if d >= 3 else 2


def _row_parallel_forced_loop(t, mesh):
    x, w, y = t
    shard(x, 1, mesh)
    shard(w, 0, mesh)
    y.set_device_mesh(mesh)
    y.set_overlap(True)


def _matmul_to_strided_shards(fd, d):
    """``matmul`` contracting a sharded axis, its result's axis 1 (2d) split in 2 x d and
    the piece of d sharded: the reduce-scatter goes onto strided blocks."""
    x = fd.define_tensor([2, 2 * d], dtype=DataType.Float)
    w = fd.define_tensor([2 * d, 2 * d], dtype=DataType.Float)
    y = fd.ops.matmul(x, w)
    fd.add_output(y)
    return x, w, y


def _reduce_scatter_onto_strided_shards(t, mesh):
    x, w, y = t
    shard(x, 1, mesh)
    shard(w, 0, mesh)
    d = mesh.size
    y.set_device_mesh(mesh)
    y.split(1, d, inner_split=True)
    y.outer_split(2, d)
    y.axis(2).parallelize(MX)
    y.set_overlap(True)


CASES: dict[str, Case] = {
    "reduction_to_0d_then_pointwise": Case(
        "AttributeError 'NoneType' object has no attribute 'mesh' in propagation",
        _min_then_atan, lambda t, mesh: shard(t[0], 0, mesh),
        lambda x: [torch.atan(torch.amin(x, dim=[0]))], lambda d: [[d]]),
    "0d_result_on_a_sub_mesh": Case(
        "a full reduction on a mesh of some ranks ran on the others too",
        _sum_then_exp, _on_half, lambda x: [torch.exp(torch.sum(x))], lambda d: [[4, 4]]),
    "parallelize_broadcast_axis_on_a_mesh_axis_of_one_device": Case(
        "ScheduleError at world size 1, where nvFuser's reduce-scatter test makes the "
        "static extent d == 1 a broadcast axis",
        _sum_rows, _broadcast_axis_on_one_device, lambda x: [x.sum(0)],
        lambda d: [[d, 4 * d]], comms=_reduce_scatter),
    "reduction_and_iteration_axis_on_one_mesh_axis_is_a_reduce_scatter": Case(
        "'DIDx is used twice' for nvFuser's way of writing a reduce-scatter",
        _sum_of_3d, _reduction_and_iteration_on_mesh_x, lambda x: [x.sum(0)],
        lambda d: [[2 * d, 3, 4 * d]], comms=_reduce_scatter),
    "sequence_sharded_attention_gradients-non-causal": Case(
        "issue 11: right attention output, silently wrong q/k/v gradients (each rank used "
        "only its own key/value rows)",
        _attention(False, _SEQ_SHAPE)[0], _sequence_sharded, _attention(False, _SEQ_SHAPE)[1],
        lambda d: [_SEQ_SHAPE] * 4,
        comms=_sequence_comms(False), tol=_TIGHT),
    "sequence_sharded_attention_gradients-causal": Case(
        "refused; then the query sequence was gathered; now context-parallel",
        _attention(True, _SEQ_SHAPE)[0], _sequence_sharded, _attention(True, _SEQ_SHAPE)[1],
        lambda d: [_SEQ_SHAPE] * 4,
        comms=_sequence_comms(True), tol=_TIGHT),
    "attention_backward_with_mixed_shardings": Case(
        "refused: the gradients' natural shardings disagreed on heads (fuzzer seed 115 at "
        "2 ranks)",
        _attention(True, _SMALL, "grads")[0], _mixed_attention_shardings,
        _attention(True, _SMALL, "grads")[1], lambda d: [_SMALL] * 4, tol=_TIGHT),
    "attention_backward_input_needs_chosen_jointly": Case(
        "refused with 'sdpfa_bwd ... needs a communication': v's key sequence sharded made "
        "q_grad a partial sum over it while k, read for k_grad, stayed whole (fuzzer seeds "
        "1558 at 2 ranks, 1158 and 1506 at 4)",
        _attention(False, _SMALL, "grads")[0], _v_on_its_sequence_q_grad_on_its_head_dim,
        _attention(False, _SMALL, "grads")[1], lambda d: [_SMALL] * 4, tol=_TIGHT),
    "outputs_of_one_op_on_different_meshes": Case(
        "refused; the op runs on the first output's mesh and the other output is moved "
        "(fuzzer seed 167 at 2 ranks)",
        _var_mean, _var_mean_on_two_meshes,
        lambda x: list(torch.var_mean(x, dim=[0], correction=1)), lambda d: [[4, 8]],
        meshes="two"),
    "0d_tensor_moved_between_meshes": Case(
        "ExecutionError, the copy got None (fuzzer seed 0 at 2 ranks)",
        _minimum_with_0d, _0d_on_the_other_mesh, lambda x, s: [torch.minimum(x, s)],
        lambda d: [[8], []], meshes="two"),
    "2x2_mesh_differently_split_operands": Case(
        "issue 11: off by up to 3.1 (6.2 for the sum), silently",
        _add_where_sum, _differently_split_on_2x2, _add_where_sum_reference,
        lambda d: [[4, 4, 4]] * 2, meshes="2x2"),
    "axis_split_twice_then_matmul_split_on_mesh_y": Case(
        "issue 11: KeyError: ParallelType.mesh_x in ir/layout.py",
        _matmul, _split_twice_then_mesh_y, lambda x, w: [x @ w], lambda d: [[8, 4], [4, 8]],
        meshes="2x2"),
    "partial_extrema_added_as_partial_sums": Case(
        "silent wrong values: add/sub of two partial maxima (minima, products) kept "
        "the result partial and summed it (found while fixing seeds 2308 and 4096)",
        _combined_extrema, _both_on_the_reduced_axis, _combined_extrema_reference,
        lambda d: [[2 * d + 1, 3]] * 2,
        comms=lambda d, kinds: kinds == ([] if d == 1 else ["allreduce"] * 6)),
    "var_mean_result_pinned_partial": Case(
        "refused: 'would be a partial result ..., which var_mean cannot produce'",
        _var_mean_then_exp, _var_pinned_partial,
        lambda x: [torch.var(x, dim=0).exp(), x.mean(0)], lambda d: [[2 * d + 1, 3]],
        comms=_gathered_then_reduced),
    "attention_forward_result_pinned_partial_on_the_keys": Case(
        "refused: 'would be a partial result ..., which sdpfa_fwd cannot produce'",
        _attention_then_exp, _attention_pinned_partial_on_the_keys,
        lambda q, k, v: [torch.nn.functional.scaled_dot_product_attention(q, k, v).exp()],
        lambda d: [[1, 2, 2 * d + 1, 4]] * 3, comms=_gathered_then_reduced, tol=_TIGHT),
    "partial_sums_of_cyclic_shards_added": Case(
        "refused: 'add(T4, T5): T5 axis 0 is replicated but reduced is DIDx ... needs a "
        "communication' (fuzzer seed 3 at 2 ranks, with Features.extrema)",
        _partial_sums_added, _cyclic_on_the_reduced_axis,
        lambda x, y: [x.sum(0, keepdim=True) + y.sum(0, keepdim=True), x.sum(0, keepdim=True)],
        lambda d: [[2 * d - 1]] * 2,
        comms=lambda d, kinds: kinds == ([] if d == 1 else ["allreduce"] * 2)),
    "expanded_broadcast_operand_beside_a_one_element_shard": Case(
        "ExecutionError 'an output is of local shape [3], expected [1]': a pointwise op took "
        "a rank's one-element shard of an uneven split for a broadcast axis and expanded its "
        "result to the expanded operand's extent (found by the gradient fuzzer, seed 6 at "
        "2 ranks: the backward of max reads such a broadcast; fixed with the next case)",
        _where_of_an_expanded_scalar, lambda t, mesh: shard(t[0], 0, mesh),
        lambda x, s: [torch.where(x > 0, s, 0.0), x * s], lambda d: [[2 * d - 1], []]),
    "expanded_broadcast_axis_against_a_shard": Case(
        "ExecutionError 'The size of tensor a (4) must match the size of tensor b (2)': the "
        "allgathered expanded axis (materialized) kept its global extent next to the "
        "output's shard; and a stride-0 one was expanded back to its global extent where the "
        "output's shard had 1 element (fuzzer seed 802 at 2 ranks, low precision)",
        _expanded_against_shards, _rows_sharded_outputs_on_the_expanded_axis,
        _expanded_reference, lambda d: [[3], [3], [3, _odd(d)]]),
    "linear_contracting_an_expanded_broadcast_axis": Case(
        "ExecutionError 'mat1 and mat2 shapes cannot be multiplied (24x5 and 3x3)': the "
        "weight's contracted axis stayed sharded against the expanded axis, whole on every "
        "rank (low-precision fuzzer seed 875 at 4 ranks, a float32 bug)",
        _linear_of_expanded, lambda t, mesh: shard(t[1], 1, mesh),
        lambda x, w: [torch.nn.functional.linear(x[:, :, None].expand(4, 3, w.shape[1]), w)],
        lambda d: [[4, 3], [6, 2 * d + 1]]),
    "var_mean_then_attention_on_its_size_1_axes": Case(
        "issue 11: off by 0.03-0.08 at 2 ranks",
        _var_mean_attention, lambda t, mesh: shard(t[0], 2, mesh),
        _var_mean_attention_reference, lambda d: [[2, 2, 8, 4], [1, 1, 8, 1]],
        tol={"rtol": 1e-5, "atol": 1e-5}),
    "allreduce_loop_over_an_empty_shard_of_the_contracted_axis": Case(
        "ExecutionError in the GEMM -> allreduce loop on the rank whose shard of the "
        "contracted axis is empty: 'cannot reshape tensor of 0 elements into shape [-1, 0]' "
        "(overlap fuzzer seed 28 at 3 ranks), and the other ranks then out of step",
        _matmul_on_short_contracted_axis, _row_parallel_forced_loop,
        lambda x, w: [x @ w], lambda d: [[3, _short(d)], [_short(d), 1]],
        comms=lambda d, kinds: (d == 1) == (not kinds) and set(kinds) <= {"allreduce"}),
    "reduce_scatter_loop_onto_strided_shards": Case(
        "ExecutionError 'The size of tensor a (3) must match the size of tensor b (2)': "
        "set_overlap(True) made the reduce-scatter a loop that reduces contiguous blocks, "
        "onto an axis split before its device split (strided blocks); now it runs whole, no "
        "per-block reduce (overlap fuzzer seed 69 at 4 ranks)",
        _matmul_to_strided_shards, _reduce_scatter_onto_strided_shards,
        lambda x, w: [x @ w], lambda d: [[2, 2 * d], [2 * d, 2 * d]],
        comms=lambda d, kinds: "reduce" not in kinds),
}


@pytest.mark.parametrize("name", list(CASES))
def test_regression(multidevice_test, name):
    case = CASES[name]
    kinds = _run(multidevice_test, case)
    if case.comms is not None:
        assert case.comms(multidevice_test.size, kinds), kinds


# The features the seeds below were drawn with (later features draw other programs).
DRAWN_WITH = Features(uneven=True, any_to_any=True)
CI_FEATURES = Features(uneven=True, any_to_any=True, integers=True, extrema=True)
LOW_PRECISION = dataclasses.replace(CI_FEATURES, low_precision=True)
OVERLAP = dataclasses.replace(CI_FEATURES, overlap=True)
OVERLAP_STREAM_AXES = dataclasses.replace(OVERLAP, stream_axes=True)
SYMBOLIC = dataclasses.replace(CI_FEATURES, symbolic=True)
INDEXING_SYMBOLIC = dataclasses.replace(CI_FEATURES, indexing=True, symbolic=True)
LOW_PRECISION_INDEXING_SYMBOLIC = dataclasses.replace(LOW_PRECISION, indexing=True,
                                                      symbolic=True)


@dataclasses.dataclass(frozen=True)
class Seed:
    """A fuzzer program (``generate(seed, world_size, features)``) that once failed."""

    seed: int
    world_size: int
    was: str
    open: bool = False  # still failing: expected to fail (strict) until fixed
    features: Features = DRAWN_WITH
    compile: str | None = None  # run compiled by this torch.compile backend (fuzz_runner)


SEEDS: dict[str, Seed] = {
    "rng_state_broadcast_uint64-1054": Seed(
        1054, 4, "untyped gloo error: attention's RNG state (uint64) broadcast to a mesh"),
    "rng_state_broadcast_uint64-1095": Seed(1095, 4, "as 1054"),
    "rng_state_broadcast_uint64-1955": Seed(1955, 4, "as 1054"),
    "attention_backward_input_needs-1558": Seed(
        1558, 2, "refused: sdpfa_bwd's input needs read per input (v's key sequence sharded, "
        "k whole)"),
    "attention_backward_input_needs-1158": Seed(1158, 4, "as 1558"),
    "attention_backward_input_needs-1506": Seed(1506, 4, "as 1558, on the 2x2 mesh"),
    "partial_max_resharded_as_a_sum-2308": Seed(
        2308, 4, "silent mismatch: max(x, dims=[1], keepdim=True) pinned partial on another "
        "split of its reduction axis; the reshard between the two partial states took the "
        "target for a partial sum (to_partial filled 0, not -inf, and the allreduce(max) that "
        "followed clipped negative maxima to 0)"),
    "partial_max_resharded_as_a_sum-4096": Seed(
        4096, 4, "as 2308, on the 2x2 mesh: max over an axis on mesh_y, its result pinned "
        "partial on mesh_x"),
    "expanded_broadcast_axis_against_a_shard-802": Seed(
        802, 2, "ExecutionError: where(cond, broadcast_in_dim's expanded axis gathered, a "
        "shard): 'The size of tensor a (2) must match the size of tensor b (3)'",
        features=LOW_PRECISION),
    "linear_contracting_an_expanded_broadcast_axis-875": Seed(
        875, 4, "ExecutionError: linear(broadcast_in_dim(x), w) with w's contracted axis "
        "sharded on the 2x2 mesh: 'mat1 and mat2 shapes cannot be multiplied'",
        features=LOW_PRECISION),
    "empty_shard_next_to_a_repeated_axis-82": Seed(
        82, 4, "ExecutionError in rsqrt: a pointwise op on a stride-0 operand took an empty "
        "shard's axis (extent 0) for a broadcast one: 'The expanded size of the tensor (1) "
        "must match the existing size (0)' (also seed 314 at 3 ranks)",
        features=LOW_PRECISION),
    "compiled_cast_to_bfloat16_and_back-8": Seed(
        8, 2, "compiled (Inductor): cast(cast(x, BFloat16), Float) fused into nothing, x "
        "unrounded, 0.0074 off the interpreter", features=CI_FEATURES, compile="inductor"),
    "allreduce_loop_over_an_empty_shard_of_the_contracted_axis-28": Seed(
        28, 3, "ExecutionError: matmul's contracted axis of 2 on 3 ranks, its allreduce forced "
        "into a loop of 2 row chunks: 'cannot reshape tensor of 0 elements into shape "
        "[-1, 0]' on rank 2", features=OVERLAP),
    "reduce_scatter_loop_onto_a_strided_shard-69": Seed(
        69, 4, "ExecutionError: matmul's partial result reduce-scattered onto axis 1 of 6 "
        "split in 3 x 2, the piece of 2 sharded over 4 ranks (strided blocks), forced into "
        "a loop that reduces contiguous blocks: 'The size of tensor a (3) must match the "
        "size of tensor b (2)'", features=OVERLAP),
    # Symbolic extents (issue 31 item 6): the same seeds' programs with static extents ran.
    "symbolic_uneven_split_learnt_from_every_rank-3": Seed(
        3, 2, "refused: 'ranks disagree on input T0': an uneven split of a -1 axis, whose "
        "extent each rank took for its shard times 2", features=SYMBOLIC),
    "symbolic_operand_resharded_per_signature-6": Seed(
        6, 2, "refused: 'T3 = where(T2, T0, T1): T0 axis 0 is replicated but axis 0 of T3 is "
        "DIDx ...: schedule both alike': the resharding was decided without the extents",
        features=SYMBOLIC),
    "slice_of_a_symbolic_axis-9": Seed(
        9, 2, "refused when defined: 'slice: axis 0 has a symbolic extent; slicing it needs a "
        "static extent'", features=SYMBOLIC),
    "symbolic_uneven_split_broadcast_against_static-15": Seed(
        15, 2, "refused: 'add: operands do not broadcast ... extent 3, ... extent 4': an "
        "uneven -1 axis bound as if even (4, not 3)", features=SYMBOLIC),
    "symbolic_uneven_split_with_empty_shards-6": Seed(
        6, 4, "refused: 'T2 = exp(T0): T0 axis 0 is DIDx (owners []), DIDy (owners []) but "
        "axis 0 of T2 is ...' on the 2x2 mesh (an extent bound as if even)",
        features=SYMBOLIC),
    "symbolic_operand_of_maximum_resharded_per_signature-21": Seed(
        21, 4, "refused: 'T3 = maximum(T0, T1): T1 axis 2 is replicated but axis 2 of T3 is "
        "DIDx ...'", features=SYMBOLIC),
    "symbolic_broadcast_in_dim_resharded_per_signature-22": Seed(
        22, 4, "refused: 'T2 = broadcast_in_dim(T3, ...): T3 axis 0 is replicated but ...'",
        features=SYMBOLIC),
    "strided_shard_kept_by_a_forced_allgather_loop-20132": Seed(
        20132, 4, "mismatch (every value of linear(where(gt(t1, 0), t0, t1), w) on the 2x2 "
        "mesh, set_overlap(True), 4 chunks): t1's last axis is sharded in strided blocks "
        "(an outer split of a piece of it), the GEMM's operand in blocks, the same S(2) "
        "placement; the stream loop took the reshard for an allgather over the other mesh "
        "axis alone and left the re-layout out. Found by the overlap fuzz run of "
        "2026-12-05; a loop now needs the shards it keeps in blocks on both sides",
        features=dataclasses.replace(OVERLAP_STREAM_AXES, indexing=True)),
    "symbolic_extents_in_a_forced_stream_loop-19": Seed(
        19, 4, "mismatch (6 of 12 values of linear(div(x, abs(w) + 1), v) on the 2x2 mesh, "
        "set_overlap(True), 2 chunks) with symbolic extents; the same program with static "
        "extents matches. Fixed with strided_shard_kept_by_a_forced_allgather_loop-20132 "
        "(a loop needs the shards it keeps in blocks on both sides)",
        features=dataclasses.replace(OVERLAP_STREAM_AXES, symbolic=True)),
    "cross_entropy_of_a_symbolic_class_axis-2": Seed(
        2, 1, "refused when defined: 'cross_entropy: the class axis 1 of T5 has a symbolic "
        "extent; class indices need a static one'", features=INDEXING_SYMBOLIC),
    "take_along_axis_of_symbolic_extents_permuted-32": Seed(
        32, 2, "ExecutionError: 'an output is torch.bfloat16 of local shape [8, 6, 2], "
        "expected ... [8, 6, 1]': permute(silu(take_along_axis(x [-1, -1, -1], index "
        "[-1, 2, 8], 2)), [2, 0, 1]), its output sharding pinned", features=(
            LOW_PRECISION_INDEXING_SYMBOLIC)),
    "take_along_axis_of_a_reduction_output-44": Seed(
        44, 2, "ExecutionError: 'IndexError: tuple index out of range' in _held_rows: "
        "take_along_axis(linear(x, w), index, 0), index split on axis 1: the rows to read "
        "were looked up by logical axis, linear's output has a reduction axis (the held "
        "indices count materialized axes only)", features=INDEXING_SYMBOLIC),
    "take_along_axis_of_a_reduction_output-118": Seed(118, 2, "as 44",
                                                       features=INDEXING_SYMBOLIC),
    "take_along_axis_of_a_reduction_output-9": Seed(
        9, 4, "as 44, low precision", features=LOW_PRECISION_INDEXING_SYMBOLIC),
    "cross_entropy_mean_scheduled_on_its_static_rows-2107": Seed(
        2107, 4, "refused (ScheduleError 'axis 0 is out of range for T30, whose loop domain "
        "has 0 axes'), the engine's: cross_entropy(mean) of logits [5, 2] is the fused "
        "kernel's loss where the class extent is static (a sum over the rows, whose reduced "
        "axis a schedule may split: a partial loss) and was div(sum, count) where it is "
        "symbolic (a 0-d result); the schedule was drawn on the static probe. Found by the "
        "segmented fuzz run of 2026-12-05; the symbolic path now sums each row's loss "
        "divided by the count, a sum over the rows as the fused one",
        features=LOW_PRECISION_INDEXING_SYMBOLIC),
    # Found in session 13's last campaign (fixed since).
    "gemm_pattern_on_a_reduction_result-619": Seed(
        619, 4, "mismatch, the generator's: the overlap mode's GEMM pattern wrote logical axis "
        "indices for var's result, whose loop domain keeps the reduced axis: it pinned the "
        "reduced axis (a partial output, returned partial: zeros on half the ranks) where "
        "a shard was meant; the pattern now leaves reduction results alone",
        features=OVERLAP_STREAM_AXES),
    "low_precision_one_element_output-3298": Seed(
        3298, 4, "mismatch: a Half sum over every axis, sharded over 2 ranks, 0.0069 off the "
        "exact -0.4306: the partial sums (-12.62, 12.19) are rounded to Half before the "
        "allreduce (-12.625 + 12.1875 = -0.4375), as DTensor rounds a cast partial; the "
        "oracle's scale now includes the largest sum of absolute terms of the program's sums "
        "(fuzz_precision.InFloat64.partial_magnitude), which bounds any partial",
        features=LOW_PRECISION),
    "half_partial_product_overflow-60600": Seed(
        60600, 4, "mismatch (inf against 0.0055), the oracle's: prod of 32 Half values (4 "
        "inputs expanded 8 times) over 4 ranks; one rank's partial product overflowed Half "
        "where the whole does not, as a partial sum rounds (3298) but past any tolerance. "
        "A program whose factors above 1 could overflow its dtype is now compared nowhere "
        "(fuzz_precision.InFloat64.product_magnitude); it must still run. Found by the "
        "low-precision fuzz run of 2026-12-05 (seed 60000 on)",
        features=LOW_PRECISION_INDEXING_SYMBOLIC),
    "stream_loop_placed_alike_where_a_rank_drops_the_bias-140149": Seed(
        140149, 4, "a hang, caught by the timeout (CollectiveFailed: 'T19 = reshard(T2, "
        "[R, S(0)c] -> [R, R]) ... timed out; do all ranks run the same program?'): "
        "linear(gathered x, w, b) with w's contracted axis split over mesh axis 1 (a partial "
        "sum: only coordinate 0 adds the bias) and x gathered over mesh axis 0 by a forced "
        "stream loop; the loop was placed after what this rank's steps read, so ranks 0 and 2 "
        "gathered the bias before the loop and ranks 1 and 3 after it, each pair waiting for "
        "the other. The loop's place now follows the expressions, alike on every rank. Found "
        "by the overlap fuzz run of 2026-12-05 (seed 140000 on)",
        features=dataclasses.replace(OVERLAP_STREAM_AXES, indexing=True, symbolic=True)),
    "narrowing_cast_of_a_partial_matmul-160": Seed(
        160, 3, "mismatch (22 of 48, up to 5% relative): cast(matmul(x, w), BFloat16) cast "
        "back to Float, w's contracted axis split over 3 ranks: the narrowing cast keeps the "
        "partial sum partial (by design, ops/pointwise._cast_infer), so 3 partials are "
        "rounded to BFloat16 before the allreduce, against a float32 oracle of 1e-4 (0.0156 "
        "off at a scale of 4); kept (DTensor reduces a cast partial in the narrow type too):"
        " a float32 program that rounds to BFloat16 is now compared with BFloat16's "
        "tolerances (fuzz_runner.tolerance)", features=INDEXING_SYMBOLIC),
    "attention_output_on_another_mesh_than_its_sequence_sharded_q-640514": Seed(
        640514, 4, "untyped (ExecutionError of a KeyError in context_record): q, k and v "
        "sequence-sharded on ranks 2-3, the attention's output pinned on ranks 0-1: the "
        "context-parallel planning chose the ring on q's layout, and the attention ran on "
        "the output's mesh with q moved there whole, whose sequence no device splits. An "
        "output on another mesh now rules the ring out (the engine's gather runs). Found by "
        "the forward heads fuzz run of 2026-12-05 (seed 640000 on, 4 ranks)",
        features=dataclasses.replace(INDEXING_SYMBOLIC, heads=True)),
}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=s.was)) if s.open else n
    for n, s in SEEDS.items()])
def test_fuzz_seed(multidevice_test, name):
    seed = SEEDS[name]
    if multidevice_test.size != seed.world_size:
        pytest.skip(f"the program of seed {seed.seed} was drawn for {seed.world_size} ranks")
    outcome = run_program(generate(seed.seed, seed.world_size, seed.features),
                          multidevice_test.rank, multidevice_test.device, seed.compile)
    assert outcome.kind == "match", outcome.report()


def test_a_loop_on_a_mesh_without_some_ranks_creates_its_groups_on_every_rank(
        multidevice_test):
    """Overlap fuzzer seed 148 at 2 ranks: set_overlap(True) on tensors of a mesh of rank 0
    alone made a stream loop there, whose lowering created a process group on rank 0 only
    (creating a group is collective over the world): the ranks' group counts parted, and
    the next group created after a recover() hung (at seed 281 of a long run). Every rank
    now creates the loops' groups, run or not: the program matches and the counts agree."""
    if multidevice_test.size != 2:
        pytest.skip("the program of seed 148 was drawn for 2 ranks")
    outcome = run_program(generate(148, 2, OVERLAP), multidevice_test.rank,
                          multidevice_test.device)
    assert outcome.kind == "match", outcome.report()
    counts = Communicator.instance().allgather_object(
        torch.distributed.distributed_c10d._world.group_count)
    assert len(set(counts)) == 1, f"process groups created per rank: {counts}"

