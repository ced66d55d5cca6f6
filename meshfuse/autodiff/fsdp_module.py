"""``FullyShardedModule``: a fusion's parameters fully sharded over a data-parallel mesh
dimension (:mod:`meshfuse.parallel.fsdp`), as a ``torch.nn.Module``.

Each parameter is an ``nn.Parameter`` holding this rank's shard of its storage (first axis
split over ``shard``); the forward gathers each layer's parameters by one allgather, a layer
ahead, and the backward reduce-scatters each layer's gradients by one reduce-scatter, so
``.grad`` is a shard like its parameter and any torch optimizer (AdamW) updates the local
shards. The layers are carried to the derived forward and backward
(:func:`~meshfuse.parallel.fsdp.layers.register_derivation`).

A model made of several such modules run one after the other (a Llama model's embedding,
blocks and head) prefetches across them (:func:`prefetch_in_order`): each module's forward
launches the next module's gather before it computes, and each module's backward the
gather of the module before it, as FSDP2's prefetch does; so a module's gather runs under
its neighbour's compute, and two modules' gathered parameters are alive at most.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from meshfuse.autodiff.function import FusionFunction
from meshfuse.errors import DefinitionError, InputError
from meshfuse.ir.tensor_view import TensorView
from meshfuse.parallel.fsdp import (
    AheadOfStep,
    FsdpOptions,
    MemoryAccount,
    MixedPrecision,
    NamedMesh,
    clip_grad_norm_,
    copies,
    layers_of,
    memory_account,
    nbytes,
    register_derivation,
    shard_fusion,
)
from meshfuse.sharding import shard_tensor


class _LayeredFunction(FusionFunction):
    """A FusionFunction whose derivations carry the fusion's layers."""

    def derivation(self, requires_grad, extents=None):
        compiled = super().derivation(requires_grad, extents)
        d = compiled.derivation
        if layers_of(d.backward) is None:
            register_derivation(self.fusion, d.forward, d.backward, d.residuals, d.gradients,
                                len(d.cotangents))
        compiled.derives_partials = False  # its layers are the whole backward's
        return compiled


class FullyShardedModule(torch.nn.Module):
    """A layer stack whose forward is ``fd``, its parameters fully sharded.

    Args:
        fd: the fusion definition (optionally tensor/sequence parallel on ``mesh``).
        parameters: ``{name: (input TensorView, global initial value)}``.
        layers: the parameter names of each layer, in the order the layers run.
        batch: the inputs whose first axis is the batch (split over the data-parallel
            dimensions).
        mesh: a :class:`NamedMesh`, a torch ``DeviceMesh`` with ``mesh_dim_names``, or a
            meshfuse ``DeviceMesh`` with ``names``.
        shard, replicate, reshard_after_forward, mp_policy: see :class:`FsdpOptions`.

    Example:
        >>> model = FullyShardedModule(fd, {"w1": (w1, w1_init), "w2": (w2, w2_init)},
        ...                            [["w1"], ["w2"]], [x], mesh, names=("dp",))
        >>> loss = model(model.shard_input(x, x_global))
        >>> loss.backward(); model.clip_grad_norm_(1.0); optimizer.step()
    """

    def __init__(self, fd, parameters: Mapping[str, tuple[TensorView, torch.Tensor]],
                 layers: Sequence[Sequence[str]], batch: Sequence[TensorView], mesh, *,
                 names: Sequence[str] | None = None, shard: str = "dp",
                 replicate: str | None = None, reshard_after_forward: bool = True,
                 mp_policy: MixedPrecision | None = None) -> None:
        super().__init__()
        fd.define()
        unknown = [n for layer in layers for n in layer if n not in parameters]
        if unknown:
            raise DefinitionError(f"layers name {unknown}, which are not among the "
                                  f"parameters {list(parameters)}")
        self.options = FsdpOptions(shard, replicate, reshard_after_forward,
                                   mp_policy or MixedPrecision())
        self.sharded = shard_fusion(
            fd.fusion, NamedMesh.of(mesh, names),
            [[parameters[n][0] for n in layer] for layer in layers], batch, self.options)
        inputs = fd.fusion.inputs()
        self._slots: dict[int, str] = {}
        self._copies: list[int] = []
        for name, (tv, value) in parameters.items():
            storage = self.sharded.storage(tv)
            shard = shard_tensor(value, storage).detach().clone()
            self.register_parameter(name, torch.nn.Parameter(shard))
            self._slots[inputs.index(tv)] = name
            self._copies.append(copies(storage))
        self._arguments = [v for i, v in enumerate(inputs) if i not in self._slots]
        self._function = _LayeredFunction(self.sharded.fusion, remat=self.options.remat)
        self._storages = {name: self.sharded.storage(tv) for name, (tv, _) in parameters.items()}
        self.activation_bytes = 0
        self._neighbours: tuple = (None, None)  # (before, after): see prefetch_in_order

    def parameter_tensors(self) -> dict[str, TensorView]:
        """Each parameter's storage TensorView, whose schedule lays out the local shard it
        holds (what checkpoints read to place the shard in the global tensor)."""
        return dict(self._storages)

    def shard_input(self, tv: TensorView, value: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the global ``value`` of input ``tv`` (a batch split on the
        data-parallel dimensions)."""
        return shard_tensor(value, self.sharded.storage(tv))

    def forward(self, *args):
        """Runs the fusion on ``args`` (the non-parameter inputs' local shards, in
        definition order) and the parameters; returns its output, or a tuple of them."""
        if len(args) != len(self._arguments):
            names = ", ".join(v.name for v in self._arguments)
            raise InputError(f"FullyShardedModule takes {len(self._arguments)} arguments "
                             f"({names}), got {len(args)}")
        supplied = iter(args)
        inputs = [getattr(self, self._slots[i]) if i in self._slots else next(supplied)
                  for i in range(len(self._arguments) + len(self._slots))]
        before, after = self._neighbours
        chained = before is not None or after is not None
        if chained:
            self.prefetch(claim=True)  # its own gather (launched by the module before)
        if after is not None:
            after.prefetch()  # the next module's, under this one's compute
        outputs = self._function(inputs)
        self.activation_bytes = self._saved_bytes(outputs[0])
        if chained and outputs[0].requires_grad:
            outputs[0].register_hook(self._backward_prefetch)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def prefetch(self, backward: bool = False, claim: bool = False) -> None:
        """Launches now the gathers of this module's parameters that its last built forward
        (or ``backward``) program runs (nothing before the first call, or for a gather fed
        by a mixed-precision cast); ``claim``: its next run takes them (see
        :class:`~meshfuse.parallel.fsdp.buckets.AheadOfStep`)."""
        programs = self._last_programs()
        if programs is None:
            return
        program = programs[1 if backward else 0]
        slot_of = self._parameter_slots(program, backward)
        for step, call in zip(program.steps, program.calls):
            if step.op == "set" and len(step.args) == 1 and \
                    getattr(step.args[0], "index", None) in slot_of:
                slot_of[step.outputs[0]] = slot_of[step.args[0].index]  # a local copy
            if isinstance(call, AheadOfStep) and step.args and \
                    all(getattr(a, "index", None) in slot_of for a in step.args):
                call.prefetch(*(getattr(self, slot_of[a.index]) for a in step.args),
                              claim=claim)

    def _backward_prefetch(self, grad: torch.Tensor) -> None:
        """Run as the gradient of this module's output is ready, right before its
        backward: its own gathers (claimed: launched by the module after it) and the
        module before's."""
        self.prefetch(backward=True, claim=True)
        if self._neighbours[0] is not None:
            self._neighbours[0].prefetch(backward=True)

    def _last_programs(self):
        if not self._function._derivations:
            return None
        compiled = list(self._function._derivations.values())[-1]
        forward = compiled.derivation.forward_runner._programs
        backward = compiled._backward._programs if compiled._backward is not None else {}
        if not forward or not backward:
            return None
        return list(forward.values())[-1], list(backward.values())[-1]

    def _parameter_slots(self, program, backward: bool) -> dict[int, str]:
        """The program's input slots that hold parameters -> their names."""
        if not backward:
            return {program.input_slots[i]: name for i, name in self._slots.items()}
        d = list(self._function._derivations.values())[-1].derivation
        first = len(d.cotangents)
        return {program.input_slots[first + k]: self._slots[r.index]
                for k, r in enumerate(d.residuals)
                if r.kind == "input" and r.index in self._slots}

    def _saved_bytes(self, output: torch.Tensor) -> int:
        """The bytes the forward saved for the backward (its residuals), the parameter
        shards aside (counted as parameters)."""
        node = output.grad_fn
        residuals = getattr(getattr(node, "residuals", None), "values", None) or []
        params = {p.untyped_storage().data_ptr() for p in self.parameters()}
        return nbytes(t for t in residuals if isinstance(t, torch.Tensor) and
                      t.untyped_storage().data_ptr() not in params)

    def programs(self) -> tuple:
        """The forward's and the backward's per-rank programs of the last derivation run
        (for inspection: their steps show the buckets and their order)."""
        compiled = list(self._function._derivations.values())[-1]
        forward = list(compiled.derivation.forward_runner._programs.values())[-1]
        backward = list(compiled._backward._programs.values())[-1]
        return forward, backward

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clips the sharded gradients to a global norm of ``max_norm`` (every mesh
        dimension, replicas counted once); returns the norm before clipping."""
        return clip_grad_norm_(list(self.parameters()), max_norm, self._copies)

    def memory_account(self, optimizer: torch.optim.Optimizer | None = None,
                       activations: int | None = None) -> MemoryAccount:
        """This rank's parameter, gradient, optimizer-state and gathered-parameter bytes, and
        ``activations`` (default: what the last forward saved for its backward)."""
        saved = self.activation_bytes if activations is None else activations
        return memory_account(self.parameters(), optimizer, activations=saved)


def prefetch_in_order(modules: Sequence[FullyShardedModule]) -> None:
    """Makes ``modules`` (run in this order, each once per step) prefetch across each
    other: each one's forward launches the next one's gather first, and each one's backward
    (as its output's gradient is ready) the gather of the one before. From the second step
    on: the first builds the programs whose gathers are launched."""
    modules = list(modules)
    for i, m in enumerate(modules):
        m._neighbours = (modules[i - 1] if i else None,
                         modules[i + 1] if i + 1 < len(modules) else None)
