"""A stack of residual MLP blocks with a mean-squared-error loss, as one fusion: the small
model of the fully sharded data parallel tests and docs (docs/fsdp.md).

Each block (pre-norm)::

    h = h + fc2(gelu(fc1(layer_norm(h))))

and the loss is ``mean((h - target) ** 2)``. With a ``tp`` dimension the MLPs are tensor
parallel (Megatron: fc1 column parallel, fc2 row parallel) on the same mesh.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshfuse.dtypes import DataType
from meshfuse.frontend.fusion_definition import FusionDefinition

EPS = 1e-5


def block_shapes(embed: int, ffn: int) -> dict[str, tuple[int, ...]]:
    """One block's parameters, in input order."""
    return {"ln_w": (embed,), "ln_b": (embed,), "w1": (ffn, embed), "b1": (ffn,),
            "w2": (embed, ffn), "b2": (embed,)}


# The axis each parameter is split on under tensor parallelism (the others: replicated).
TP_AXIS = {"w1": 0, "b1": 0, "w2": 1}


class MlpStack(FusionDefinition):
    """Inputs ``x [batch, embed]``, ``target [batch, embed]``, then each block's parameters
    (``params[layer][name]``); output the loss.

    Args:
        batch, embed, ffn, layers: the sizes.
        mesh: a NamedMesh when the MLPs are tensor parallel over its dimension ``tp``.
        tp: that dimension's name (None: no tensor parallelism).
    """

    def __init__(self, batch: int, embed: int, ffn: int, layers: int, mesh=None,
                 tp: str | None = None, dtype: DataType = DataType.Float) -> None:
        super().__init__()
        self.sizes = (batch, embed, ffn, layers)
        self.mesh, self.tp, self.dtype = mesh, tp, dtype
        self.params: list[dict] = []

    def definition(self) -> None:
        b, e, f, n = self.sizes
        self.x = self.define_tensor([b, e], dtype=self.dtype)
        self.target = self.define_tensor([b, e], dtype=self.dtype)
        for _ in range(n):
            self.params.append({name: self.define_tensor(list(shape), dtype=self.dtype)
                                for name, shape in block_shapes(e, f).items()})
        o, h = self.ops, self.x
        for p in self.params:
            var, mean = o.var_mean(h, dims=[-1], correction=0, keepdim=True)
            ln = o.add(o.mul(o.mul(o.sub(h, mean), o.rsqrt(o.add(var, EPS))), p["ln_w"]),
                       p["ln_b"])
            g = o.gelu(o.linear(ln, p["w1"], p["b1"]))
            h = o.add(h, o.linear(g, p["w2"], p["b2"]))
        diff = o.sub(h, self.target)
        self.add_output(o.mul(o.sum(o.mul(diff, diff), dims=[0, 1]), 1.0 / (b * e)))

    def multidevice_schedule(self) -> None:
        if self.tp is None:
            return
        kind, size = self.mesh.parallel_type(self.tp), self.mesh.size(self.tp)
        for p in self.params:
            for name, tv in p.items():
                tv.set_device_mesh(self.mesh.mesh)
                if name in TP_AXIS:
                    tv.outer_split(TP_AXIS[name], size)
                    tv.axis(TP_AXIS[name]).parallelize(kind)

    def parameter_inputs(self) -> dict[str, object]:
        """``{"3_w1": TensorView, ...}``: every parameter input by ``layer_name``."""
        return {f"{k}_{n}": tv for k, p in enumerate(self.define().params) for n, tv in p.items()}


def init_parameters(embed: int, ffn: int, layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Global initial values by ``layer_name`` (norms near (1, 0), weights 1/sqrt(fan_in))."""
    gen = torch.Generator().manual_seed(seed)
    result = {}
    for k in range(layers):
        for name, shape in block_shapes(embed, ffn).items():
            x = torch.randn(shape, generator=gen)
            if name == "ln_w":
                x = 1 + 0.1 * x
            elif name.startswith("w"):
                x = x / shape[1] ** 0.5
            else:
                x = 0.1 * x
            result[f"{k}_{name}"] = x
    return result


def torch_loss(x: torch.Tensor, target: torch.Tensor, params: dict[str, torch.Tensor],
               layers: int) -> torch.Tensor:
    """The same model in plain PyTorch (the reference)."""
    h = x
    for k in range(layers):
        p = {n: params[f"{k}_{n}"] for n in block_shapes(1, 1)}
        ln = F.layer_norm(h, h.shape[-1:], p["ln_w"], p["ln_b"], EPS)
        h = h + F.linear(F.gelu(F.linear(ln, p["w1"], p["b1"])), p["w2"], p["b2"])
    return ((h - target) ** 2).mean()
