"""A GPT block written as its forward only, tensor and sequence parallel (Megatron TP+SP).

The block (pre-norm, causal self-attention, tanh-GELU MLP)::

    h = x + out_proj(attention(q_proj(ln1(x)), k_proj(ln1(x)), v_proj(ln1(x))))
    y = h + fc2(gelu_tanh(fc1(ln2(h))))

Its backward is derived (``fd.as_autograd_function()``, ``meshfuse.vjp``); nothing of it is
written here. The schedule pins what a Megatron user decides, on a 1-D mesh of ``d`` ranks:
q/k/v and fc1 weights column parallel (output features, so heads, split), out_proj and fc2
row parallel (input features split), layer norms and the row-parallel biases replicated,
and with sequence parallelism the block's input and output (and ``h``) split on the
sequence. Propagation and resharding derive the rest: an allgather of each layer norm's
output before the column-parallel projections and a reduce-scatter of each row-parallel
result, in the forward and, transposed, in the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshfuse.dtypes import DataType
from meshfuse.frontend.fusion_definition import FusionDefinition
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.mesh import DeviceMesh

EPS = 1e-5


def parameter_shapes(embed: int) -> dict[str, tuple[int, ...]]:
    """The block's parameters, in input order after ``x``."""
    e = embed
    return {
        "ln1_w": (e,), "ln1_b": (e,),
        "w_q": (e, e), "b_q": (e,), "w_k": (e, e), "b_k": (e,), "w_v": (e, e), "b_v": (e,),
        "w_o": (e, e), "b_o": (e,),
        "ln2_w": (e,), "ln2_b": (e,),
        "w_fc1": (4 * e, e), "b_fc1": (4 * e,), "w_fc2": (e, 4 * e), "b_fc2": (e,),
    }


# The axis each parameter is split on under tensor parallelism (None: replicated).
TP_AXIS = {"w_q": 0, "b_q": 0, "w_k": 0, "b_k": 0, "w_v": 0, "b_v": 0, "w_o": 1,
           "w_fc1": 0, "b_fc1": 0, "w_fc2": 1}


class GptBlock(FusionDefinition):
    """One block; inputs ``x [batch, seq, embed]`` then :func:`parameter_shapes`' parameters;
    output ``y``.

    Args:
        batch, seq, embed, heads: the sizes (global).
        dtype: the element type.
        mesh: a 1-D mesh for tensor parallelism, or None (one device).
        sequence_parallel: split ``x``, ``h`` and ``y`` on the sequence (else replicated).
        output_replicated: gather ``y`` on every rank (for a loss computed on each).
    """

    def __init__(self, batch: int, seq: int, embed: int, heads: int,
                 dtype: DataType = DataType.Float, mesh: DeviceMesh | None = None,
                 sequence_parallel: bool = True, output_replicated: bool = False) -> None:
        super().__init__()
        self.sizes = (batch, seq, embed, heads)
        self.dtype = dtype
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self.output_replicated = output_replicated
        self.params: dict = {}

    def definition(self) -> None:
        b, s, e, _ = self.sizes
        self.x = self.define_tensor([b, s, e], dtype=self.dtype, contiguity=True)
        p = self.params
        for name, shape in parameter_shapes(e).items():
            p[name] = self.define_tensor(list(shape), dtype=self.dtype, contiguity=True)
        o = self.ops
        ln1 = self.layer_norm(self.x, p["ln1_w"], p["ln1_b"])
        q, k, v = (self.to_heads(o.linear(ln1, p[f"w_{n}"], p[f"b_{n}"])) for n in "qkv")
        attn, _, _, _ = o.sdpfa_fwd(q, k, v, 0.0, True)
        # nvFuser's promotion adds bf16 in float: the sums are cast back to the block's dtype
        # (and scheduled like the casts, so that partial sums are reduce-scattered into them).
        self.h_sum = o.add(self.x, o.linear(self.from_heads(attn), p["w_o"], p["b_o"]))
        self.h = self._io(self.h_sum)
        ln2 = self.layer_norm(self.h, p["ln2_w"], p["ln2_b"])
        f = o.gelu(o.linear(ln2, p["w_fc1"], p["b_fc1"]), approximate="tanh")
        self.y_sum = o.add(self.h, o.linear(f, p["w_fc2"], p["b_fc2"]))
        self.y = self._io(self.y_sum)
        self.add_output(self.y)

    def multidevice_schedule(self) -> None:
        if self.mesh is None:
            return
        for name, tv in self.params.items():
            self._place(tv, TP_AXIS.get(name))
        sequence = 1 if self.sequence_parallel else None
        self._place(self.x, sequence)
        for tv in dict.fromkeys((self.h_sum, self.h)):  # one tensor in float32
            self._place(tv, sequence)
        for tv in dict.fromkeys((self.y_sum, self.y)):
            self._place(tv, None if self.output_replicated else sequence)

    def _place(self, tv, axis: int | None) -> None:
        tv.set_device_mesh(self.mesh)
        if axis is not None:
            tv.outer_split(axis, self.mesh.size)
            tv.axis(axis).parallelize(ParallelType.mesh_x)

    def layer_norm(self, x, w, b):
        o = self.ops
        var, mean = o.var_mean(x, dims=[-1], correction=0, keepdim=True)
        x_hat = o.mul(o.sub(x, mean), o.rsqrt(o.add(var, EPS)))
        return self._io(o.add(o.mul(x_hat, w), b))

    def _io(self, t):
        """``t`` in the block's dtype (a no-op when it already is)."""
        return t if t.dtype is self.dtype else self.ops.cast(t, self.dtype)

    def to_heads(self, t):
        """``[B, S, E]`` to ``[B, heads, S, E / heads]``."""
        b, s, e, heads = self.sizes
        return self.ops.permute(self.ops.reshape(t, [b, s, heads, e // heads]), [0, 2, 1, 3])

    def from_heads(self, t):
        b, s, e, _ = self.sizes
        return self.ops.reshape(self.ops.permute(t, [0, 2, 1, 3]), [b, s, e])


def torch_block(x: torch.Tensor, p: dict[str, torch.Tensor], heads: int) -> torch.Tensor:
    """The same block in plain PyTorch (the reference)."""
    b, s, e = x.shape
    h = F.layer_norm(x, (e,), p["ln1_w"], p["ln1_b"], EPS)
    q, k, v = (F.linear(h, p[f"w_{n}"], p[f"b_{n}"]).reshape(b, s, heads, e // heads)
               .transpose(1, 2) for n in "qkv")
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + F.linear(a.transpose(1, 2).reshape(b, s, e), p["w_o"], p["b_o"])
    f = F.gelu(F.linear(F.layer_norm(x, (e,), p["ln2_w"], p["ln2_b"], EPS), p["w_fc1"],
                        p["b_fc1"]), approximate="tanh")
    return x + F.linear(f, p["w_fc2"], p["b_fc2"])


def init_parameters(embed: int, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Global initial values: layer norms near (1, 0), weights scaled by 1/sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    result = {}
    for name, shape in parameter_shapes(embed).items():
        x = torch.randn(shape, generator=gen)
        if name.startswith("ln"):
            x = (1 + 0.1 * x) if name.endswith("_w") else 0.1 * x
        elif name.startswith("w"):
            x = x / shape[1] ** 0.5
        else:
            x = 0.1 * x
        result[name] = x.to(dtype)
    return result
