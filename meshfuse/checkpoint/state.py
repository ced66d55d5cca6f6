"""What a checkpoint holds, as one flat dict of names to values, and back into a model.

The names (what torchtitan and DTensor checkpoints use for the weights, so the files load
into each other's models):

- each parameter and persistent buffer under its name (the module's fully qualified name,
  or the name ``model.checkpoint_names()`` gives it, e.g. Hugging Face's);
- ``optimizer.state.NAME.KEY`` per optimizer state entry (AdamW's ``exp_avg`` and
  ``exp_avg_sq``, laid out as their parameter, and ``step``) and
  ``optimizer.param_groups.G.KEY`` per hyperparameter of group ``G`` (its ``params``: the
  parameters' names): what DCP writes for ``{"optimizer": get_optimizer_state_dict(...)}``,
  so the optimizer state moves between meshfuse and PyTorch's DTensor models too;
- ``rng.RANK``: the rank's torch generators (meshfuse's random ops and dropout draw their
  seeds from torch's default CPU generator, so it is the whole random state);
- ``extra``: the caller's objects (the step, the data position).

Every tensor is a :class:`~.chunks.ShardedValue`: a meshfuse module's parameter is placed in
its global tensor by the schedule of its TensorView (``parameter_tensors()`` of
``FusionModule`` and ``FullyShardedModule``), a DTensor by its placements, anything else is
replicated (every rank holds it whole).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshfuse.checkpoint.chunks import ShardedValue, boxed, chunks_of, flat_piece, whole
from meshfuse.errors import CheckpointError
from meshfuse.sharding import global_shape, shard_indices

OPTIMIZER = "optimizer.state."
GROUPS = "optimizer.param_groups"
RNG = "rng."
EXTRA = "extra"
RESERVED = ("optimizer.", RNG, EXTRA)


def checkpoint_names(model: torch.nn.Module) -> dict[str, str]:
    """The checkpoint's name of each of ``model``'s state-dict entries (what the
    ``checkpoint_names()`` of ``model`` or of its submodules, outer ones first, call them)."""
    named: dict[str, str] = {}
    for prefix, module in reversed(list(model.named_modules())):
        hook = getattr(module, "checkpoint_names", None)
        if callable(hook):
            named.update({f"{prefix}.{k}" if prefix else k: v for k, v in hook().items()})
    return {fqn: named.get(fqn, fqn) for fqn in model.state_dict(keep_vars=True)}


@dataclasses.dataclass(frozen=True)
class FlatPiece:
    """A parameter of which a flat shard holds the elements ``[start, stop)`` (row-major):
    its fqn, its shape and where they lie in the shard (``at``)."""

    fqn: str
    shape: tuple[int, ...]
    start: int
    stop: int
    at: int

    def value(self, flat: torch.Tensor) -> ShardedValue:
        """The piece of ``flat`` (laid out as the shard: its state too) as the parameter's."""
        return flat_piece(flat.detach()[self.at:self.at + self.stop - self.start],
                          self.shape, self.start)


def flat_shards(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, list[FlatPiece]]]:
    """Each flat shard parameter of ``model`` (a module with ``held_pieces()`` and
    ``shard``: ShardedStage) by its fqn, with the pieces of parameters it holds."""
    found = {}
    for prefix, module in model.named_modules():
        if not callable(getattr(module, "held_pieces", None)):
            continue
        pieces = [FlatPiece(f"{prefix}.{name}" if prefix else name, tuple(shape), start, stop,
                            at) for name, shape, start, stop, at in module.held_pieces()]
        found[f"{prefix}.shard" if prefix else "shard"] = (module.shard, pieces)
    return found


def _layouts(model: torch.nn.Module) -> dict[str, object]:
    """The TensorView laying out each meshfuse module parameter, by its fqn."""
    found = {}
    for prefix, module in model.named_modules():
        tensors = getattr(module, "parameter_tensors", None)
        if callable(tensors):
            for name, tv in tensors().items():
                found[f"{prefix}.{name}" if prefix else name] = tv
    return found


def _dtensor_value(name: str, t: DTensor) -> ShardedValue:
    if any(p.is_partial() for p in t.placements):
        raise CheckpointError(f"{name} is a DTensor with a partial placement {t.placements}: "
                              "reduce it (redistribute to Replicate or Shard) before saving")
    local = t.detach().to_local()
    if t.device_mesh.get_coordinate() is None:
        return ShardedValue(local, tuple(t.shape), ())
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return boxed(local, t.shape, offsets)


def tensor_value(name: str, t: torch.Tensor, tv=None) -> ShardedValue:
    """``t`` (a parameter's local shard under ``tv``'s schedule, a DTensor, or a tensor every
    rank holds whole) as chunks of its global tensor."""
    if isinstance(t, DTensor):
        return _dtensor_value(name, t)
    if tv is None:
        return whole(t.detach())
    shape = global_shape(tv)
    return ShardedValue(t.detach(), shape, chunks_of(shape, shard_indices(tv, shape)))


def model_values(model: torch.nn.Module) -> dict[str, ShardedValue]:
    """``model``'s parameters and persistent buffers by checkpoint name."""
    names, layouts, flat = checkpoint_names(model), _layouts(model), flat_shards(model)
    pieces = {p.fqn: p.value(shard) for shard, ps in flat.values() for p in ps}
    return {names[fqn]: pieces[fqn] if fqn in pieces else tensor_value(fqn, t, layouts.get(fqn))
            for fqn, t in model.state_dict(keep_vars=True).items() if fqn not in flat}


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """The checkpoint name of each parameter, by ``id`` of the parameter."""
    names = checkpoint_names(model)
    return {id(p): names.get(fqn, fqn) for fqn, p in model.named_parameters()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to_local() if isinstance(t, DTensor) else t.detach()


def like_parameter(param: ShardedValue, value):
    """An optimizer state entry laid out as its parameter where it has the parameter's local
    shape (moments), else held whole (``step``) or kept as an object."""
    if not isinstance(value, torch.Tensor):
        return value
    local = _local(value)
    if local.dim() and local.shape == param.local.shape:
        return param.with_local(local)
    return whole(local)


def optimizer_values(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     params: dict[str, ShardedValue]) -> dict[str, object]:
    """``optimizer``'s state and hyperparameters by checkpoint name."""
    ids, values = parameter_names(model), {}
    names = checkpoint_names(model)
    pieces = {id(shard): ps for shard, ps in flat_shards(model).values()}
    flat = {key: [names[p.fqn] for p in ps] for key, ps in pieces.items()}
    for g, group in enumerate(optimizer.param_groups):
        missing = [i for i, p in enumerate(group["params"]) if id(p) not in ids]
        if missing:
            raise CheckpointError(f"the optimizer holds parameters {missing} of a group that "
                                  "are not the model's: pass the optimizer of this model")
        for key, value in group.items():
            values[f"{GROUPS}.{g}.{key}"] = value if key != "params" else \
                [n for p in group["params"] for n in flat.get(id(p), [ids[id(p)]])]
        for p in group["params"]:
            if id(p) in flat:
                values.update(_flat_state(names, pieces[id(p)], optimizer.state.get(p, {}), p))
                continue
            for key, value in optimizer.state.get(p, {}).items():
                name = ids[id(p)]
                values[f"{OPTIMIZER}{name}.{key}"] = like_parameter(params[name], value)
    return values


def _flat_state(names: dict[str, str], pieces: list[FlatPiece], state: dict,
                shard: torch.Tensor) -> dict[str, object]:
    """A flat shard's optimizer ``state`` as the ``pieces`` of parameters it holds (moments
    cut as the shard, ``step`` and the like for each)."""
    values = {}
    for piece in pieces:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == shard.shape and value.dim():
                value = piece.value(value)
            elif isinstance(value, torch.Tensor):
                value = whole(value.detach())
            values[f"{OPTIMIZER}{names[piece.fqn]}.{key}"] = value
    return values


def merge_groups(values: dict[str, object], process_group=None) -> dict[str, object]:
    """``values`` with each group's parameter names those of every rank (pipeline stages
    hold different parameters; the one copy of a group written must name them all)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    mine = {k: v for k, v in values.items() if is_group_entry(k) and k.endswith(".params")}
    every: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(every, mine, group=process_group)
    merged = dict(values)
    for other in every:
        for key, names in other.items():
            merged[key] = list(dict.fromkeys([*merged.get(key, []), *names]))
    return merged


def is_group_entry(key: str) -> bool:
    """Whether ``key`` names a hyperparameter of a saved optimizer (``GROUPS.G.KEY``; or
    ``GROUPS``, all groups as one object)."""
    return key == GROUPS or key.startswith(GROUPS + ".")


def saved_groups(values: dict[str, object]) -> list[dict] | None:
    """The saved optimizer's parameter groups from the loaded ``values`` (None without)."""
    if GROUPS in values:
        return values[GROUPS]
    groups: dict[int, dict] = {}
    for key, value in values.items():
        if key.startswith(GROUPS + "."):
            g, entry = key[len(GROUPS) + 1:].split(".", 1)
            groups.setdefault(int(g), {})[entry] = value
    return [groups[g] for g in sorted(groups)] if groups else None


def rng_state() -> dict[str, object]:
    """This rank's torch generators (CPU, and every CUDA device's where there are any)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, object]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
