"""A fusion as a ``torch.autograd.Function``: ``fd.as_autograd_function()``.

Calling it runs the forward (the user's program plus residual outputs) on this rank's local
shards and saves the residuals; ``backward()`` runs the derived backward fusion on the
cotangents and the residuals and returns each input's gradient, as this rank's shard laid out
like the input (replicated inputs get complete gradients on every rank).

The backward is derived for the floating-point inputs that require grad in a call (and are in
``wrt``), once per such set, then cached; for a fusion with symbolic extents, once per such
set and set of extents the inputs bind (the fusion made static with them:
:func:`meshfuse.passes.concrete.with_extents`, its unscheduled inputs and outputs laid out as its
build lays them out, which ``shard_tensor`` reads).

DTensors in, DTensors out: called with DTensors, it takes their local shards (an unscheduled
input gets its DTensor's placements, as ``execute`` does) and returns DTensors; gradients
reach the input DTensors through DTensor's own differentiable conversions, each with its
input's placements.

Memory: the backward frees each residual after its last use, as the hand-written backward
fused with its forward would (``torch.autograd.Function.save_for_backward`` would hold them
all until the backward ends). So a node's backward runs once, unless ``keep_residuals=True``
keeps them for the node's lifetime (``backward(retain_graph=True)`` twice). An input saved
as a residual and modified in place before the backward is an error, as in PyTorch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshfuse.autodiff.derivation import (
    DEFAULT_REMAT,
    Derivation,
    PartialBackward,
    derive,
    zero_cotangents,
)
from meshfuse.autodiff.engine_thread import run_backward_here
from meshfuse.dtensor import (
    check_dtensor_input,
    has_dtensors,
    run_on_dtensors,
    schedule_like_dtensor,
)
from meshfuse.engine.runner import FusionRunner
from meshfuse.errors import InputError
from meshfuse.ir.fusion import Fusion, Reshard
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.tensor_view import TensorView
from meshfuse.passes.concrete import has_symbolic_ids, with_extents
from meshfuse.passes.pipeline import compiled_for
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.interpreter.agreement import agreement_ranks
from meshfuse.runtime.interpreter.host_time import PathTime
from meshfuse.runtime.replay.automatic import holders, overwritable


class FusionFunction:
    """``f(inputs) -> outputs`` with autograd: takes what ``execute`` takes, returns what it
    returns (this rank's local shards), and records one autograd node for the fusion.

    Args:
        fusion: the user's fusion (read, never changed).
        wrt: the inputs that may get gradients (default: every floating-point tensor input);
            an input gets one when it is in ``wrt`` and its tensor requires grad.
        remat: the rematerialization policy (``"recompute"``, ``"recompute_fused"``: the
            default, ``"recompute_gathers"`` or ``"save"``; see
            :mod:`meshfuse.autodiff.derivation`).
        keep_residuals: keep the residuals until the autograd node dies, so that its
            backward may run more than once (default: each is freed after its last use in
            the one backward).
        compile: how the forward and backward programs run, as ``execute(compile=...)``
            takes it (None: ``MESHFUSE_COMPILE``, by default fused segments on CUDA and the
            interpreter on the CPU; True or a torch.compile backend: fused segments, see
            docs/fusion.md).
    """

    def __init__(self, fusion: Fusion, wrt: Sequence[TensorView] | None = None,
                 remat: str = DEFAULT_REMAT, keep_residuals: bool = False,
                 compile: bool | str | None = None) -> None:
        self.fusion = fusion
        self.remat = remat
        self.keep_residuals = keep_residuals
        self.compile = compile
        inputs = fusion.inputs()
        self.wrt = [v for v in inputs if isinstance(v, TensorView) and v.dtype.is_floating] \
            if wrt is None else list(wrt)
        self._arity = len(inputs)
        # the positions of the inputs in wrt (looked up at every call)
        self._wrt_positions = tuple(i for i, v in enumerate(inputs) if v in self.wrt)
        self._derivations: dict[tuple, _Compiled] = {}
        self._lacking: bool | None = None  # see _inputs_not_everywhere
        self._ranks: tuple[int, ...] | None = None  # see _agreeing_ranks
        self._extents: FusionRunner | None = None  # binds symbolic extents: see _bound
        self._symbolic: bool | None = None  # whether the fusion has symbolic extents
        # requires_grad flags -> derivation, where this rank's flags alone decide it (see
        # _compiled_for: no agreement with other ranks, no symbolic extents)
        self._by_flags: dict[tuple[bool, ...], _Compiled] | None = None

    def derivation(self, requires_grad: Sequence[bool],
                   extents: Mapping[IterDomain, int] | None = None) -> _Compiled:
        """The compiled forward and backward for inputs whose ``requires_grad`` flags are
        ``requires_grad`` (one per fusion input); for a fusion with symbolic extents, of
        the fusion with ``extents`` (bound by the inputs) made static: a gradient's shapes
        are decided per set of extents, as the forward's communications are."""
        wrt = tuple(i for i in self._wrt_positions if requires_grad[i])
        key = (wrt, None if extents is None else self._symbolic_key(extents))
        if key not in self._derivations:
            inputs = self.fusion.inputs()
            source = self.fusion
            if extents is not None:
                build = compiled_for(self.fusion)
                ends = [v for v in (*inputs, *self.fusion.outputs()) if isinstance(v, TensorView)]
                source, _ = with_extents(self.fusion, extents, {v: build[v] for v in ends})
            derivation = derive(source, [source.inputs()[i] for i in wrt], self.remat)
            self._derivations[key] = _Compiled(derivation, self.compile)
        return self._derivations[key]

    def _symbolic_key(self, extents: Mapping[IterDomain, int]) -> tuple:
        return tuple(extents[i] for tv in self.fusion.tensors() for i in tv.logical
                     if i.extent is None)

    def _bound(self, inputs: Sequence[Any]) -> Mapping[IterDomain, int] | None:
        """The extents ``inputs`` bind, for a fusion with symbolic extents (else None)."""
        if self._symbolic is None:  # the fusion is built: its extents stay as they are
            self._symbolic = has_symbolic_ids(self.fusion)
        if not self._symbolic:
            return None
        if self._extents is None:
            self._extents = FusionRunner(self.fusion)
        return self._extents.bound_extents(inputs)

    def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        """This rank's outputs on ``inputs``, recorded for autograd. With DTensors among
        ``inputs``, outputs are DTensors and gradients flow to the input DTensors (see
        :meth:`_on_dtensors`)."""
        inputs = list(inputs)
        if len(inputs) != self._arity:
            raise InputError(f"the fusion takes {self._arity} inputs, got {len(inputs)}")
        if has_dtensors(inputs):
            return self._on_dtensors(inputs)
        return self._apply(self._compiled_for(inputs), inputs)

    def explain(self, inputs: Sequence[Any]) -> str:
        """The autograd path on ``inputs`` (as ``__call__`` takes them; call it on every rank
        of the fusion, as ``execute``): the forward program's ``explain(inputs)`` (tensors,
        communications, fused segments, CUDA-graph replay, host time per cached call), then
        the derived backward's state for each signature it ran (fused segments, replay, host
        time; its inputs are autograd's and the residuals), and the host time of the autograd
        node around both programs (their ``execute`` included: the rest is the node's own
        Python, residuals and autograd's calls). Runs no kernel but a first call's build."""
        inputs = [x.to_local() if isinstance(x, DTensor) else x for x in inputs]
        compiled = self._compiled_for(inputs)
        return "\n".join([compiled.derivation.forward_runner.explain(inputs),
                          *compiled.backward_lines(), *compiled.node_lines()])

    def call_lines(self) -> list[str]:
        """What the calls so far did, binding nothing (no inputs needed): for each set of
        inputs that require grad, the forward's and the backward's lines per signature
        (fused segments, CUDA-graph replay, host time) and the node's host time."""
        lines = []
        for n, compiled in enumerate(self._derivations.values()):
            forward = compiled.derivation.forward_runner.call_lines()
            lines += [f"derivation {n}:", "  forward:", *(f"    {x}" for x in forward),
                      *(f"  {x}" for x in compiled.backward_lines()),
                      *(f"  {x}" for x in compiled.node_lines())]
        return lines

    def _apply(self, compiled: _Compiled, inputs: list) -> list[torch.Tensor]:
        """The autograd node's outputs. A rank that holds none of the inputs that require
        grad (it passes None for them: they lie on other ranks' meshes) still joins the
        backward, whose collectives the other ranks run with it: an empty leaf that
        requires grad makes its outputs require grad, so its backward runs."""
        anchor = None
        if torch.is_grad_enabled():
            if compiled.has_gradients and not any(
                    isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
                anchor = torch.empty(0, requires_grad=True)
            run_backward_here()
            if not _SOLE:
                _calibrate()
        apply = _FusionAutograd.apply if torch._C._are_functorch_transforms_active() \
            else _NODE_APPLY
        return list(apply(compiled, self.keep_residuals, anchor, *inputs))

    def _compiled_for(self, inputs: Sequence[Any]) -> _Compiled:
        """The derivation for the inputs that require grad in this call. Where some rank
        holds no shard of some input (it lies on other ranks' meshes), the ranks agree on
        which inputs require grad (one small allgather per call, only for such fusions):
        each rank derives and runs the same forward and backward. A rank outside every mesh
        of the fusion holds nothing and takes part in nothing: it derives as if each floating
        input required grad, so that its outputs join a backward that does nothing here."""
        extents = self._bound(inputs)
        if not torch.is_grad_enabled():
            return self.derivation([False] * len(inputs), extents)
        flags = [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
        if self._by_flags is not None:  # (found once per set of flags)
            compiled = self._by_flags.get(key := tuple(flags))
            if compiled is None:
                compiled = self._by_flags[key] = self.derivation(flags, extents)
            return compiled
        ranks = self._agreeing_ranks()
        if Communicator.instance().rank not in ranks:
            flags = [isinstance(v, TensorView) and v.dtype.is_floating
                     for v in self.fusion.inputs()]
        elif self._inputs_not_everywhere():
            flags = _agreed(flags, ranks)
        elif extents is None:  # this rank's flags alone decide, from now on
            self._by_flags = {}
        return self.derivation(flags, extents)

    def _agreeing_ranks(self) -> tuple[int, ...]:
        """The ranks of the fusion's meshes (:func:`agreement_ranks`), found once."""
        if self._ranks is None:
            self._ranks = agreement_ranks(self.fusion, Communicator.instance().size)
        return self._ranks

    def _inputs_not_everywhere(self) -> bool:
        """Whether some rank of the fusion's (:func:`agreement_ranks`: a pipeline stage's
        for a fusion on its sub-mesh) holds no shard of some tensor input (decided on the
        first call, once the inputs' schedules are fixed)."""
        if self._lacking is None:
            ranks = self._agreeing_ranks()
            compiled = compiled_for(self.fusion)
            meshes = [compiled[v].mesh for v in self.fusion.inputs() if isinstance(v, TensorView)]
            self._lacking = any(m is not None and any(r not in m for r in ranks)
                                for m in meshes)
        return self._lacking

    def _on_dtensors(self, inputs: list) -> list:
        """As ``execute`` on DTensors (:mod:`meshfuse.dtensor`): an unscheduled input takes
        its DTensor's placements (until the first derivation fixes the schedules; later
        DTensors must lie alike), the fusion runs on the local shards, and its outputs come
        back as DTensors. The local shards and the outputs pass through DTensor's
        differentiable ``to_local``/``from_local``, so each input DTensor's gradient is a
        DTensor with its placements (a replicated one's complete on every rank)."""
        fusion_inputs = self.fusion.inputs()
        bound: dict[int, DTensor] = {}

        def bind(position: int, x: DTensor) -> None:
            tv = fusion_inputs[position]
            if isinstance(tv, TensorView):
                bound[position] = x
                if not self._derivations and not tv.is_scheduled:
                    schedule_like_dtensor(tv, x)

        def run(local: list):
            compiled = self._compiled_for(local)
            forward = compiled.derivation.forward
            for position, x in bound.items():
                check_dtensor_input(forward.inputs()[position], x)
            outputs = self._apply(compiled, local)
            return outputs, forward.outputs()[:compiled.derivation.num_outputs]

        return run_on_dtensors(inputs, bind, run)


class _Compiled:
    """A derivation and the runner of its backward (built on the first backward)."""

    def __init__(self, derivation: Derivation, compile: bool | str | None = None) -> None:
        self.derivation = derivation
        self.compile = compile
        self._backward: FusionRunner | None = None
        # zero cotangents' positions -> the backward without them (None: none derived)
        self._partial: dict[frozenset[int], tuple[PartialBackward, FusionRunner] | None] = {}
        # False: a missing cotangent is made of zeros (a backward that a strategy rewrites,
        # such as FSDP's layered one, which knows only the whole backward)
        self.derives_partials = True
        # host time of the autograd node's forward and backward, their programs included
        self.node_forward, self.node_backward = PathTime(), PathTime()
        # the forward's program key -> the backward's (see run_backward)
        self._backward_keys: dict[tuple, tuple] = {}
        # What every call of the node reads of the derivation, found once:
        d = derivation
        # the residuals that are outputs of the node (positions among the residuals)
        self.returned = tuple(i for i, r in enumerate(d.residuals)
                              if r.kind == "output" and r.index < d.num_outputs)
        # the node's outputs without a cotangent
        carried = set(d.cotangents)
        self.non_differentiable = tuple(j for j in range(d.num_outputs) if j not in carried)
        # the node's outputs that are no residual (a 0-d one of them is copied)
        saved = {r.index for r in d.residuals if r.kind == "output"}
        self.unsaved = tuple(j for j in range(d.num_outputs) if j not in saved)
        self.has_gradients = any(i is not None for i in d.gradients)

    def backward_lines(self) -> list[str]:
        """explain's lines on the derived backward: per signature it ran, see
        :meth:`~meshfuse.engine.runner.FusionRunner.call_lines` (and on each backward
        derived without some cotangents, that ran)."""
        lines = self._backward.call_lines() if self._backward is not None else ["not run yet"]
        lines = ["derived backward:", *self._saved_lines(), *(f"  {line}" for line in lines)]
        for zero, partial in self._partial.items():
            if partial is not None:
                outputs = ", ".join(str(self.derivation.cotangents[k]) for k in sorted(zero))
                title = f"derived backward without the cotangents of outputs {outputs} (none came):"
                lines += [title, *(f"  {line}" for line in partial[1].call_lines())]
        return lines

    def _saved_lines(self) -> list[str]:
        """What the forward saves for the backward, under which policy: each value's name,
        global shape and the op that made it."""
        source = self.derivation.source
        if source is None:
            return []
        saved = [f"{v.name} {[i.extent for i in v.materialized()]} ({_made_by(v)})"
                 if isinstance(v, TensorView) else f"{v.name} ({_made_by(v)})"
                 for v in source.residuals]
        return [f"  saved for the backward (remat={source.remat!r}): {len(saved)} values: "
                + ", ".join(saved)]

    def runners(self) -> list[FusionRunner]:
        """The forward's runner and those of the backwards that ran."""
        partial = [p[1] for p in self._partial.values() if p is not None]
        backward = [self._backward] if self._backward is not None else []
        return [self.derivation.forward_runner, *backward, *partial]

    def node_lines(self) -> list[str]:
        """explain's lines on the node's host time (none before a call)."""
        lines = [f"  {name}: {path.least / 1e3:.0f} us at least, {path.last / 1e3:.0f} us the "
                 f"last (over {path.calls} calls)"
                 for name, path in (("forward", self.node_forward),
                                    ("backward", self.node_backward)) if path.calls]
        title = "host time per autograd node call (this rank, measured, its program included):"
        return [title, *lines] if lines else []

    def run_forward(self, inputs: list) -> tuple[list[torch.Tensor], tuple | None]:
        """The forward (the user's outputs, then the residuals) on ``inputs``, and its
        program's key (:meth:`~meshfuse.engine.runner.FusionRunner.layout_key`), which
        the backward reads its own from."""
        runner = self.derivation.forward_runner
        key = runner.layout_key(inputs)
        return runner.execute(inputs, compile=self.compile, key=key), key

    def run_backward(self, inputs: list,
                     partial: tuple[PartialBackward, FusionRunner] | None = None,
                     overwrite: frozenset[int] = frozenset(),
                     forward_key: tuple | None = None) -> list[torch.Tensor]:
        """The backward (or the ``partial`` one, see :meth:`partial_backward`) on
        ``inputs``, a list it empties (each value is freed after its last use). The
        cotangents are staged: a replayed backward copies those that autograd made at new
        addresses into its graph's buffers rather than keying on them, and reads in place
        those that lie at a graph's output (the residuals' addresses are those of the
        forward's outputs, stable: see ``AutoReplay.run``); ``overwrite``: the cotangents
        autograd handed to this node alone, whose memory a replayed backward gives to the
        gradient laid out alike (a stack's input gradient, passed from layer to layer in
        one buffer). ``forward_key``: the key of the forward's program that made the
        residuals (None: unknown). The backward's inputs are laid out as that program lays
        out its outputs (the residuals), inputs (those saved) and outputs (the cotangents,
        laid out as their outputs: ``_laid_out``), so its key is found once per forward
        key, not read from some thirty tensors at each call."""
        key = None
        if partial is not None:
            runner, cotangents = partial[1], len(partial[0].cotangents)
        else:
            if self._backward is None:
                self._backward = FusionRunner(self.derivation.backward)
            runner, cotangents = self._backward, len(self.derivation.cotangents)
            if forward_key is not None:
                key = self._backward_keys.get(forward_key)
                if key is None:
                    key = runner.layout_key(inputs)
                    if key is not None:
                        self._backward_keys[forward_key] = key
        return runner.execute(inputs, donate=True, compile=self.compile,
                              staged=range(cotangents), overwrite=overwrite, key=key)

    def partial_backward(self, zero: frozenset[int]) -> tuple[PartialBackward, FusionRunner] | None:
        """The backward without the cotangents at positions ``zero`` and its runner,
        derived at its first use (None: it cannot be; see
        :func:`~meshfuse.autodiff.derivation.zero_cotangents`)."""
        if zero not in self._partial:
            partial = zero_cotangents(self.derivation, zero) if self.derives_partials else None
            self._partial[zero] = None if partial is None else \
                (partial, FusionRunner(partial.backward))
        return self._partial[zero]


def _scalar_outputs_copied(outputs: list, unsaved: Sequence[int]) -> list:
    """``outputs``, the 0-d ones that are no residual (positions ``unsaved``) copied: a
    replayed forward returns its outputs in its CUDA graph's memory, which the graph
    rewrites at its next replay and so will not replay while they are held; a training loop
    holds the previous step's loss while it runs the next forward
    (``loss = model(x).loss``), which would make the graph capture a second copy of itself
    (its memory, residuals included, twice). Larger outputs stay in the graph's memory: the
    next layer of a stack reads its input there."""
    for j in unsaved:
        o = outputs[j]
        if isinstance(o, torch.Tensor) and o.dim() == 0:
            outputs[j] = o.clone()
    return outputs


class _FusionAutograd(torch.autograd.Function):
    """One node per call; see the module doc.

    The residuals are held in ``ctx.residuals``, a :class:`_Residuals`, except those that
    are outputs of the node: saved with ``save_for_backward`` (held directly, an output
    would hold its own node: a reference cycle). ``anchor`` is None or an empty leaf that
    requires grad (see ``FusionFunction._apply``), not an input of the fusion.
    """

    @staticmethod
    def forward(ctx, compiled: _Compiled, keep: bool, anchor, *inputs):
        start = time.perf_counter_ns()
        ctx.set_materialize_grads(False)  # an output without a gradient: see backward
        d = compiled.derivation
        # Inputs on other ranks get no gradient (None, or the meta tensor of a symbolic
        # input's global shape there).
        ctx.absent = [x is None or isinstance(x, torch.Tensor) and x.is_meta for x in inputs]
        results, ctx.forward_key = compiled.run_forward(list(inputs))
        residuals = [inputs[r.index] if r.kind == "input" else results[r.index]
                     for r in d.residuals]
        outputs = _scalar_outputs_copied(results[:d.num_outputs], compiled.unsaved)
        # Residuals that are outputs of the node (positions among the residuals).
        ctx.returned = compiled.returned
        ctx.save_for_backward(*(residuals[i] for i in ctx.returned))
        for i in ctx.returned:
            residuals[i] = None
        ctx.residuals = _Residuals(residuals, keep)
        ctx.compiled = compiled
        ctx.layouts = [(o.shape, o.stride(), o.dtype, o.device) for o in outputs]
        if compiled.non_differentiable:
            ctx.mark_non_differentiable(*(outputs[j] for j in compiled.non_differentiable))
        compiled.node_forward.add(time.perf_counter_ns() - start)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *cotangents):
        start = time.perf_counter_ns()
        handed_over = _handed_over(cotangents)  # first: the lists below hold them too
        d = ctx.compiled.derivation
        residuals = ctx.residuals.take()
        for i, x in zip(ctx.returned, ctx.saved_tensors):
            residuals[i] = x
        # Outputs that got no gradient (None: the loss alone was differentiated, not the
        # logits returned beside it) run the backward derived without their cotangents.
        zero = frozenset(k for k, j in enumerate(d.cotangents) if cotangents[j] is None)
        partial = ctx.compiled.partial_backward(zero) if zero else None
        # Else every cotangent came, or zeros of the outputs' sizes stand for those missing.
        taken = range(len(d.cotangents)) if partial is None else partial[0].cotangents
        gradients = d.gradients if partial is None else partial[0].gradients
        if partial is not None:
            residuals = [residuals[r] for r in partial[0].residuals]
        laid_out = [_laid_out(cotangents[d.cotangents[k]], *ctx.layouts[d.cotangents[k]])
                    for k in taken]
        needed = ctx.compiled.has_gradients if partial is None \
            else any(i is not None for i in gradients)
        overwrite = frozenset(n for n, k in enumerate(taken)
                              if d.cotangents[k] in handed_over)
        inputs = laid_out + residuals
        del residuals, laid_out  # the backward's program holds the only references
        grads = ctx.compiled.run_backward(inputs, partial, overwrite, ctx.forward_key) \
            if needed else []
        ctx.compiled.node_backward.add(time.perf_counter_ns() - start)
        return (None, None, None, *(None if i is None or absent else grads[i]
                                    for i, absent in zip(gradients, ctx.absent)))


# ``_FusionAutograd.apply`` without what ``torch.autograd.Function.apply`` does in Python
# before it (binding default arguments for a ``setup_context``, which this node has not, and
# unwrapping functorch's wrappers left by transforms that ended, walking the twenty-odd
# arguments with pytree): 3 us of the 8 per call on this CPU, before the forward's launch.
# Under a functorch transform, ``Function.apply`` itself (see ``_apply``).
_NODE_APPLY = super(torch.autograd.Function, _FusionAutograd).apply


def _references(cotangents: tuple) -> list[int]:
    """The Python references to each of ``cotangents`` (a backward's arguments), counted as
    :func:`_handed_over` counts them."""
    return [sys.getrefcount(x) for x in cotangents]


# what a backward sees of a cotangent that autograd handed to it alone, made in Python by the
# backward before it (as a replayed or interpreted backward makes its gradients): its Python
# references (_references), and its tensor's and memory's (automatic.holders)
_SOLE: list[tuple[int, tuple[int, int]]] = []


class _Probe(torch.autograd.Function):
    """A node whose backward records what it sees of its cotangent and makes its gradient
    in Python. Of two chained (``_Probe.apply(_Probe.apply(x))``), the one applied first
    runs its backward last, on the cotangent the other's backward made: that record stays."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, *cotangents):
        _SOLE[:] = [(_references(cotangents)[0], holders(cotangents[0]))]
        return cotangents[0] * 1


def _calibrate() -> None:
    """Measures, once, what a backward sees of a cotangent nobody else holds (the Python
    references of the engine and of the call, the uses of its tensor and memory: these
    depend on the versions of Python and torch)."""
    x = torch.zeros(2, requires_grad=True)
    with torch.enable_grad():
        (_Probe.apply(_Probe.apply(x)) * 2).sum().backward()


def _handed_over(cotangents: tuple) -> set[int]:
    """The positions of the cotangents that autograd handed to this backward alone: no other
    Python reference (a hook that kept the gradient), no other tensor on their memory (a
    user's ``grad_outputs``, a gradient that autograd passes to two nodes, a view; none that
    requires grad: a higher-order gradient's), but the automatic graph that made them (see
    :func:`~meshfuse.runtime.replay.automatic.overwritable`). Their memory may take this
    backward's results."""
    if not _SOLE:
        return set()
    counts = _references(cotangents)
    references, alone = _SOLE[0]
    return {j for j, (x, n) in enumerate(zip(cotangents, counts))
            if n == references and isinstance(x, torch.Tensor) and not x.requires_grad
            and overwritable(x, alone)}


class _Residuals:
    """The residuals of one autograd node (None where ``save_for_backward`` holds one): taken
    by its backward, once unless ``keep``; each tensor's version is checked as
    ``save_for_backward`` checks it (an input modified in place after the forward)."""

    def __init__(self, values: list, keep: bool) -> None:
        self.values = values
        self.versions = [x._version if isinstance(x, torch.Tensor) else None for x in values]
        self.keep = keep

    def take(self) -> list:
        if self.values is None:
            raise RuntimeError(
                "Trying to backward through a fusion's autograd node a second time: its "
                "residuals were freed as its first backward ran. Run the fusion again, or "
                "create it with as_autograd_function(keep_residuals=True) to backward through "
                "it more than once (with retain_graph=True)"
            )
        for i, (x, version) in enumerate(zip(self.values, self.versions)):
            if isinstance(x, torch.Tensor) and x._version != version:
                raise RuntimeError(
                    f"one of the tensors a fusion's backward needs (residual {i}, of shape "
                    f"{list(x.shape)}) has been modified by an inplace operation: it is at "
                    f"version {x._version}, expected version {version}. Modify it out of "
                    "place, or after the backward"
                )
        values = list(self.values) if self.keep else self.values
        if not self.keep:
            self.values = None
        return values


def _laid_out(x: torch.Tensor | None, shape, strides, dtype, device) -> torch.Tensor:
    """``x`` with the strides the backward expects for a cotangent (its output's); zeros
    for a missing one (None)."""
    if x is None:
        return torch.empty_strided(shape, strides, dtype=dtype, device=device).zero_()
    if x.stride() == strides:
        return x
    out = torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)
    return out.copy_(x)


def _agreed(flags: list[bool], ranks: tuple[int, ...]) -> list[bool]:
    """Whether each input requires grad on some rank of ``ranks`` (the fusion's; the ranks
    that hold it say so; one that holds none passes None and says nothing). A rank outside
    ``ranks``, or alone in them, keeps its own ``flags``."""
    communicator = Communicator.instance()
    if communicator.rank not in ranks or len(ranks) == 1:
        return flags
    gathered = communicator.agreement_allgather(torch.tensor(flags, dtype=torch.uint8),
                                                ranks=ranks)
    return [bool(x) for x in torch.stack(gathered).amax(0).tolist()]


def _made_by(v) -> str:
    """The op that made value ``v`` of the forward, or "input"."""
    expr = v.definition
    if expr is None:
        return "input"
    return "communication" if isinstance(expr, Reshard) else expr.op.name
