# ruff: noqa: S102 (a program is code: running exactly the lines of its reproduction)
"""Random schedules for the fuzzer's programs (``fuzz_programs.py``).

A schedule is written as tensor-method calls (``t3.outer_split(1, 2)``,
``t3.axis(1).parallelize(ParallelType.mesh_x)``), chosen while applying them to a probe
definition of the program, so that loop positions are right. It covers:

- which tensors are pinned: inputs only, outputs only, all, or a random subset (propagation
  fills the rest);
- meshes: every rank on a 1-D mesh, a 2x2 mesh at 4 ranks, or 1-D meshes of some ranks, the
  inputs on different ones;
- splits: block (outer) or cyclic (inner), an axis split twice (over both axes of a 2x2 mesh,
  or split once more before the device split on a 1-D mesh), and partial results (the
  reduction axis of an intermediate reduction parallelized).

Extents the split factor does not divide are scheduled only with ``features.uneven``; inner
splits, second splits and partial results only with ``features.any_to_any``.
"""

from __future__ import annotations

import math
import random

import torch

from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType, ScheduleError
from meshfuse.ir.iter_domain import Split
from meshfuse.ir.tensor_view import TensorView

PTS = {"mesh_x": ParallelType.mesh_x, "mesh_y": ParallelType.mesh_y}


def meshes_for(world_size: int, rng: random.Random,
               mesh_2d: bool) -> tuple[str, dict[str, list]]:
    """A mesh mode and its meshes (name -> device list, as DeviceMesh takes it)."""
    full = list(range(world_size))
    modes = ["1d"] * 3
    if world_size == 4 and mesh_2d:
        modes += ["2x2"] * 3
    if world_size > 1:
        modes += ["between"]
    mode = rng.choice(modes)
    if mode == "1d":
        return mode, {"mesh": full}
    if mode == "2x2":
        return mode, {"mesh": [[0, 1], [2, 3]]}
    half = world_size // 2
    return mode, {"mesh": full, "mesh_a": full[:half], "mesh_b": full[half:]}


def schedule_program(program, rng: random.Random, features) -> None:
    """Chooses and records ``program.schedule``, ``program.meshes`` and ``program.mode``."""
    mesh_mode, meshes = meshes_for(program.world_size, rng, features.any_to_any)
    program.meshes = meshes
    env = {"DataType": DataType, "math": math, "torch": torch}
    for name, devices in meshes.items():
        env[name] = DeviceMesh(devices)
    with FusionDefinition() as fd:
        env["fd"] = fd
        exec(program.definition_code(), env)
    inputs = [n for n, _ in program.inputs]
    computed = [n for n in env if n.startswith("t") and n[1:].isdigit()
                and isinstance(env[n], TensorView) and n not in inputs]
    pin_mode = rng.choice(["inputs", "outputs", "all", "some"])
    if pin_mode == "inputs":
        pinned = inputs
    elif pin_mode == "outputs":
        pinned = list(program.outputs)
    elif pin_mode == "all":
        pinned = inputs + computed
    else:
        pinned = [n for n in inputs + computed if rng.random() < 0.4] or [inputs[0]]
    program.mode = f"{mesh_mode}, pinned {pin_mode}"
    outputs = set(program.outputs)
    writer = _Writer(program.schedule)
    try:
        for name in pinned:
            tv = env[name]
            if tv.dtype is DataType.UInt64 or (not tv.dtype.is_floating and
                                                not features.integers):
                continue  # attention's RNG state: left to propagation
            mesh_name = _mesh_of(name, meshes, inputs, rng, mesh_mode)
            writer.call(name, tv, "set_device_mesh", env[mesh_name], arg_code=mesh_name)
            for pt_name in ("mesh_y", "mesh_x") if mesh_mode == "2x2" else ("mesh_x",):
                if rng.random() < 0.75:
                    _shard_one(writer, name, tv, env[mesh_name], PTS[pt_name], pt_name, rng,
                               features, partial_ok=name not in outputs)
    except ScheduleError:
        program.features.add("schedule refused")


def _mesh_of(name, meshes, inputs, rng, mode) -> str:
    if mode != "between":
        return "mesh"
    return rng.choice(["mesh_a", "mesh_b"] if name in inputs else ["mesh", "mesh_a", "mesh_b"])


class _Writer:
    """Applies schedule calls to probe tensors and records them as code."""

    def __init__(self, lines: list[str]):
        self.lines = lines

    def call(self, name: str, tv: TensorView, method: str, *args, arg_code: str | None = None):
        text = arg_code if arg_code is not None else ", ".join(repr(a) for a in args)
        self.lines.append(f"{name}.{method}({text})")
        getattr(tv, method)(*args)

    def parallelize(self, name: str, tv: TensorView, pos: int, pt: ParallelType, pt_name: str):
        self.lines.append(f"{name}.axis({pos}).parallelize(ParallelType.{pt_name})")
        tv.axis(pos).parallelize(pt)


def _serial_pieces(tv: TensorView, logical_id) -> list:
    """The loop IDs split from ``logical_id`` (itself if unsplit) not parallelized yet."""
    ids = [logical_id]
    for t in tv.transforms:
        if isinstance(t, Split) and t.in_id in ids:
            ids.extend(t.outputs)
    return [i for i in tv.loop if i in ids and not tv.parallel_type(i).is_device]


def _shard_one(writer: _Writer, name: str, tv: TensorView, mesh: DeviceMesh,
               pt: ParallelType, pt_name: str, rng: random.Random, features,
               partial_ok: bool) -> None:
    """Splits one axis of ``tv`` (or a piece of an already split one) and parallelizes the
    part of extent ``d`` on ``pt``."""
    d = mesh.axis_size(pt)
    reductions = [i for i in tv.logical if i.is_reduction and tv.definition is not None
                  and tv.definition.op.partial_reduce is not None
                  and tv.definition.op.name != "mean"]
    axes = [i for i in tv.materialized() if not i.is_broadcast and (i.extent or 0) >= 2]
    if features.any_to_any and partial_ok and reductions and rng.random() < 0.2:
        axes = reductions
    pieces = [p for i in axes for p in _serial_pieces(tv, i) if p.extent and p.extent >= 2]
    if not features.any_to_any:  # one block split per axis
        pieces = [p for p in pieces if p in tv.logical]
    if not features.uneven:
        pieces = [p for p in pieces if p.extent % d == 0]
    if not pieces:
        return
    piece = rng.choice(pieces)
    pos = tv.loop.index(piece)
    kind = rng.choice(["outer", "outer", "inner", "twice"]) if features.any_to_any else "outer"
    if kind == "twice":
        first = [f for f in (2, 3) if piece.extent % f == 0 and piece.extent > f]
        if first:
            writer.call(name, tv, "split", pos, rng.choice(first), rng.random() < 0.5)
            options = [p for p in (pos, pos + 1)
                       if features.uneven or tv.loop[p].extent % d == 0]
            if not options:
                return
            pos = rng.choice(options)
        kind = rng.choice(["outer", "inner"])
    if kind == "outer":
        writer.call(name, tv, "outer_split", pos, d)
        writer.parallelize(name, tv, pos, pt, pt_name)
    else:
        writer.call(name, tv, "inner_split", pos, d)
        writer.parallelize(name, tv, pos + 1, pt, pt_name)

