"""Train the Llama-family model of :mod:`meshfuse.examples.llama` on synthetic tokens.

::

    python -m meshfuse.examples.train_llama --mesh tp=2 --steps 20 --out runs/llama

starts one rank per device of the mesh (GPUs with NCCL, or CPU processes with gloo when
there is no GPU; under ``torchrun``/``mpirun`` it runs in the ranks it is given), trains the
model tensor + sequence parallel with AdamW, shows a progress bar (loss, tokens/s), prints
each rank's memory account (parameter, gradient and optimizer-state bytes) and compares every
step's loss with the same model trained in plain PyTorch on one device (rank 0 runs it):
``--out`` gets ``train_llama.json`` and the two loss curves, ``train_llama.png``. The exit
status is 1 when a float32 loss is off by more than ``--rtol`` (1e-5) relative, 2 on a bad
argument (one line on stderr, before any rank starts).

``--mesh`` names the mesh's dimensions: ``tp=N`` tensor (+ sequence) parallelism over N
ranks, ``dp=M`` fully sharded data parallelism over M (:mod:`meshfuse.parallel.fsdp`: each
fusion's parameters sharded over ``dp``, the batch split over it), as ``--mesh dp=2,tp=2``
on 4 ranks; ``replicate=R`` with ``dp`` is HSDP (parameters replicated over R, sharded
over ``dp``), ``cp=C`` context parallelism (the sequence split over C, ring attention), as
``--mesh dp=2,cp=2,tp=2`` on 8 ranks. ``--max-norm`` clips the gradients' global norm (over every rank's shards).
``--cuda-graph`` (GPUs only) replays each training step (forward, backward, clipping, AdamW
with ``capturable=True``) from one CUDA graph (``meshfuse.capture_step``); its first three
steps run as they are, the fourth captures.

The data: sequences that count up by a stride modulo the vocabulary (a random start and
stride per sequence, seeded per step); the next token is learnable in context, so the loss
falls well below the uniform ``log(vocab)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

import torch

from meshfuse.checkpoint.training import add_arguments, resume, save_at
from meshfuse.examples.llama import LlamaConfig, LlamaModel, init_parameters
from meshfuse.examples.llama_torch import LlamaTorch
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.launch import launcher_world_size, spawn
from meshfuse.parallel.fsdp import NamedMesh
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.replay.step import capture_step

PROG = "python -m meshfuse.examples.train_llama"
MESH_DIMS = ("replicate", "dp", "cp", "tp")  # outermost first
FLOAT32_RTOL = 1e-5


class _Parser(argparse.ArgumentParser):
    """Errors as one line on stderr, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` as ``{"dp": 2, "tp": 2}``, every dimension of :data:`MESH_DIMS`
    present (1 where not named); an ``argparse.ArgumentTypeError`` saying what is wrong."""
    sizes = dict.fromkeys(MESH_DIMS, 1)
    named = set()
    for item in text.split(","):
        name, eq, value = item.strip().partition("=")
        if not eq or name not in sizes:
            raise argparse.ArgumentTypeError(
                f"mesh dimension {item.strip()!r} is not NAME=SIZE with NAME one of "
                f"{', '.join(MESH_DIMS)} (e.g. --mesh tp=2 or --mesh dp=2,tp=2)")
        if name in named:
            raise argparse.ArgumentTypeError(f"mesh dimension {name} is given twice")
        if not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"{name}={value}: the size must be a positive "
                                             "integer")
        named.add(name)
        sizes[name] = int(value)
    return sizes


def parse_args(argv: Sequence[str] | None = None,
               launcher_size: int | None = None) -> argparse.Namespace:
    """The script's options, checked against the mesh and the ranks (exit 2 on a bad one)."""
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", type=parse_mesh, default=parse_mesh("tp=2"),
                   help="mesh dimensions NAME=SIZE, comma separated: dp (fully sharded data "
                        "parallel), replicate (HSDP's replicas, with dp), cp (context "
                        "parallel), tp (tensor + sequence parallel); default tp=2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=None,
                   help="clip the gradients to this global norm (default: no clipping)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay each step from one CUDA graph (meshfuse.capture_step; GPUs)")
    p.add_argument("--rtol", type=float, default=FLOAT32_RTOL,
                   help="largest relative loss difference from PyTorch in float32")
    p.add_argument("--out", default=None, help="directory for train_llama.json and .png")
    add_arguments(p, "--save", "--resume")
    for field in dataclasses.fields(LlamaConfig):
        if field.name != "dtype":
            p.add_argument(f"--{field.name.replace('_', '-')}", default=field.default,
                           type=float if field.type == "float" else int)
    args = p.parse_args(argv)
    _check(p, args, launcher_size)
    return args


def _check(p: _Parser, args: argparse.Namespace, launcher_size: int | None) -> None:
    mesh = args.mesh
    copies = mesh["dp"] * mesh["replicate"]
    if args.batch % copies:
        what = "dp" if mesh["replicate"] == 1 else "replicate x dp"
        p.error(f"--mesh splits --batch {args.batch} sequences over {what} = {copies} ranks: "
                f"give a batch that {what} divides")
    if mesh["replicate"] > 1 and mesh["dp"] == 1:
        p.error(f"--mesh replicate={mesh['replicate']} replicates what dp shards: give dp=N "
                "too (HSDP), or use dp alone")
    ranks = math.prod(mesh.values())
    spec = ",".join(f"{k}={v}" for k, v in mesh.items())
    if launcher_size is not None and ranks != launcher_size:
        p.error(f"--mesh {spec} needs {ranks} ranks, but the launcher started "
                f"{launcher_size}; start {ranks} ranks or give a mesh of {launcher_size}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if launcher_size is None and gpus and ranks > gpus:
        p.error(f"--mesh {spec} needs {ranks} ranks, but this host has {gpus} GPUs (one "
                f"rank per GPU)")
    if args.heads % mesh["tp"]:
        p.error(f"--mesh tp={mesh['tp']} splits {args.heads} query heads: give a tp that "
                "divides --heads")
    if args.steps < 1 or args.batch < 1:
        p.error("--steps and --batch must be positive")
    if args.cuda_graph and not gpus:
        p.error("--cuda-graph captures CUDA graphs, and this host has no GPU: run without it")
    try:
        args.config = config_of(args)
    except ValueError as e:
        p.error(str(e))


def config_of(args: argparse.Namespace) -> LlamaConfig:
    names = [f.name for f in dataclasses.fields(LlamaConfig)]
    return LlamaConfig(**{n: getattr(args, n) for n in names})


def synthetic_batch(cfg: LlamaConfig, batch: int, step: int, seed: int = 0):
    """``ids`` and ``targets`` ``[batch, seq]`` (int64): sequences counting up by a stride
    modulo the vocabulary, the targets the next tokens; the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    tokens = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def memory_account(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (its local shards;
    the optimizer's step counters, scalars, left out)."""
    def size(ts):
        return sum(t.numel() * t.element_size() for t in ts
                   if isinstance(t, torch.Tensor) and t.dim() > 0)

    params = list(model.parameters())
    return {"parameters": size(params), "gradients": size(p.grad for p in params),
            "optimizer_state": size(v for s in opt.state.values() for v in s.values())}


def step(model, opt: torch.optim.Optimizer, ids: torch.Tensor, targets: torch.Tensor,
         max_norm: float | None = None) -> float:
    """One AdamW step (the gradients clipped to ``max_norm``); the loss before the update."""
    return _update(model, opt, ids, targets, max_norm).item()


def _update(model, opt: torch.optim.Optimizer, ids: torch.Tensor, targets: torch.Tensor,
            max_norm: float | None) -> torch.Tensor:
    """:func:`step`'s work on the device, its loss a tensor (nothing read to the host)."""
    opt.zero_grad()
    loss = model(ids, targets)
    loss.backward()
    if max_norm is not None:
        clip_grad_norm_(model, max_norm)
    opt.step()
    return loss.detach()


def captured_step(model, opt: torch.optim.Optimizer, max_norm: float | None = None):
    """:func:`step` replayed from one CUDA graph per batch shape (``meshfuse.capture_step``:
    ``opt`` must run on the device, as ``AdamW(..., capturable=True)`` does): called as
    ``run(ids, targets)``, it returns the loss before the update."""
    graphed = capture_step(lambda ids, targets: _update(model, opt, ids, targets, max_norm))
    return lambda ids, targets: graphed(ids, targets).item()


def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clips ``model``'s gradients to a global norm of ``max_norm``: a meshfuse model's over
    every rank's shards (each element counted once), else torch's."""
    if isinstance(model, LlamaModel):
        return model.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def device_mesh(sizes: dict[str, int], world_size: int):
    """The model's mesh: a 1-D tensor-parallel mesh when only ``tp`` is over 1, else a named
    mesh of ``dp`` and ``tp`` (and ``replicate``, ``cp`` where over 1), outermost first."""
    names = [n for n in MESH_DIMS if n in ("dp", "tp") or sizes.get(n, 1) > 1]
    if names == ["dp", "tp"] and sizes.get("dp", 1) == 1:
        return DeviceMesh(range(world_size))
    shape = tuple(sizes.get(n, 1) for n in names)
    return NamedMesh(DeviceMesh(torch.arange(world_size).reshape(shape)), tuple(names))


def train(cfg: LlamaConfig, steps: int, batch: int = 4, lr: float = 3e-3, seed: int = 0,
          reference=LlamaTorch, progress: bool = False, mesh: dict[str, int] | None = None,
          max_norm: float | None = None, save: str | None = None,
          resume_from: str | None = None, cuda_graph: bool = False):
    """Trains the meshfuse model over all ranks (``mesh``: the sizes of ``dp``, fully sharded
    data parallel, and ``tp``, tensor + sequence parallel; default all ranks ``tp``) and, on
    rank 0, ``reference(cfg)`` (a module named as ``LlamaForCausalLM``, called ``(ids,
    targets)``) on one device, from the same parameters on the same batches, both clipped
    to ``max_norm`` when given; ``save``/``resume_from`` write and read checkpoints;
    ``cuda_graph``: the meshfuse model's steps replayed from a CUDA graph
    (:func:`captured_step`). Returns
    the meshfuse losses, the reference's (None off rank 0), and this rank's memory account
    after the first step."""
    comm = Communicator.instance()
    sizes = mesh or {"dp": 1, "tp": comm.size}
    device = comm.device
    params = init_parameters(cfg, seed)
    model = LlamaModel(cfg, batch, params, device_mesh(sizes, comm.size), device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=cuda_graph)
    first = resume(resume_from, model, opt)
    run = captured_step(model, opt, max_norm) if cuda_graph else \
        (lambda ids, targets: step(model, opt, ids, targets, max_norm))
    ref = ref_opt = None
    if reference is not None and comm.rank == 0:
        ref = reference(cfg).to(device)
        ref.load_state_dict(params)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    losses, ref_losses, account = [], [] if ref else None, None
    bar = _progress(steps, progress and comm.rank == 0)
    start = time.perf_counter()
    for i in bar:
        ids, targets = (t.to(device) for t in synthetic_batch(cfg, batch, i, seed))
        if i < first:  # resumed: the reference replays the steps the checkpoint holds
            if ref is not None:
                step(ref, ref_opt, ids, targets, max_norm)
            continue
        losses.append(run(ids, targets))
        if ref is not None:
            ref_losses.append(step(ref, ref_opt, ids, targets, max_norm))
        account = account or memory_account(model, opt)
        if hasattr(bar, "set_postfix"):
            rate = (i + 1) * batch * cfg.seq / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tokens_s=f"{rate:.0f}")
    save_at(save, model, opt, steps)
    return losses, ref_losses, account


def _progress(steps: int, show: bool):
    if show:
        try:
            from tqdm import tqdm  # optional: a plain loop without it
            return tqdm(range(steps), desc="train_llama", unit="step")
        except ImportError:
            pass
    return range(steps)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _plot(path: str, losses, ref_losses, title: str) -> None:
    import matplotlib  # optional: only for --out
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ref_losses, label="PyTorch, one device", linewidth=3, alpha=0.5)
    ax.plot(losses, label="meshfuse", linestyle="--")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_rank(args: argparse.Namespace) -> int:
    comm = Communicator.instance()
    cfg = args.config
    losses, ref_losses, account = train(cfg, args.steps, args.batch, args.lr, args.seed,
                                        mesh=args.mesh, max_norm=args.max_norm,
                                        progress=True, save=args.save, resume_from=args.resume,
                                        cuda_graph=args.cuda_graph)
    accounts = comm.allgather_object(account)
    if comm.rank != 0:
        return 0
    for rank, a in enumerate(accounts):
        print(f"rank {rank}: parameters {a['parameters']:,} B, gradients {a['gradients']:,} "
              f"B, optimizer state {a['optimizer_state']:,} B")
    worst = max(_relative(a, b) for a, b in zip(losses, ref_losses))
    ok = cfg.dtype != "float32" or worst <= args.rtol
    mesh = ",".join(f"{k}={v}" for k, v in args.mesh.items())
    print(f"{comm.size} ranks (--mesh {mesh}), {cfg.dtype}, device {comm.device}: loss "
          f"{losses[0]:.4f} -> {losses[-1]:.4f}; largest relative difference from PyTorch "
          f"on one device {worst:.2e}" + ("" if cfg.dtype != "float32" else
                                          f" (tolerance {args.rtol:g}): "
                                          + ("ok" if ok else "FAILED")))
    if args.out:
        _write(args, losses, ref_losses, accounts, mesh)
    return 0 if ok else 1


def _write(args, losses, ref_losses, accounts, mesh: str) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train_llama.json"), "w") as f:
        json.dump({"mesh": args.mesh, "config": dataclasses.asdict(args.config),
                   "losses": losses, "pytorch": ref_losses, "memory": accounts}, f, indent=1)
    _plot(os.path.join(args.out, "train_llama.png"), losses, ref_losses,
          f"Llama-family model, --mesh {mesh}, {args.config.dtype}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher_size = launcher_world_size()
    args = parse_args(argv, launcher_size)
    if launcher_size is None:
        codes = spawn(math.prod(args.mesh.values()), ["-m", "meshfuse.examples.train_llama",
                                                      *argv])
        return max(codes) if all(c >= 0 for c in codes) else 1
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
