"""Training a 2-block GPT stack through derived backwards, against the same stack in PyTorch.

Each block is a :class:`~meshfuse.examples.gpt.GptBlock` (layer norm, causal attention through
``sdpfa_fwd``, tanh-GELU MLP, residuals) made a :class:`~meshfuse.FusionModule`, tensor and
sequence parallel over all ranks; the last block's output is replicated, so every rank
computes the same mean-squared-error loss. The reference is the same stack in plain PyTorch
on one device (every rank runs it), from the same initialization, in the same dtype, trained
with the same AdamW. The per-step losses must agree: within 1e-5 relative in float32 (the
CPU test, ``tests/test_autodiff_training.py``), within bf16's tolerance in bf16 (on GPUs)::

    torchrun --nproc-per-node 2 -m meshfuse.examples.train_gpt --dtype bfloat16 --out DIR

prints each step's losses and writes them (``train_gpt.json``) under ``DIR``; the exit
status is 1 when a step's losses differ by more than ``--rtol``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from meshfuse.autodiff.module import FusionModule
from meshfuse.dtypes import DataType
from meshfuse.examples.gpt import GptBlock, init_parameters, torch_block
from meshfuse.mesh import DeviceMesh
from meshfuse.runtime.communicator import Communicator
from meshfuse.sharding import shard_tensor

# The default relative tolerance on a step's loss, per dtype.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def train(steps: int = 20, batch: int = 2, seq: int = 16, embed: int = 32, heads: int = 4,
          dtype: torch.dtype = torch.float32, lr: float = 1e-3) -> list[tuple[float, float]]:
    """Trains both stacks ``steps`` steps on this rank; returns each step's (meshfuse loss,
    PyTorch loss), computed before that step's update."""
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
    reference = [torch.nn.ParameterDict(
        {n: torch.nn.Parameter(t.clone().to(device)) for n, t in init.items()})
        for init in inits]
    opt = torch.optim.AdamW(stack.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW([p for d in reference for p in d.values()], lr=lr)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x, target = (torch.randn(batch, seq, embed, generator=gen).to(device, dtype)
                     for _ in range(2))
        y = stack[1](stack[0](shard_tensor(x, blocks[0].x, communicator.rank)))
        loss = (y - target).float().pow(2).mean()
        ref_y = torch_block(torch_block(x, dict(reference[0]), heads), dict(reference[1]), heads)
        ref_loss = (ref_y - target).float().pow(2).mean()
        losses.append((loss.item(), ref_loss.item()))
        for o, value in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            value.backward()
            o.step()
    return losses


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
                        help="largest relative difference of a step's losses (default: "
                             "1e-5 in float32, 3e-2 in bfloat16)")
    parser.add_argument("--out", default=None, help="directory for train_gpt.json")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rtol = RTOL[dtype] if args.rtol is None else args.rtol
    losses = train(args.steps, args.batch, args.seq, args.embed, args.heads, dtype)
    worst = max(abs(a - b) / abs(b) for a, b in losses)
    communicator = Communicator.instance()
    if communicator.rank == 0:
        for step, (a, b) in enumerate(losses):
            print(f"step {step:3d}: meshfuse {a:.6f}  pytorch {b:.6f}  rel {abs(a - b) / abs(b):.1e}")
        verdict = "ok" if worst <= rtol else "FAILED"
        print(f"{communicator.size} ranks, {args.dtype}, device {communicator.device}: largest "
              f"relative difference {worst:.2e} (tolerance {rtol:g}): {verdict}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "train_gpt.json"), "w") as f:
                json.dump({"args": vars(args), "world": communicator.size,
                           "device": str(communicator.device), "losses": losses,
                           "largest_relative_difference": worst, "rtol": rtol}, f, indent=1)
    return 0 if worst <= rtol else 1


if __name__ == "__main__":
    sys.exit(main())
