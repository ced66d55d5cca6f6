"""The meshfuse programs the benchmarks run, next to the torch code each one stands for.

- ``SeedAttention`` (from :mod:`meshfuse.examples.seed_sdpa`): the seed's fusion, with its
  sizes as parameters: SDPA forward and backward, heads split over the mesh, BHSE or BSHE.
- :class:`Pointwise10`: a chain of ten pointwise ops on two ``[n, n]`` tensors, rows split
  over the mesh; :func:`pointwise10_torch` makes the same torch calls.
- :class:`MegatronMlp`: a tensor-parallel MLP, forward and backward written out (GELU's
  derivative as pointwise ops), with the two allreduces Megatron needs expressed as ``set``
  of a partial result; :func:`megatron_mlp_torch` makes the same calls plus
  ``torch.distributed.all_reduce``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import meshfuse
from meshfuse import DataType, FusionDefinition, ParallelType
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention  # noqa: F401 (re-exported)


def as_format(t: torch.Tensor, qkv_format: QkvFormat) -> torch.Tensor:
    """``t`` (``[b, h, s, e]``) laid out in ``qkv_format``, shape unchanged."""
    if qkv_format is QkvFormat.BSHE:
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous()


class _Sharded(FusionDefinition):
    """A fusion whose every tensor is scheduled by hand: on ``mesh``, with one logical axis
    (or none: replicated) outer-split by the mesh size and parallelized on ``mesh_x``."""

    def __init__(self, mesh: meshfuse.DeviceMesh | None):
        super().__init__()
        self._mesh = mesh
        self._plan: list[tuple[meshfuse.TensorView, int | None]] = []

    def _on(self, tv, axis: int | None):
        self._plan.append((tv, axis))
        return tv

    def multidevice_schedule(self) -> None:
        if self._mesh is None:
            return
        for tv, axis in self._plan:
            self.sched._set_device_mesh(tv, self._mesh)
            if axis is not None:
                self.sched.split(tv, axis, self._mesh.size, False)
                self.sched.parallelize(tv, axis, ParallelType.mesh_x)


class Pointwise10(_Sharded):
    """``log(sigmoid(exp(tanh(x*y + x) * 0.5) - y)**2 + 1)``: ten ops on ``[n, n]`` fp32."""

    def __init__(self, n: int, mesh: meshfuse.DeviceMesh | None):
        super().__init__(mesh)
        self._n = n

    def definition(self) -> None:
        o, n = self.ops, self._n
        x, y = (self._on(self.define_tensor([n, n], dtype=DataType.Float), 0) for _ in range(2))
        t = self._on(o.mul(x, y), 0)
        t = self._on(o.add(t, x), 0)
        t = self._on(o.tanh(t), 0)
        t = self._on(o.mul(t, 0.5), 0)
        t = self._on(o.exp(t), 0)
        t = self._on(o.sub(t, y), 0)
        t = self._on(o.sigmoid(t), 0)
        t = self._on(o.mul(t, t), 0)
        t = self._on(o.add(t, 1.0), 0)
        self.add_output(self._on(o.log(t), 0))


def pointwise10_torch(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The torch calls of :class:`Pointwise10`, one kernel each."""
    t = torch.mul(x, y)
    t = torch.add(t, x)
    t = torch.tanh(t)
    t = torch.mul(t, 0.5)
    t = torch.exp(t)
    t = torch.sub(t, y)
    t = torch.sigmoid(t)
    t = torch.mul(t, t)
    t = torch.add(t, 1.0)
    return torch.log(t)




class MegatronMlp(_Sharded):
    """``z = gelu(x @ w1.T) @ w2.T`` and its gradients, tensor parallel (Megatron).

    Inputs ``x [T, H]`` and ``dz [T, H]`` replicated, ``w1 [F, H]`` split on F (column
    parallel), ``w2 [H, F]`` split on F (row parallel). Outputs ``z, dx`` (replicated, each
    from a partial sum: an allreduce) and ``dw1, dw2`` (split on F). With ``mesh=None`` the
    same program runs unsharded on one device.
    """

    def __init__(self, tokens: int, hidden: int, ffn: int, mesh: meshfuse.DeviceMesh | None,
                 dtype: DataType = DataType.BFloat16, overlap: bool | None = None):
        super().__init__(mesh)
        self._sizes, self._dtype, self._overlap = (tokens, hidden, ffn), dtype, overlap

    def definition(self) -> None:
        o, on = self.ops, self._on
        t, hd, f = self._sizes
        dt = self._dtype
        x = on(self.define_tensor([t, hd], dtype=dt), None)
        w1 = on(self.define_tensor([f, hd], dtype=dt), 0)
        w2 = on(self.define_tensor([hd, f], dtype=dt), 1)
        dz = on(self.define_tensor([t, hd], dtype=dt), None)
        h = on(o.linear(x, w1), 1)  # [T, F/d, rH]
        a = on(o.gelu(h), 1)
        z_partial = on(o.linear(a, w2), 2)
        z = on(o.set(z_partial), None)  # partial over F, then replicated
        da = on(o.matmul(dz, w2), 1)
        dh = on(o.gelu_backward(da, h), 1)
        dw2 = on(o.matmul(on(o.permute(dz, [1, 0]), None), a), 1)  # [H, F/d, rT]
        dw1 = on(o.matmul(on(o.permute(dh, [1, 0]), 0), x), 0)  # [F/d, H, rT]
        dx_partial = on(o.matmul(dh, w1), 2)
        dx = on(o.set(dx_partial), None)  # partial over F, then replicated
        for partial in (z_partial, dx_partial):  # their allreduces as loops, or not
            partial.set_overlap(self._overlap)
        for out in (z, dx, dw1, dw2):
            self.add_output(out)


def megatron_mlp_torch(x, w1, w2, dz, group=None):
    """The calls of :class:`MegatronMlp` on local shards, with NCCL allreduces when sharded.

    ``group`` None: the unsharded program (no communication).
    """
    h = torch.nn.functional.linear(x, w1)
    a = torch.nn.functional.gelu(h)
    z = torch.nn.functional.linear(a, w2)
    if group is not None:
        dist.all_reduce(z, group=group)
    dh = torch.ops.aten.gelu_backward(dz @ w2, h)
    dw2 = dz.t() @ a
    dw1 = dh.t() @ x
    dx = dh @ w1
    if group is not None:
        dist.all_reduce(dx, group=group)
    return z, dx, dw1, dw2
