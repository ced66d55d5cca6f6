"""torch.distributed.checkpoint's planners and file storage, taught meshfuse's shards.

The state a checkpoint holds is one flat dict: a :class:`~.chunks.ShardedValue` per tensor
(this rank's chunks, each with its global offsets) and plain Python objects (pickled). The
save planner makes one write item per chunk; DCP's global step keeps one copy of items that
several ranks hold (replicas) and writes the metadata: each tensor's global shape, dtype and
chunks. The load planner asks, for each chunk a rank holds, for the overlapping parts of the
saved chunks, so a checkpoint written under one layout (mesh, world size, schedule) loads
under any other.

The storage classes count the bytes this rank writes and reads (tensor data as stored), what
:func:`~.api.save` and :func:`~.api.load` report.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    create_read_items_for_chunk_list,
)

from meshfuse.checkpoint.chunks import ShardedValue


def _write_items(fqn: str, value) -> list[WriteItem]:
    if not isinstance(value, ShardedValue):
        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]
    properties = TensorProperties.create_from_tensor(value.local)
    return [WriteItem(index=MetadataIndex(fqn, torch.Size(c.offsets)),
                      type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=c.storage(), properties=properties,
                                                  size=torch.Size(value.shape)))
            for c in value.chunks]


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner (replicas deduplicated) over a flat dict of
    :class:`ShardedValue` s and objects."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([item for fqn, value in self.state_dict.items()
                              for item in _write_items(fqn, value)])
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        return value.piece(index.offset) if isinstance(value, ShardedValue) else value


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner over a flat dict of :class:`ShardedValue` s (filled in
    place, chunk by chunk) and objects (replaced by what was saved)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # Not the default's: it walks the dict as a tree and drops the values it does not
        # know (ours), to make room for tensors on the meta device, which we never have.
        self.original_state_dict = self.state_dict = state_dict
        self.mappings = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for fqn, value in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(value, ShardedValue):
                chunks = [c.storage() for c in value.chunks]
                items += create_read_items_for_chunk_list(fqn, md, chunks)
            else:
                items += _create_read_items(fqn, md, value)
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].piece(index.offset)


def tensor_bytes(items) -> int:
    """The tensor bytes of write items (their chunks)."""
    return sum(math.prod(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize
               for i in items if i.type != WriteItemType.BYTE_IO)


class CountingWriter(FileSystemWriter):
    """``FileSystemWriter`` that counts the tensor bytes this rank writes
    (``bytes_written``) after DCP's deduplication of replicas."""

    bytes_written = 0

    def write_data(self, plan: SavePlan, planner):
        self.bytes_written += tensor_bytes(plan.items)
        return super().write_data(plan, planner)


class CountingReader(FileSystemReader):
    """``FileSystemReader`` that counts the tensor bytes this rank reads: ``bytes_read``
    as stored (each saved chunk it touches, read whole, once per read item), and
    ``bytes_needed``, the parts of them it keeps."""

    bytes_read = 0
    bytes_needed = 0

    def read_data(self, plan: LoadPlan, planner):
        md = self.metadata if hasattr(self, "metadata") else self.read_metadata()
        for item in plan.items:
            tensor = md.state_dict_metadata[item.storage_index.fqn]
            if isinstance(tensor, BytesStorageMetadata):
                continue
            size = tensor.properties.dtype.itemsize
            stored = next(c.sizes for c in tensor.chunks
                          if c.offsets == item.storage_index.offset)
            self.bytes_read += math.prod(stored) * size
            self.bytes_needed += math.prod(item.lengths) * size
        return super().read_data(plan, planner)
