"""``meshfuse.capture_step(step_fn)``: a whole training step replayed from one CUDA graph.

The automatic replay of each program (:mod:`~meshfuse.runtime.replay.automatic`) still
leaves Python between programs: autograd's engine, the loss, the optimizer's kernels. A
captured step launches the forward, the backward, the gradient reduction and the optimizer
step as one graph.

Contract of ``step = capture_step(step_fn, warmup=3)``; ``step(*args)`` returns what
``step_fn(*args)`` returns:

- **Per signature.** The arguments' tensors (shapes, strides, dtypes, devices) and other
  values make a signature; each gets its own graph. Its first ``warmup`` calls run
  ``step_fn`` as it is, on a side stream (CUDA asks for that before a capture: library
  handles, the optimizer's states, meshfuse's programs built and their segments compiled);
  the next call captures ``step_fn`` and replays the graph; later calls replay it. Every
  call is a real step.
- **Arguments are copied** into the graph's own buffers before each replay (the batch may
  be a new tensor at every step). What ``step_fn`` reads besides its arguments (the model's
  parameters, the optimizer's states) is read where it was at the capture: keep those
  tensors, update them in place (optimizers do).
- **Results are copied out** (``copy_outputs=True``): what a call returns is not rewritten
  by the next. ``copy_outputs=False`` returns the graph's own tensors, valid until the next
  call (no copy: for large results such as logits).
- **What the step must do**: set the gradients to None before its backward
  (``optimizer.zero_grad()``: a captured backward then writes them, in the graph's memory),
  use an optimizer that runs on the device without reading values back to the host
  (``torch.optim.AdamW(..., capturable=True)``, or ``fused=True``), and draw random numbers
  only from torch's generators (registered with the graph; meshfuse's own streams would
  replay one draw: a program with dropout or a random op is not to be captured). A
  collective is captured only where its communicator allows it (NCCL does; gloo does not).
- **meshfuse's programs inside** run the interpreter (the automatic replay is paused during
  the warm-up and the capture), so their kernels are recorded in the step's graph.
- **Memory**: the graph keeps its private pool (the step's activations and gradients) for as
  long as the step lives; a new signature captures a new graph and pool, up to
  ``max_graphs`` (then ``step_fn`` runs as it is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from meshfuse.errors import InputError
from meshfuse.runtime.replay.automatic import paused
from meshfuse.runtime.replay.graphs import buffer_like, copy_into, warm_up_stream


class StepGraphs:
    """What :class:`CapturedStep` asks of CUDA; tests pass a stand-in."""

    # a capture records the work without running it (the capturing call then replays)
    capture_runs = False

    @staticmethod
    def warm_up(fn: Callable[[], Any]) -> Any:
        side = warm_up_stream()  # one for every warm-up (each stream keeps a workspace)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            result = fn()
        torch.cuda.current_stream().wait_stream(side)
        return result

    @staticmethod
    def capture(fn: Callable[[], Any]) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = fn()
        return graph, result


def capture_step(step_fn: Callable[..., Any], warmup: int = 3, copy_outputs: bool = True,
                 max_graphs: int = 4, cuda=StepGraphs) -> CapturedStep:
    """``step_fn`` replayed from one CUDA graph per signature; see the module doc.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), capturable=True)
        >>> def train_step(x, y):
        ...     opt.zero_grad()
        ...     loss = loss_fn(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        ...     return loss
        >>> step = meshfuse.capture_step(train_step)
        >>> for x, y in batches:
        ...     loss = step(x, y)
    """
    if warmup < 1:
        raise InputError(f"capture_step(warmup={warmup}): at least one warm-up call is "
                         "needed before a capture (CUDA's library handles, the optimizer's "
                         "states, meshfuse's programs); pass warmup >= 1")
    return CapturedStep(step_fn, warmup, copy_outputs, max_graphs, cuda)


class CapturedStep:
    """A step and its graphs by signature (:func:`capture_step`)."""

    def __init__(self, step_fn, warmup: int, copy_outputs: bool, max_graphs: int, cuda):
        self.step_fn = step_fn
        self._warmup = warmup
        self._copy = copy_outputs
        self._max = max_graphs
        self._cuda = cuda
        self._calls: dict[tuple, int] = {}  # warm-up calls made, by signature
        self._graphs: dict[tuple, _StepGraph] = {}

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def __call__(self, *args):
        key = _signature(args)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph.replay(args, self._copy)
        done = self._calls.get(key, 0)
        if not done:
            _check_cuda(args, self._cuda)
        if done < self._warmup or len(self._graphs) >= self._max:
            self._calls[key] = done + 1
            with paused():
                return self._cuda.warm_up(lambda: self.step_fn(*args))
        graph = self._graphs[key] = _StepGraph(self.step_fn, args, self._cuda)
        if self._cuda.capture_runs:  # a stand-in's capture ran the step already
            return graph.results(self._copy)
        return graph.replay(args, self._copy)


class _StepGraph:
    """One signature's graph: its argument buffers and its results."""

    def __init__(self, step_fn, args: tuple, cuda):
        self._buffers = [buffer_like(a) if isinstance(a, torch.Tensor) else a for a in args]
        self._tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        buffers = self._buffers
        with paused():
            self._graph, result = cuda.capture(lambda: step_fn(*buffers))
        self._leaves, self._spec = tree_flatten(result)

    def replay(self, args: tuple, copy: bool):
        if self._tensors:
            copy_into([self._buffers[i] for i in self._tensors],
                      [args[i] for i in self._tensors])
        self._graph.replay()
        return self.results(copy)

    def results(self, copy: bool):
        leaves = [x.detach().clone() if copy and isinstance(x, torch.Tensor) else x
                  for x in self._leaves]
        return tree_unflatten(leaves, self._spec)


def _signature(args: tuple) -> tuple:
    """The tensors' layouts and the other arguments' values (an unhashable one by
    identity: a graph keeps what it saw at the capture)."""
    return tuple((a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                 else (type(a), _hashable(a)) for a in args)


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return id(value)
    return value


def _check_cuda(args: tuple, cuda) -> None:
    if cuda is not StepGraphs:
        return
    for position, a in enumerate(args):
        if isinstance(a, torch.Tensor) and not a.is_cuda:
            raise InputError(f"capture_step: argument {position} is on {a.device}; a CUDA "
                             "graph captures GPU work only: pass CUDA tensors, or call the "
                             "step without capture_step")
    if not torch.cuda.is_available():
        raise InputError("capture_step needs CUDA, which this process lacks")
