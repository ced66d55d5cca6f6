"""Checkpoints: save a model's shards, its optimizer and random state on one mesh, load them on
any other, through ``torch.distributed.checkpoint``; export to and import from Hugging Face's
safetensors. See docs/checkpoints.md."""

from meshfuse.checkpoint.api import (
    AsyncSave,
    LoadResult,
    SaveResult,
    async_save,
    load,
    save,
    state_dict,
)
from meshfuse.checkpoint.chunks import ShardedValue
from meshfuse.checkpoint.hf import export_hf, import_hf

__all__ = ["AsyncSave", "LoadResult", "SaveResult", "ShardedValue", "async_save", "export_hf",
           "import_hf", "load", "save", "state_dict"]
