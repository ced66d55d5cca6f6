"""Checkpoint throughput on one GPU (issue 36): ``meshfuse.checkpoint`` save and load of a
~1B-parameter model with its AdamW state against a plain ``torch.save``/``torch.load`` of the
same tensors in the same run, and the training stall of ``async_save``.

::

    python -m benchmarks.checkpoint_io --out DIR --dir CKPT   # 1.07B parameters, one GPU
    python -m benchmarks.checkpoint_io --quick --out DIR     # tiny, runs on CPU

``CKPT`` (made if missing) holds up to ~26 GB of checkpoints at once at the default size;
put it on a disk (the record names its file system: on tmpfs the "disk" is memory).

The model is :class:`~meshfuse.examples.mlp_stack.MlpStack` as one ``FusionModule``
(``--layers`` blocks of ``--embed`` x ``--ffn``: 8 x 4096 x 16384 = 1.07B parameters, float32),
trained one AdamW step so the optimizer holds its moments (3 x 4.3 GB with the parameters).
For each of ``--repeats`` rounds, in one run and one directory (a fresh one under ``--dir``,
default the system's temporary directory, removed at the end):

- ``meshfuse save`` (DCP file storage, fsync'd, ``--threads`` writer threads) and ``load``
  (checked, staged, copied into the parameters and the optimizer);
- ``torch.save`` of the same tensors as one dict (then ``fsync``) and ``torch.load`` back
  (``map_location`` the GPU) copied into the same tensors.

Before each load, the files' pages are dropped from the page cache (``posix_fadvise
DONTNEED`` after an fsync), so loads read the disk where the kernel honours it (recorded).
GB/s counts the tensor bytes (parameters and AdamW state). The stall: ``--steps`` training
steps timed alone, then again with ``async_save`` started before step 2: the time the call
blocks (copying to pinned host memory) and the extra time of the steps while the files are
written, for a first save (which allocates the pinned copies) and a second reusing them.
Writes ``DIR/checkpoint_io.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from meshfuse import checkpoint
from meshfuse.autodiff.module import FusionModule
from meshfuse.dtypes import DataType
from meshfuse.examples.mlp_stack import MlpStack, block_shapes

GB = 1e9


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(args, device):
    """The model on ``device``, its AdamW after one step, and its step function."""
    fd = MlpStack(args.batch, args.embed, args.ffn, args.layers, dtype=DataType.Float).define()
    tvs, shapes = fd.parameter_inputs(), block_shapes(args.embed, args.ffn)
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(shapes[n.split("_", 1)[1]], generator=gen) * 0.02 for n in tvs}
    model = FusionModule(fd, {n: (tvs[n], init.pop(n)) for n in list(tvs)}).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.embed, device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x, x).backward()
        opt.step()
    step()
    _sync()
    return model, opt, step


def tensors_of(model, opt) -> dict[str, torch.Tensor]:
    """The parameters and AdamW state, flat: what ``torch.save`` writes."""
    out = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out.update({f"optim.{n}.{k}": v for k, v in opt.state[p].items()})
    return out


def _drop_cache(directory: str) -> bool:
    """Drops the files' pages from the page cache; whether the kernel took the advice."""
    ok = hasattr(os, "posix_fadvise")
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                if ok:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return ok


def _timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _torch_save(state, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(state, path: str, device) -> None:
    loaded = torch.load(path, map_location=device, weights_only=True)
    with torch.no_grad():
        for name, t in state.items():
            t.copy_(loaded[name])


def one_round(model, opt, directory: str, threads: int, device) -> dict[str, float]:
    """Seconds of each save and load, in one round."""
    state = tensors_of(model, opt)
    mf, tp = os.path.join(directory, "meshfuse"), os.path.join(directory, "torch")
    os.makedirs(tp, exist_ok=True)
    out = {"meshfuse_save": _timed(lambda: checkpoint.save(mf, model, opt,
                                                           thread_count=threads))}
    out["torch_save"] = _timed(lambda: _torch_save(state, os.path.join(tp, "state.pt")))
    out["cache_dropped"] = _drop_cache(directory)
    out["meshfuse_load"] = _timed(lambda: checkpoint.load(mf, model, opt))
    out["torch_load"] = _timed(lambda: _torch_load(state, os.path.join(tp, "state.pt"),
                                                   device))
    shutil.rmtree(mf)
    shutil.rmtree(tp)
    return out


def _steps_with_save(step, steps: int, save=None):
    """Seconds of each step, ``save()`` called before step 2; what it returned, and the
    seconds waited for its files after the steps."""
    times, pending = [], None
    for i in range(steps):
        if save is not None and i == 2:
            pending = save()
        times.append(_timed(step))
    start = time.perf_counter()
    if pending is not None:
        pending.result()
    return times, pending, time.perf_counter() - start


def stall(model, opt, step, directory: str, steps: int, threads: int) -> dict[str, float]:
    """Training steps alone, and with an ``async_save`` before step 2: a first one (which
    allocates its pinned host copies) and a second reusing them (``previous=``)."""
    path = os.path.join(directory, "async")
    base, _, _ = _steps_with_save(step, steps)
    out = {"step_seconds": statistics.median(base)}
    previous = None
    for run in ("first", "reused"):
        times, previous, waited = _steps_with_save(step, steps, lambda p=previous: (
            checkpoint.async_save(path, model, opt, previous=p, thread_count=threads)))
        out[f"{run}_call_seconds"] = previous.stall_seconds
        out[f"{run}_steps_slowdown_seconds"] = sum(times) - sum(base)
        out[f"{run}_wait_after_steps_seconds"] = waited
    shutil.rmtree(path, ignore_errors=True)
    return out


def _filesystem(directory: str) -> str:
    """The type of the file system ``directory`` is on (tmpfs: the "disk" is memory)."""
    path, best = os.path.realpath(directory), ("", "unknown")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, kind, *_ = line.split()
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and \
                        len(mount) > len(best[0]):
                    best = (mount, kind)
    except OSError:
        pass
    return best[1]


def _table(record: dict) -> str:
    gb = record["tensor_bytes"] / GB
    rows = ["| operation | seconds (median) | GB/s |", "|---|---|---|"]
    for name in ("meshfuse_save", "torch_save", "meshfuse_load", "torch_load"):
        s = record.get("median_seconds", {}).get(name)
        if s is not None:
            rows.append(f"| {name.replace('_', ' ')} | {s:.3g} | {gb / s:.3g} |")
    st = record.get("async", {})
    return "\n".join([
        f"# Checkpoint I/O, {record['device']}", "",
        (f"{record['parameters'] / 1e9:.3g}B parameters + AdamW state = {gb:.3g} GB of "
         f"tensors; writer threads {record['threads']}; checkpoints on {record['filesystem']}"
         f"; page cache dropped before loads: {record.get('cache_dropped')}."), "", *rows, "",
        *(f"async_save ({run} host copies): the call blocks {st[run + '_call_seconds']:.3g} s "
          f"(copy to pinned host memory); the {record['steps']} steps around it take "
          f"{st[run + '_steps_slowdown_seconds']:+.3g} s more than alone (step "
          f"{st['step_seconds'] * 1e3:.3g} ms); waiting for the files afterwards "
          f"{st[run + '_wait_after_steps_seconds']:.3g} s." for run in ("first", "reused")
          if run + "_call_seconds" in st),
        ""])


def _write(record: dict, out: str) -> str:
    """Writes ``record`` (as far as it got) to ``out``; its markdown table."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "checkpoint_io.json"), "w") as f:
        json.dump(record, f, indent=1)
    text = _table(record)
    with open(os.path.join(out, "checkpoint_io.md"), "w") as f:
        f.write(text)
    return text


def _arguments(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_io",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--dir", default=None, help="where checkpoints are written (made if "
                   "missing; default: the system's temporary directory)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embed", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.embed, args.ffn, args.repeats, args.steps = 2, 64, 128, 1, 4
    return args


def main(argv=None) -> int:
    args = _arguments(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, opt, step = build(args, device)
    state = tensors_of(model, opt)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)  # a fresh machine: the directory may not exist
    directory = tempfile.mkdtemp(prefix="meshfuse-ckpt-bench-", dir=args.dir)
    names = ("meshfuse_save", "torch_save", "meshfuse_load", "torch_load")
    record = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "args": vars(args),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tensor_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "threads": args.threads, "steps": args.steps, "filesystem": _filesystem(directory),
        "rounds": [],
    }
    del state
    try:  # the record is written after each part, so a run cut short keeps what it measured
        for _ in range(args.repeats):
            record["rounds"].append(one_round(model, opt, directory, args.threads, device))
            record["cache_dropped"] = all(r["cache_dropped"] for r in record["rounds"])
            record["median_seconds"] = {n: statistics.median(r[n] for r in record["rounds"])
                                        for n in names}
            _write(record, args.out)
        record["async"] = stall(model, opt, step, directory, args.steps, args.threads)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(_write(record, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
