"""Training a 2-block GPT stack through derived backwards, against the same stack in PyTorch.

Each block is a :class:`~meshfuse.examples.gpt.GptBlock` (layer norm, causal attention through
``sdpfa_fwd``, tanh-GELU MLP, residuals) made a :class:`~meshfuse.FusionModule`, tensor and
sequence parallel over all ranks; the last block's output is replicated, so every rank
computes the same mean-squared-error loss. The reference is the same stack in plain PyTorch
on one device (every rank runs it), from the same initialization, in the same dtype, trained
with the same AdamW on the same batches. Every step's loss (computed before its update) is
compared::

    torchrun --nproc-per-node 2 -m meshfuse.examples.train_gpt --dtype bfloat16 --out DIR

prints each step's losses and writes them (``train_gpt.json``) under ``DIR``; the exit
status is 1 when the check below fails.

The check, per dtype:

- **float32** (the CPU test, ``tests/test_autodiff_training.py``): every step's loss within
  1e-5 relative of PyTorch's. Sharding changes only the order of float32 sums.
- **bfloat16**: bf16 keeps 8 significant bits, and a tensor-parallel layer rounds at other
  points than the single-device one (partial products rounded to bf16, then reduce-scattered
  in bf16), so two correct bf16 trainings part by rounding alone, and more as the steps go
  (AdamW's update turns small gradient differences into whole steps). The yardstick is the
  reference implementation of the same parallelism: the stack is also trained with DTensor
  (``parallelize_module``, Colwise/Rowwise + SequenceParallel: :mod:`gpt_torch`) on the same
  ranks, and ``eps`` is the largest relative difference of its losses from PyTorch's over the
  steps. meshfuse passes when every step's loss is within ``2 * eps`` of PyTorch's (as close
  to the single-device model as DTensor is, within a factor 2), or within ``2**-8`` (bf16's
  relative precision) where ``eps`` is smaller. A wrong gradient moves the losses apart by
  far more within 20 steps.

``--rtol`` replaces the bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from meshfuse.autodiff.module import FusionModule
from meshfuse.checkpoint.training import add_arguments, resume, save_at
from meshfuse.dtypes import DataType
from meshfuse.examples.gpt import GptBlock, init_parameters, torch_block
from meshfuse.examples.gpt_torch import Gpt3Block, parallelize
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.sharding import shard_tensor

FLOAT32_RTOL = 1e-5
BF16_PRECISION = 2.0 ** -8


@dataclasses.dataclass(frozen=True)
class StepLosses:
    """One step's losses before its update: meshfuse's, PyTorch's on one device, and
    DTensor's (TP + SP on the same ranks; None in float32)."""

    meshfuse: float
    pytorch: float
    dtensor: float | None = None


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


class _TorchStack:
    """The reference: the two blocks in plain PyTorch on one device, with AdamW."""

    def __init__(self, inits, heads: int, dtype: torch.dtype, device, lr: float):
        self.heads, self.dtype = heads, dtype
        self.params = [torch.nn.ParameterDict(
            {n: torch.nn.Parameter(t.clone().to(device, dtype)) for n, t in init.items()})
            for init in inits]
        self.opt = torch.optim.AdamW([p for d in self.params for p in d.values()], lr=lr)

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = x.to(self.dtype)
        for p in self.params:
            y = torch_block(y, dict(p), self.heads)
        return (y - target.to(self.dtype)).float().pow(2).mean()


class _DTensorStack:
    """The twin: the two blocks as torch modules parallelized by DTensor (TP + SP) over all
    ranks, with AdamW; the last block's output gathered for the loss."""

    def __init__(self, inits, heads: int, device, lr: float):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.mesh = init_device_mesh(device.type, (self.world,))
        self.blocks = [parallelize(Gpt3Block({n: t.to(device) for n, t in init.items()}, heads),
                                   self.mesh) for init in inits]
        self.opt = torch.optim.AdamW([p for b in self.blocks for p in b.parameters()], lr=lr)

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = DTensor.from_local(x.chunk(self.world, 1)[self.rank], self.mesh, [Shard(1)],
                               shape=x.shape, stride=x.stride())
        for block in self.blocks:
            y = block(y)
        return (y.full_tensor() - target).float().pow(2).mean()


def _step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def train(steps: int = 20, batch: int = 2, seq: int = 16, embed: int = 32, heads: int = 4,
          dtype: torch.dtype = torch.float32, lr: float = 1e-3, save: str | None = None,
          resume_from: str | None = None) -> list[StepLosses]:
    """Trains the meshfuse stack and the PyTorch references ``steps`` steps on this rank;
    returns each step's losses."""
    communicator = Communicator.instance()
    device = communicator.device
    mesh = DeviceMesh(range(communicator.size))
    inits = [init_parameters(embed, seed=layer, dtype=dtype) for layer in range(2)]
    blocks = [GptBlock(batch, seq, embed, heads, DataType.from_torch(dtype), mesh,
                       sequence_parallel=True, output_replicated=layer == 1)
              for layer in range(2)]
    stack = torch.nn.ModuleList(
        FusionModule(block, {n: (block.define().params[n], init[n]) for n in init})
        for block, init in zip(blocks, inits)).to(device)
    opt = torch.optim.AdamW(stack.parameters(), lr=lr)
    references = [_TorchStack(inits, heads, dtype, device, lr)]
    if dtype != torch.float32:
        references.append(_DTensorStack(inits, heads, device, lr))
    losses, start = [], resume(resume_from, stack, opt)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x, target = (torch.randn(batch, seq, embed, generator=gen).to(device, dtype)
                     for _ in range(2))
        theirs = [_step(r.opt, r.loss(x, target)) for r in references]
        if step < start:  # resumed: the references replay the steps the checkpoint holds
            continue
        y = stack[1](stack[0](shard_tensor(x, blocks[0].x, communicator.rank)))
        mine = _step(opt, (y - target).float().pow(2).mean())
        losses.append(StepLosses(mine, *theirs))
    save_at(save, stack, opt, steps)
    return losses


def verdict(losses: list[StepLosses], rtol: float | None = None) -> dict:
    """The check of the module doc: ``ok``, the bound, and the differences it read."""
    direct = max(_relative(s.meshfuse, s.pytorch) for s in losses)
    if losses[0].dtensor is None:
        bound = FLOAT32_RTOL if rtol is None else rtol
        return {"ok": direct <= bound, "bound": bound, "direct": direct}
    eps = max(_relative(s.dtensor, s.pytorch) for s in losses)
    bound = max(2 * eps, BF16_PRECISION) if rtol is None else rtol
    return {"ok": direct <= bound, "bound": bound, "direct": direct, "dtensor": eps}


def _report(losses: list[StepLosses], check: dict, dtype: str) -> str:
    lines = []
    for step, s in enumerate(losses):
        line = (f"step {step:3d}: meshfuse {s.meshfuse:.6f}  pytorch {s.pytorch:.6f}  "
                f"rel {_relative(s.meshfuse, s.pytorch):.1e}")
        if s.dtensor is not None:
            line += f"  dtensor {s.dtensor:.6f}  rel {_relative(s.dtensor, s.pytorch):.1e}"
        lines.append(line)
    communicator = Communicator.instance()
    head = (f"{communicator.size} ranks, {dtype}, device {communicator.device}: largest relative "
            f"difference from PyTorch {check['direct']:.2e}")
    if "dtensor" in check:
        head += f" (DTensor's {check['dtensor']:.2e}; bound {check['bound']:.2e})"
    else:
        head += f" (tolerance {check['bound']:g})"
    return "\n".join([*lines, head + (": ok" if check["ok"] else ": FAILED")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshfuse.examples.train_gpt",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16, help="divisible by the rank count")
    parser.add_argument("--embed", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rtol", type=float, default=None,
                        help="largest relative difference from PyTorch's loss (default: 1e-5 "
                             "in float32; in bfloat16 twice DTensor's, at least 2**-8)")
    parser.add_argument("--out", default=None, help="directory for train_gpt.json")
    add_arguments(parser, "--save", "--resume")
    args = parser.parse_args(argv)
    losses = train(args.steps, args.batch, args.seq, args.embed, args.heads,
                   getattr(torch, args.dtype), save=args.save, resume_from=args.resume)
    check = verdict(losses, args.rtol)
    communicator = Communicator.instance()
    if communicator.rank == 0:
        print(_report(losses, check, args.dtype))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "train_gpt.json"), "w") as f:
                json.dump({"args": vars(args), "world": communicator.size,
                           "device": str(communicator.device),
                           "losses": [dataclasses.asdict(s) for s in losses], **check},
                          f, indent=1)
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
