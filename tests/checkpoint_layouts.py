"""The checkpoint tests' model: a stack of MLP blocks (meshfuse.examples.mlp_stack) under
one of several layouts, with its AdamW step; and :func:`main`, a training script of it with
``--save``/``--resume`` that tests/checkpoint_jobs.py runs at several world sizes.

Layouts: ``one`` (every rank holds everything), ``tp`` (tensor parallel blocks over every
rank), ``cyclic`` (the same axes split cyclically), ``fsdp`` (fully sharded over every rank:
uneven shards at 3 and 4 ranks) and ``dp2tp2`` (FSDP x TP on 4 ranks).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from meshfuse import DeviceMesh
from meshfuse.autodiff.fsdp_module import FullyShardedModule
from meshfuse.autodiff.module import FusionModule
from meshfuse.checkpoint.training import add_arguments, resume, save_at
from meshfuse.dtypes import DataType
from meshfuse.examples.mlp_stack import EPS, TP_AXIS, MlpStack, block_shapes, init_parameters
from meshfuse.parallel.fsdp import NamedMesh
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.sharding import shard_tensor

B, E, FFN, LAYERS = 6, 5, 10, 2  # 5 and 10: uneven shards over 3 and 4 ranks
LR = 1e-2
LAYOUTS = ("one", "tp", "cyclic", "fsdp", "dp2tp2")


class Cyclic(MlpStack):
    """The stack with its tensor-parallel axes split cyclically (inner splits)."""

    def multidevice_schedule(self) -> None:
        kind, size = self.mesh.parallel_type(self.tp), self.mesh.size(self.tp)
        for p in self.params:
            for name, tv in p.items():
                tv.set_device_mesh(self.mesh.mesh)
                if name in TP_AXIS:
                    tv.inner_split(TP_AXIS[name], size)
                    tv.axis(TP_AXIS[name] + 1).parallelize(kind)


def _mesh(kind: str, world: int) -> NamedMesh | None:
    ranks = DeviceMesh(range(world))
    if kind in ("tp", "cyclic"):
        return NamedMesh(ranks, ("tp",))
    if kind == "fsdp":
        return NamedMesh(ranks, ("dp",))
    return NamedMesh.parse("dp=2,tp=2", world) if kind == "dp2tp2" else None


def build(kind: str, world: int, layers: int = LAYERS, dtype=torch.float32, embed: int = E):
    """A model of layout ``kind`` on ``world`` ranks, its AdamW and ``step(i) -> loss``."""
    mesh = _mesh(kind, world)
    tp = "tp" if kind in ("tp", "cyclic", "dp2tp2") else None
    fd = (Cyclic if kind == "cyclic" else MlpStack)(
        B, embed, FFN, layers, mesh, tp, DataType.from_torch(dtype)).define()
    tvs = fd.parameter_inputs()
    init = {n: v.to(dtype) for n, v in init_parameters(embed, FFN, layers).items()}
    if kind in ("fsdp", "dp2tp2"):
        names = [[f"{k}_{n}" for n in block_shapes(embed, FFN)] for k in range(layers)]
        model = FullyShardedModule(fd, {n: (tvs[n], init[n]) for n in tvs}, names,
                                   [fd.x, fd.target], mesh)
        shard = model.shard_input
    else:
        model = FusionModule(fd, {n: (tvs[n], init[n]) for n in tvs})

        def shard(tv, value):
            return shard_tensor(value, tv)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(i: int) -> float:
        x, target = batch(i, dtype, embed)
        opt.zero_grad()
        loss = model(shard(fd.x, x), shard(fd.target, target))
        loss.backward()
        opt.step()
        return loss.item()
    return model, opt, step


# The stack as torchtitan writes a model: a module per block, named as PyTorch names them.
TORCH_NAMES = {"ln_w": "norm.weight", "ln_b": "norm.bias", "w1": "fc1.weight",
               "b1": "fc1.bias", "w2": "fc2.weight", "b2": "fc2.bias"}


class TorchBlock(torch.nn.Module):
    def __init__(self, embed: int, ffn: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(embed, eps=EPS)
        self.fc1 = torch.nn.Linear(embed, ffn)
        self.fc2 = torch.nn.Linear(ffn, embed)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class TorchStack(torch.nn.Module):
    """:class:`MlpStack` in plain PyTorch (``layers.K.fc1.weight``...), the module that
    ``fully_shard`` and ``parallelize_module`` lay out."""

    def __init__(self, layers: int = LAYERS, embed: int = E, ffn: int = FFN) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(TorchBlock(embed, ffn) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = layer(h)
        return ((h - target) ** 2).mean()


def torch_name(name: str) -> str:
    """The :class:`TorchStack` name of an :class:`MlpStack` parameter (``1_w1``)."""
    layer, kind = name.split("_", 1)
    return f"layers.{layer}.{TORCH_NAMES[kind]}"


class TorchNamed(torch.nn.Module):
    """A meshfuse model whose checkpoints name its parameters as :class:`TorchStack` does
    (through ``checkpoint_names``)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)

    def checkpoint_names(self) -> dict[str, str]:
        return {f"inner.{n}": torch_name(n) for n in self.inner.state_dict()}


def batch(i: int, dtype=torch.float32, embed: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i``'s global input and target."""
    gen = torch.Generator().manual_seed(100 + i)
    return tuple(torch.randn(B, embed, generator=gen).to(dtype) for _ in range(2))


def main(argv: list[str]) -> int:
    """``--layout KIND --steps N [--save DIR] [--resume DIR] [--out FILE]``: trains steps
    from the checkpoint's (or 0) up to N on the launcher's ranks; rank 0 writes the losses
    as JSON to ``--out``."""
    p = argparse.ArgumentParser(prog="checkpoint_layouts")
    p.add_argument("--layout", choices=LAYOUTS, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", default=None)
    add_arguments(p)
    args = p.parse_args(argv)
    comm = Communicator.instance()
    model, opt, step = build(args.layout, comm.size)
    first = resume(args.resume, model, opt)
    losses = [step(i) for i in range(first, args.steps)]
    save_at(args.save, model, opt, args.steps)
    if comm.rank == 0 and args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"first": first, "losses": losses}, f)
    return 0
