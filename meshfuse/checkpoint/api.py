"""``save`` and ``load``: a model's shards, its optimizer, the random state and the caller's
objects, through torch.distributed.checkpoint (DCP) and its file-system storage.

Every rank calls them (they are collective over the default process group, or
``process_group``); without torch.distributed one process saves and loads alone.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshfuse.checkpoint.chunks import ShardedValue
from meshfuse.checkpoint.integrity import agreed, check_files, read_metadata
from meshfuse.checkpoint.planners import CountingReader, CountingWriter, LoadPlanner, SavePlanner
from meshfuse.checkpoint.replicas import share, shared_reads
from meshfuse.checkpoint.restore import (
    apply_model,
    apply_optimizer,
    check,
    check_groups,
    check_optimizer,
    staging,
)
from meshfuse.checkpoint.state import (
    EXTRA,
    RNG,
    merge_groups,
    model_values,
    optimizer_values,
    rng_state,
    saved_groups,
    set_rng_state,
)
from meshfuse.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """What this rank wrote: tensor bytes (its chunks, replicas written by one rank only)."""

    bytes_written: int


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What :func:`load` read on this rank: the ``extra`` objects saved with the model, the
    tensor bytes read from storage (saved chunks it touched, whole) and those it kept."""

    extra: object
    bytes_read: int
    bytes_needed: int


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
               extra: object = None) -> dict[str, object]:
    """The flat dict a checkpoint of ``model`` holds (see :mod:`.state` for the names)."""
    state: dict[str, object] = model_values(model)
    if optimizer is not None:
        state.update(optimizer_values(model, optimizer, dict(state)))
    state[f"{RNG}{_rank()}"] = rng_state()
    state[EXTRA] = extra
    return state


def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: object = None, *, process_group=None, thread_count: int = 1) -> SaveResult:
    """Saves ``model`` (each parameter as its global tensor: this rank writes its shards,
    replicas once), ``optimizer``'s state, every rank's random state and ``extra`` (any
    picklable object: the step, the data position) to the directory ``path``.

    Example:
        >>> meshfuse.checkpoint.save("ckpt/step100", model, opt, extra={"step": 100})
        >>> result = meshfuse.checkpoint.load("ckpt/step100", model, opt)
        >>> start = result.extra["step"]
    """
    writer = CountingWriter(path, thread_count=thread_count)
    state = merge_groups(state_dict(model, optimizer, extra), process_group)
    dcp.save(state, storage_writer=writer, planner=SavePlanner(),
             process_group=process_group)
    return SaveResult(writer.bytes_written)


class _Staged:
    """DCP's async stager for a state already copied off the training's tensors."""

    should_synchronize_after_execute = False

    def stage(self, state):
        return state

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _copied(state: dict[str, object], buffers: dict[str, torch.Tensor]) -> dict[str, object]:
    """``state`` with each tensor copied to host memory (pinned where it is on a GPU), so
    training may change the originals while the copy is written; ``buffers`` are host
    tensors of an earlier save to copy into where they fit (filled with the new ones)."""
    out = {}
    for name, value in state.items():
        if isinstance(value, ShardedValue):
            local, host = value.local, buffers.get(name)
            if host is None or host.shape != local.shape or host.dtype != local.dtype:
                host = buffers[name] = torch.empty(local.shape, dtype=local.dtype,
                                                   pin_memory=local.is_cuda)
            value = value.with_local(host.copy_(local, non_blocking=True))
        out[name] = value
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return out


@functools.cache
def _background_group():
    """A gloo group of every rank for the saves' background collectives, so that they
    never interleave with the training's on the default group (None without
    torch.distributed). Made by the first ``async_save``, which every rank calls."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


@dataclasses.dataclass
class AsyncSave:
    """A save under way: ``stall_seconds`` the caller waited (copying to host memory);
    ``result()`` waits for the files."""

    future: Future
    writer: CountingWriter
    stall_seconds: float
    buffers: dict[str, torch.Tensor]

    def result(self) -> SaveResult:
        self.future.result()
        return SaveResult(self.writer.bytes_written)


def async_save(path: str, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None = None, extra: object = None, *,
               previous: AsyncSave | None = None, process_group=None,
               thread_count: int = 1) -> AsyncSave:
    """:func:`save` in the background: returns once the state is copied to host memory
    (training may go on), the files are written by a thread. ``previous``, the last
    ``async_save``, lends its host (pinned) memory once its files are written (it is waited
    for), so a training loop allocates the copies once. With torch.distributed the process
    group needs a CPU backend (gloo)."""
    start = time.perf_counter()
    buffers = {}
    if previous is not None:
        previous.result()
        buffers = previous.buffers
    state = _copied(merge_groups(state_dict(model, optimizer, extra), process_group), buffers)
    writer = CountingWriter(path, thread_count=thread_count)
    group = process_group if process_group is not None else _background_group()
    future = dcp.async_save(state, storage_writer=writer, planner=SavePlanner(),
                            process_group=group, async_stager=_Staged())
    return AsyncSave(future, writer, time.perf_counter() - start, buffers)


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         *, strict: bool = True, allow_partial: bool = False, only=None,
         restore_rng: bool = True, process_group=None) -> LoadResult:
    """Loads the checkpoint at ``path`` into ``model`` (and ``optimizer``), whatever mesh,
    world size and schedule it was saved under: each rank reads the saved chunks that
    overlap its shards; a tensor every rank of a host holds whole is read by one of them
    and broadcast to the others. Restores this rank's random state (the rank's own where the
    checkpoint has it, else rank 0's) unless ``restore_rng`` is False.

    Args:
        optimizer: None loads the model only (a checkpoint with or without optimizer state).
        strict: False ignores tensors of the checkpoint that the model lacks.
        allow_partial: True keeps the values of the model's tensors the checkpoint lacks
            (and of the optimizer's state where the checkpoint has none for a parameter).
        only: checkpoint names of the model's tensors to load (a name or several; see
            ``state_dict(model)``); the others, and their optimizer state, keep their values.

    Raises:
        CheckpointError: on every rank, before the model or the optimizer is changed, when
            the checkpoint lacks a tensor of the model (unless ``allow_partial``) or
            (``strict``) holds one the model lacks, a shape or dtype differs, it holds no
            optimizer state for ``optimizer``, or a file is missing, truncated or corrupt.

    Example:
        >>> checkpoint.load("ckpt/step100", model)      # the weights only
        >>> checkpoint.load("ckpt/step100", model, only=["lm_head.weight"], strict=False)
    """
    reader = CountingReader(path)
    params = model_values(model)

    def prepare():
        metadata = read_metadata(reader, path)
        chosen = check(path, metadata, params, strict, allow_partial, only)
        if optimizer is not None:
            check_optimizer(path, metadata, allow_partial)
        check_files(path, metadata)
        return metadata, chosen
    metadata, chosen = agreed(prepare, process_group)
    staged = staging(chosen, metadata, optimizer)
    rng = f"{RNG}{_rank()}" if f"{RNG}{_rank()}" in metadata.state_dict_metadata else f"{RNG}0"
    for key in (EXTRA, rng):
        if key in metadata.state_dict_metadata:
            staged[key] = None
    _read(path, reader, staged, process_group)
    if optimizer is not None:  # every rank read the same groups: they decide alike
        check_groups(path, model, optimizer, chosen, saved_groups(staged),
                     allow_partial)
    apply_model(chosen, staged)
    if optimizer is not None:
        apply_optimizer(model, optimizer, chosen, staged)
    if restore_rng and staged.get(rng) is not None:
        set_rng_state(staged[rng])
    return LoadResult(staged.get(EXTRA), reader.bytes_read, reader.bytes_needed)


def _read(path: str, reader: CountingReader, staged: dict[str, object], process_group) -> None:
    """DCP reads ``staged`` (tensors every rank of a host holds whole: one rank each, then
    broadcast in the host)."""
    shared = shared_reads(staged) if process_group is None else []
    others = {n: staged.pop(n) for n, rank in shared if rank != _rank()}
    try:
        dcp.load(staged, storage_reader=reader, planner=LoadPlanner(),
                 process_group=process_group)
    except CheckpointException as e:
        raise CheckpointError(f"reading checkpoint {path} failed on ranks "
                              f"{sorted(e.failures)}: {_first(e)}; a file is truncated or "
                              "corrupt: save again or use an earlier checkpoint") from e
    staged.update(others)
    share(staged, shared)


def _first(e: CheckpointException) -> str:
    failure = next(iter(e.failures.values()))
    exc = failure[0] if isinstance(failure, tuple) else failure
    return f"{type(exc).__name__}: {str(exc)[:200]}"
