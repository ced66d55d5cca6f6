"""``FusionModule``: a ``torch.nn.Module`` whose forward is a fusion.

The fusion's parameter inputs become ``nn.Parameter`` s holding this rank's local shards (as
the schedule lays them out); the other inputs are the module's arguments. Gradients come back
as local shards too, so any torch optimizer trains the module: each rank updates its shard,
and replicated parameters, whose gradients are complete on every rank, stay equal.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from meshfuse.autodiff.derivation import DEFAULT_REMAT
from meshfuse.errors import DefinitionError, InputError
from meshfuse.ir.fusion import is_user_name
from meshfuse.ir.tensor_view import TensorView
from meshfuse.sharding import shard_tensor


class FusionModule(torch.nn.Module):
    """A layer whose forward is ``fd`` (as ``fd.as_autograd_function()``).

    Args:
        fd: the fusion definition, scheduled.
        parameters: ``{name: (input TensorView, value)}``: the inputs that are trainable
            parameters, with their initial values: global tensors (sharded here with
            ``shard_tensor``) or, with ``local=True``, this rank's shards. An input that
            ``define_tensor`` did not name takes the parameter's name (before ``fd`` is
            built), so that the backward's tensors, its errors and ``meshfuse.vjp(fd)``
            name its gradient after it (``grad_w1``).
        local: the values are already local shards.
        remat: the rematerialization policy of the backward.

    Example:
        >>> layer = FusionModule(fd, {"w1": (w1, torch.randn(32, 16)),
        ...                           "w2": (w2, torch.randn(16, 32))})
        >>> out = layer(x_local)                 # the other inputs, in definition order
        >>> out.sum().backward(); torch.optim.AdamW(layer.parameters()).step()
    """

    def __init__(self, fd, parameters: Mapping[str, tuple[TensorView, torch.Tensor]],
                 local: bool = False, remat: str = DEFAULT_REMAT) -> None:
        super().__init__()
        fd.define()
        inputs = fd.fusion.inputs()
        self._slots: dict[int, str] = {}
        for name, (tv, _) in parameters.items():
            if tv not in inputs:
                raise DefinitionError(
                    f"FusionModule parameter {name!r}: {tv!r} is not an input of the fusion"
                )
            given = fd.fusion.given_names()
            if not fd.built and tv.name not in given and name not in given and \
                    is_user_name(name):
                fd.fusion.set_name(tv, name)
        for name, (tv, value) in parameters.items():
            shard = value if local else shard_tensor(value, tv)
            self.register_parameter(name, torch.nn.Parameter(shard.detach().clone()))
            self._slots[inputs.index(tv)] = name
        self._arguments = [v for i, v in enumerate(inputs) if i not in self._slots]
        self._function = fd.as_autograd_function(remat=remat)
        self._tensors = {name: tv for name, (tv, _) in parameters.items()}

    def parameter_tensors(self) -> dict[str, TensorView]:
        """Each parameter's TensorView, whose schedule lays out the local shard it holds
        (what checkpoints read to place the shard in the global tensor)."""
        return dict(self._tensors)

    def forward(self, *args):
        """Runs the fusion on ``args`` (the non-parameter inputs, in definition order) and
        the parameters; returns its output, or a tuple of its outputs."""
        outputs = self._function(self._inputs(args))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def explain(self, *args) -> str:
        """The forward's and the derived backward's programs on ``args`` (as ``forward``
        takes them), their replay and host time: see
        :meth:`~meshfuse.autodiff.function.FusionFunction.explain`."""
        return self._function.explain(self._inputs(args))

    def _inputs(self, args: tuple) -> list:
        """The fusion's inputs: ``args`` and the parameters, in definition order."""
        if len(args) != len(self._arguments):
            names = ", ".join(v.name for v in self._arguments)
            raise InputError(
                f"FusionModule takes {len(self._arguments)} arguments ({names}), got {len(args)}"
            )
        supplied = iter(args)
        return [getattr(self, self._slots[i]) if i in self._slots else next(supplied)
                for i in range(len(self._arguments) + len(self._slots))]
