"""A per-rank program captured once into a CUDA graph and replayed on each call.

A cached ``execute`` still launches each kernel (and each collective) from Python; for small
programs that host time is the whole cost (the seed's attention: about 50 us of GPU work under
about 150 us of launches). ``execute(inputs, cuda_graph=True)`` captures the program once per
input signature and then replays it: one launch for the whole program.

Contract of a :class:`GraphedProgram`:

- Its inputs are copied into buffers of its own before each replay, and its outputs are
  copied out of the graph's buffers, so callers keep plain tensors: later calls overwrite
  nothing they hold, and they may change or free their inputs between calls.
- Python values among the inputs (scalars) are part of the graph: the runner captures one
  graph per distinct value.
- It holds its input buffers and the memory of one run of the program (the graph's private
  pool) for as long as it is cached.
- The first call runs the program eagerly once (a warm-up on a side stream, as CUDA requires
  for library handles and workspaces), captures it, and replays it. Every rank captures alike,
  so NCCL captures the program's collectives on every rank.
- Random numbers: attention dropout drawn by a fused kernel is replayed as the interpreter
  draws it (each replay seeds the step's generator: :mod:`~meshfuse.runtime.replay.streams`;
  the warm-up's and the capture's seed draws are given back to torch's generator); a program
  whose random values are decided on the host at each call otherwise (a random op or the
  global dropout mask without a given seed) is refused with an InputError, as its graph would
  replay one draw forever.
- :func:`~meshfuse.runtime.comm.collectives.record_communications` sees the warm-up's collectives
  and, at each replay, the captured ones (the capture itself communicates nothing).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from meshfuse.errors import InputError
from meshfuse.runtime.comm import collectives
from meshfuse.runtime.comm.collectives import captured_communications
from meshfuse.runtime.interpreter.executor import Program
from meshfuse.runtime.replay.streams import plan_streams


class GraphedProgram:
    """``program`` captured on CUDA for inputs like ``inputs``; see the module doc."""

    def __init__(self, program: Program, inputs: Sequence[Any]):
        self._inputs = [buffer_like(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        self._copied = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        with torch.random.fork_rng(devices=[]):  # its seed draws are not a call's
            warm_up_run(program, self._inputs)
        self._streams = plan_streams(program, self._inputs)  # the kernels are bound now
        if isinstance(self._streams, str):
            raise InputError(f"execute(cuda_graph=True): the program cannot be captured: "
                             f"{self._streams}; run it without cuda_graph=True")
        with self._streams.capturing():
            self._graph, self._outputs, self._communications = capture(
                program, self._inputs, warm_up=False, generators=self._streams.generators)

    def run(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        """The program's outputs for ``inputs`` (of the signature it was captured for)."""
        if self._copied:
            copy_into([self._inputs[i] for i in self._copied],
                      [inputs[i] for i in self._copied])
        if self._streams.streams:
            self._streams.prepare(inputs)
        self._graph.replay()
        collectives.report(self._communications)
        outputs = [torch.empty_like(o) for o in self._outputs]
        on_device = [i for i, o in enumerate(self._outputs) if o.is_cuda]
        if on_device:
            copy_into([outputs[i] for i in on_device],
                      [self._outputs[i] for i in on_device])
        return outputs


def capture(program: Program, inputs: Sequence[Any], warm_up: bool = True,
            error_mode: str = "global", generators: Sequence[torch.Generator] = (),
            pool: Any = None, overwrite: Collection[int] = ()):
    """``(graph, outputs, communications)``: ``program`` on ``inputs`` captured into a CUDA
    graph (nothing runs until it is replayed). ``outputs`` live in the graph's private memory
    pool and are rewritten by each replay; the graph reads ``inputs`` at their addresses.
    ``warm_up``: run the program once on a side stream first, as CUDA requires for library
    handles and workspaces. ``error_mode``: ``torch.cuda.graph``'s ``capture_error_mode``
    (``"thread_local"`` lets other threads, such as NCCL's watchdog, use CUDA meanwhile).
    ``generators``: registered with the graph before its capture (PyTorch's graph-safe RNG:
    each replay reads their seed and offset of that moment; see
    :mod:`~meshfuse.runtime.replay.streams`). ``pool``: a memory pool handle to capture
    into (shared with other graphs: :mod:`~meshfuse.runtime.replay.pools`), else the
    graph's own. ``overwrite``: positions of inputs whose memory outputs may take
    (:func:`into_inputs`; the warm-up writes none)."""
    if warm_up:
        warm_up_run(program, inputs)
    graph = torch.cuda.CUDAGraph()
    for generator in generators:
        graph.register_generator_state(generator)
    with captured_communications() as communications, \
            torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode):
        outputs = into_inputs(program.run(inputs), inputs, overwrite)
    return graph, outputs, communications


def into_inputs(outputs: list, inputs: Sequence[Any], overwrite: Collection[int]) -> list:
    """``outputs``, each input at a position of ``overwrite`` (read by the program, needed
    by nobody after it: a backward's donated cotangent) given the values of the first
    output laid out as it is (shape, strides, element type; memory of the program's own) and
    standing for that output. Run at the end of a capture, the graph copies that output into
    the input's memory, so the output's own memory is an intermediate of the graph, free for
    the graphs captured after it in a shared pool: a stack of N layers' backward graphs
    hands one input gradient from layer to layer in the memory of the first cotangent,
    instead of holding N of them (16 x 16 MiB on a 1B model's step)."""
    if not overwrite:
        return outputs
    given = {x.untyped_storage()._cdata for x in inputs if isinstance(x, torch.Tensor)}
    outputs = list(outputs)
    for i in sorted(overwrite):
        target = inputs[i]
        for j, out in enumerate(outputs):
            if isinstance(out, torch.Tensor) and out.shape == target.shape and \
                    out.stride() == target.stride() and out.dtype == target.dtype and \
                    out.device == target.device and out.untyped_storage()._cdata not in given:
                target.copy_(out)
                outputs[j] = target
                break
    return outputs


def warm_up_run(program: Program, inputs: Sequence[Any]) -> None:
    """One run of ``program`` on a side stream (:func:`warm_up_stream`), as CUDA requires
    before a capture (library handles, workspaces); the current stream waits for it."""
    side = warm_up_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        program.run(inputs)
    torch.cuda.current_stream().wait_stream(side)


_WARM_UP_STREAMS: dict[int, torch.cuda.Stream] = {}


def warm_up_stream() -> torch.cuda.Stream:
    """The side stream of every warm-up before a capture on the current device, made once.
    cuBLAS keeps a workspace for each stream it ran on (32 MiB on an H100 or H200) for as
    long as the process lives: a new stream for each warm-up left one workspace allocated
    per captured graph (a 1B Llama step's 33 graphs held 1 GiB of them)."""
    device = torch.cuda.current_device()
    stream = _WARM_UP_STREAMS.get(device)
    if stream is None:
        stream = _WARM_UP_STREAMS[device] = torch.cuda.Stream()
    return stream


def buffer_like(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its strides (the program was built for them)."""
    buffer = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return buffer.copy_(x)


# bytes from which copy_into copies a tensor with a copy of its own
LARGE_COPY = 2**20


def copy_into(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copies each source into its destination: the large ones one by one, the small ones
    (a batch's token ids, scalars) with one launch. ``_foreach_copy_``'s kernel is slower
    for large tensors: on an H200, one bf16 tensor of 8 MiB in 10.4 us against ``copy_``'s
    6.9, of 48 MiB in 47.1 against 26.9
    (``benchmarks/results/2026-12-04-2124-h200-1gpu-copy-vs-foreach-copy-cef3aa9.txt``)."""
    small_to, small_from = [], []
    for to, source in zip(destinations, sources, strict=True):
        if to.nbytes >= LARGE_COPY:
            to.copy_(source)
        else:
            small_to.append(to)
            small_from.append(source)
    if small_to:
        torch._foreach_copy_(small_to, small_from)
