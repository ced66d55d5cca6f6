"""Training a GPT stack fully sharded over ``dp`` (and tensor parallel over ``tp``, context
parallel over ``cp``), against the same stack in PyTorch on one device.

The model is :class:`~meshfuse.examples.gpt_stack.GptStack` (GPT blocks and a
mean-squared-error loss, one fusion), its parameters sharded over the mesh's ``dp``
dimension (:class:`~meshfuse.autodiff.fsdp_module.FullyShardedModule`), trained with AdamW
and gradient clipping on synthetic batches; every rank also trains the PyTorch reference, and
each step's losses are compared::

    python -m meshfuse.examples.train_fsdp --mesh dp=2,tp=2 --steps 20 --out DIR

starts the mesh's ranks itself (gloo on CPUs; under torchrun, the launcher's ranks must be
the mesh's), shows a progress bar with the loss and tokens/s, prints each rank's memory
account, and writes ``train_fsdp.json`` and the loss curves ``train_fsdp.png`` under
``DIR``. Exit status: 0 when every float32 loss is within ``--rtol`` (1e-5) relative of
PyTorch's, 1 otherwise, 2 with one line on stderr for bad options (a mesh whose sizes do not
multiply to the ranks, a mesh without ``dp``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import torch

from meshfuse.autodiff.fsdp_module import FullyShardedModule
from meshfuse.checkpoint.training import add_arguments, resume, save_at
from meshfuse.errors import ScheduleError
from meshfuse.examples.gpt import parameter_shapes
from meshfuse.examples.gpt_stack import GptStack, stack_parameters, torch_loss
from meshfuse.launch import launcher_world_size, spawn
from meshfuse.parallel.fsdp import NamedMesh
from meshfuse.runtime.comm.communicator import Communicator

PROG = "python -m meshfuse.examples.train_fsdp"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: Sequence[str] | None, world: int | None) -> argparse.Namespace:
    """The options, checked (``world``: the launcher's ranks, None without one)."""
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default=None,
                   help="named mesh dimensions, outermost first: dp=2,tp=2 (default: dp=4, or "
                        "dp over the launcher's ranks); dp is required, cp (context parallel "
                        "attention) and tp optional")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--embed", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping")
    p.add_argument("--dtype", choices=("float32",), default="float32")
    p.add_argument("--keep-gathered", action="store_true",
                   help="reshard_after_forward=False: keep gathered parameters for the backward")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--out", default=None, help="directory for train_fsdp.json and .png")
    add_arguments(p, "--save", "--resume")
    args = p.parse_args(argv)
    text = args.mesh or f"dp={world or 4}"
    try:
        sizes = NamedMesh.parse(text, _product(text))
    except ScheduleError as e:
        p.error(str(e))
    if "dp" not in sizes.names or set(sizes.names) - {"dp", "cp", "tp"}:
        p.error(f"--mesh {text}: name the dimensions dp (and cp, tp), e.g. dp=2,tp=2")
    ranks = sizes.mesh.size
    if world is not None and ranks != world:
        p.error(f"--mesh {text} has {ranks} devices but the launcher started {world} ranks; "
                f"make the sizes multiply to {world}")
    if args.embed % args.heads:
        p.error(f"--embed {args.embed} is not a multiple of --heads {args.heads}")
    args.mesh, args.ranks = text, ranks
    return args


def _product(text: str) -> int:
    """The product of the sizes in a mesh text (its own check reports a malformed one)."""
    total = 1
    for part in text.split(","):
        size = part.partition("=")[2]
        total *= int(size) if size.isdigit() and int(size) > 0 else 1
    return total


def train(args) -> dict:
    """This rank's training (see the module doc); returns the record written as json."""
    comm = Communicator.instance()
    mesh = NamedMesh.parse(args.mesh, comm.size)
    tp = "tp" if "tp" in mesh.names else None
    cp = "cp" if "cp" in mesh.names else None
    b, s, e, h, n = args.batch, args.seq, args.embed, args.heads, args.layers
    fd = GptStack(b, s, e, h, n, mesh, tp, cp=cp)
    tvs, init = fd.parameter_inputs(), stack_parameters(e, n)
    layers = [[f"{k}_{name}" for name in parameter_shapes(e)] for k in range(n)]
    model = FullyShardedModule(fd, {name: (tvs[name], init[name]) for name in tvs}, layers,
                               [fd.input, fd.target], mesh,
                               reshard_after_forward=not args.keep_gathered)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref = {name: torch.nn.Parameter(t.clone()) for name, t in init.items()}
    ref_opt = torch.optim.AdamW(ref.values(), lr=args.lr)
    losses, account, first = [], None, resume(args.resume, model, opt)
    for step in _progress(range(args.steps), comm.rank == 0):
        gen = torch.Generator().manual_seed(1000 + step)
        x, target = torch.randn(b, s, e, generator=gen), torch.randn(b, s, e, generator=gen)
        if step < first:  # resumed: the reference replays the steps the checkpoint holds
            _reference_step(x, target, ref, ref_opt, args)
            continue
        start = time.perf_counter()
        loss = model(model.shard_input(fd.input, x), model.shard_input(fd.target, target))
        loss.backward()
        model.clip_grad_norm_(args.max_norm)
        opt.step()
        account = model.memory_account(opt)
        opt.zero_grad()
        seconds = time.perf_counter() - start
        expected = _reference_step(x, target, ref, ref_opt, args)
        losses.append((loss.item(), expected))
        _show(loss.item(), b * s / seconds)
    save_at(args.save, model, opt, args.steps)
    worst = max(abs(a - r) / abs(r) for a, r in losses)
    return {"mesh": args.mesh, "losses": losses, "largest_relative_difference": worst,
            "ok": worst <= args.rtol, "memory": account.describe() if account else ""}


def _reference_step(x, target, ref, ref_opt, args) -> float:
    """One step of the PyTorch reference; its loss."""
    expected = torch_loss(x, target, ref, args.layers, args.heads)
    expected.backward()
    torch.nn.utils.clip_grad_norm_(ref.values(), args.max_norm)
    ref_opt.step()
    ref_opt.zero_grad()
    return expected.item()


_BAR = []


def _progress(steps, shown: bool):
    """``steps`` behind a tqdm bar on rank 0 (without tqdm installed, plain)."""
    if not shown:
        return steps
    try:
        from tqdm import tqdm  # optional: the bar only
    except ImportError:
        return steps
    bar = tqdm(steps, desc="train", unit="step")
    _BAR[:] = [bar]
    return bar


def _show(loss: float, tokens_per_s: float) -> None:
    if _BAR:
        _BAR[0].set_postfix(loss=f"{loss:.4f}", tokens_s=f"{tokens_per_s:.0f}")


def _write(record: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "train_fsdp.json"), "w") as f:
        json.dump(record, f, indent=1)
    try:
        import matplotlib  # optional: the picture only
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([a for a, _ in record["losses"]], label=f"meshfuse ({record['mesh']})")
    ax.plot([r for _, r in record["losses"]], "--", label="PyTorch, one device")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.savefig(os.path.join(out, "train_fsdp.png"), dpi=100)
    plt.close(fig)


def run_rank(args) -> int:
    comm = Communicator.instance()
    record = train(args)
    print(f"rank {comm.rank}: {record['memory']}", flush=True)
    if comm.rank == 0:
        print(f"{args.steps} steps on {args.mesh}: largest relative difference from PyTorch "
              f"{record['largest_relative_difference']:.2e} (tolerance {args.rtol:g}): "
              f"{'ok' if record['ok'] else 'FAILED'}")
        if args.out:
            _write(record, args.out)
    return 0 if record["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    world = launcher_world_size()
    args = parse_args(argv, world)
    if world is None:
        codes = spawn(args.ranks, ["-m", "meshfuse.examples.train_fsdp", *argv])
        return 0 if all(c == 0 for c in codes) else 1
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
