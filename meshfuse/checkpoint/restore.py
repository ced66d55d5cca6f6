"""Loading in three steps, so that a bad checkpoint leaves the model as it was:

1. :func:`staging`: a private tensor for everything the checkpoint will fill (laid out as
   the model's), chosen from the checkpoint's metadata (which optimizer entries it has);
2. :func:`check`: the metadata against the model (names, global shapes, dtypes): a
   :class:`~meshfuse.errors.CheckpointError` naming the tensor and the fix, on every rank
   (every rank reads the same metadata and decides alike);
3. DCP reads into the staging tensors; only when every rank has read all of it,
   :func:`apply` copies them into the parameters and the optimizer.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.tensor import DTensor

from meshfuse.checkpoint.chunks import ShardedValue, whole
from meshfuse.checkpoint.state import (
    OPTIMIZER,
    RESERVED,
    checkpoint_names,
    flat_shards,
    is_group_entry,
    parameter_names,
    saved_groups,
)
from meshfuse.errors import CheckpointError


def _listed(names, limit: int = 4) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def staging(params: dict[str, ShardedValue], metadata: Metadata,
            optimizer: torch.optim.Optimizer | None) -> dict[str, object]:
    """A fresh value for each parameter and, with ``optimizer``, for each optimizer entry of
    the checkpoint whose parameter the model has."""
    staged: dict[str, object] = {
        name: v.with_local(torch.empty_like(v.local)) for name, v in params.items()}
    if optimizer is None:
        return staged
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(OPTIMIZER):
            continue
        name, _ = key[len(OPTIMIZER):].rsplit(".", 1)
        param = params.get(name)
        if param is None:
            continue  # a parameter not loaded (the model lacks it, or not chosen)
        if isinstance(md, BytesStorageMetadata):
            staged[key] = None
        elif len(md.size) and tuple(md.size) == param.shape:
            staged[key] = param.with_local(torch.empty(
                param.local.shape, dtype=md.properties.dtype, device=param.local.device))
        else:
            staged[key] = whole(torch.empty(md.size, dtype=md.properties.dtype))
    for key in metadata.state_dict_metadata:
        if is_group_entry(key):
            staged[key] = None
    return staged


def _chosen(path: str, params: dict[str, ShardedValue], only) -> dict[str, ShardedValue]:
    if only is None:
        return params
    only = [only] if isinstance(only, str) else list(only)
    unknown = sorted(set(only) - set(params))
    if unknown:
        raise CheckpointError(
            f"only= names {_listed(unknown)}, which the model lacks (loading {path}); the "
            f"model's checkpoint names are {_listed(params)}")
    return {name: params[name] for name in only}


def check(path: str, metadata: Metadata, params: dict[str, ShardedValue], strict: bool = True,
          allow_partial: bool = False, only=None) -> dict[str, ShardedValue]:
    """The model's tensors to load from the checkpoint at ``path`` (of ``params``, those
    named in ``only``; with ``allow_partial``, those the checkpoint holds); raises a
    :class:`CheckpointError` where the checkpoint does not fit them."""
    saved = metadata.state_dict_metadata
    chosen = _chosen(path, params, only)
    tensors = {k for k, md in saved.items()
               if not k.startswith(RESERVED) and not isinstance(md, BytesStorageMetadata)}
    missing, extra = set(chosen) - set(saved), tensors - set(params)
    if missing and not allow_partial:
        raise CheckpointError(
            f"checkpoint {path} lacks {len(missing)} of the model's tensors ({_listed(missing)})"
            f"; it holds {_listed(tensors)}: is it another model's? Load the checkpoint of "
            "this architecture (or rename with the model's checkpoint_names()), or pass "
            "allow_partial=True to keep the values of the tensors it lacks")
    if extra and strict:
        raise CheckpointError(
            f"checkpoint {path} holds {len(extra)} tensors the model lacks ({_listed(extra)}): "
            "is it another model's? Pass strict=False to load the others and ignore these")
    chosen = {name: value for name, value in chosen.items() if name not in missing}
    _check_tensors(path, saved, chosen)
    return chosen


def check_optimizer(path: str, metadata: Metadata, allow_partial: bool) -> None:
    """Raises a :class:`CheckpointError` where an optimizer is to be loaded from a checkpoint
    saved without one (unless ``allow_partial``)."""
    if not any(map(is_group_entry, metadata.state_dict_metadata)) and not allow_partial:
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state (it was saved without an optimizer):"
            " pass optimizer=None to load the model only, or allow_partial=True to keep the "
            "optimizer's state as it is")


def _check_tensors(path: str, saved, params: dict[str, ShardedValue]) -> None:
    for name, value in params.items():
        md = saved[name]
        if isinstance(md, BytesStorageMetadata):
            raise CheckpointError(f"checkpoint {path} holds {name} as an object, not a tensor")
        if tuple(md.size) != tuple(value.shape):
            raise CheckpointError(
                f"{name} has global shape {list(md.size)} in checkpoint {path} but "
                f"{list(value.shape)} in the model: build the model with the checkpoint's "
                "sizes")
        if md.properties.dtype != value.local.dtype:
            raise CheckpointError(
                f"{name} is {md.properties.dtype} in checkpoint {path} but "
                f"{value.local.dtype} in the model: build the model in "
                f"{md.properties.dtype} (or convert it after loading)")


def apply_model(params: dict[str, ShardedValue], staged: dict[str, object]) -> None:
    """Copies the staged weights into the parameters (their local shards)."""
    with torch.no_grad():
        for name, value in params.items():
            value.local.copy_(staged[name].local)


def _as_state(param: torch.nn.Parameter, value: torch.Tensor) -> torch.Tensor:
    """A loaded state tensor in the form the optimizer keeps for ``param`` (a DTensor laid
    out as a DTensor parameter where it has the parameter's local shape)."""
    if isinstance(param, DTensor) and value.shape == param.to_local().shape and value.dim():
        return DTensor.from_local(value, param.device_mesh, param.placements,
                                  shape=param.shape, stride=param.stride())
    return value


def check_groups(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 chosen: dict[str, ShardedValue], groups, allow_partial: bool) -> None:
    """Raises a :class:`CheckpointError` where the saved optimizer (its ``groups``, read with
    the data) lacks parameters of ``optimizer`` that are loaded, or has another number of
    parameter groups (unless ``allow_partial``)."""
    if groups is None or allow_partial:
        return
    names = parameter_names(model)
    saved = {name for group in groups for name in group["params"]}
    lacking = [names[id(p)] for g in optimizer.param_groups for p in g["params"]
               if names.get(id(p)) in chosen and names[id(p)] not in saved]
    if lacking:
        raise CheckpointError(
            f"the optimizer of checkpoint {path} did not hold {_listed(lacking)}, which this "
            "optimizer updates: pass allow_partial=True to start their state afresh")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the optimizer of checkpoint {path} has {len(groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups, or "
            "pass allow_partial=True to keep this one's hyperparameters")


def apply_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    chosen: dict[str, ShardedValue], staged: dict[str, object]) -> None:
    """Sets ``optimizer``'s state of the ``chosen`` parameters and its hyperparameters to the
    staged ones; a chosen parameter the saved optimizer held without state (not stepped
    yet) loses its state too."""
    names = parameter_names(model)
    params = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]
              if names.get(id(p)) in chosen}
    groups = saved_groups(staged)
    saved = {name for group in groups or () for name in group["params"]}
    stateful = {key[len(OPTIMIZER):].rsplit(".", 1)[0] for key in staged
                if key.startswith(OPTIMIZER)}
    for name in saved & set(params) - stateful:
        optimizer.state.pop(params[name], None)
    for key, value in staged.items():
        if not key.startswith(OPTIMIZER):
            continue
        name, entry = key[len(OPTIMIZER):].rsplit(".", 1)
        if name in params:
            _set_state(optimizer, params[name], entry, value)
    _apply_flat(model, optimizer, chosen, staged)
    if groups is not None and len(groups) == len(optimizer.param_groups):
        _apply_groups(optimizer, groups)


def _apply_flat(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                chosen: dict[str, ShardedValue], staged: dict[str, object]) -> None:
    """The staged state of the ``chosen`` parameters a flat shard (ShardedStage) holds
    pieces of, into the shard's state: the moments cut as the shard, ``step`` whole."""
    names = checkpoint_names(model)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    entries: dict[str, list[tuple[str, object]]] = {}
    for key, value in staged.items():
        if key.startswith(OPTIMIZER):
            name, entry = key[len(OPTIMIZER):].rsplit(".", 1)
            entries.setdefault(name, []).append((entry, value))
    for shard, pieces in flat_shards(model).values():
        if id(shard) not in held:
            continue
        state = optimizer.state[shard]
        for piece in pieces:
            for entry, value in entries.get(names[piece.fqn], ()) \
                    if names[piece.fqn] in chosen else ():
                if isinstance(value, ShardedValue) and value.flat:
                    target = state.setdefault(entry, torch.zeros_like(shard.detach()))
                    with torch.no_grad():
                        target[piece.at:piece.at + piece.stop - piece.start].copy_(value.local)
                else:
                    tensor = value.local if isinstance(value, ShardedValue) else value
                    state[entry] = tensor.clone() if isinstance(tensor, torch.Tensor) else tensor


def _set_state(optimizer: torch.optim.Optimizer, param, entry: str, value) -> None:
    tensor = value.local if isinstance(value, ShardedValue) else value
    old = optimizer.state[param].get(entry)
    if isinstance(old, DTensor):
        old = old.to_local()
    if isinstance(old, torch.Tensor) and isinstance(tensor, torch.Tensor) and \
            old.shape == tensor.shape:
        with torch.no_grad():
            old.copy_(tensor)
    else:
        optimizer.state[param][entry] = _as_state(param, tensor)


def _apply_groups(optimizer: torch.optim.Optimizer, groups) -> None:
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
