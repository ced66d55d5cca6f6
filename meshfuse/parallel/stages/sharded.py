"""A stage whose parameters are sharded over the stage's data-parallel devices, gathered
once per step (pipeline x FSDP).

A stage's devices may form a ``dp x tp`` grid: each ``dp`` row runs its own copy of the
stage (itself tensor parallel over the row, or on one device) on its share of every
microbatch's rows (:class:`~meshfuse.parallel.stages.runtime.PipelineRunner`'s
``data_parallel``). :class:`ShardedStage` keeps one flat shard of the stage's parameters per
``dp`` member: the pipeline runner calls :meth:`~ShardedStage.begin_step` when a step
starts, which launches one allgather of the flat parameters (the stage's first forward
waits for it); the gathered weights serve every microbatch of the step; after the stage's
last backward action (``B`` or ``W``) of the step the runner calls
:meth:`~ShardedStage.end_step`, which launches one reduce-scatter of the accumulated
gradients (their mean over ``dp``) into the shard's ``.grad`` and frees the gathered
weights and their gradients. An optimizer of ``stage.parameters()`` updates the shard (the
wrapped module's parameters have no gradient between steps, so optimizers skip them).

Microbatches gathered once per step trade memory (the whole stage's weights live through
the step) for communication (one gather and one reduce-scatter per step, not one per
microbatch as a fusion that gathers its own parameters does).
"""

from __future__ import annotations

import torch

from meshfuse.errors import InputError
from meshfuse.runtime.comm import collectives
from meshfuse.runtime.comm.pending import Pending


class ShardedStage(torch.nn.Module):
    """``module`` with its parameters held as one flat shard per member of ``group``.

    Args:
        module: the stage (a torch module; its parameters are plain tensors of one dtype,
            e.g. a tensor-parallel fusion module's local shards).
        group: the stage's data-parallel devices holding this rank
            (:func:`~meshfuse.runtime.comm.collectives.group_along` of the stage's mesh).

    Example:
        >>> stage = ShardedStage(FusionStage(cfg, microbatch // dp, params, 0, 5, tp_mesh),
        ...                      group_along(Communicator.instance(), stage_mesh, 0))
        >>> runner = PipelineRunner(plan, {0: stage}, loss, stage_ranks,
        ...                         data_parallel=(dp_coordinate, dp))
    """

    def __init__(self, module: torch.nn.Module, group: collectives.Group) -> None:
        super().__init__()
        self.module, self.group = module, group
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        _check(self._params)
        self._shapes = [p.shape for p in self._params]
        # where each parameter starts in the flat parameters, and where they end
        self._offsets = [0]
        for shape in self._shapes:
            self._offsets.append(self._offsets[-1] + shape.numel())
        self.numel = numel = self._offsets[-1]  # the whole stage's
        self._padded = -(-numel // group.size) * group.size
        # a stage without parameters holds an empty shard and never communicates
        flat = self._flat([p.detach() for p in self._params])
        n = self._padded // group.size
        self.shard = torch.nn.Parameter(flat[group.coordinate * n:(group.coordinate + 1) * n]
                                        .clone())
        self._gathering: Pending | None = None
        self._live = True
        self._free()

    def extra_repr(self) -> str:
        inner = self.module.extra_repr() or type(self.module).__name__
        return f"{inner}, parameters sharded over ranks {list(self.group.ranks)}"

    def flat_layout(self) -> tuple[list[tuple[str, torch.Size, int]], int]:
        """Where the wrapped module's parameters lie in the flat parameters, as ``(name here
        (``module.NAME``), shape, offset)``, and where this rank's ``shard`` starts in them: how a
        checkpoint (:mod:`meshfuse.checkpoint`) saves the shard as the parameters it holds
        pieces of, under their own names and shapes."""
        return (list(zip([f"module.{n}" for n in self._names], self._shapes, self._offsets)),
                self.group.coordinate * self.shard.numel())

    def held_pieces(self) -> list[tuple[str, torch.Size, int, int, int]]:
        """``(name, shape, start, stop, at)`` of each parameter (named as in
        :meth:`flat_layout`): the elements ``[start, stop)`` of it (row-major; empty where
        the shard holds none) lie in ``shard`` from ``at`` on."""
        entries, base = self.flat_layout()
        end = base + self.shard.numel()
        pieces = []
        for name, shape, offset in entries:
            lo = min(max(offset, base), offset + shape.numel())
            hi = max(min(offset + shape.numel(), end), lo)
            pieces.append((name, shape, lo - offset, hi - offset, max(lo - base, 0)))
        return pieces

    def forward(self, *args, **kwargs):
        self._install()
        return self.module(*args, **kwargs)

    def begin_step(self) -> None:
        """Launches the gather of the parameters (waited for by the first forward)."""
        if self._gathering is None and not self._live and self._params:
            self._gathering = collectives.allgather(self.shard.detach(), 0, self.group,
                                                    async_op=True)

    def end_step(self) -> Pending | None:
        """Launches the reduce-scatter of the step's gradients (their mean over the group)
        into ``shard.grad`` and frees the gathered parameters; returns what to wait for."""
        if not self._live or not self._params:
            return None
        flat = self._flat([p.grad if p.grad is not None else torch.zeros_like(p)
                           for p in self._params])
        self._free()
        pending = collectives.reduce_scatter(flat, 0, self.group, "sum", async_op=True)
        return pending.then(self._accumulate)

    def _accumulate(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad / self.group.size
        if self.shard.grad is None:
            self.shard.grad = grad
        else:
            self.shard.grad.add_(grad)
        return grad

    def _install(self) -> None:
        """The gathered weights as the module's parameters (gathering them now if no step
        began: a forward outside the pipeline)."""
        if self._live or not self._params:
            return
        self.begin_step()
        full, self._gathering = self._gathering.wait(), None
        for p, shape, offset in zip(self._params, self._shapes, self._offsets):
            p.data = full[offset:offset + shape.numel()].view(shape)
            p.grad = None
        self._live = True

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``tensors`` (laid out as the parameters) as one flat tensor, zero padded to the
        group's multiple."""
        return torch.cat([t.reshape(-1) for t in tensors] +
                         [torch.zeros(self._padded - self.numel, **_kind(self._params))])

    def _free(self) -> None:
        for p in self._params:
            p.data = p.data.new_empty(0)
            p.grad = None
        self._live = False


def _kind(params: list[torch.Tensor]) -> dict:
    """The dtype and device of the flat parameters."""
    return {"dtype": params[0].dtype, "device": params[0].device} if params else {}


def _check(params: list[torch.Tensor]) -> None:
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise InputError(f"ShardedStage holds parameters of one dtype in one flat shard; "
                         f"this stage has {sorted(map(str, dtypes))}: cast them alike")
    odd = [type(p.data).__name__ for p in params if type(p.data) is not torch.Tensor]
    if odd:
        raise InputError(f"ShardedStage shards plain tensors, but the stage's parameters "
                         f"include {odd[0]}s (e.g. DTensors): give it the module's local "
                         f"shards (a meshfuse fusion module) instead")
