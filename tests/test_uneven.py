"""Uneven shards: extents the mesh does not divide, sharded as DTensor's ``Shard`` (blocks of
``ceil(n / d)``, shorter or empty at the end), through whole programs, against the unsharded
reference: the seed attention with heads the world size does not divide (6 heads at 4 ranks
here; 12 heads at 5 ranks with ``--world-sizes 5``, or in
``test_seed_attention_12_heads_at_5_ranks``, its own 5 CPU processes, opt-in with
``MESHFUSE_LONG_TESTS=1`` as 5 more processes cost the suite ~15 CPU seconds), Megatron MLPs
whose ffn size (and token count) the world size does not divide.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from mesh_helpers import mesh_1d, shard

from meshfuse import DataType, FusionDefinition, shard_tensor
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention, random_inputs, reference
from meshfuse.launch import spawn
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

TOKENS, HIDDEN, FFN = 6, 8, 7


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(current_device())


@pytest.mark.mpi
@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
def test_seed_attention_with_heads_the_world_size_does_not_divide(multidevice_test, qkv_format):
    """12 heads where the world size does not divide 12 (5 ranks: 3, 3, 3, 3, 0), else 6
    (4 ranks: 2, 2, 2, 0)."""
    d, rank = multidevice_test.size, multidevice_test.rank
    h = 12 if 12 % d else 6
    b, s, e = 1, 16, h * 4
    model = SeedAttention(qkv_format, mesh_1d(multidevice_test), b, h, s, e,
                          dtype=DataType.Float)
    q, k, v, out_grad = random_inputs(b, h, s, e, dtype=torch.float32, device=current_device())
    outputs = model.execute(model.inputs_for(q, k, v, out_grad, rank))
    heads = -(-h // d)
    assert outputs[0].shape[1] == max(0, min(heads, h - heads * rank))
    for out, ref, tv in zip(outputs, reference(q, k, v, out_grad),
                            (model.attn, model.q_grad, model.k_grad, model.v_grad)):
        torch.testing.assert_close(out, shard_tensor(ref, tv, rank), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not os.environ.get("MESHFUSE_LONG_TESTS"),
                    reason="5 more CPU processes; set MESHFUSE_LONG_TESTS=1 (or run the multi-"
                    "device tests of this module with --world-sizes 5)")
def test_seed_attention_12_heads_at_5_ranks():
    """The issue's case: 12 heads over 5 CPU ranks (3, 3, 3, 3, 0), each rank checking its
    shards against the unsharded reference (``python -m meshfuse.demo --nproc 5``, small)."""
    codes = spawn(5, ["-m", "meshfuse.demo", "--heads", "12", "--batch", "1", "--seq", "16",
                      "--embed", "96"], timeout_s=300)
    assert codes == [0] * 5, codes


class _Mlp(FusionDefinition):
    """``y = gelu(x @ w1.T + b1) @ w2.T + b2``: column-parallel fc1 (w1, b1 sharded on the
    ffn axis), row-parallel fc2; with ``sequence``, tokens sharded in and out as well."""

    def __init__(self, mesh, sequence: bool):
        super().__init__()
        self.mesh, self.sequence = mesh, sequence

    def definition(self) -> None:
        ops = self.ops
        self.x = self.define_tensor([TOKENS, HIDDEN])
        self.w1 = self.define_tensor([FFN, HIDDEN])
        self.b1 = self.define_tensor([FFN])
        self.w2 = self.define_tensor([HIDDEN, FFN])
        self.b2 = self.define_tensor([HIDDEN])
        h = ops.linear(self.x, self.w1, self.b1)
        self.y = ops.add(ops.linear(ops.gelu(h, approximate="tanh"), self.w2), self.b2)
        self.add_output(self.y)

    def multidevice_schedule(self) -> None:
        shard(self.w1, 0, self.mesh)
        shard(self.b1, 0, self.mesh)
        shard(self.w2, 1, self.mesh)
        if self.sequence:
            shard(self.x, 0, self.mesh)
            shard(self.y, 0, self.mesh)


@pytest.mark.mpi
@pytest.mark.parametrize("sequence", [False, True], ids=["tensor_parallel", "sequence_parallel"])
def test_megatron_mlp_with_an_ffn_size_the_world_size_does_not_divide(multidevice_test,
                                                                      sequence):
    """ffn 7 (and 6 tokens with sequence parallelism) over 2 or 4 ranks: one allreduce (or an
    allgather and a reduce-scatter), the shards uneven, the values the reference's."""
    rank = multidevice_test.rank
    tensors = [_randn(TOKENS, HIDDEN, seed=0), _randn(FFN, HIDDEN, seed=1, scale=0.3),
               _randn(FFN, seed=2, scale=0.1), _randn(HIDDEN, FFN, seed=3, scale=0.3),
               _randn(HIDDEN, seed=4, scale=0.1)]
    x, w1, b1, w2, b2 = tensors
    expected = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
    model = _Mlp(mesh_1d(multidevice_test), sequence).define()
    local = [shard_tensor(t, tv, rank) for t, tv in zip(tensors, model.fusion.inputs())]
    with record_communications() as comms:
        y, = model.execute(local)
    torch.testing.assert_close(y, shard_tensor(expected, model.y, rank), rtol=1e-5, atol=1e-5)
    kinds = sorted(c.kind for c in comms if len(c.ranks) > 1)
    if multidevice_test.size > 1:
        assert kinds == (["allgather", "reduce_scatter"] if sequence else ["allreduce"]), comms




@pytest.mark.mpi
@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_reduction_over_an_axis_with_empty_shards(multidevice_test, op):
    """6 columns over 4 ranks (2, 2, 2, 0): the rank holding none contributes the
    reduction's identity to the partial result."""
    rank = multidevice_test.rank
    g = _randn(3, 6, seed=7)
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 6])
        y = getattr(fd.ops, op)(x, dims=[1])
        fd.add_output(y)
    shard(x, 1, mesh_1d(multidevice_test))
    y_ref = getattr(torch, {"max": "amax", "min": "amin"}.get(op, op))(g, dim=1)
    out, = fd.execute([shard_tensor(g, x, rank)])
    torch.testing.assert_close(out, y_ref)


@pytest.mark.mpi
def test_reshape_merging_an_unevenly_sharded_axis(multidevice_test):
    """[6, 2] -> [12] with axis 0 block-sharded over the ranks: at 4 ranks the rows go 2, 2,
    2, 0 but the merged axis would go 3, 3, 3, 3, so the shard does not carry through the
    reshape; the rows are gathered instead (not refused, not wrong)."""
    rank = multidevice_test.rank
    g = _randn(6, 2, seed=8)
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 2])
        y = fd.ops.exp(fd.ops.reshape(x, [12]))
        fd.add_output(y)
    shard(x, 0, mesh_1d(multidevice_test))
    out, = fd.execute([shard_tensor(g, x, rank)])
    torch.testing.assert_close(out, shard_tensor(g.reshape(12).exp(), y, rank))
