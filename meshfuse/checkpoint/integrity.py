"""Is the checkpoint there and whole? Checked from its metadata before anything is read, and
decided alike on every rank.

DCP's metadata records, for every saved item (a tensor's chunk, a pickled object), the file
that holds it and the byte range in it. A file that is missing or shorter than the end of
its last item (a save cut short, a partial copy) is found by a ``stat`` per file, without
reading data, and named with the first tensor it cuts. DCP stores no checksums, so bytes
changed inside an item are found only where they break its deserialization (DCP's read
fails, which :func:`~.api.load` also reports as a :class:`CheckpointError`).

Each rank checks what it sees; :func:`agreed` shares the outcome, so that a rank whose view
differs (a file system not shared alike) cannot leave the others waiting in a collective:
every rank raises the first failing rank's error.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from meshfuse.errors import CheckpointError

T = TypeVar("T")


def read_metadata(reader: FileSystemReader, path: str) -> Metadata:
    """The checkpoint's metadata, or a :class:`CheckpointError` saying why it cannot be read."""
    try:
        return reader.read_metadata()
    except FileNotFoundError as e:
        raise CheckpointError(f"no checkpoint at {path} ({e.filename} is missing): give the "
                              "directory save() wrote") from None
    except (EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError,
            RuntimeError) as e:  # a truncated or corrupt metadata file: unpickling fails
        raise CheckpointError(f"the metadata of checkpoint {path} cannot be read ({e!r}): "
                              "the file is truncated or corrupt; save again or use an "
                              "earlier checkpoint") from None


def _item(index) -> str:
    offset = f" at offsets {list(index.offset)}" if index.offset is not None else ""
    return f"{index.fqn}{offset}"


def check_files(path: str, metadata: Metadata) -> None:
    """Raises a :class:`CheckpointError` naming the file and the first item it lacks where a
    data file of the checkpoint at ``path`` is missing or ends before an item it holds."""
    ends: dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        ends.setdefault(info.relative_path, []).append((info.offset + info.length, index))
    for name, items in sorted(ends.items()):
        file = os.path.join(path, name)
        try:
            size = os.stat(file).st_size
        except FileNotFoundError:
            first = min(items, key=lambda e: e[0])[1]
            raise CheckpointError(
                f"checkpoint {path} lacks its data file {name} (which holds {_item(first)} "
                f"and {len(items) - 1} more items): copy the whole directory, or save "
                "again") from None
        cut = sorted((end, _item(index)) for end, index in items if end > size)
        if cut:
            end, first = cut[0]
            raise CheckpointError(
                f"checkpoint {path} is truncated: {name} has {size} bytes but {first} ends "
                f"at byte {end} ({len(cut)} items cut); the save did not finish or the copy "
                "is partial: save again or use an earlier checkpoint")


def agreed(step: Callable[[], T], process_group=None) -> T:
    """``step()`` on every rank; where it raises a :class:`CheckpointError` on any rank,
    every rank raises the first such rank's (one collective of the ranks' outcomes)."""
    error, result = None, None
    try:
        result = step()
    except CheckpointError as e:
        error = str(e)
    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size(process_group)
        errors = [None] * size
        dist.all_gather_object(errors, error, group=process_group)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, message = failed[0]
            where = "" if error == message else f" (on rank {rank})"
            raise CheckpointError(message + where)
    elif error is not None:
        raise CheckpointError(error)
    return result
