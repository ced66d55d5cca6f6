"""Dropout in ``sdpfa_fwd``/``sdpfa_bwd``: which random stream each attention shard draws.

One user-visible seed and offset per attention call (``rng_seed``/``rng_offset``, or a seed
drawn from torch's default generator at each call) decide every mask. Two modes:

- ``"shard"`` (default, fast): each shard's kernel draws from its own stream, keyed by the
  seed, the offset and the shard's position in the global tensor (the first global batch,
  head and query index it holds). Streams are independent across shards, so no two heads
  anywhere share a mask, and the same seed and schedule give the same masks. On CUDA the
  fused kernel (cuDNN, flash, memory-efficient) runs with torch's CUDA generator pointed at
  a private generator seeded with the stream's key for the call
  (:mod:`meshfuse.ops.random.generator_swap`); its backward replays the RNG state the forward
  returned. In a program, what depends on the signature only (the key's words, the
  generators, the state's form) is decided once (:class:`FusedDropout`). On CPU, and
  wherever the math kernel runs, the mask is drawn with meshfuse's generator from the stream
  key and the element's local position.
- ``"global"`` (for validation): the keep mask is ``uniform(seed, offset)[b, h, i, j] >= p``
  at the *global* position, exactly what ``fd.ops.uniform(0, 1, [B, H, S, Skv], rng_seed=seed,
  rng_offset=offset)`` gives, so a sharded run is bitwise the unsharded one at any world
  size. It always runs the math kernel (the probability matrix is materialized).

The RNG state ``sdpfa_fwd`` returns for its backward has nvFuser's form whatever the kernel:
``seed`` a ``[2]`` uint64 tensor holding the stream's (Philox seed, offset), ``offset`` a 0-d
uint64 zero; zeros without dropout. :func:`rng_state` and :func:`kernel_state` convert
between it and each kernel's own tensors. Where the state never leaves a program (not a
fusion output, read only by backwards of that program that run the forward's kernel), it
travels in the kernel's own form instead (*kernel form*, decided once per signature): joining
cuDNN's two tensors into nvFuser's one costs a GPU launch per call.

``MESHFUSE_DROPOUT_MODE=global|shard`` sets the mode of attention calls that do not pass
``dropout_mode``. A backward that does not pass it uses its forward's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError, InputError
from meshfuse.ir.global_index import GlobalIndex
from meshfuse.ops.attention.backends import AttentionBackend
from meshfuse.ops.random import rng
from meshfuse.ops.random.generator_swap import GeneratorSwap, generator_swap
from meshfuse.ops.registry import AxisSpec, OutSpec

ENV_VAR = "MESHFUSE_DROPOUT_MODE"
SHARD, GLOBAL = "shard", "global"
MODES = (SHARD, GLOBAL)


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
    ``[B, H, S, Skv]`` mask block sits in the global mask (all keys are held). Made once per
    program signature (by localization); what it derives is computed on first use."""

    mode: str
    index: GlobalIndex

    @functools.cached_property
    def position(self) -> tuple[int, ...]:
        """The shard's first global index on every axis but the keys (batch, head, query,
        and any leading axes before them)."""
        return self.index.starts[:-1]

    @functools.cached_property
    def words(self) -> tuple[int, ...]:
        """What the stream key hashes besides the seed and offset: the shard's position in
        ``"shard"`` mode, nothing in ``"global"`` mode (one stream, indexed globally)."""
        return () if self.mode == GLOBAL else self.position

    @property
    def axis_names(self) -> tuple[str, ...]:
        """``b, h, s, k``, after ``l0, l1, ...`` for leading axes."""
        leading = len(self.index.extents) - 4
        return tuple(f"l{a}" for a in range(leading)) + ("b", "h", "s", "k")

    def stream(self, seed: int, offset: int) -> int:
        """The key of the stream this rank draws from for ``seed`` and ``offset``."""
        return rng.stream_key(seed, offset, *self.words)

    def keep_mask(self, seed: int, offset: int, dropout_p: float,
                  device: torch.device) -> torch.Tensor:
        """The local boolean keep mask ``[b, h, s, Skv]`` (True: kept)."""
        if self.mode == GLOBAL:
            counters, bound = self.index.linear(device), math.prod(self.index.extents)
        else:
            shape = self.index.local_shape
            bound = math.prod(shape)
            counters = torch.arange(bound, device=device).view(shape)
        return rng.unit_uniform(self.stream(seed, offset), counters, torch.float32,
                                bound=bound) >= dropout_p

    def describe(self, seed, offset) -> str:
        """A line for ``explain``: the stream (symbolic when the seed is a run-time value)."""
        if seed is None:
            source = "seed drawn from torch's generator at each call, offset 0"
        else:
            source = f"seed {getattr(seed, 'name', seed)}, offset {getattr(offset, 'name', offset)}"
            if isinstance(seed, int) and isinstance(offset, int):
                source += f" (stream key {self.stream(seed, offset):#018x})"
        if self.mode == GLOBAL:
            return (f"dropout mask at global {self.index.describe(self.axis_names)} from "
                    f"uniform(seed, offset); {source}")
        where = ", ".join(f"{n}={i}" for n, i in zip(self.axis_names, self.position))
        return f"dropout stream of this shard: hash(seed, offset, {where}); {source}"


def attention_site(mode: str, out: GlobalIndex, kv_length: int) -> DropoutSite:
    """The site of an attention whose output (or query gradient) has index ``out``
    (``[..., B, H, S, E]``) and whose keys number ``kv_length`` (always held whole): the mask
    is ``[..., B, H, S, Skv]``."""
    return DropoutSite(mode, GlobalIndex(out.extents[:-1] + (kv_length,),
                                         out.indices[:-1] + (None,)))


def run_in_stream(key: int, device: torch.device, kernel, *args):
    """``kernel(*args)`` with torch's CUDA generator drawing from the stream ``key`` (a
    fused CUDA kernel draws its dropout mask from it, and returns the RNG state its backward
    replays); the generator is left as it was. On other devices, just the call."""
    if device.type != "cuda":
        return kernel(*args)
    return generator_swap(device).run(key, kernel, *args)


# ----------------------------------------------------------------------------------------------
# The RNG state a forward hands to its backward

SEED_SPEC = OutSpec(DataType.UInt64, (AxisSpec(2),))
OFFSET_SPEC = OutSpec(DataType.UInt64, ())
_ZEROS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def no_rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The state of an attention without dropout: zeros, shared (never written)."""
    zeros = _ZEROS.get(device)
    if zeros is None:
        zeros = (torch.zeros(2, dtype=torch.uint64, device=device),
                 torch.zeros((), dtype=torch.uint64, device=device))
        _keep(_ZEROS, device, device, zeros)
    return zeros


def _keep(cache: dict, key, device: torch.device, value) -> None:
    """Caches ``value`` unless it was made inside a CUDA graph capture (its zeros are only
    written when the graph replays)."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        cache[key] = value


def rng_state(seed: int, offset: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The state of the math kernel's mask: the seed and offset it was drawn with, on the
    attention's ``device`` (beside its other outputs, as a fused kernel's)."""
    pair = torch.tensor([seed, offset], dtype=torch.int64, device=device).view(torch.uint64)
    return pair, no_rng_state(device)[1]


def state_of_kernel(backend: AttentionBackend, seed, offset, device: torch.device):
    """nvFuser's form of a fused kernel's RNG state (``seed``/``offset`` as it returned
    them): flash's already is; cuDNN's ``[1]`` int64 pair and the memory-efficient kernel's
    0-d int64 pair are joined into one ``[2]`` tensor on ``device`` (no copy back to the host;
    the memory-efficient kernel's pair, on the CPU outside a CUDA graph, is copied to the GPU
    so that every output of the forward is on one device)."""
    if backend is AttentionBackend.FLASH:
        return seed, offset
    pair = torch.cat([seed.reshape(1), offset.reshape(1)]).view(torch.uint64).to(device)
    return pair, no_rng_state(device)[1]


def kernel_state(backend: AttentionBackend, seed: torch.Tensor, offset: torch.Tensor,
                 dropout_p: float, device: torch.device, kernel_form: bool = False):
    """The fused kernel's own ``(seed, offset)`` tensors back from nvFuser's form, or as
    they are in ``kernel_form`` (the forward passed its kernel's tensors through); without
    dropout: zeros of the kernel's form, which it does not read."""
    if dropout_p == 0.0:
        return _kernel_zeros(backend, device)
    if kernel_form or backend is AttentionBackend.FLASH:
        return seed, offset
    _check_state(seed, offset)
    pair = seed.view(torch.int64)
    if backend is AttentionBackend.CUDNN:
        return pair[0:1], pair[1:2]
    # memory-efficient: 0-d int64 on the CPU, as it returned them (outside a CUDA graph its
    # backward reads them on the host)
    return pair[0].cpu(), pair[1].cpu()


_KERNEL_ZEROS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _kernel_zeros(backend: AttentionBackend, device: torch.device):
    key = (backend, device)
    zeros = _KERNEL_ZEROS.get(key)
    if zeros is None:
        if backend is AttentionBackend.FLASH:
            zeros = no_rng_state(device)
        elif backend is AttentionBackend.CUDNN:  # its backward wants them on the GPU
            zeros = (torch.zeros(1, dtype=torch.int64, device=device),
                     torch.zeros(1, dtype=torch.int64, device=device))
        else:
            zeros = (torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64))
        _keep(_KERNEL_ZEROS, key, device, zeros)
    return zeros


def from_legacy_state(seed, offset, device: torch.device):
    """The RNG state in nvFuser's form, also from the form of PyTorch before 2.7 (and of
    nvFuser programs of that time): a 0-d int64 Philox seed and a 0-d int64 offset, often on
    the CPU. Any other form is returned as it is (and checked where it is read)."""
    if isinstance(seed, torch.Tensor) and isinstance(offset, torch.Tensor) and \
            seed.ndim == 0 and offset.ndim == 0 and seed.dtype == torch.int64 and \
            offset.dtype == torch.int64:
        pair = torch.stack([seed, offset]).view(torch.uint64).to(device)
        return pair, no_rng_state(device)[1]
    return seed, offset


def seed_and_offset(seed: torch.Tensor, offset: torch.Tensor) -> tuple[int, int]:
    """The seed and offset of the math kernel's mask, from its state."""
    _check_state(seed, offset)
    first, second = seed.view(torch.int64).tolist()
    return first, second


def check_kernel_form(backend: AttentionBackend, seed, offset) -> None:
    """The internal invariant of *kernel form*: the state is a fused kernel's own tensors
    (checked on a program's first backward; its later calls read the same forward)."""
    assert isinstance(seed, torch.Tensor) and isinstance(offset, torch.Tensor) and (
        backend is AttentionBackend.FLASH or seed.dtype == torch.int64), (backend, seed)


def _check_state(seed, offset) -> None:
    if not isinstance(seed, torch.Tensor) or seed.dtype != torch.uint64 or \
            tuple(seed.shape) != (2,):
        got = f"{seed.dtype} {list(seed.shape)}" if isinstance(seed, torch.Tensor) else \
            type(seed).__name__
        raise InputError(f"sdpfa_bwd: seed must be the forward's RNG state, a uint64 [2] "
                         f"tensor (or, PyTorch's form before 2.7, a 0-d int64 seed with a "
                         f"0-d int64 offset), got {got}; pass sdpfa_fwd's seed and offset "
                         "outputs")


# Fused kernels whose RNG state is in device memory, captured or not: a backward in the same
# graph or one after it reads the state its forward's replay wrote.
GRAPH_SAFE_KERNELS = (AttentionBackend.CUDNN, AttentionBackend.FLASH)


class FusedDropout:
    """Per-shard dropout with a fused CUDA kernel in a program, for one input signature.

    Everything that depends on the signature only is decided once, when the program's kernel
    is bound: the words the stream key hashes (the shard's position), the step's own
    :class:`~meshfuse.ops.random.generator_swap.GeneratorSwap` (a private generator per step, so
    that a CUDA graph holding several dropout steps can seed each for its replay) and the form of
    the kernel's RNG state. A call hashes the seed and offset into the stream key (only when
    they changed since the last call: a constant seed is hashed once), swaps generators
    around the kernel and joins the kernel's RNG state into nvFuser's form, or, in
    ``kernel_form`` (the state only feeds this program's backwards), returns the kernel's own
    tensors unchanged.

    In a program replayed from a CUDA graph, the kernel runs inside the graph and the call's
    host work is :meth:`seed_stream`, done by the replay before it (see
    :mod:`meshfuse.runtime.replay.streams`).
    """

    def __init__(self, site: DropoutSite, backend: AttentionBackend, device: torch.device,
                 kernel_form: bool = False):
        self.backend = backend
        self.kernel_form = kernel_form
        self._words = site.words
        self._device = device
        self.swap = GeneratorSwap(device)
        self._last: tuple[int | None, int | None, int] = (None, None, 0)

    def key(self, seed: int, offset: int) -> int:
        """The stream key of ``seed`` and ``offset`` (``DropoutSite.stream``), cached."""
        last_seed, last_offset, key = self._last
        if seed != last_seed or offset != last_offset:
            key = rng.stream_key(seed, offset, *self._words)
            self._last = (seed, offset, key)
        return key

    def seed_stream(self, seed: int, offset: int) -> int:
        """Seeds this step's generator with the stream of ``seed`` and ``offset``, as a call
        does before its kernel (a replayed graph's kernel draws from it); returns the key."""
        key = self.key(seed, offset)
        self.swap.seed(key)
        return key

    def graph_unsafe(self) -> str | None:
        """Why this kernel's dropout cannot be replayed from a CUDA graph, or None: cuDNN and
        flash return their RNG state in device memory whether captured or not; the
        memory-efficient kernel returns it on the host outside a graph (a replay would hand
        its backward another form)."""
        if self.backend not in GRAPH_SAFE_KERNELS:
            return f"the {self.backend.value} kernel's RNG state is not graph-safe"
        if not self.swap.exchanges_states:
            return "this torch cannot exchange CUDA generator states"
        return None

    def forward(self, kernel, seed: int, offset: int, *args):
        """``kernel(*args)`` (a bound fused forward) drawing from this shard's stream:
        ``(attn, log_sumexp, seed, offset)``, the RNG state in nvFuser's form (or the
        kernel's, in ``kernel_form``)."""
        attn, lse, kernel_seed, kernel_offset = self.swap.run(self.key(seed, offset), kernel,
                                                              *args)
        if self.kernel_form:
            return attn, lse, kernel_seed, kernel_offset
        return (attn, lse,
                *state_of_kernel(self.backend, kernel_seed, kernel_offset, self._device))
