"""Case 5: bus bandwidth of allgather, reduce-scatter and allreduce, 64 MiB to 512 MiB.

``size`` is the full buffer as nccl-tests counts it: allgather's output, reduce-scatter's
input, allreduce's buffer. ``algbw = size / time``; ``busbw`` is algbw times ``(n-1)/n``
(allgather, reduce-scatter) or ``2(n-1)/n`` (allreduce), comparable across world sizes.

Variants: ``torch`` (baseline: ``torch.distributed`` called directly) and ``meshfuse``
(``meshfuse.runtime.collectives``, when that module exists and has a function for the
collective that this file knows how to call; skipped otherwise, saying why).
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Any

import torch
import torch.distributed as dist

import meshfuse
from benchmarks.context import Context
from benchmarks.harness import Plan, Record, Skip, Variant, run_variants, skipped

SIZES_MIB = (64, 128, 256, 512)
QUICK_SIZES_MIB = (1, 4)
DTYPE = torch.float32

# collective -> (busbw factor of n, candidate meshfuse function names)
COLLECTIVES = {
    "allgather": (lambda n: (n - 1) / n, ("allgather", "all_gather", "all_gather_into_tensor")),
    "reduce_scatter": (lambda n: (n - 1) / n,
                       ("reduce_scatter", "reducescatter", "reduce_scatter_tensor")),
    "allreduce": (lambda n: 2 * (n - 1) / n, ("allreduce", "all_reduce")),
}


def _buffers(ctx: Context, op: str, numel: int):
    """(input, output) of ``op`` for a full buffer of ``numel`` elements."""
    shard = numel // ctx.world
    full = torch.ones(numel, dtype=DTYPE, device=ctx.device)
    part = torch.ones(shard, dtype=DTYPE, device=ctx.device)
    if op == "allgather":
        return part, full
    if op == "reduce_scatter":
        return full, part
    return full, full


def _torch_step(op: str, inp: torch.Tensor, out: torch.Tensor):
    if op == "allgather":
        return lambda: dist.all_gather_into_tensor(out, inp)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(out, inp)
    return lambda: dist.all_reduce(inp)


def _bind(fn, known: dict[str, Any], what: str) -> dict[str, Any]:
    """Keyword arguments for ``fn`` (a function or a class) from ``known``, by name.

    Raises:
        Skip: ``fn`` has a required parameter that ``known`` does not name.
    """
    signature = inspect.signature(fn)
    kwargs = {}
    for name, param in signature.parameters.items():
        if name in known:
            kwargs[name] = known[name]
        elif param.default is inspect.Parameter.empty and param.kind not in (
                param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise Skip(f"{what}{signature}: parameter {name!r} unknown to "
                       "benchmarks/cases/collectives.py; add it there")
    return kwargs


def _meshfuse_group(module, ctx: Context, comm, mesh) -> Any:
    """The ``group`` argument: the module's ``Group`` record if it has one, else the torch
    process group of the mesh."""
    process_group = comm.group(mesh, 0)
    record = getattr(module, "Group", None)
    if record is None:
        return process_group
    known = {"process_group": process_group, "pg": process_group,
             "ranks": tuple(range(ctx.world)), "coordinate": ctx.rank, "mesh_axis": 0,
             "mesh": mesh}
    return record(**_bind(record, known, "meshfuse.runtime.collectives.Group"))


def _meshfuse_step(ctx: Context, op: str, inp: torch.Tensor, out: torch.Tensor):
    """A call of meshfuse's collective for ``op``, its arguments bound by parameter name
    (the functions return their result; ``out`` is only passed to one that asks for it)."""
    module = importlib.import_module("meshfuse.runtime.collectives")
    names = COLLECTIVES[op][1]
    fn = next((getattr(module, n) for n in names if callable(getattr(module, n, None))), None)
    if fn is None:
        raise Skip(f"meshfuse.runtime.collectives has none of {', '.join(names)}")
    from meshfuse.runtime.communicator import Communicator

    comm = Communicator.instance()
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    known = {
        "tensor": inp, "x": inp, "input": inp, "inp": inp, "send": inp, "src": inp,
        "output": out, "out": out, "dst": out, "recv": out,
        "axis": 0, "mesh_axis": 0, "mesh": mesh, "communicator": comm, "comm": comm,
        "reduce_op": "sum", "op": "sum", "group": _meshfuse_group(module, ctx, comm, mesh),
    }
    kwargs = _bind(fn, known, f"meshfuse.runtime.collectives.{fn.__name__}")
    return lambda: fn(**kwargs)


def _meshfuse_missing() -> str | None:
    """Why there is no meshfuse variant at all, or None."""
    try:
        importlib.import_module("meshfuse.runtime.collectives")
    except ImportError:
        return "meshfuse has no runtime.collectives module yet"
    return None


def _variants(ctx: Context, op: str, numel: int, with_meshfuse: bool) -> list[Variant]:
    def torch_setup():
        return _torch_step(op, *_buffers(ctx, op, numel))

    def meshfuse_setup():
        return _meshfuse_step(ctx, op, *_buffers(ctx, op, numel))

    variants = [Variant("torch", torch_setup)]
    if with_meshfuse:
        variants.append(Variant("meshfuse", meshfuse_setup))
    return variants


def run(ctx: Context) -> list[Record]:
    if ctx.world < 2:
        return [skipped(ctx, "collectives", "-", "torch", "needs 2+ ranks (torchrun)")]
    sizes = QUICK_SIZES_MIB if ctx.quick else SIZES_MIB
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=5, iters=30)
    records = []
    missing = _meshfuse_missing()
    if missing:
        records.append(skipped(ctx, "collectives", "all sizes", "meshfuse", missing))
    element = torch.tensor([], dtype=DTYPE).element_size()
    with warnings.catch_warnings():  # reduce_scatter_tensor is deprecated in newer torch
        warnings.simplefilter("ignore", FutureWarning)
        for op, (factor, _) in COLLECTIVES.items():
            for mib in sizes:
                numel = mib * 2**20 // element
                params = {"op": op, "size_mib": mib, "dtype": "fp32", "ranks": ctx.world}
                found = run_variants(ctx, "collectives", f"{op} {mib}MiB",
                                     _variants(ctx, op, numel, not missing), plan, "torch",
                                     params)
                for r in found:
                    if r.status == "ok":
                        algbw = mib * 2**20 / (r.median_ms * 1e-3) / 1e9
                        r.metrics["algbw_gbps"] = algbw
                        r.metrics["busbw_gbps"] = algbw * factor(ctx.world)
                records += found
    return records
