"""The seed program: head-parallel attention forward and backward, in BHSE or BSHE layout.

``SeedAttention`` is the seed test's ``Model`` (``tests/test_seed_sdpa.py``) with its sizes as
arguments: q, k, v and out_grad of global shape ``[b, h, s, e // h]``, heads split over a 1-D
mesh of ``d`` devices (outer split of axis 1 by ``d``, parallelized on ``mesh_x``), every
tensor scheduled by hand, BSHE tensors reordered so the allocation is ``[B, DIDx, S, H/d, E]``.
``dropout_p > 0`` replaces the seed's ``TODO(#3123)``: each head shard draws its own dropout
stream (``dropout_mode="shard"``), or the mask is the unsharded run's (``"global"``).
"""

from __future__ import annotations

import enum

import torch

from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType
from meshfuse.sharding import shard_tensor


class QkvFormat(enum.Enum):
    BHSE = "BHSE"
    BSHE = "BSHE"


STRIDE_ORDER = {QkvFormat.BHSE: [3, 2, 1, 0], QkvFormat.BSHE: [3, 1, 2, 0]}


class SeedAttention(FusionDefinition):
    """Attention forward+backward with heads sharded over ``mesh`` (see the module doc)."""

    def __init__(self, qkv_format: QkvFormat, mesh: DeviceMesh, b: int, h: int, s: int, e: int,
                 is_causal: bool = True, dtype: DataType = DataType.BFloat16,
                 dropout_p: float = 0.0, dropout_mode: str | None = None):
        super().__init__()
        self.qkv_format, self.mesh = qkv_format, mesh
        self.shape, self.is_causal, self.dtype = [b, h, s, e // h], is_causal, dtype
        self.dropout_p, self.dropout_mode = dropout_p, dropout_mode

    def definition(self) -> None:
        self.q, self.k, self.v, self.out_grad = [
            self.define_tensor(shape=self.shape, dtype=self.dtype,
                               stride_order=STRIDE_ORDER[self.qkv_format])
            for _ in range(4)
        ]
        dropout_p = self.define_scalar(self.dropout_p, dtype=DataType.Double)
        is_causal = self.define_scalar(self.is_causal, dtype=DataType.Bool)
        self.attn, self.log_sumexp, seed, offset = self.ops.sdpfa_fwd(
            self.q, self.k, self.v, dropout_p, is_causal, scale=None,
            dropout_mode=self.dropout_mode,
        )
        self.q_grad, self.k_grad, self.v_grad = self.ops.sdpfa_bwd(
            self.out_grad, self.q, self.k, self.v, self.attn, self.log_sumexp, dropout_p,
            is_causal, seed, offset, scale=None,
        )
        for t in (self.attn, self.q_grad, self.k_grad, self.v_grad):
            self.add_output(t)

    def multidevice_schedule(self) -> None:
        d = self.mesh.size
        for t in (self.q, self.k, self.v, self.attn, self.log_sumexp, self.out_grad,
                  self.q_grad, self.k_grad, self.v_grad):
            self.sched._set_device_mesh(t, self.mesh)
            self.sched.split(t, 1, d, False)
            self.sched.parallelize(t, 1, ParallelType.mesh_x)
            if self.qkv_format is QkvFormat.BSHE:
                self.sched.reorder(t, {2: 3, 3: 2})
            self.sched.set_allocation_as_loop(t)

    def inputs_for(self, q, k, v, out_grad, rank: int) -> list[torch.Tensor]:
        """``rank``'s local shards of global q, k, v, out_grad, laid out as scheduled."""

        self.define()
        return [shard_tensor(t, tv, rank) for t, tv in
                zip((q, k, v, out_grad), (self.q, self.k, self.v, self.out_grad))]


def reference(q, k, v, out_grad, is_causal: bool = True) -> list[torch.Tensor]:
    """attn, q_grad, k_grad, v_grad of PyTorch's SDPA with autograd (unsharded)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    attn.backward(out_grad)
    return [attn.detach(), q.grad, k.grad, v.grad]


def random_inputs(b: int, h: int, s: int, e: int, dtype=torch.bfloat16, device="cpu",
                  seed: int = 0) -> list[torch.Tensor]:
    """Global q, k, v, out_grad of shape ``[b, h, s, e // h]`` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, e // h, generator=gen).to(dtype=dtype, device=device)
            for _ in range(4)]
