"""A DeepSeek-V3-style mixture-of-experts block, as a fusion and in plain PyTorch.

The block (docs/experts.md): a router (``x @ gate^T``, softmax or sigmoid scores, top-k,
optionally biased and group-limited choice), ``experts`` small SwiGLU experts computing each
token's top-k slots, and one shared SwiGLU expert every token goes through; the output is the
weighted sum of the routed experts plus the shared one.

- :func:`define_moe_block` adds the block to a ``FusionDefinition`` (tokens ``[T, dim]`` or
  ``[batch, seq, dim]``); :func:`expert_parallel` schedules it: tokens and the experts split
  over one mesh axis (expert parallelism), the experts' ffn optionally over another (tensor
  parallelism of the experts: EP x TP), or the tokens also over another (data parallelism:
  EP x DP);
- :func:`moe_block_torch` is the reference, plain PyTorch on whole tensors (a loop over the
  experts, each computing the tokens that chose it);
- :func:`init_params` draws the weights.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from meshfuse.dtypes import DataType
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.ops.moe.routing import choose, scores_of, weights_of

PARAMS = ("gate", "w1", "w2", "w3", "shared_w1", "shared_w2", "shared_w3")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The block's sizes and routing."""

    dim: int = 16
    experts: int = 8
    ffn: int = 8
    top_k: int = 2
    shared_ffn: int = 16
    score: str = "sigmoid"
    normalize: bool = True
    scale: float = 1.0
    groups: int | None = None
    top_groups: int | None = None
    biased: bool = False  # a routing bias input (DeepSeek-V3's auxiliary-loss-free balancing)
    capacity_factor: float | None = None  # None: dropless

    def capacity(self, tokens: int) -> int | None:
        """Rows an expert computes at most: ``ceil(factor * tokens * top_k / experts)``."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        e, f, h, s = self.experts, self.ffn, self.dim, self.shared_ffn
        return {"gate": (e, h), "w1": (e, f, h), "w2": (e, h, f), "w3": (e, f, h),
                "shared_w1": (s, h), "shared_w2": (h, s), "shared_w3": (s, h)}

    def routing(self) -> dict:
        return {"top_k": self.top_k, "score": self.score, "normalize": self.normalize,
                "scale": self.scale, "groups": self.groups, "top_groups": self.top_groups}


def init_params(cfg: MoEConfig, dtype=torch.float64, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=gen, dtype=torch.float64) /
                   shape[-1] ** 0.5).to(dtype) for name, shape in cfg.shapes().items()}


def _swiglu(o, x, w1, w2, w3):
    """``(silu(x w1^T) * x w3^T) w2^T`` (the product back in ``x``'s dtype: half-precision
    pointwise ops compute in float32)."""
    return o.linear(o.cast(o.mul(o.silu(o.linear(x, w1)), o.linear(x, w3)), x.dtype), w2)


def define_moe_block(fd, cfg: MoEConfig, tokens: int | tuple[int, ...],
                     dtype: DataType = DataType.Double):
    """Adds the block's inputs (``x [tokens, dim]``, or ``[batch, seq, dim]`` for ``tokens =
    (batch, seq)``; the weights of :data:`PARAMS`, and ``bias [experts]`` when
    ``cfg.biased``) and ops to ``fd``; adds the output ``y`` and the token counts per
    expert. Returns ``(tensors by name, y, counts)``."""
    o = fd.ops
    token_shape = [tokens] if isinstance(tokens, int) else list(tokens)
    tv = {"x": fd.define_tensor([*token_shape, cfg.dim], dtype=dtype)}
    for name, shape in cfg.shapes().items():
        tv[name] = fd.define_tensor(list(shape), dtype=dtype)
    if cfg.biased:
        tv["bias"] = fd.define_tensor([cfg.experts], dtype=dtype)
    x = tv["x"]
    logits = o.linear(x, tv["gate"])
    if dtype in (DataType.BFloat16, DataType.Half):  # routing in float32, as torch users do
        logits = o.cast(logits, DataType.Float)
    weights, indices = o.moe_route(logits, tv.get("bias"), **cfg.routing())
    routed, counts, _ = o.moe_experts(x, indices, weights, tv["w1"], tv["w2"], tv["w3"],
                                      cfg.capacity(math.prod(token_shape)))
    y = o.add(routed, _swiglu(o, x, tv["shared_w1"], tv["shared_w2"], tv["shared_w3"]))
    fd.add_output(y)
    fd.add_output(counts)
    return tv, y, counts


def expert_parallel(tv: dict, y, counts, mesh, ep: ParallelType = ParallelType.mesh_x,
                    tp: ParallelType | None = None, dp: ParallelType | None = None) -> None:
    """Schedules the block's tensors: tokens (``x``, ``y``) and the routed experts (axis 0
    of ``w1``, ``w2``, ``w3``; and ``counts``) split in blocks over ``ep``; with ``tp``, the
    experts' ffn axis over ``tp`` too; with ``dp``, the tokens split over ``dp`` first
    (data parallel: each ``dp`` coordinate its own tokens, its own ``ep`` group of every
    expert). Tokens ``[batch, seq, dim]``: the sequence over ``ep``, the batch over ``dp``.
    The router and the shared expert are replicated."""
    for t in (*tv.values(), y, counts):
        t.set_device_mesh(mesh)
    for t in (tv["x"], y):
        if t.ndim == 3:
            _split(t, 1, mesh, ep)
            if dp is not None:
                _split(t, 0, mesh, dp)
        else:
            _split(t, 0, mesh, *(pt for pt in (dp, ep) if pt is not None))
    for t in (tv["w1"], tv["w2"], tv["w3"], counts):
        _split(t, 0, mesh, ep)
    if tp is not None:
        for name, axis in (("w1", 1), ("w2", 2), ("w3", 1)):
            _split(tv[name], axis, mesh, tp)


def _split(t, axis: int, mesh, *pts: ParallelType) -> None:
    """Splits ``t``'s axis ``axis`` in blocks over each of ``pts`` in turn (the next one
    splitting what the previous left)."""
    pos = t.loop.index(t.logical[axis])
    for pt in pts:
        t.split(pos, mesh.axis_size(pt), inner_split=False)
        t.parallelize(pos, pt)
        pos += 1


def route_torch(x, gate, cfg: MoEConfig, bias=None):
    """``(weights, indices, scores)`` of the router in plain PyTorch."""
    scores = scores_of(F.linear(x, gate), cfg.score)
    indices = choose(scores.detach(), bias, cfg.top_k, cfg.groups, cfg.top_groups)
    return weights_of(scores, indices, cfg.normalize, cfg.scale), indices, scores


def moe_block_torch(params: dict, x: torch.Tensor, cfg: MoEConfig, bias=None):
    """The block on whole tensors: ``(y, rows each expert computed)``; with a capacity, an
    expert computes its first rows by token order only. ``x [tokens, dim]`` or ``[batch,
    seq, dim]``."""
    if x.ndim > 2:
        y, computed = moe_block_torch(params, x.reshape(-1, x.shape[-1]), cfg, bias)
        return y.reshape(x.shape), computed
    weights, indices, _ = route_torch(x, params["gate"], cfg, bias)
    y = torch.zeros_like(x)
    capacity = cfg.capacity(x.shape[0])
    computed = torch.zeros(cfg.experts)
    for e in range(cfg.experts):
        token, slot = torch.nonzero(indices == e, as_tuple=True)  # in token order
        token, slot = token[:capacity], slot[:capacity]
        computed[e] = len(token)
        h = F.silu(x[token] @ params["w1"][e].t()) * (x[token] @ params["w3"][e].t())
        y = y.index_add(0, token, (h @ params["w2"][e].t()) * weights[token, slot, None])
    shared = F.silu(F.linear(x, params["shared_w1"])) * F.linear(x, params["shared_w3"])
    return y + F.linear(shared, params["shared_w2"]), computed
