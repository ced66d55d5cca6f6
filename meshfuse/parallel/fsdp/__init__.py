"""Fully sharded data parallelism (FSDP, ZeRO-3) and HSDP as a schedule (docs/fsdp.md).

- :mod:`~meshfuse.parallel.fsdp.spec`: named meshes, the mixed-precision policy, options;
- :mod:`~meshfuse.parallel.fsdp.transform`: a fusion rewritten with sharded parameter
  storages, gathered before their first use, and the batch split;
- :mod:`~meshfuse.parallel.fsdp.layers`: which layer each parameter belongs to, and the
  gathers and reductions that makes of a compiled fusion's communications;
- :mod:`~meshfuse.parallel.fsdp.program`: the program's order (gathers one layer ahead)
  and buckets (one collective per layer), asked for by the engine;
- :mod:`~meshfuse.parallel.fsdp.buckets`: the bucketed collectives, uneven shards padded;
- :mod:`~meshfuse.parallel.fsdp.memory`: the memory account of a rank;
- :mod:`~meshfuse.parallel.fsdp.clip`: the global norm of sharded gradients, and clipping.
"""

from meshfuse.parallel.fsdp.buckets import AheadOfStep
from meshfuse.parallel.fsdp.clip import clip_grad_norm_, copies, grad_norm
from meshfuse.parallel.fsdp.layers import layers_of, register_derivation, register_layers
from meshfuse.parallel.fsdp.memory import GATHERED, MemoryAccount, memory_account, nbytes
from meshfuse.parallel.fsdp.program import LayerSchedule, layer_schedule
from meshfuse.parallel.fsdp.spec import FsdpOptions, MixedPrecision, NamedMesh
from meshfuse.parallel.fsdp.transform import ShardedFusion, shard_fusion

__all__ = [
    "GATHERED",
    "AheadOfStep",
    "FsdpOptions",
    "LayerSchedule",
    "MemoryAccount",
    "MixedPrecision",
    "NamedMesh",
    "ShardedFusion",
    "clip_grad_norm_",
    "copies",
    "grad_norm",
    "layer_schedule",
    "layers_of",
    "memory_account", "nbytes",
    "register_derivation",
    "register_layers",
    "shard_fusion",
]
