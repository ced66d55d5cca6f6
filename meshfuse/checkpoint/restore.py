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
    GROUPS,
    OPTIMIZER,
    RESERVED,
    parameter_names,
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
        if param is None or isinstance(md, BytesStorageMetadata):
            staged[key] = None
        elif len(md.size) and tuple(md.size) == param.shape:
            staged[key] = param.with_local(torch.empty(
                param.local.shape, dtype=md.properties.dtype, device=param.local.device))
        else:
            staged[key] = whole(torch.empty(md.size, dtype=md.properties.dtype))
    if GROUPS in metadata.state_dict_metadata:
        staged[GROUPS] = None
    return staged


def check(path: str, metadata: Metadata, params: dict[str, ShardedValue],
          strict: bool = True) -> None:
    """Raises a :class:`CheckpointError` where the checkpoint at ``path`` does not fit the
    model whose parameters are ``params``."""
    saved = metadata.state_dict_metadata
    tensors = {k for k, md in saved.items()
               if not k.startswith(RESERVED) and not isinstance(md, BytesStorageMetadata)}
    missing, extra = set(params) - set(saved), tensors - set(params)
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {len(missing)} of the model's tensors ({_listed(missing)})"
            f"; it holds {_listed(tensors)}: is it another model's? Load the checkpoint of "
            "this architecture (or rename with the model's checkpoint_names())")
    if extra and strict:
        raise CheckpointError(
            f"checkpoint {path} holds {len(extra)} tensors the model lacks ({_listed(extra)}): "
            "is it another model's? Pass strict=False to load the others and ignore these")
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


def apply_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    staged: dict[str, object]) -> None:
    """Sets ``optimizer``'s state and hyperparameters to the staged ones."""
    names = parameter_names(model)
    params = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    for key, value in staged.items():
        if not key.startswith(OPTIMIZER):
            continue
        name, entry = key[len(OPTIMIZER):].rsplit(".", 1)
        if name not in params:
            continue
        param = params[name]
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
    _apply_groups(optimizer, staged.get(GROUPS))


def _apply_groups(optimizer: torch.optim.Optimizer, groups) -> None:
    if groups is None:
        return
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
