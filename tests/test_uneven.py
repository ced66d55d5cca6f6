"""Uneven shards: extents the mesh does not divide, sharded as DTensor's ``Shard`` (blocks of
``ceil(n / d)``, shorter or empty at the end), through whole programs, against the unsharded
reference: the seed attention with heads the world size does not divide (6 heads at 4 ranks
here; 12 heads at 5 ranks in ``test_seed_attention_12_heads_at_5_ranks``, its own 5 CPU
processes), Megatron MLPs whose ffn size (and token count) the world size does not divide.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from mesh_helpers import mesh_1d, shard

from meshfuse import DataType, FusionDefinition, shard_tensor
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention, random_inputs, reference
from meshfuse.launch import spawn
from meshfuse.runtime.collectives import record_communications
from meshfuse.testing.utils import current_device

TOKENS, HIDDEN, FFN = 6, 8, 7


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(current_device())


@pytest.mark.mpi
@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
def test_seed_attention_with_heads_the_world_size_does_not_divide(multidevice_test, qkv_format):
    """6 heads: at 4 ranks the shards hold 2, 2, 2 and 0 heads."""
    d, rank = multidevice_test.size, multidevice_test.rank
    b, h, s, e = 1, 6, 16, 6 * 4
    model = SeedAttention(qkv_format, mesh_1d(multidevice_test), b, h, s, e,
                          dtype=DataType.Float)
    q, k, v, out_grad = random_inputs(b, h, s, e, dtype=torch.float32, device=current_device())
    outputs = model.execute(model.inputs_for(q, k, v, out_grad, rank))
    heads = -(-h // d)
    assert outputs[0].shape[1] == max(0, min(heads, h - heads * rank))
    for out, ref, tv in zip(outputs, reference(q, k, v, out_grad),
                            (model.attn, model.q_grad, model.k_grad, model.v_grad)):
        torch.testing.assert_close(out, shard_tensor(ref, tv, rank), rtol=1e-4, atol=1e-4)


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
