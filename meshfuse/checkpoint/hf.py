"""Hugging Face weights: a model's global (unsharded) parameters as safetensors, by the
names of its checkpoint (``model.checkpoint_names()``: Hugging Face's for the Llama example;
a module captured from ``transformers`` by ``meshfuse.parallelize`` has them already).

``export_hf`` gathers each tensor's chunks on rank 0, which writes ``model.safetensors``;
``import_hf`` reads, on every rank, only the boxes of its own shards (safetensors slices),
checked against the model first (names, shapes, dtypes) as :func:`~.api.load` does.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

from meshfuse.checkpoint.chunks import ShardedValue
from meshfuse.checkpoint.restore import apply_model, check
from meshfuse.checkpoint.state import model_values
from meshfuse.errors import CheckpointError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _box(chunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))


def full_tensor(value: ShardedValue) -> torch.Tensor | None:
    """The global tensor of ``value`` on rank 0 (None elsewhere), from every rank's chunks."""
    pieces = [(c, value.piece(c.offsets).cpu()) for c in value.chunks]
    if _distributed():
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(pieces, gathered, dst=0)
        if dist.get_rank() != 0:
            return None
    else:
        gathered = [pieces]
    out = torch.empty(value.shape, dtype=value.local.dtype)
    for rank_pieces in gathered:
        for chunk, piece in rank_pieces:
            out[_box(chunk)] = piece
    return out


def export_hf(path: str, model: torch.nn.Module) -> None:
    """Writes ``model``'s global weights to ``path/model.safetensors`` (rank 0 writes; every
    rank calls it)."""
    from safetensors.torch import save_file  # installed with transformers: imported on use

    tensors = {name: full_tensor(value) for name, value in model_values(model).items()}
    if not _distributed() or dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    if _distributed():
        dist.barrier()


def _files(path: str) -> dict[str, str]:
    """Each tensor's safetensors file under ``path`` (one file, or an index's shards)."""
    from safetensors import safe_open

    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, WEIGHTS)
    if not os.path.exists(single):
        raise CheckpointError(f"no Hugging Face weights at {path}: neither {WEIGHTS} nor "
                              f"{INDEX} is there")
    try:
        with safe_open(single, "pt") as f:
            names = f.keys()
        return dict.fromkeys(names, single)
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise CheckpointError(f"{single} cannot be read ({e}): the file is truncated or "
                              "corrupt") from None


def _metadata(files: dict[str, str]) -> Metadata:
    """The safetensors' names, shapes and dtypes as DCP metadata (what :func:`check` reads)."""
    from safetensors import safe_open

    md = {}
    for file in sorted(set(files.values())):
        with safe_open(file, "pt") as f:
            names = f.keys()
            for name in names:
                s = f.get_slice(name)
                md[name] = TensorStorageMetadata(TensorProperties(_DTYPES[s.get_dtype()]),
                                                 torch.Size(s.get_shape()), [])
    return Metadata(md)


def import_hf(path: str, model: torch.nn.Module, *, strict: bool = True) -> None:
    """Loads Hugging Face safetensors weights from the directory ``path`` into ``model``
    (each rank reads the boxes of its shards).

    Raises:
        CheckpointError: on every rank, before any parameter changes: a tensor missing or
            (``strict``) extra, another shape or dtype, a file missing or unreadable.
    """
    from safetensors import safe_open

    files = _files(path)
    params = model_values(model)
    check(path, _metadata(files), params, strict)
    staged = {n: v.with_local(torch.empty_like(v.local)) for n, v in params.items()}
    failure = None
    try:
        for name, value in staged.items():
            with safe_open(files[name], "pt", device="cpu") as f:
                s = f.get_slice(name)
                for chunk in value.chunks:
                    value.piece(chunk.offsets).copy_(s[_box(chunk)])
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        failure = f"reading {name} from {path} failed ({e}): the file is truncated or corrupt"
    _raise_everywhere(failure)
    apply_model(params, staged)


def _raise_everywhere(failure: str | None) -> None:
    """A CheckpointError on every rank when one rank's read failed."""
    failures = [failure]
    if _distributed():
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    failed = [rank for rank, f in enumerate(failures) if f]
    if failed:
        raise CheckpointError(f"{failures[failed[0]]} (on ranks {failed})")
