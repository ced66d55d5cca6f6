"""A stack of GPT blocks (:class:`~meshfuse.examples.gpt.GptBlock`) with a mean-squared-error
loss, as one fusion, tensor and sequence parallel over a ``tp`` dimension of a named mesh,
context parallel over a ``cp`` dimension (or not parallel at all): the model the fully
sharded training script shards over ``dp``.
"""

from __future__ import annotations

import torch

from meshfuse.dtypes import DataType
from meshfuse.examples.gpt import TP_AXIS, GptBlock, init_parameters, parameter_shapes, torch_block
from meshfuse.parallel.fsdp.transform import shard_axis


class GptStack(GptBlock):
    """Inputs ``x [batch, seq, embed]``, ``target`` (alike), then each block's parameters
    (:func:`~meshfuse.examples.gpt.parameter_shapes` order); output the loss
    ``mean((y - target) ** 2)``.

    Args:
        batch, seq, embed, heads, layers: the sizes.
        mesh: a :class:`~meshfuse.parallel.fsdp.spec.NamedMesh`, or None.
        tp: the dimension of ``mesh`` the blocks are tensor and sequence parallel over
            (None: no tensor parallelism).
        cp: the dimension of ``mesh`` the sequence is split over (context parallelism: the
            residual stream, the target and so the attention's q, k and v; within each
            ``cp`` block, the residual stream is split again over ``tp``); None: none.
    """

    def __init__(self, batch: int, seq: int, embed: int, heads: int, layers: int,
                 mesh=None, tp: str | None = None, dtype: DataType = DataType.Float,
                 cp: str | None = None) -> None:
        super().__init__(batch, seq, embed, heads, dtype, None, sequence_parallel=True)
        self.named, self.tp, self.cp, self.layers = mesh, tp, cp, layers
        self.blocks: list[dict] = []
        self.region_inputs: list = []  # the layer norms' outputs, gathered over tp

    def tp_input(self, t):
        """A layer norm's output gathered over ``tp`` once, for the column-parallel
        projections that read it (Megatron's gather at a tensor-parallel region's input): left
        to propagation, a batch split over another dimension would make the projections
        follow the activation's split and gather the weights over ``tp`` instead."""
        if self.tp is None:
            return t
        gathered = self.ops.set(t)
        self.region_inputs.append(gathered)
        return gathered

    def definition(self) -> None:
        b, s, e, _ = self.sizes
        self.input = self.x = self.define_tensor([b, s, e], dtype=self.dtype, contiguity=True)
        self.target = self.define_tensor([b, s, e], dtype=self.dtype, contiguity=True)
        for _ in range(self.layers):
            self.params = {name: self.define_tensor(list(shape), dtype=self.dtype,
                                                    contiguity=True)
                           for name, shape in parameter_shapes(e).items()}
            y = self.forward()
            self.blocks.append({"params": self.params, "x": self.x,
                                "io": (self.h_sum, self.h, self.y_sum, self.y)})
            self.x = y
        o = self.ops
        diff = o.sub(o.cast(y, DataType.Float), o.cast(self.target, DataType.Float))
        self.add_output(o.mul(o.sum(o.mul(diff, diff), dims=[0, 1, 2]), 1.0 / (b * s * e)))

    def multidevice_schedule(self) -> None:
        if self.tp is None and self.cp is None:
            return
        activations = {}  # a block's input is the one before's output: placed once
        for block in self.blocks:
            for name, tv in block["params"].items():
                self._place(tv, TP_AXIS.get(name), self.tp)
            activations.update(dict.fromkeys((block["x"], *block["io"])))
        if self.cp is not None:
            activations[self.target] = None
        for tv in activations:
            self._place(tv, 1, self.cp)  # the sequence: over cp, then within it over tp
            self._place(tv, 1, self.tp)
        for tv in self.region_inputs:
            self._place(tv, 1, self.cp)

    def _place(self, tv, axis: int | None, dim: str | None) -> None:
        """Puts ``tv`` on the mesh, split on materialized axis ``axis`` over dimension
        ``dim`` (within the part an earlier split over another dimension left a rank)."""
        tv.set_device_mesh(self.named.mesh)
        if axis is not None and dim is not None and self.named.size(dim) > 1:
            shard_axis(tv, self.named, dim, axis)

    def parameter_inputs(self) -> dict[str, object]:
        """``{"0_w_q": TensorView, ...}``: every parameter input by ``layer_name``."""
        self.define()
        return {f"{k}_{n}": tv for k, block in enumerate(self.blocks)
                for n, tv in block["params"].items()}


def stack_parameters(embed: int, layers: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Global initial values by ``layer_name`` (block ``k`` drawn with seed ``k``)."""
    return {f"{k}_{n}": t for k in range(layers)
            for n, t in init_parameters(embed, seed=k, dtype=dtype).items()}


def torch_loss(x: torch.Tensor, target: torch.Tensor, params: dict[str, torch.Tensor],
               layers: int, heads: int) -> torch.Tensor:
    """The same stack in plain PyTorch (the reference)."""
    y = x
    for k in range(layers):
        y = torch_block(y, {n: params[f"{k}_{n}"] for n in parameter_shapes(1)}, heads)
    return (y.float() - target.float()).pow(2).mean()
