# ruff: noqa: S102 (a layout is code: running exactly the lines of its reproduction)
"""Random save-here, load-there cases for the checkpoint fuzzer (``test_fuzz_checkpoint.py``).

A case is a few tensors, each with a random global shape (0 to 3 axes of 1 to 7 elements)
and dtype, saved under one layout and loaded under another; every loaded shard must equal
the same slice of the global tensor, bit for bit. A layout is drawn independently for each
side:

- ``whole``: every rank holds the tensor (a plain tensor, replicated);
- ``meshfuse``: a TensorView on a mesh of some of the ranks (1-D, or 2x2 at 4 ranks), each
  mesh axis splitting a random axis (block or cyclic, once or twice, uneven extents and
  empty shards allowed; ``fuzz_schedules._shard_one``) or replicating; ranks outside the
  mesh hold nothing;
- ``dtensor``: a DTensor on a torch DeviceMesh of some of the ranks, each mesh dimension
  ``Replicate()`` or ``Shard(axis)`` (uneven, two mesh dimensions may split one axis).

The expected shard of a rank is sliced from the global tensor by meshfuse's own
``shard_tensor`` (a TensorView) or torch's ``distribute_tensor`` (a DTensor), not by the
checkpoint's chunk arithmetic, so a wrong box on either side shows. The loading side starts
from other values, so a box left unread shows too.
"""

from __future__ import annotations

import dataclasses
import os
import random
import types

import torch
from fuzz_schedules import PTS, _shard_one, _Writer
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from meshfuse import DeviceMesh, FusionDefinition, ParallelType, checkpoint
from meshfuse.dtypes import DataType
from meshfuse.sharding import shard_tensor

DTYPES = (torch.float32, torch.float32, torch.bfloat16, torch.float64, torch.int32)
KINDS = ("meshfuse", "meshfuse", "dtensor", "whole")
_FEATURES = types.SimpleNamespace(any_to_any=True, uneven=True)


@dataclasses.dataclass(frozen=True)
class Layout:
    """``kind``; ``mesh``: the ranks (nested for 2x2); ``code``: the TensorView's schedule
    as calls on ``t`` (meshfuse) or the placements, one per mesh dimension (dtensor)."""

    kind: str
    mesh: tuple = ()
    code: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.kind == "whole":
            return "whole"
        return f"{self.kind} on {list(self.mesh)}: {'; '.join(self.code) or 'replicated'}"


@dataclasses.dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    save: Layout
    load: Layout


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    world: int
    tensors: tuple[Tensor, ...]

    def report(self) -> str:
        return "\n".join([f"case seed {self.seed} at {self.world} ranks:"] + [
            f"  t{i} {list(t.shape)} {t.dtype}: saved {t.save}; loaded {t.load}"
            for i, t in enumerate(self.tensors)])


def _ranks(world: int, rng: random.Random) -> tuple:
    size = rng.randint(1, world)
    ranks = sorted(rng.sample(range(world), size))
    if size == 4 and rng.random() < 0.5:
        return ((ranks[0], ranks[1]), (ranks[2], ranks[3]))
    return tuple(ranks)


def _pts(mesh: tuple) -> tuple[str, ...]:
    return ("mesh_y", "mesh_x") if isinstance(mesh[0], tuple) else ("mesh_x",)


def _nested(mesh: tuple) -> list:
    return [list(row) for row in mesh] if isinstance(mesh[0], tuple) else list(mesh)


def _meshfuse_layout(shape, dtype, mesh: tuple, rng: random.Random) -> Layout:
    """A schedule drawn by applying it to a probe TensorView (so its calls are valid)."""
    with FusionDefinition() as fd:
        tv = fd.define_tensor(list(shape), dtype=DataType.from_torch(dtype))
    device_mesh = DeviceMesh(_nested(mesh))
    tv.set_device_mesh(device_mesh)
    lines: list[str] = []
    for name in _pts(mesh):
        if rng.random() < 0.8:
            _shard_one(_Writer(lines), "t", tv, device_mesh, PTS[name], name, rng, _FEATURES,
                       partial_ok=False)
    return Layout("meshfuse", mesh, tuple(lines))


def _dtensor_layout(shape, mesh: tuple, rng: random.Random) -> Layout:
    placements = []
    for _ in _pts(mesh):
        if shape and rng.random() < 0.75:
            placements.append(f"S({rng.randrange(len(shape))})")
        else:
            placements.append("R")
    return Layout("dtensor", mesh, tuple(placements))


def _layout(shape, dtype, world: int, rng: random.Random) -> Layout:
    kind = rng.choice(KINDS)
    if kind == "whole":
        return Layout("whole")
    mesh = _ranks(world, rng)
    if kind == "dtensor":
        return _dtensor_layout(shape, mesh, rng)
    return _meshfuse_layout(shape, dtype, mesh, rng)


def generate(seed: int, world: int, tensors: int = 3) -> Case:
    rng = random.Random(seed * 1009 + world)
    out = []
    for _ in range(tensors):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.choice((0, 1, 1, 2, 2, 2, 3))))
        dtype = rng.choice(DTYPES)
        out.append(Tensor(shape, dtype, _layout(shape, dtype, world, rng),
                          _layout(shape, dtype, world, rng)))
    return Case(seed, world, tuple(out))


def _global(t: Tensor, index: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 31 + index)
    values = torch.randn(t.shape, generator=gen, dtype=torch.float64) * 100
    return values.to(t.dtype)


class Holder(torch.nn.Module):
    """Tensors as buffers, with the TensorViews of those laid out by a meshfuse schedule
    (what ``checkpoint`` asks a module for)."""

    def __init__(self, values: dict[str, torch.Tensor], views: dict[str, object]) -> None:
        super().__init__()
        for name, value in values.items():
            self.register_buffer(name, value)
        self._views = views

    def parameter_tensors(self) -> dict[str, object]:
        return dict(self._views)


class _Side:
    """One side's layouts made real: TensorViews of one fusion, torch meshes (cached)."""

    def __init__(self, case: Case, side: str, meshes: dict) -> None:
        self.layouts = [getattr(t, side) for t in case.tensors]
        self.meshes, self.views = meshes, {}
        with FusionDefinition() as fd:
            for i, (t, layout) in enumerate(zip(case.tensors, self.layouts)):
                if layout.kind == "meshfuse":
                    self.views[i] = fd.define_tensor(list(t.shape),
                                                     dtype=DataType.from_torch(t.dtype))
        for i, tv in self.views.items():
            env = {"t": tv, "ParallelType": ParallelType}
            tv.set_device_mesh(DeviceMesh(_nested(self.layouts[i].mesh)))
            for line in self.layouts[i].code:
                exec(line, env)

    def _torch_mesh(self, mesh: tuple) -> TorchMesh:
        if mesh not in self.meshes:
            self.meshes[mesh] = TorchMesh("cpu", torch.tensor(_nested(mesh)))
        return self.meshes[mesh]

    def shard(self, i: int, value: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s shard of the global ``value`` under layout ``i`` (its expected one)."""
        layout = self.layouts[i]
        if layout.kind == "whole":
            return value.clone()
        if layout.kind == "dtensor":
            placements = [Replicate() if p == "R" else Shard(int(p[2:-1]))
                          for p in layout.code]
            return distribute_tensor(value, self._torch_mesh(layout.mesh), placements,
                                     src_data_rank=None)
        if rank not in DeviceMesh(_nested(layout.mesh)):
            return torch.empty(0, dtype=value.dtype)  # outside the mesh: nothing
        return shard_tensor(value, self.views[i], rank)

    def module(self, values: list[torch.Tensor], rank: int) -> Holder:
        return Holder({f"t{i}": self.shard(i, v, rank) for i, v in enumerate(values)},
                      {f"t{i}": tv for i, tv in self.views.items()})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run(case: Case, path: str, rank: int, meshes: dict) -> list[str]:
    """Saves the case's tensors under their save layouts to ``path`` and loads them under
    their load layouts; the tensors whose loaded shard on this rank is not the expected
    one."""
    values = [_global(t, i, case.seed) for i, t in enumerate(case.tensors)]
    saving, loading = _Side(case, "save", meshes), _Side(case, "load", meshes)
    checkpoint.save(path, saving.module(values, rank))
    others = [_global(t, i + 100, case.seed) for i, t in enumerate(case.tensors)]
    target = loading.module(others, rank)
    checkpoint.load(path, target)
    wrong = []
    for i, value in enumerate(values):
        got, expected = _local(getattr(target, f"t{i}")), _local(loading.shard(i, value, rank))
        if got.shape != expected.shape or not torch.equal(got, expected):
            wrong.append(f"t{i} on rank {rank}: loaded {got.flatten()[:8].tolist()}, "
                         f"expected {expected.flatten()[:8].tolist()}")
    return wrong


def case_dir(base: str, case: Case) -> str:
    return os.path.join(base, f"case{case.seed}")
