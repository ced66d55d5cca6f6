"""Every differentiable op's derived gradient against ``torch.autograd``, from the op table.

Each sample of ``op_table.py`` whose op has a ``vjp`` rule runs as a one-op fusion in float64
through ``fd.as_autograd_function()``: random cotangents for its differentiable outputs, and
the gradients of its floating-point inputs compared with ``torch.autograd.grad`` of the
sample's torch reference on the same global values. At world sizes 2 and 4 every tensor
input is block-sharded on its first axis the mesh divides, the gradient of each input must
come back as this rank's shard of the reference gradient (laid out like the input), and a
replicated input's gradient must be complete.

A bfloat16 pass runs a subset of the ops (pointwise, reductions, layout, matmul, casts) against
``torch.autograd`` of the reference in bfloat16 on the same values, within a loose tolerance
(both round every intermediate to bfloat16, in orders that may differ).
"""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import mesh_1d, shard
from op_table import OP_TABLE, T
from test_ops import _generator, concrete, declare

from meshfuse import FusionDefinition, TensorView, shard_tensor
from meshfuse.ops.registry import REGISTRY
from meshfuse.testing.utils import current_device

DTYPE = torch.float64
TOLERANCE = {"rtol": 1e-7, "atol": 1e-7}
# PyTorch's SDPA kernels take no float64: attention runs in float32 against the float32
# math backend's autograd.
FLOAT32_OPS = {"sdpfa_fwd": {"rtol": 1e-4, "atol": 1e-5}}
# The bfloat16 pass: ops whose derivative is a few roundings deep, one sample each.
BF16_OPS = ("add", "sub", "mul", "div", "exp", "tanh", "sigmoid", "silu", "gelu", "relu",
            "neg", "where", "cast", "sum", "mean", "var_mean", "permute", "reshape", "cat",
            "slice", "broadcast_in_dim", "matmul", "linear")
BF16_TOLERANCE = {"rtol": 5e-2, "atol": 5e-2}
# The sharded runs take this many samples of each op (the unsharded run takes them all).
SHARDED_SAMPLES = 2


def _cases():
    for info in OP_TABLE:
        op = REGISTRY[info.name]
        if op.vjp is None or op.vjp.differentiable == () or \
                not any(d.is_floating_point for d in info.dtypes):
            continue  # no gradient to check (random draws are constants)
        for sample in info.samples:
            if sample.define is None:
                yield pytest.param(info, sample, id=f"{info.name}-{sample.name}")


CASES = list(_cases())


def _sharded_cases():
    taken: dict[str, int] = {}
    for case in CASES:
        name = case.values[0].name
        if taken.get(name, 0) < SHARDED_SAMPLES:
            taken[name] = taken.get(name, 0) + 1
            yield case


def _differentiable(op, outs) -> list[int]:
    return [i for i, o in enumerate(outs) if op.vjp.is_differentiable(i, o.dtype)]


def _bf16_cases():
    taken = set()
    for case in CASES:
        name = case.values[0].name
        if name in BF16_OPS and name not in taken:
            taken.add(name)
            yield case


def check_gradients(info, sample, rank: int = 0, mesh=None, bf16: bool = False) -> None:
    """Runs ``sample`` with autograd (sharded on ``mesh`` if given) against torch.autograd
    (both in bfloat16 with ``bf16``)."""
    op = REGISTRY[info.name]
    gen = _generator("vjp", info.name, sample.name)
    dtype = torch.float32 if info.name in FLOAT32_OPS else DTYPE
    tolerance = FLOAT32_OPS.get(info.name, TOLERANCE)
    if bf16:
        dtype, tolerance = torch.bfloat16, BF16_TOLERANCE
    values = concrete(sample.args, dtype, "cpu", gen)
    inputs: list = []
    with FusionDefinition() as fd:
        args = [declare(fd, s, v, False, inputs) for s, v in zip(sample.args, values)]
        outs = getattr(fd.ops, info.name)(*args, **sample.kwargs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for o in outs:
            fd.add_output(o)
    tvs = fd.fusion.inputs()
    # Causal attention cannot shard its sequence (a ShardingError): batch or heads only.
    causal = info.name == "sdpfa_fwd" and any(v is True for v in values)
    if mesh is not None:
        for tv in (v for v in tvs if isinstance(v, TensorView)):
            axis = _shardable_axis(tv, mesh.size, axes=2 if causal else None)
            if axis is not None:
                shard(tv, axis, mesh)
    leaves = [x.detach().requires_grad_() if _floating(x) else x for x in inputs]
    local = [_local(x, tv, rank) for x, tv in zip(leaves, tvs)]
    outputs = fd.as_autograd_function()(local)

    expected = sample.ref(*_rebuild(sample.args, values, leaves))
    expected = expected if isinstance(expected, tuple | list) else (expected,)
    carried = _differentiable(op, outs)
    cotangents = [torch.randn(expected[i].shape, generator=gen, dtype=dtype) for i in carried]
    for i, ct in zip(carried, cotangents):
        mine = shard_tensor(expected[i].detach(), outs[i], rank) if mesh else expected[i]
        torch.testing.assert_close(outputs[i].cpu(), mine.detach(), **tolerance)
    wanted = [i for i, x in enumerate(leaves) if _floating(x)]
    if not carried or not wanted:
        return
    torch.autograd.backward([outputs[i] for i in carried],
                            [_local(ct, outs[i], rank) for i, ct in zip(carried, cotangents)])
    reference = torch.autograd.grad([expected[i] for i in carried],
                                    [leaves[i] for i in wanted], cotangents, allow_unused=True)
    for i, ref in zip(wanted, reference):
        ref = _local(torch.zeros_like(leaves[i]) if ref is None else ref, tvs[i], rank)
        got = local[i].grad
        got = torch.zeros_like(ref) if got is None else got
        torch.testing.assert_close(got.cpu(), ref.detach().cpu(), **tolerance,
                                   msg=lambda m, i=i: f"gradient of input {i}: {m}")


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _shardable_axis(tv, size: int, axes: int | None = None) -> int | None:
    """The first of ``tv``'s first ``axes`` axes (default all) that ``size`` divides."""
    for axis, id_ in enumerate(tv.materialized()[:axes]):
        if id_.extent and id_.extent > 1 and id_.extent % size == 0:
            return axis
    return None


def _local(x, tv, rank: int):
    """``rank``'s shard of global ``x`` under ``tv`` (a leaf stays a leaf that requires grad)."""
    if not isinstance(x, torch.Tensor) or tv is None:
        return x
    shard_ = shard_tensor(x.detach(), tv, rank).to(current_device())
    return shard_.requires_grad_() if x.requires_grad else shard_


def _rebuild(specs, values, leaves):
    """The sample's arguments with its tensors replaced by ``leaves`` (same order)."""
    flat = iter(leaves)

    def one(spec, value):
        if isinstance(spec, T):
            return next(flat)
        if isinstance(spec, list) and spec and isinstance(spec[0], T):
            return [one(s, v) for s, v in zip(spec, value)]
        if hasattr(spec, "how") and spec.how == "input":
            next(flat)
        return value

    return [one(s, v) for s, v in zip(specs, values)]


@pytest.mark.parametrize("info, sample", CASES)
def test_vjp_matches_torch_autograd(info, sample):
    check_gradients(info, sample)


@pytest.mark.parametrize("info, sample", list(_bf16_cases()))
def test_bf16_vjp_matches_torch_autograd(info, sample):
    check_gradients(info, sample, bf16=True)


def test_bf16_pass_covers_its_ops():
    """Each op named for the bfloat16 pass has a sample there (a renamed op is noticed)."""
    assert {p.values[0].name for p in _bf16_cases()} == set(BF16_OPS)


def test_every_differentiable_op_is_covered():
    """Each op with a vjp rule has samples here; each op without one cannot be
    differentiated on purpose."""
    covered = {p.values[0].name for p in CASES}
    with_rule = {name for name, op in REGISTRY.items() if op.vjp is not None}
    # iota reads no tensor; stop_gradient's gradient is zero by definition (its users' cases
    # cover it: cross entropy's max).
    assert with_rule - covered <= {"eq", "ge", "gt", "le", "lt", "ne", "logical_and",
                                   "logical_or", "normal", "uniform", "rand_like", "randn_like",
                                   "iota", "stop_gradient"}
    # grouped_mm: its weight gradient needs a grouped product of transposes (not an op yet).
    # The MoE and cross entropy backwards are gradients themselves; token counts are integers.
    assert {name for name, op in REGISTRY.items() if op.vjp is None} == {
        "gelu_backward", "sdpfa_bwd", "grouped_mm", "moe_route_bwd", "moe_experts_bwd",
        "moe_token_counts", "cross_entropy_bwd"}


@pytest.mark.mpi
@pytest.mark.parametrize("info, sample", list(_sharded_cases()))
def test_sharded_vjp_matches_torch_autograd(info, sample, multidevice_test):
    if multidevice_test.size == 1:
        pytest.skip("the unsharded case is test_vjp_matches_torch_autograd")
    check_gradients(info, sample, multidevice_test.rank, mesh_1d(multidevice_test))
