"""The global norm of sharded gradients, and clipping them to a largest norm, as
``torch.nn.utils.clip_grad_norm_`` does on one device.

Each rank holds a shard of each gradient; a shard is held alike by every rank along a mesh
dimension the parameter is replicated over (HSDP's replicate dimension, a tensor-parallel
dimension for a layer norm's weight). The squared norm is the sum, over the world, of each
rank's local sums of squares divided by the number of ranks holding the same shard: each
element counted once. One allreduce over the world per call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.placement import Replicate, placements
from meshfuse.ir.tensor_view import TensorView
from meshfuse.runtime.comm import collectives
from meshfuse.runtime.comm.communicator import Communicator


def copies(tv: TensorView) -> int:
    """How many ranks hold each shard of ``tv`` (the product of the mesh dimensions it is
    replicated over)."""
    if tv.mesh is None:
        return 1
    return math.prod(n for n, p in zip(tv.mesh.shape, placements(tv))
                     if isinstance(p, Replicate))


def grad_norm(grads: Sequence[torch.Tensor | None], copies: Sequence[int]) -> torch.Tensor:
    """The 2-norm of the whole gradients whose local shards are ``grads``, each shard held
    by ``copies`` ranks (see the module doc); the same value on every rank."""
    device = next((g.device for g in grads if g is not None), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g, n in zip(grads, copies):
        if g is not None and g.numel():
            total += g.detach().double().pow(2).sum() / n
    communicator = Communicator.instance()
    if communicator.size > 1:
        world = collectives.group_along(communicator, DeviceMesh(range(communicator.size)), 0)
        total = collectives.allreduce(total, world, "sum")
    return total.sqrt()


def clip_grad_norm_(parameters: Sequence[torch.Tensor], max_norm: float,
                    copies: Sequence[int]) -> torch.Tensor:
    """Scales the gradients of ``parameters`` (local shards, each held by ``copies``
    ranks) so that their global norm is at most ``max_norm``; returns the norm before."""
    grads = [p.grad for p in parameters]
    norm = grad_norm(grads, copies)
    scale_to(grads, norm, max_norm)
    return norm.float()


def scale_to(grads: Sequence[torch.Tensor | None], norm: torch.Tensor,
             max_norm: float) -> None:
    """Scales ``grads`` (local tensors) in place by ``max_norm / norm`` where the global
    ``norm`` exceeds ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does."""
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        if g is not None:
            g.mul_(scale.to(g.dtype))
