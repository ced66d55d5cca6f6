"""Random ops (uniform, normal, rand_like, randn_like): the same global values sharded or not,
reproducible from (seed, offset), and statistically sound.

The reference of a sharded run is the same fusion run unsharded: every rank compares its shard
bitwise with the unsharded values sliced by the schedule (``shard_tensor``), and the shards of
all ranks put back together (``unshard_tensor``) must be the unsharded tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard

from meshfuse import DataType, DefinitionError, FusionDefinition, InputError, unshard_tensor
from meshfuse.errors import ExecutionError
from meshfuse.ops.random import rng
from meshfuse.passes.pipeline import compiled_for
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.sharding import shard_tensor
from meshfuse.testing.utils import current_device

SEED, OFFSET = 1234, 7


def _distribution(op: str, shape, dtype=DataType.Float, seeded=True):
    """A fusion drawing ``op`` values of ``shape`` (explicit seed and offset inputs)."""
    fd = FusionDefinition()
    with fd:
        a, b = (0.0, 1.0) if op == "normal" else (-2.0, 3.0)
        seeds = {}
        if seeded:
            seeds = {"rng_seed": fd.define_scalar(dtype=DataType.Int),
                     "rng_offset": fd.define_scalar(dtype=DataType.Int)}
        out = getattr(fd.ops, op)(a, b, shape, dtype=dtype, **seeds)
        fd.add_output(out)
    return fd, out


def _unsharded(op: str, shape, dtype=DataType.Float) -> torch.Tensor:
    fd, _ = _distribution(op, shape, dtype)
    return fd.execute([SEED, OFFSET])[0]


def _gather(multidevice_test, local: torch.Tensor, tv) -> torch.Tensor:
    shards = multidevice_test.communicator.allgather_object(local.cpu())
    mesh = compiled_for(tv.fusion)[tv].mesh  # propagation may have given tv its mesh
    return unshard_tensor([shards[r] for r in mesh.device_ids], tv)


def _check_sharded(multidevice_test, fd, out, expected, inputs):
    with record_communications() as comms:
        local, = fd.execute(inputs)
    assert comms == [], f"random values need no communication, got {comms}"
    mine = shard_tensor(expected.cpu(), out, multidevice_test.rank)
    whole = _gather(multidevice_test, local, out)
    if local.device == expected.device:
        assert torch.equal(local.cpu(), mine)
        assert torch.equal(whole, expected.cpu())
    else:
        # A fusion without tensor inputs runs unsharded on the CPU: the random bits are the
        # same on every device, but log/cos/sqrt (normal's transform) may differ by an ulp.
        torch.testing.assert_close(local.cpu(), mine, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(whole, expected.cpu(), rtol=1e-6, atol=1e-6)


# (shape, schedule) on a 1-D mesh; a schedule shards (materialized axis, cyclic) pairs.
ONE_D = {
    "block-rows": ((8, 6), ((0, False),)),
    "cyclic-cols": ((3, 8), ((1, True),)),
    "block-3d-middle": ((2, 4, 3), ((1, False),)),
}


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["uniform", "normal"])
@pytest.mark.parametrize("case", list(ONE_D))
def test_distribution_sharded_is_unsharded_bitwise(multidevice_test, op, case):
    shape, schedule = ONE_D[case]
    expected = _unsharded(op, shape)
    fd, out = _distribution(op, shape)
    mesh = mesh_1d(multidevice_test)
    for axis, cyclic in schedule:
        shard(out, axis, mesh, inner=cyclic)
    _check_sharded(multidevice_test, fd, out, expected, [SEED, OFFSET])


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Double])
def test_distribution_on_a_2d_mesh(multidevice_test, dtype):
    """Rows over mesh_y (block), columns over mesh_x (cyclic)."""
    mesh = mesh_2x2(multidevice_test)
    expected = _unsharded("uniform", (4, 6), dtype)
    fd, out = _distribution("uniform", (4, 6), dtype)
    shard(out, 0, mesh, MY)
    shard(out, 1, mesh, MX, inner=True)
    _check_sharded(multidevice_test, fd, out, expected, [SEED, OFFSET])


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["rand_like", "randn_like"])
def test_like_ops_follow_their_input_sharding(multidevice_test, op):
    """``rand_like(x)`` of a sharded ``x``: the output is sharded like x (propagation), and
    its values are those of the unsharded run."""
    d = multidevice_test.size
    x = torch.zeros(2 * d, 5, device=current_device())

    def define():
        fd = FusionDefinition()
        with fd:
            tx = fd.define_tensor([2 * d, 5])
            seed, offset = (fd.define_scalar(dtype=DataType.Int) for _ in range(2))
            out = fd.ops.mul(getattr(fd.ops, op)(tx, rng_seed=seed, rng_offset=offset), 2.0)
            fd.add_output(out)
        return fd, tx, out

    fd, _, _ = define()
    expected = fd.execute([x, SEED, OFFSET])[0]
    fd, tx, out = define()
    shard(tx, 0, mesh_1d(multidevice_test))
    local_x = multidevice_test.shard_tensor(x, tx)
    _check_sharded(multidevice_test, fd, out, expected, [local_x, SEED, OFFSET])


@pytest.mark.mpi
def test_drawn_seed_agrees_across_ranks(multidevice_test):
    """Without rng_seed, each call draws its seed from torch's generator: ranks seeded alike
    draw alike, so the shards still form the unsharded values."""
    d = multidevice_test.size
    fd, _ = _distribution("uniform", (2 * d, 4), seeded=False)
    torch.manual_seed(5)
    expected = fd.execute([])[0]
    fd, out = _distribution("uniform", (2 * d, 4), seeded=False)
    shard(out, 0, mesh_1d(multidevice_test))
    torch.manual_seed(5)
    _check_sharded(multidevice_test, fd, out, expected, [])


# ----- one process: values, statistics, errors -------------------------------------------


def test_values_depend_on_seed_and_offset_only():
    a = _unsharded("uniform", (64,))
    assert torch.equal(a, _unsharded("uniform", (64,)))
    fd, _ = _distribution("uniform", (64,))
    for seed, offset in ((SEED, OFFSET + 1), (SEED + 1, OFFSET)):
        b = fd.execute([seed, offset])[0]
        assert (a != b).float().mean() > 0.9, "another seed or offset must give other values"
    # An element's value depends on its global index, not on the tensor's shape.
    assert torch.equal(_unsharded("uniform", (8, 8)).flatten(), a)


def test_drawn_seeds_follow_torch_manual_seed():
    fd, _ = _distribution("normal", (32,), seeded=False)
    torch.manual_seed(3)
    first, second = fd.execute([])[0], fd.execute([])[0]
    torch.manual_seed(3)
    assert torch.equal(fd.execute([])[0], first)
    assert not torch.equal(first, second), "each call draws a new seed"


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.Double, DataType.BFloat16,
                                   DataType.Half])
def test_uniform_statistics(dtype):
    n = 50_000
    fd, _ = _distribution("uniform", (n,), dtype)
    u = fd.execute([SEED, OFFSET])[0]
    assert u.dtype == dtype.torch_dtype
    assert u.min() >= -2.0 and u.max() < 3.0, "uniform values lie in [minval, maxval)"
    u = u.double()
    sigma = 5.0 / math.sqrt(12 * n)  # 5 standard errors of the mean, with width 5
    assert abs(u.mean().item() - 0.5) < 5 * sigma
    assert abs(u.var().item() / (25 / 12) - 1) < 0.02
    counts = torch.histc(u, bins=20, min=-2.0, max=3.0)
    chi2 = ((counts - n / 20) ** 2 / (n / 20)).sum().item()
    assert chi2 < 60, f"chi-square {chi2} with 19 degrees of freedom"


def test_uniform_low_precision_never_reaches_maxval():
    """bfloat16 has 8 bits: values just below 1 round up unless clamped."""
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.uniform(0.0, 1.0, [50_000], rng_seed=1, rng_offset=0,
                                     dtype=DataType.BFloat16))
    values = fd.execute([])[0]
    assert values.max() < 1.0 and values.min() >= 0.0
    assert (values == torch.tensor(1.0, dtype=torch.bfloat16).nextafter(
        torch.tensor(0.0, dtype=torch.bfloat16))).any(), "the top value below maxval occurs"


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.Double])
def test_normal_statistics(dtype):
    n = 50_000
    fd, _ = _distribution("normal", (n,), dtype)
    z = fd.execute([SEED, OFFSET])[0].double()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 0.02
    assert abs((z ** 4).mean().item() - 3) < 0.1, "kurtosis of a normal distribution"
    assert abs((z.abs() < 1).double().mean().item() - 0.6827) < 0.01


def test_offsets_give_independent_values():
    fd, _ = _distribution("uniform", (50_000,))
    a, b = (fd.execute([SEED, offset])[0] for offset in (0, 1))
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(corr) < 0.02


DEFINITION_ERRORS = {
    "seed-without-offset": (lambda fd: fd.ops.uniform(0.0, 1.0, [4], rng_seed=1),
                            "rng_seed and rng_offset must be given together"),
    "int-dtype": (lambda fd: fd.ops.normal(0.0, 1.0, [4], dtype=DataType.Int),
                  "dtype must be a floating-point DataType"),
    "negative-seed": (lambda fd: fd.ops.uniform(0.0, 1.0, [4], rng_seed=-1, rng_offset=0),
                      r"rng_seed must be an integer in \[0, 2\*\*63\)"),
    "float-seed": (lambda fd: fd.ops.uniform(0.0, 1.0, [4], rng_seed=fd.define_scalar(1.5),
                                             rng_offset=0), "rng_seed must be an Int scalar"),
    "symbolic-extent": (lambda fd: fd.ops.uniform(0.0, 1.0, [-1, 4]),
                        "random tensors need static positive extents"),
    "input-extent": (lambda fd: fd.ops.uniform(
        0.0, 1.0, [fd.define_scalar(dtype=DataType.Int)]), "shape entry 0"),
    "int-like": (lambda fd: fd.ops.rand_like(fd.define_tensor([3], dtype=DataType.Int)),
                 "rand_like: dtype must be a floating-point DataType"),
}


@pytest.mark.parametrize("case", list(DEFINITION_ERRORS))
def test_definition_errors(case):
    build, message = DEFINITION_ERRORS[case]
    with pytest.raises(DefinitionError, match=message), FusionDefinition() as fd:
        build(fd)


def test_bad_seed_value_at_run_time():
    """A seed input out of range fails its step (the same on every rank: scalars are
    replicated), naming the op and the argument."""
    fd, _ = _distribution("uniform", (4,))
    with pytest.raises(ExecutionError, match=r"uniform: rng_offset must be an integer in \[0, 2"
                       ) as info:
        fd.execute([1, -3])
    assert isinstance(info.value.__cause__, InputError)


def test_explain_names_the_positions_and_the_seed():
    fd, _ = _distribution("uniform", (4, 6))
    text = fd.explain([SEED, OFFSET])
    assert "values at global a all 4, b all 6; seed S0, offset S1" in text


def test_a_known_bound_gives_the_same_bits_without_reading_the_counters():
    """Below 2**32 counters the high word's mix is one number; it is taken so only when the
    caller says so (``bound``), never by reading the counters back to the host (which a CUDA
    graph cannot capture). Both ways give the same bits, and counters past 2**32 mix their
    high word."""
    index = torch.arange(1000, dtype=torch.int64) * 7919
    for key in (0, 12345, 2**63 + 5):
        for lane in (0, 3):
            assert torch.equal(rng.random_words(key, index, lane, bound=2**32),
                               rng.random_words(key, index, lane))
    big = torch.tensor([2**32 - 1, 2**32, 2**40 + 3])
    k0 = rng.mix32((77 & rng.MASK32) ^ rng._mul32(1, rng._GOLDEN))
    k1 = rng.mix32(((77 >> 32) & rng.MASK32) ^ rng._mul32(7, rng._GOLDEN))
    expected = rng.mix32(rng.mix32((big & rng.MASK32) ^ k0) ^ rng.mix32((big >> 32) ^ k1))
    assert torch.equal(rng.random_words(77, big), expected)
