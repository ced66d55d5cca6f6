"""The main job: the seed's sharded attention, forward and backward, on N ranks.

``python -m meshfuse.demo`` starts one process per GPU (NCCL), or 4 CPU processes (gloo)
without a GPU; each rank runs the seed fusion in the BHSE and BSHE layouts on its head shard
(any rank count: 12 heads over 5 ranks are shards of 3, 3, 3, 3 and 0 heads),
checks attn and the three gradients against the unsharded PyTorch reference, and rank 0
prints a short report. Under ``torchrun``/``mpirun`` it runs in the ranks it is given.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

import torch

from meshfuse import DeviceMesh
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention, random_inputs, reference
from meshfuse.ir.printer import format_tensor
from meshfuse.launch import launcher_world_size, spawn
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.sharding import shard_tensor

RTOL, ATOL = 1.6e-2, 1e-2
NAMES = ("attn", "q_grad", "k_grad", "v_grad")


PROG = "python -m meshfuse.demo"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit code 2): a bad argument
    is reported before any rank starts, with no usage block or traceback."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive; give a value of at least 1")
    return value


def parse_args(argv: Sequence[str] | None = None,
               launcher_size: int | None = None) -> argparse.Namespace:
    """The demo's options, checked: every size positive, ``embed`` a multiple of ``heads``
    (any head count splits over any rank count: the shards are uneven where it must be).

    ``launcher_size`` is the world size a launcher started (None without one). Exits with
    code 2 and one line on stderr on a bad argument.
    """
    p = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=_positive, default=None,
                   help="ranks to start (default: the GPU count, or 4 CPU processes; under "
                        "torchrun/mpirun: the launcher's ranks)")
    p.add_argument("--batch", type=_positive, default=2, help="batch size B (default: %(default)s)")
    p.add_argument("--heads", type=_positive, default=12,
                   help="attention heads H, split over the ranks (default: %(default)s)")
    p.add_argument("--seq", type=_positive, default=1024, help="sequence length S (default: %(default)s)")
    p.add_argument("--embed", type=_positive, default=768,
                   help="model width; head dim E = embed / heads (default: %(default)s)")
    args = p.parse_args(argv)
    if args.embed % args.heads:
        nearest = max(1, args.embed // args.heads) * args.heads
        p.error(f"--embed {args.embed} is not a multiple of --heads {args.heads} (the head "
                f"dim is embed / heads); choose a multiple such as --embed {nearest}")
    if launcher_size is not None and args.nproc not in (None, launcher_size):
        p.error(f"--nproc {args.nproc}, but the launcher started {launcher_size} ranks; drop "
                "--nproc under a launcher")
    gpus = gpu_count()
    if launcher_size is None and gpus and (args.nproc or 0) > gpus:
        p.error(f"--nproc {args.nproc}, but this host has {gpus} GPUs (one rank per GPU); "
                f"choose --nproc of at most {gpus}")
    return args


def gpu_count() -> int:
    """The GPUs of this host (0 without CUDA): the most ranks the demo starts on them."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_nproc() -> int:
    """One rank per GPU, or 4 CPU processes without one."""
    return gpu_count() or 4


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher_size = launcher_world_size()
    args = parse_args(argv, launcher_size)
    if launcher_size is None:
        codes = spawn(args.nproc or default_nproc(), ["-m", "meshfuse.demo", *argv])
        return 0 if all(c == 0 for c in codes) else 1
    return run_rank(args)


def run_rank(args) -> int:
    comm = Communicator.instance()
    d, b, h, s, e = comm.size, args.batch, args.heads, args.seq, args.embed
    mesh = DeviceMesh(range(d))
    ok = True
    for fmt in QkvFormat:
        model = SeedAttention(fmt, mesh, b, h, s, e)
        globals_ = random_inputs(b, h, s, e, device=comm.device)
        inputs = model.inputs_for(*globals_, rank=comm.rank)
        start = time.perf_counter()
        outs = model.execute(inputs)
        first = time.perf_counter() - start
        start = time.perf_counter()
        outs = model.execute(inputs)
        _sync(comm.device)
        cached = time.perf_counter() - start
        refs = reference(*globals_)
        tvs = (model.attn, model.q_grad, model.k_grad, model.v_grad)
        errors, layout_ok = {}, True
        for name, out, ref, tv in zip(NAMES, outs, refs, tvs):
            expected = shard_tensor(ref, tv, comm.rank)
            diff = (out.float() - expected.float()).abs()
            errors[name] = diff.max().item() if diff.numel() else 0.0  # an empty shard
            ok &= torch.allclose(out.float(), expected.float(), rtol=RTOL, atol=ATOL)
            layout_ok &= out.stride() == expected.stride() or _same_order(out, expected)
        ok &= layout_ok
        report = {"rank": comm.rank, "shapes": [list(o.shape) for o in outs],
                      "strides": [list(o.stride()) for o in outs], "errors": errors,
                      "first_s": first, "cached_s": cached, "layout_ok": layout_ok}
        reports = comm.allgather_object(report)
        if comm.rank == 0:
            _print_report(fmt, model, reports, d, comm)
    all_ok = comm.allgather_object(ok)
    if comm.rank == 0:
        print("RESULT:", "every rank matches the unsharded reference" if all(all_ok)
              else f"MISMATCH on ranks {[r for r, v in enumerate(all_ok) if not v]}")
    return 0 if all(all_ok) else 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _same_order(a: torch.Tensor, b: torch.Tensor) -> bool:
    key = lambda t: sorted((s, i) for i, (s, n) in enumerate(zip(t.stride(), t.shape)) if n > 1)
    return [i for _, i in key(a)] == [i for _, i in key(b)]


def _print_report(fmt, model, reports, d, comm) -> None:
    print(f"=== seed attention, {fmt.value}, {d} rank(s), backend {comm.backend}, "
          f"device {comm.device.type} ===")
    print("scheduled q:")
    print("  " + format_tensor(model.q).replace("\n", "\n  "))
    for r in reports:
        shapes = ", ".join(f"{n}{s}/{st}" for n, s, st in zip(NAMES, r["shapes"], r["strides"]))
        worst = max(r["errors"].values())
        print(f"rank {r['rank']}: {shapes}")
        print(f"        max |err| {worst:.3e}  layout {'ok' if r['layout_ok'] else 'WRONG'}  "
              f"first execute {r['first_s'] * 1e3:.1f} ms, cached {r['cached_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
