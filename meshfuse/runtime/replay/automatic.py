"""Automatic CUDA-graph replay of a cached program where it is safe: ``execute``'s default.

A cached ``execute`` of a small program is host-bound: Python launches each kernel (or each
compiled segment) in more time than the GPU takes to run it. Replaying a CUDA graph launches
the whole program at once. ``cuda_graph=True`` does that with copies of the inputs and the
outputs; the automatic replay here copies nothing, and so replays only where that is safe:

- **Which programs** (:func:`why_not_replayed`). A program on CUDA tensors that communicates
  nothing (collectives stay launched from Python, overlapped as the interpreter schedules
  them, with their timeouts and error reports), draws no random numbers on the host (a graph
  would replay one random tensor forever: a step with a random stream, see ``explain``,
  unless its seed is given; attention dropout with a fused kernel replays, each replay
  seeding its streams as the interpreter would: :mod:`meshfuse.runtime.replay.streams`),
  holds every output on this rank, and whose capture succeeds (an op that reads a value back
  to the host cannot be captured: the program then stays with the interpreter).
- **Which calls** (:func:`replay_wanted`). By default every call, unless
  ``MESHFUSE_CUDA_GRAPH=0`` or ``execute(..., cuda_graph=False)``; a call that donates its
  inputs (an autograd backward) too, see *Donation* below.
- **Inputs in place.** A graph reads its inputs where they were when it was captured, so
  graphs are kept per set of input addresses (and Python scalar values, but for the seeds
  of dropout, which each replay reads itself), and per state of
  ``torch.use_deterministic_algorithms`` (kernels such as flash attention's backward are
  chosen by it at each call; a graph keeps those it captured): a call whose inputs sit
  where a captured call's did, in the same mode, replays. A set of addresses is captured at
  its second call (the first runs the interpreter: a loop whose inputs move every call never
  pays for captures it would not replay; the signature's first call also binds kernels and
  compiles segments, which a capture must not do), or at its first where its inputs are
  settled (see *Repeated layers*), up to :data:`MAX_GRAPHS` graphs per
  signature and :data:`MAX_FUSION_GRAPHS` per fusion, over all its signatures, and while the
  pools of all the process's automatic graphs hold less than :data:`POOL_FRACTION` of the
  device's memory; beyond, the interpreter runs. A graph's capture follows a warm-up run on
  a side stream. Small integer and boolean inputs (a step's token ids, targets, masks: a new
  batch at each step, wherever the allocator puts it) are the exception: a replay copies
  them into buffers of its graph and they are not part of its key (:func:`data_inputs`),
  as a backward's cotangents (but those that lie at a graph's output: :meth:`AutoReplay.run`).
- **Repeated layers.** One program may run at many places of a step: the layers of a stack
  that ``meshfuse.parallelize`` builds once and calls once per layer (one autograd function,
  so one forward and one backward runner for all of them), or one fusion applied to several
  tensors. Each place has its own inputs (the layer's parameters, the previous layer's
  output), so its own set of addresses and its own graph: the limits per signature and per
  fusion are set for stacks of a hundred layers, not for the few graphs of one call site.
  What bounds them is memory, the pools' bytes. A layer's input is the previous layer's
  output, which moves into that layer's graph memory when its graph is captured: with the
  second-call rule alone, layer ``i`` would be captured at step ``i + 2``. So a set of
  addresses is captured at its first call where its inputs are *settled*: one at an output
  of a live graph (the previous layer's, replayed), each other tensor where an earlier call
  of the signature had its position's (the layer's parameters, met in the previous step),
  the scalars as at an earlier call; the whole stack replays from the second step.
- **A program fed its own output** (``x = f(x, w)``, the other inputs the same): each graph
  writes a new output address, which the next call's key holds; where the interpreter's
  outputs come back at recurring addresses (as the caching allocator hands them out), graph
  after graph was captured (a simulation: 60 after 1000 calls, up to :data:`MAX_GRAPHS`).
  Past :data:`MAX_CHAIN` graphs chained so, the input is copied into a graph's buffer
  (:meth:`AutoReplay._looped`): that key's two graphs take turns. A stack of one layer at
  every position (tied weights) keeps a graph per position up to that depth.
- **Outputs in the graph's memory.** A replay returns aliases of the graph's own output
  tensors, whose memory the next replay of that graph rewrites. So a graph replays only when
  nothing outside holds that memory any more (the storages' use counts are back to what the
  graph itself holds: a result, or any view of it, that the caller still holds counts). A
  loop ``out = execute(...)`` still holds the previous result during the next call: when every
  graph of a set of addresses is busy, a second one (its own output memory, in the pool of
  second graphs: :mod:`~meshfuse.runtime.replay.pools`) is captured for it, up to
  :data:`BUFFERS`; when those are busy too, the interpreter runs and what the
  caller holds stays as it was.

- **Donation.** A donating call (``execute(..., donate=True)``: an autograd backward, whose
  inputs are the cotangents and the forward's residuals) gives its references up so that
  the interpreter frees each input after its last use. A graph frees nothing: it is
  captured without donation (its intermediates are freed inside its own pool, which every
  replay reuses), and a replayed donating call holds its inputs until the replay is
  launched, then empties the caller's list as the interpreter would (the runner does:
  ``FusionRunner.execute``). The stream order keeps the memory safe: whatever the caching
  allocator hands out next is written by later kernels of the same stream. The cost is the
  inputs' memory held through the whole backward instead of freed one by one; where the
  forward replays, its residuals live in the forward graph's pool anyway. A donated input
  that nothing else holds at all (:func:`overwritable`: a cotangent autograd handed to this
  backward alone) and that the graph reads in place gives its memory to an output laid out
  alike: the graph ends with a copy of that output there
  (:func:`~meshfuse.runtime.replay.graphs.into_inputs`), so the output's own memory is an
  intermediate, free for the graphs captured after it in the shared pool. A stack's
  backwards so hand their input gradient down in one buffer (the top layer's cotangent's)
  instead of holding one per layer; graphs are kept per set of such inputs.
- **Autograd** (``fd.as_autograd_function()``, ``FusionModule``): the forward and the
  backward are two programs of two runners, each replayed under these rules; no rule is
  added. Residuals are outputs of the forward's graph, held by the autograd node until its
  backward takes them: the forward's graph is busy meanwhile (the use-count rule above),
  so a second forward before that backward (gradient accumulation over micro-batches, one
  layer applied twice, activation checkpointing's recomputation) replays the other graph
  of its set of addresses or runs the interpreter, and never rewrites residuals that a
  backward still has to read. The backward's graph reads the residuals at their addresses
  (a forward graph's output memory, the same from step to step): it is keyed, like any
  graph, on them. Its gradients are its outputs: a parameter's ``.grad`` that autograd
  set to one of them (it takes the tensor when ``.grad`` is None) makes that graph busy
  until ``zero_grad()`` sets it to None; accumulating into it meanwhile replays the
  backward's other graph, which is added into ``.grad`` (a copy).

Memory: the automatic graphs of a device share two memory pools, one for forwards and plain
calls and one for backwards, so that a stack's layers hold their outputs and one layer's
intermediates, not each layer's (:mod:`~meshfuse.runtime.replay.pools`, which also says
when a graph whose intermediates' memory a later graph's outputs took may replay;
``MESHFUSE_SHARED_GRAPH_POOLS=0``: a private pool per graph, one run's outputs and
intermediates each). ``explain`` says how much each signature's captures hold.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Collection, Sequence
from typing import Any

import torch

from meshfuse.errors import InputError
from meshfuse.ops.registry import lookup
from meshfuse.runtime.interpreter.executor import RESHARD, Program
from meshfuse.runtime.interpreter.fused import FUSED
from meshfuse.runtime.interpreter.program import unchanged_view
from meshfuse.runtime.replay.graphs import buffer_like, capture, copy_into
from meshfuse.runtime.replay.pools import (
    BACKWARD,
    FORWARD,
    SharedPool,
    pool_layout,
    shared_pool,
    written,
)
from meshfuse.runtime.replay.streams import (
    StreamPlan,
    plan_streams,
    seed_inputs,
    static_reason,
)

# graphs captured per program signature (all sets of input addresses: one per place of a
# step where the program runs, such as each layer of a stack that shares it)
MAX_GRAPHS = 128
# integer and boolean inputs up to this size are copied into a graph's buffers at each replay
# (see data_inputs)
DATA_BYTES = 16 * 2**20
BUFFERS = 2  # graphs (sets of output memory) per set of input addresses
# graphs of one program chained on its own outputs with the same other inputs, keyed on
# their addresses (see AutoReplay._looped)
MAX_CHAIN = 8
# replays of one copying graph with its copied inputs at the same addresses after which a
# graph reading them in place is captured (see AutoReplay._steady_or)
STEADY_CALLS = 3
# the most bytes of outputs per byte read in place that such a graph may add (see
# AutoReplay._worth_reading_in_place)
STEADY_OUTPUT_RATIO = 8
MAX_SEEN = 256  # sets of input addresses remembered until their second call
MAX_ADDRESSES = 8192  # their tensors' addresses remembered (see AutoReplay._settled)
MAX_FUSION_GRAPHS = 256  # graphs captured per fusion, over all its signatures
# the share of a device's memory that the pools of all automatic graphs may hold together
POOL_FRACTION = 0.25
AUTO = "auto"


_PAUSED = [0]  # > 0: no automatic replay (a whole step is warmed up or captured)


@contextlib.contextmanager
def paused():
    """No automatic replay inside (every thread: an autograd backward runs on the engine's):
    :func:`~meshfuse.runtime.replay.step.capture_step` warms a whole step up and captures
    it, with every program's kernels in its graph, and wants no graphs of the programs."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


class GraphBudget:
    """How many more graphs the signatures of one fusion may capture: a fusion called with
    many input shapes keeps at most :data:`MAX_FUSION_GRAPHS` graphs (and their memory)."""

    def __init__(self, graphs: int = MAX_FUSION_GRAPHS):
        self.left = graphs


def replay_wanted(option: bool | str | None, default: bool) -> bool:
    """Whether a call may replay automatically: ``option`` is ``execute``'s ``cuda_graph``
    (None: ``default``, from ``MESHFUSE_CUDA_GRAPH``; ``"auto"``: yes; False: no). A call
    that donates its inputs may (see the module doc: donation).

    Raises:
        InputError: for an option other than True (handled by the caller), "auto", False
            and None.
    """
    if option is None:
        wanted = default
    elif option == AUTO:
        wanted = True
    elif option is False:
        wanted = False
    else:
        raise InputError(f"execute(cuda_graph={option!r}): pass True (capture, copying inputs "
                         "and outputs), 'auto' (replay where safe, copying nothing: the "
                         "default) or False (never)")
    return wanted


def why_not_replayed(program: Program, device: torch.device) -> str | None:
    """Why ``program``, run on tensors of ``device``, is never replayed, or None."""
    if device.type != "cuda":
        return f"its inputs are on {device.type}, not on a CUDA device"
    if not program.steps:
        return "it launches nothing"
    for step, call in zip(program.steps, program.calls):
        random = static_reason(step, program.input_slots)
        if random is not None:
            return random
        if not _local(step, call):
            return f"it communicates ({step.label})"
    if not all(o.held for o in program.outputs):
        return "this rank does not hold every output"
    return None


def replay_lines(program: Program, device: torch.device, replays: Sequence[AutoReplay],
                 wanted: bool) -> list[str]:
    """explain's lines on the automatic replay of one signature: none for a program on the
    CPU (never replayed) or with the replay turned off (``wanted`` False); else the state of
    each of ``replays`` (one per compiled form), or before any call, the decision alone."""
    if device.type != "cuda" or not wanted:
        return []
    if not replays:
        reason = why_not_replayed(program, device)
        return [f"CUDA graph replay: off ({reason})" if reason else _NOT_YET]
    return [replay.describe() for replay in replays]


_NOT_YET = ("CUDA graph replay: on (nothing captured yet: a set of input addresses is "
            "captured at its second call)")


def _local(step, call) -> bool:
    """Whether a record runs on this rank's tensors only: a compiled segment, a reshard that
    moves no data (a local copy, on a mesh of one device), a ``set`` run as a view, or an op
    run by its registry implementation (a communication, a stream-parallel loop and a
    context-parallel attention run something else)."""
    if step.op == FUSED or call is unchanged_view:
        return True
    if step.op == RESHARD:
        return not step.plan and call is torch.clone
    try:
        op = lookup(step.op)
    except AttributeError:  # a reshard, a stream-parallel loop: no registry op
        return False
    if op.make_impl is not None:
        return isinstance(op.make_impl, type) and isinstance(call, op.make_impl)
    return call is op.impl


def cuda_capture(program: Program, inputs: Sequence[Any], generators=(),
                 pool: SharedPool | None = None, overwrite: Collection[int] = ()):
    """``(graph, outputs, grown, written)``: ``program`` captured into ``pool`` (with its
    warm-up run: :func:`~meshfuse.runtime.replay.graphs.capture`; ``generators`` registered
    with the graph; ``overwrite``: inputs whose memory outputs take,
    :func:`~meshfuse.runtime.replay.graphs.into_inputs`), the bytes the pool grew by, and
    the pool's memory the graph may write (:func:`~meshfuse.runtime.replay.pools.written`).
    ValueError unless every tensor is on CUDA."""
    if not all(x.is_cuda for x in inputs if isinstance(x, torch.Tensor)):
        raise ValueError("an input is not a CUDA tensor")
    handle = pool.cuda_handle() if pool is not None else None
    before, _, held = pool_layout(handle) if handle is not None else (0, [], [])
    # Thread-local capture: the program has no collective, and other threads (NCCL's
    # watchdog) may keep using CUDA while it is captured.
    graph, outputs, _ = capture(program, inputs, error_mode="thread_local",
                                generators=generators, pool=handle, overwrite=overwrite)
    if not all(o.is_cuda for o in outputs):
        raise ValueError("an output is not a CUDA tensor")
    after, segments, _ = pool_layout(graph.pool())
    return graph, outputs, after - before, written(segments, held)


def cuda_memory_limit(device: torch.device) -> int:
    """The bytes the automatic graphs' pools may hold on ``device``: :data:`POOL_FRACTION`
    of its memory."""
    return int(torch.cuda.get_device_properties(device).total_memory * POOL_FRACTION)


class CudaGraphs:
    """What :class:`AutoReplay` asks of CUDA: ``capture(program, inputs, generators)`` (see
    :func:`cuda_capture`), ``capturing()``, whether the current stream is being captured
    already (by the caller's own graph), and ``memory_limit(device)``, the bytes all the
    automatic graphs' pools may hold (a stand-in without it: no limit). Tests pass a
    stand-in."""

    capture = staticmethod(cuda_capture)
    capturing = staticmethod(torch.cuda.is_current_stream_capturing)
    memory_limit = staticmethod(cuda_memory_limit)


_LIVE: weakref.WeakSet[AutoReplay] = weakref.WeakSet()  # every AutoReplay of the process


# the addresses of the live automatic graphs' outputs (address -> how many outputs start
# there): an input found there stays there from call to call
_GRAPH_OUTPUTS: dict[int, int] = {}


def _track_outputs(graph: _Graph, outputs: Sequence[torch.Tensor]) -> None:
    addresses = [t.data_ptr() for t in outputs]
    for a in addresses:
        _GRAPH_OUTPUTS[a] = _GRAPH_OUTPUTS.get(a, 0) + 1
    weakref.finalize(graph, _forget_outputs, addresses)


def _forget_outputs(addresses: list[int]) -> None:
    for a in addresses:
        left = _GRAPH_OUTPUTS.get(a, 1) - 1
        if left > 0:
            _GRAPH_OUTPUTS[a] = left
        else:
            _GRAPH_OUTPUTS.pop(a, None)


# the storages of the live automatic graphs' outputs (handle -> the use count the graph's
# own references make): see overwritable
_GRAPH_STORAGES: dict[int, int] = {}


def _track_storages(graph: _Graph, storages: Sequence[int], counts: Sequence[int]) -> None:
    _GRAPH_STORAGES.update(zip(storages, counts))
    weakref.finalize(graph, _forget_storages, list(storages))


def _forget_storages(storages: list[int]) -> None:
    for s in storages:
        _GRAPH_STORAGES.pop(s, None)


def holders(x: torch.Tensor) -> tuple[int, int]:
    """``(tensors, storage uses)``: the references to ``x``'s tensor (not its Python object)
    and to its memory (its own tensor's, its views', its bases', a graph's)."""
    return x._use_count(), torch._C._storage_Use_Count(x.untyped_storage()._cdata)


def overwritable(x: torch.Tensor, alone: tuple[int, int]) -> bool:
    """Whether the one tensor ``x`` is all that holds its memory, but for the automatic
    graph whose output that memory may be (which rewrites it at its next replay anyway):
    no other tensor, view or base shares its storage. ``alone``: what :func:`holders`
    gives for a tensor made alone (the counts torch keeps vary with its version: a storage's
    Python object, once made, may count). The caller vouches that nothing else holds ``x``'s
    Python object (autograd handed it over: see ``meshfuse.autodiff.function``)."""
    uses, storage = holders(x)
    graph = _GRAPH_STORAGES.get(x.untyped_storage()._cdata)  # its tensors' uses
    return uses == alone[0] and storage == (alone[1] if graph is None else graph + 1)


def _addresses(inputs: Sequence[Any], unkeyed: frozenset[int]) -> list[tuple[int, int]]:
    """``(position, address)`` of each keyed tensor input."""
    return [(i, x.data_ptr()) for i, x in enumerate(inputs)
            if isinstance(x, torch.Tensor) and i not in unkeyed]


def _outside_graphs(addresses: list[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    """Those of ``addresses`` (``(position, address)``) not at a live graph's output."""
    return frozenset((i, a) for i, a in addresses if a not in _GRAPH_OUTPUTS)


def data_inputs(inputs: Sequence[Any]) -> frozenset[int]:
    """The positions of small integer or boolean tensor inputs (token ids, targets, masks:
    at most :data:`DATA_BYTES`, on the device of the floating-point inputs), which a replay
    copies into buffers of its graph rather than keying on their addresses: a training loop
    hands each step a new batch, wherever the allocator puts it, and the program would
    otherwise run the interpreter until the batches' addresses repeat (and every graph keyed
    on a later layer's output moved with it)."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    # on the device of the program's floating-point tensors (a host tensor, such as a
    # kernel's random state on the CPU, is no graph's buffer)
    devices = {x.device for x in tensors if x.is_floating_point() or x.is_complex()}
    return frozenset(i for i, x in enumerate(inputs)
                     if isinstance(x, torch.Tensor) and not x.is_floating_point()
                     and not x.is_complex() and x.device in devices
                     and x.numel() * x.element_size() <= DATA_BYTES)


def _values(key: tuple, inputs: Sequence[Any]) -> tuple:
    """``key`` without the tensors' addresses nor which of them are copied or overwritten (a
    cotangent read in place once the graph making it is captured is the same call's)."""
    n = len(inputs)
    return (*[None if isinstance(x, torch.Tensor) else k for x, k in zip(inputs, key)],
            *key[n + 2:])


def held_bytes() -> int:
    """The device memory that the pools of the process's automatic graphs hold (those of
    runners still alive: a dropped runner's graphs are freed with it)."""
    return sum(replay.pool_bytes for replay in list(_LIVE))


class AutoReplay:
    """The graphs of one program signature, keyed by input addresses; see the module doc.

    ``reason``: why the program is never replayed (None: it may be). ``budget``: the
    fusion's, shared by its signatures. ``cuda``: :class:`CudaGraphs` or a stand-in."""

    def __init__(self, program: Program, device: torch.device,
                 budget: GraphBudget | None = None, cuda=CudaGraphs):
        self._program = program
        self._budget = budget or GraphBudget()
        self._cuda = cuda
        self.reason = why_not_replayed(program, device)
        # inputs a replay reads on the host, not part of a graph's key
        self._unkeyed = seed_inputs(program) if self.reason is None else frozenset()
        self._staged: dict = {}  # see _staging
        # copied inputs' addresses that a graph reads in place, and for each copying key the
        # addresses of its copied inputs at its last call, with their count (_steady_or)
        self._steady: set[int] = set()
        self._streaks: dict[tuple, tuple[tuple, int]] = {}
        self._copying_kept: set[tuple] = set()  # copying keys found not worth a second graph
        self._unkeyed_of: dict[frozenset[int], frozenset[int]] = {}  # see _keyed
        self._graphs: dict[tuple, list[_Graph]] = {}
        self._seen: set[tuple] = set()  # sets of input addresses run once, not captured
        # the tensor inputs' (position, address) of those calls
        self._addresses: set[tuple[int, int]] = set()
        self._values: set[tuple] = set()  # and their keys' other values (see _settled)
        self._rests: set[frozenset] = set()  # captured graphs' inputs not graphs' outputs
        # this program's graphs' output addresses -> (the graph's place in a chain of graphs
        # fed their own outputs, its inputs that lie at no graph's output); those at the end
        # of a chain apart (see _looped)
        self._chained: dict[int, tuple[int, frozenset]] = {}
        self._chain_ends: dict[int, frozenset] = {}
        self.graphs = 0  # captured, over all sets of input addresses
        self.replaced = 0  # of those, dropped for one reading steady inputs in place
        self.pool_bytes = 0  # the device memory they hold
        self._streams = ""  # explain's words on the dropout streams a replay seeds
        self._device = device
        self.capped = False  # a capture was refused: the pools' memory limit is reached
        self.waits = 0  # calls where a graph waited for a later graph's outputs
        _LIVE.add(self)

    def run(self, inputs: Sequence[Any], staged: Collection[int] = (),
            donating: bool = False, overwrite: Collection[int] = ()
            ) -> list[torch.Tensor] | None:
        """The outputs replayed (or captured and replayed) for ``inputs``, or None where the
        interpreter must run this call (also inside the caller's own CUDA graph capture,
        which then captures the interpreter's kernels). ``staged``: the positions of
        tensor inputs whose addresses may change from call to call (a backward's
        cotangents): each graph copies them into buffers of its own, and they are not part
        of its key; but those that lie at a live graph's output, which are read in place
        (see :meth:`_find`).
        ``donating``: the call donates its inputs (a backward): a graph captured for it
        goes into the backwards' shared pool (:mod:`~meshfuse.runtime.replay.pools`).
        ``overwrite``: donated inputs that nothing else holds (:func:`overwritable`); those
        read in place give their memory to an output laid out alike (the graph copies it
        there: :func:`~meshfuse.runtime.replay.graphs.into_inputs`), which then is no
        memory of the graph's: graphs are kept per set of such inputs too."""
        if self.reason is not None or _PAUSED[0] or self._cuda.capturing():
            return None
        key, staged, unkeyed, graphs = self._find(inputs, staged, overwrite)
        if graphs is None:
            if key not in self._seen and not self._settled(key, inputs, unkeyed):
                self._remember(key, inputs, unkeyed)  # new addresses: the interpreter
                return None
            graphs = []
        for graph in graphs:
            if graph.free():
                return graph.replay(inputs)
            if graph.unheld():
                self.waits += 1  # free but for a later graph's outputs (see pools.py)
        if len(graphs) >= BUFFERS or self.graphs >= MAX_GRAPHS or self._budget.left <= 0 \
                or self._memory_spent():
            return None
        rest = _outside_graphs(_addresses(inputs, unkeyed))
        graph = self._captured(inputs, staged, BACKWARD if donating else FORWARD, key[-2],
                               buffer=len(graphs))
        if graph is None:
            return None
        self._rests.add(rest)
        self._graphs[key] = [*graphs, graph]
        self._chain(graph, inputs, staged, rest)
        return graph.replay(inputs)

    def _find(self, inputs: Sequence[Any], staged: Collection[int],
              overwrite: Collection[int] = ()):
        """``(key, copied, unkeyed, graphs)`` of this call: its graphs' key, the positions a
        replay copies into its graph's buffers, those left out of the key, and the graphs
        captured for it (None: none yet). The copied inputs are ``staged`` and the small
        integer ones (:meth:`_staging`), but those that stay in place: each of these is
        read where it lies, keyed on its address, with no buffer nor copy; unless the
        call's graphs were captured with it copied, which are kept. An input stays in place
        where it lies at a live graph's output (a backward's cotangent that the next
        layer's replayed backward made, a residual's random seed: at the same address at
        every step), or at an address that a graph reads in place because a copying graph
        found it there call after call (:meth:`_steady_or`)."""
        copied = self._staging(staged, inputs)
        # (the staged set itself where nothing is looped: a set made at every call would be
        # hashed again at every lookup)
        looped = self._looped(inputs, copied) if self._chain_ends else None
        with_looped = copied | looped if looped else copied
        settled = [i for i in copied if (a := inputs[i].data_ptr()) in _GRAPH_OUTPUTS
                   or a in self._steady and i not in overwrite] if copied else ()
        if not settled:
            found = self._keyed(inputs, with_looped, overwrite)
        else:
            still_copied = copied.difference(settled)
            found = self._keyed(inputs, still_copied | looped if looped else still_copied,
                                overwrite)
            if found[3] is None:  # no graph reads them in place: one may copy them
                copying = self._keyed(inputs, with_looped, overwrite)
                if copying[3] is not None:
                    found = copying
        return self._steady_or(found, inputs, staged, overwrite) if staged else found

    def _steady_or(self, found: tuple, inputs: Sequence[Any], staged: Collection[int],
                   overwrite: Collection[int]) -> tuple:
        """``found`` (a copying key's answer, see :meth:`_find`), or, once its graphs have
        found their copied ``staged`` inputs at the same addresses :data:`STEADY_CALLS`
        calls in a row, the answer for those inputs read in place, with an empty list of
        graphs: one is captured now. A gradient that the caller passes at every step
        (``out.backward(grad)`` with one ``grad``) is so read where it lies, with no copy;
        one that moves from call to call stays copied. Inputs in ``overwrite`` (autograd's
        own cotangents, handed over) are left as they are: their memory takes a result;
        and the small integer inputs (a batch's token ids), whose copy costs less than a
        graph of their own.

        The copying graph is dropped where nothing holds its outputs
        (:meth:`_drop_unheld`); else it stays beside the new one, whose outputs are a
        second copy of its memory: so only where that memory is worth the copy it saves
        (:meth:`_worth_reading_in_place`), for a program that runs at one place (one set of
        input addresses captured: not a stack's layers, whose graphs together are most of
        the memory the pools may hold; a parallelized Llama-3.2-1B captured a second graph
        per layer, reached that limit and ran the interpreter), and while another capture
        is allowed."""
        key, copied, _, graphs = found
        if graphs is None or len(self._graphs) != 1 or key in self._copying_kept:
            return found
        steady = tuple(i for i in staged if i in copied and i not in overwrite)
        if not steady:
            return found
        addresses = tuple(inputs[i].data_ptr() for i in steady)
        last = self._streaks.get(key)
        calls = last[1] + 1 if last is not None and last[0] == addresses else 1
        self._streaks[key] = (addresses, calls)
        if calls < STEADY_CALLS or any(a in _GRAPH_OUTPUTS for a in addresses) \
                or self.graphs >= MAX_GRAPHS or self._budget.left <= 0 or self._memory_spent():
            return found
        if not self._worth_reading_in_place(graphs[0], [inputs[i] for i in steady]):
            self._copying_kept.add(key)
            del self._streaks[key]
            return found
        self._steady.update(addresses)
        self._drop_unheld(key, graphs)
        in_place = self._keyed(inputs, copied.difference(steady), overwrite)
        return in_place if in_place[3] is not None else (*in_place[:3], [])

    def _looped(self, inputs: Sequence[Any], copied: frozenset[int]) -> frozenset[int]:
        """The positions of tensor inputs that lie at the output of a graph of this program
        at the end of a chain (:data:`MAX_CHAIN` graphs, each fed the one before's output,
        all with the same other inputs): copied into a graph's buffer rather than keyed.
        A loop ``x = f(x, w)`` would otherwise capture graph after graph, each keyed on the
        one before's output memory, up to :data:`MAX_GRAPHS`: the two graphs of the copying
        key take turns instead. A stack of layers sharing their weights (each position's
        input the one before's output, every step) keeps a graph per position up to
        :data:`MAX_CHAIN` positions."""
        found = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)
                 and i not in copied and x.data_ptr() in self._chain_ends]
        if not found:
            return frozenset()
        rest = _outside_graphs(_addresses(inputs, self._unkeyed | copied))
        return frozenset(i for i in found if self._chain_ends[inputs[i].data_ptr()] == rest)

    def _chain(self, graph: _Graph, inputs: Sequence[Any], copied: frozenset[int],
               rest: frozenset) -> None:
        """Records the place of ``graph``, just captured for ``inputs`` (``copied``: the
        positions it copies, ``rest``: its keyed inputs at no graph's output) in a chain
        of this program's graphs fed their own outputs: one further than the graph whose
        output an input is, if that graph had the same ``rest``; at the chain's end where
        it copies an input that :meth:`_looped` found."""
        place = 0
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                if i in copied and x.data_ptr() in self._chain_ends:
                    place = MAX_CHAIN
                elif i not in copied:
                    before = self._chained.get(x.data_ptr())
                    if before is not None and before[1] == rest:
                        place = max(place, before[0] + 1)
        for address in graph.output_addresses():
            self._chained[address] = (place, rest)
            if place >= MAX_CHAIN - 1:
                self._chain_ends[address] = rest

    def _keyed(self, inputs: Sequence[Any], copied: frozenset[int],
               overwrite: Collection[int] = ()):
        """:meth:`_find`'s answer for the inputs at ``copied`` copied (those of
        ``overwrite`` read in place are overwritten)."""
        unkeyed = self._unkeyed_of.get(copied)
        if unkeyed is None:
            unkeyed = self._unkeyed_of[copied] = self._unkeyed | copied
        written = frozenset(i for i in overwrite if i not in copied) if overwrite \
            else frozenset()
        # A graph keeps the kernels of its capture; the interpreter picks a deterministic
        # backward (flash's) whenever torch's switch is on at the call.
        key = (*[None if i in unkeyed else x.data_ptr() if isinstance(x, torch.Tensor) else x
                 for i, x in enumerate(inputs)],
               copied, written, torch.are_deterministic_algorithms_enabled())
        return key, copied, unkeyed, self._graphs.get(key)

    def _staging(self, staged: Collection[int], inputs: Sequence[Any]) -> frozenset[int]:
        """The tensor positions a replay may copy into its graph's buffers: ``staged`` and
        the small integer inputs (:func:`data_inputs`), found once per ``staged``."""
        if not isinstance(staged, (frozenset, range, tuple)):  # a list: hashed as a set
            staged = frozenset(staged)
        found = self._staged.get(staged)
        if found is None:
            tensors = frozenset(i for i in staged if isinstance(inputs[i], torch.Tensor))
            found = self._staged[staged] = tensors | data_inputs(inputs)
        return found

    def _remember(self, key: tuple, inputs: Sequence[Any], unkeyed: frozenset[int]) -> None:
        if len(self._seen) >= MAX_SEEN:
            self._seen.clear()
            self._values.clear()
        self._seen.add(key)
        if len(self._addresses) >= MAX_ADDRESSES:
            self._addresses.clear()
        self._addresses.update(_addresses(inputs, unkeyed))
        self._values.add(_values(key, inputs))

    def _settled(self, key: tuple, inputs: Sequence[Any], unkeyed: frozenset[int]) -> bool:
        """Whether a set of input addresses met for the first time may be captured now: some
        keyed tensor input lies in a live graph's output memory (the previous layer's
        replayed output), each of the others where an earlier call of this signature had
        its position's tensor (a parameter of this layer, met in the previous step), and the
        other values (scalars, the deterministic switch) are those of an earlier call (a
        scalar that changes at every call is not captured at every call). Without it, a
        stack's layer would be captured two calls after the one before it, each layer's
        input moving into a graph's memory once that graph is captured: a stack of N layers
        would replay whole after N steps. A graph's output is asked for so that inputs the
        allocator hands out in changing combinations of a few addresses (the outputs of
        torch's ops between programs) wait for a combination's second call, as before. The
        other inputs must be a combination no graph was captured with (each layer has its
        parameters): a loop feeding a program its own output (``x = f(x, w)``) would
        otherwise capture a graph at every call, each one's output a new graph's input.
        Never at the signature's first call (binding, compiling)."""
        if not self._seen or _values(key, inputs) not in self._values:
            return False
        addresses = _addresses(inputs, unkeyed)
        rest = _outside_graphs(addresses)
        chained = len(rest) < len(addresses)
        return chained and bool(rest) and rest not in self._rests and rest <= self._addresses

    def _drop_unheld(self, key: tuple, graphs: list[_Graph]) -> None:
        """Drops the graphs of ``key`` (copying inputs that now stay in place) where nothing
        holds their outputs: the graph reading those inputs in place, captured next into the
        same shared pool, then takes their memory rather than a second copy of it, and the
        runner keeps one graph per set of addresses (another is captured if the inputs move
        again). Graphs whose outputs are held stay (dropped, their memory would stay taken)."""
        if not all(graph.unheld() for graph in graphs):
            return
        del self._graphs[key]
        self.replaced += len(graphs)
        for graph in graphs:
            for address in graph.output_addresses():
                self._chained.pop(address, None)
                self._chain_ends.pop(address, None)

    def _worth_reading_in_place(self, copying: _Graph, steady: list[torch.Tensor]) -> bool:
        """Whether a second graph that reads ``steady`` in place is worth its memory next to
        ``copying``, the graph that copies them: its outputs (a second set, as large as the
        copying graph's) take at most :data:`STEADY_OUTPUT_RATIO` times the bytes copied at
        each replay, and fit beside the pools' memory under their limit. A loss's 0-d
        cotangent, copied beside an LM head whose weight gradient is half a GiB, stays
        copied; the GPT layer's ``dy`` (8 MiB, outputs of 33 MiB) is read in place."""
        outputs = copying.output_bytes()
        if outputs > STEADY_OUTPUT_RATIO * sum(x.nbytes for x in steady):
            return False
        limit = getattr(self._cuda, "memory_limit", None)
        return limit is None or held_bytes() + outputs <= limit(self._device)

    def _memory_spent(self) -> bool:
        """Whether the automatic graphs' pools hold their limit already (the next capture's
        pool is not known before it: the limit is crossed by one graph at most)."""
        limit = getattr(self._cuda, "memory_limit", None)
        self.capped = limit is not None and held_bytes() >= limit(self._device)
        return self.capped

    def describe(self) -> str:
        """explain's line: whether and how this signature is replayed."""
        if self.reason is not None:
            return f"CUDA graph replay: off ({self.reason})"
        if not self.graphs:
            return _NOT_YET
        spent = "; the fusion's graph budget is spent" if self._budget.left <= 0 else ""
        if self.capped:
            spent += (f"; no more captures: the process's graphs hold {POOL_FRACTION:.0%} "
                      "of the device's memory")
        streams = f"; {self._streams}" if self._streams else ""
        if self.waits:
            spent += (f"; {self.waits} calls found a graph waiting for a later graph's "
                      "outputs, held, in memory its replay writes")
        if self.replaced:
            spent += (f"; {self.replaced} dropped for a graph reading inputs in place that "
                      "stay at one address (a gradient the caller passes at every step)")
        copying = [len(g._buffers) for gs in self._graphs.values() for g in gs if g._buffers]
        if copying:  # inputs that lie at new addresses each call (see _find)
            spent += ("; inputs copied in at each replay (cotangents or batches at new "
                      f"addresses): {sum(copying)}, by {len(copying)} graphs")
        return (f"CUDA graph replay: {self.graphs} graphs captured for {len(self._graphs)} "
                f"sets of input addresses (at most {MAX_GRAPHS}), holding "
                f"{self.pool_bytes / 2**20:.1f} MiB{spent}{streams}")

    def _captured(self, inputs: Sequence[Any], staged: frozenset[int], kind: str,
                  overwrite: frozenset[int] = frozenset(), buffer: int = 0) -> _Graph | None:
        """A graph captured for ``inputs`` (None: it cannot be), the ``buffer``-th of its
        set of addresses, into that buffer's shared pool of ``kind``."""
        streams = plan_streams(self._program, inputs)
        if isinstance(streams, str):
            self.reason = streams
            return None
        buffers = {i: buffer_like(inputs[i]) for i in sorted(staged)
                   if isinstance(inputs[i], torch.Tensor)}
        inputs = [buffers.get(i, x) for i, x in enumerate(inputs)]
        pool = shared_pool(self._device, kind, buffer)
        try:
            # (a stand-in capture takes ``overwrite`` only if a test gives it some)
            extra = {"overwrite": overwrite} if overwrite else {}
            with streams.capturing():
                graph, outputs, grown, writes = self._cuda.capture(
                    self._program, inputs, streams.generators, pool, **extra)
        except Exception as err:  # noqa: BLE001 - an op that cannot be captured
            self.reason = f"no capture: {type(err).__name__}: {err}"
            return None
        self.graphs += 1
        self._budget.left -= 1
        self.pool_bytes += grown
        self._streams = self._streams or streams.describe()
        captured = _Graph(graph, outputs, inputs, streams, buffers, writes)
        if pool is not None:
            pool.add(captured)
        # its own outputs: one in an input's memory (a view of it, an overwritten
        # cotangent) says nothing of where that memory stays
        _track_outputs(captured, [t for j, t in enumerate(outputs) if j not in captured._views])
        return captured


class _Graph:
    """One captured graph and its output tensors. The caller gets aliases of the outputs
    (new tensors on the same memory), so anything the caller still holds of a result (the
    tensors, views of them) shows in the outputs' storage use counts. An output that is an
    input (or a view of one: an op that works in place, such as the fused cross entropy's
    backward scaling its residual gradient) is not the graph's memory (no replay writes it):
    the caller's references to it do not count, unless that input is one of the graph's
    ``buffers`` (a staged input, copied in at each replay), and the graph does not hold it: a
    replay returns the same view of that call's input (at the captured address), so the
    input's memory is freed when its owner lets it go (holding it would keep one step's
    residual, and the forward graph it lies in busy, for as long as the graph lives)."""

    def __init__(self, graph, outputs: list[torch.Tensor], inputs: Sequence[Any],
                 streams: StreamPlan, buffers: dict[int, torch.Tensor],
                 written: Sequence[tuple[int, int]] = ()):
        self._graph = graph
        self.written = list(written)  # the shared pool's memory its replays may write
        self.blockers: list[weakref.ref[_Graph]] = []  # see pools.py
        self._streams = streams
        self._buffers = buffers
        given = {x.untyped_storage()._cdata: i for i, x in enumerate(inputs)
                 if isinstance(x, torch.Tensor) and i not in buffers}
        # outputs that are views of a given input: (input, element offset, size, stride)
        self._views = {}
        for j, t in enumerate(outputs):
            i = given.get(t.untyped_storage()._cdata)
            view = None if i is None else _view_of(t, inputs[i], i)
            if view is not None:
                self._views[j] = view
        self._outputs = [None if j in self._views else t for j, t in enumerate(outputs)]
        # kept alive by the outputs; but memory the capture did not allocate (see _foreign)
        handles = {t.untyped_storage()._cdata for t in outputs} - set(given)
        self._own = handles - _foreign(outputs, self.written)
        self._storages = sorted(self._own)
        self._baseline = [torch._C._storage_Use_Count(s) for s in self._storages]
        _track_storages(self, self._storages, self._baseline)

    def free(self) -> bool:
        """Whether the graph may replay: nothing outside holds its previous outputs, nor
        the outputs of its blockers (graphs captured later whose outputs lie in memory its
        replay writes: :mod:`~meshfuse.runtime.replay.pools`)."""
        if not self.unheld():
            return False
        if not self.blockers:
            return True
        blockers = [b() for b in self.blockers]
        self.blockers = [b for b, g in zip(self.blockers, blockers) if g is not None]
        return all(g.unheld() for g in blockers if g is not None)

    def unheld(self) -> bool:
        """Whether nothing outside holds the previous outputs' memory."""
        # (a list compared with a list: no Python frame per storage)
        return list(map(torch._C._storage_Use_Count, self._storages)) == self._baseline

    def output_ranges(self) -> list[tuple[int, int]]:
        """The device memory of its outputs (their storages, those of inputs aside)."""
        return sorted({(s.data_ptr(), s.data_ptr() + s.nbytes())
                       for s in (t.untyped_storage() for t in self._outputs if t is not None)
                       if s._cdata in self._own})

    def output_addresses(self) -> set[int]:
        """Where its outputs start (those that are no view of an input)."""
        return {t.data_ptr() for t in self._outputs if t is not None}

    def output_bytes(self) -> int:
        """The bytes of its outputs' memory (see :meth:`output_ranges`)."""
        return sum(end - start for start, end in self.output_ranges())

    def replay(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        """The outputs of a replay on ``inputs`` (at the captured addresses), its dropout
        streams seeded as the interpreter's call would seed them."""
        if self._buffers:
            copy_into(list(self._buffers.values()), [inputs[i] for i in self._buffers])
        if self._streams.streams:
            self._streams.prepare(inputs)
        self._graph.replay()
        return [t.detach() if t is not None else _same_view(inputs, *self._views[j])
                for j, t in enumerate(self._outputs)]


def _foreign(outputs: Sequence[torch.Tensor], written: Sequence[tuple[int, int]]) -> set[int]:
    """The storages of ``outputs`` that lie outside the memory the capture may write
    (``written``; none known: every output is the graph's): tensors that existed before it,
    such as a constant the program returns (the zeros that every attention without dropout
    shares as its RNG state). No replay writes them, and whoever else holds them (another
    layer's residuals: the use count of those zeros grows with each layer's forward) says
    nothing about the graph's previous results."""
    if not written:
        return set()
    storages = {s._cdata: s for s in (t.untyped_storage() for t in outputs)}
    return {h for h, s in storages.items()
            if not any(a <= s.data_ptr() and s.data_ptr() + s.nbytes() <= b
                       for a, b in written)}


def _view_of(output: torch.Tensor, source: torch.Tensor, index: int):
    """``(index, element offset from source's first element, size, stride)`` of ``output``, a
    view of input ``source`` of the same element type; None where it is not one (another
    element type over the same memory: the graph then holds it, as any output)."""
    if output.dtype != source.dtype:
        return None
    offset, rest = divmod(output.data_ptr() - source.data_ptr(), source.element_size())
    if rest:
        return None
    return index, offset, tuple(output.shape), tuple(output.stride())


def _same_view(inputs: Sequence[Any], index: int, offset: int, size, stride) -> torch.Tensor:
    source = inputs[index].detach()
    if offset == 0 and tuple(source.shape) == size and source.stride() == stride:
        return source  # the input's memory as it is: no view (which would keep its base)
    return source.as_strided(size, stride, source.storage_offset() + offset)
