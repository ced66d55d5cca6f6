"""Dropout in ``sdpfa_fwd``/``sdpfa_bwd``: which random stream each attention shard draws.

One user-visible seed and offset per attention call (``rng_seed``/``rng_offset``, or a seed
drawn from torch's default generator at each call) decide every mask. Two modes:

- ``"shard"`` (default, fast): each shard's kernel draws from its own stream, keyed by the
  seed, the offset and the shard's position in the global tensor (the first global batch,
  head and query index it holds). Streams are independent across shards, so no two heads
  anywhere share a mask, and the same seed and schedule give the same masks. On CUDA the
  fused kernel (cuDNN, flash, memory-efficient) runs with torch's CUDA generator seeded with
  the stream's key for the call (and restored after); its backward replays the RNG state the
  forward returned. On CPU, and wherever the math kernel runs, the mask is drawn with
  meshfuse's generator from the stream key and the element's local position.
- ``"global"`` (for validation): the keep mask is ``uniform(seed, offset)[b, h, i, j] >= p``
  at the *global* position, exactly what ``fd.ops.uniform(0, 1, [B, H, S, Skv], rng_seed=seed,
  rng_offset=offset)`` gives, so a sharded run is bitwise the unsharded one at any world
  size. It always runs the math kernel (the probability matrix is materialized).

``MESHFUSE_DROPOUT_MODE=global|shard`` sets the mode of attention calls that do not pass
``dropout_mode``. A backward that does not pass it uses its forward's.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from meshfuse.errors import DefinitionError, InputError
from meshfuse.ir.global_index import GlobalIndex
from meshfuse.ops import rng

ENV_VAR = "MESHFUSE_DROPOUT_MODE"
SHARD, GLOBAL = "shard", "global"
MODES = (SHARD, GLOBAL)
_MAX_SEED = 2**63 - 1


def resolve_mode(op: str, mode: str | None) -> str:
    """``mode``, or ``MESHFUSE_DROPOUT_MODE``, or ``"shard"``; DefinitionError if unknown."""
    if mode is None:
        mode = os.environ.get(ENV_VAR, "").strip().lower() or SHARD
        where = f"{ENV_VAR}={mode!r}"
    else:
        where = f"dropout_mode={mode!r}"
    if mode not in MODES:
        raise DefinitionError(f"{op}: {where} is not a dropout mode; use 'shard' (fast, one "
                              "stream per shard) or 'global' (the unsharded run's mask)")
    return mode


@dataclasses.dataclass(frozen=True)
class DropoutSite:
    """One rank's part of an attention call's dropout: the mode, and where the rank's
    ``[B, H, S, Skv]`` mask block sits in the global mask (all keys are held)."""

    mode: str
    index: GlobalIndex

    @property
    def position(self) -> tuple[int, int, int]:
        """The shard's first global batch, head and query index."""
        return self.index.starts[:3]

    def stream(self, seed: int, offset: int) -> int:
        """The key of the stream this rank draws from for ``seed`` and ``offset``."""
        if self.mode == GLOBAL:
            return rng.stream_key(seed, offset)
        return rng.stream_key(seed, offset, *self.position)

    def keep_mask(self, seed: int, offset: int, dropout_p: float,
                  device: torch.device) -> torch.Tensor:
        """The local boolean keep mask ``[b, h, s, Skv]`` (True: kept)."""
        if self.mode == GLOBAL:
            counters = self.index.linear(device)
        else:
            shape = self.index.local_shape
            counters = torch.arange(int(torch.Size(shape).numel()), device=device).view(shape)
        return rng.unit_uniform(self.stream(seed, offset), counters, torch.float32) >= dropout_p

    def describe(self, seed, offset) -> str:
        """A line for ``explain``: the stream (symbolic when the seed is a run-time value)."""
        if seed is None:
            source = "seed drawn from torch's generator at each call, offset 0"
        else:
            source = f"seed {getattr(seed, 'name', seed)}, offset {getattr(offset, 'name', offset)}"
            if isinstance(seed, int) and isinstance(offset, int):
                source += f" (stream key {self.stream(seed, offset):#018x})"
        if self.mode == GLOBAL:
            return (f"dropout mask at global {self.index.describe('bhsk')} from "
                    f"uniform(seed, offset); {source}")
        b, h, s = self.position
        return (f"dropout stream of this shard: hash(seed, offset, b={b}, h={h}, s={s}); "
                f"{source}")


def attention_site(mode: str, out: GlobalIndex, kv_length: int) -> DropoutSite:
    """The site of an attention whose output (or query gradient) has index ``out``
    (``[B, H, S, ...]``) and whose keys number ``kv_length`` (always held whole)."""
    return DropoutSite(mode, GlobalIndex(out.extents[:3] + (kv_length,),
                                         out.indices[:3] + (None,)))


def run_in_stream(key: int, device: torch.device, kernel, *args):
    """``kernel(*args)`` with torch's CUDA generator seeded with ``key`` (a fused CUDA
    kernel draws its dropout mask from it, and returns the RNG state its backward replays);
    the generator's state is restored afterwards. On other devices, just the call."""
    if device.type != "cuda":
        return kernel(*args)
    if torch.cuda.is_current_stream_capturing():
        raise InputError(
            "sdpfa_fwd: dropout_p > 0 inside a CUDA graph capture is not supported (the graph "
            "would replay one mask forever); run without cuda_graph=True"
        )
    generator = torch.cuda.default_generators[
        device.index if device.index is not None else torch.cuda.current_device()]
    saved = generator.get_state()
    generator.manual_seed(key & _MAX_SEED)
    try:
        return kernel(*args)
    finally:
        generator.set_state(saved)
